"""FP8 grouped MoE GEMMs for Hopper in Gluon: the prefill path of kernels/moe_triton.py.

The Triton loop of moe_triton.py stays near 600 TFLOP/s at prefill: a plain Triton FP8
block-scaled GEMM tops out there on a dense problem too, while the same GEMM written in
Gluon (TMA loads into a ring of shared-memory stages, each stage's arrival an mbarrier,
async wgmma, the block scales loaded one K step ahead) ran at 816 on one H200, against
1184 for torch._scaled_mm (docs/kernel-notes.md#moe-in-gluon). These two kernels are that
loop around the MoE's layout (the alignment of moe_triton.py: each expert's sorted rows
padded to BLOCK_M, an expert index per row block):

    gate_up + act   the rows' activations, gathered into sorted order first (TMA cannot
                    gather on Hopper), times the gate and up tiles of the expert's w13:
                    two products per K step, in flight together; SwiGLU-OAI or SiLU and
                    the 1 x 128 FP8 quantization of the result in the epilogue, as the
                    Triton kernel does
    down            the quantized activations (already sorted) times w2, the routing
                    weight in the epilogue

Each program makes the TMA descriptor of its expert's weights in the kernel (the weights
are one tensor per expert, addressed through the pointer table of moe_triton.py); that
takes a little global scratch per launch, which Triton asks of the allocator set with
triton.set_allocator (one is set here if there is none).

FP8 only, routed and shared experts of one width (the shared expert's own narrower TP
slice keeps the Triton kernels). Numerics equal the Triton kernels' up to the order of the
float32 sums.
"""

from __future__ import annotations

import torch

try:  # Gluon ships with triton >= 3.5; CPU installs and older triton use the Triton kernels
    import triton
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import mbarrier, tma, warpgroup_mma, warpgroup_mma_wait

    # triton 3.6 (the GPU box) names the TMA load async_copy_global_to_shared, 3.9 async_load
    _tma_load = getattr(tma, "async_load", None) or tma.async_copy_global_to_shared
    _cta_barrier = getattr(gl, "barrier", None) or gl.thread_barrier  # 3.9 / 3.6
    HAVE_GLUON = True
except ImportError:  # pragma: no cover
    HAVE_GLUON = False

BLOCK_K = 128  # the FP8 quantization group: one scale per K step


def gluon_available(device: torch.device) -> bool:
    """Gluon importable and a Hopper GPU (wgmma, TMA): sm_90 exactly."""
    return HAVE_GLUON and device.type == "cuda" and torch.cuda.get_device_capability(device) == (9, 0)


def _ensure_allocator(device: torch.device) -> None:
    """In-kernel TMA descriptors need global scratch from triton's allocator: set one on torch's
    caching allocator unless the caller set their own (inside a CUDA graph capture the scratch
    comes from the graph's pool, so replays keep it)."""
    from triton.runtime import _allocation

    if _allocation._allocator.get() is _allocation._NULL_ALLOCATOR:
        triton.set_allocator(lambda size, align, stream: torch.empty(size, dtype=torch.int8, device=device))


if HAVE_GLUON:

    @gluon.jit
    def _tile_of(pid, num_m_blocks, num_n_tiles, GROUP_M: gl.constexpr):
        """(row block, column tile) of program pid: GROUP_M row blocks at a time over every
        column tile (as moe_triton._tile_of)."""
        in_group = GROUP_M * num_n_tiles
        first_m = (pid // in_group) * GROUP_M
        size_m = gl.minimum(num_m_blocks - first_m, GROUP_M)
        return first_m + (pid % in_group) % size_m, (pid % in_group) // size_m

    @gluon.constexpr_function
    def _mma_layout(BM, BN, num_warps):
        """wgmma accumulator layout: warps stacked along M, side by side along N where BLOCK_M is
        less than 16 rows per warp (BLOCK_M 64 with 8 warps: two warp groups, half the columns each)."""
        BM, BN, num_warps = (int(getattr(v, "value", v)) for v in (BM, BN, num_warps))
        warps_m = min(num_warps, BM // 16)
        return gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[warps_m, num_warps // warps_m],
                                         instr_shape=[16, BN // (num_warps // warps_m), 32])

    @gluon.jit
    def _act_quant_store(acc_g, acc_u, rows, cols, h_ptr, hs_ptr, pid_n, N: gl.constexpr, alpha, limit, beta,
                         ACT: gl.constexpr):
        """h = act(gate, up) of one [rows, 128] tile, quantized in 1 x 128 groups and stored (any layout)."""
        # the eager MLP rounds the gate/up GEMM to bf16 first, then the activation
        g = acc_g.to(gl.bfloat16).to(gl.float32)
        u = acc_u.to(gl.bfloat16).to(gl.float32)
        if ACT == 0:  # SwiGLU-OAI
            g = gl.minimum(g, limit)
            u = gl.minimum(gl.maximum(u, -limit), limit)
            h = (u + beta) * (g / (1.0 + gl.exp(-(g * alpha))))
        else:  # SiLU-gated
            h = g / (1.0 + gl.exp(-g)) * u
        h = h.to(gl.bfloat16).to(gl.float32)
        # 1 x 128 quantization: power-of-two scale from the exponent bits (as moe_triton)
        amax = gl.maximum(gl.max(gl.abs(h), axis=1), 1e-30)
        v = gl.div_rn(amax, gl.full(amax.shape, 448.0, gl.float32, amax.type.layout))
        vb = v.to(gl.int32, bitcast=True)
        ex = ((vb >> 23) & 0xFF) + ((vb & 0x7FFFFF) != 0).to(gl.int32)
        scale = (ex << 23).to(gl.float32, bitcast=True)
        inv = ((254 - ex) << 23).to(gl.float32, bitcast=True)
        q = gl.minimum(gl.maximum(h * inv[:, None], -448.0), 448.0)
        out_rows = rows.to(gl.int64)
        gl.store(h_ptr + out_rows[:, None] * N + cols[None, :], q.to(gl.float8e4nv))
        gl.store(hs_ptr + out_rows * (N // 128) + pid_n, scale)


    @gluon.jit
    def _gate_up_body(x_ptr, xs_ptr, w, ws, h_ptr, hs_ptr, pid_m, pid_n, rows_total,
                      N: gl.constexpr, K: gl.constexpr, alpha, limit, beta, ACT: gl.constexpr,
                      BM: gl.constexpr, STAGES: gl.constexpr, SERIAL: gl.constexpr, num_warps: gl.constexpr):
        BN: gl.constexpr = 128
        BK: gl.constexpr = 128
        KB: gl.constexpr = K // BK
        smem_layout: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=8, rank=2)
        a_desc = tma.make_tensor_descriptor(x_ptr, shape=[rows_total, K], strides=[K, 1], block_shape=[BM, BK],
                                            layout=smem_layout)
        w_desc = tma.make_tensor_descriptor(w, shape=[2 * N, K], strides=[K, 1], block_shape=[BN, BK],
                                            layout=smem_layout)
        a_smem = gl.allocate_shared_memory(gl.float8e4nv, [STAGES, BM, BK], smem_layout)
        g_smem = gl.allocate_shared_memory(gl.float8e4nv, [STAGES, BN, BK], smem_layout)
        u_smem = gl.allocate_shared_memory(gl.float8e4nv, [STAGES, BN, BK], smem_layout)
        bars = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        for s in gl.static_range(STAGES):
            mbarrier.init(bars.index(s), count=1)
        off_m = pid_m * BM
        off_n = pid_n * BN
        nbytes: gl.constexpr = (BM + 2 * BN) * BK
        for s in gl.static_range(STAGES - 1):
            if s < KB:  # (compile time) a short K has fewer steps than stages
                bar = bars.index(s)
                mbarrier.expect(bar, nbytes)
                _tma_load(a_desc, [off_m, s * BK], bar, a_smem.index(s))
                _tma_load(w_desc, [off_n, s * BK], bar, g_smem.index(s))
                _tma_load(w_desc, [N + off_n, s * BK], bar, u_smem.index(s))

        mma_layout: gl.constexpr = _mma_layout(BM, BN, num_warps)
        rows = off_m + gl.arange(0, BM, layout=gl.SliceLayout(1, mma_layout))
        cols = off_n + gl.arange(0, BN, layout=gl.SliceLayout(0, mma_layout))
        a_scales = xs_ptr + rows.to(gl.int64) * KB
        g_scales = ws + (off_n // 128) * KB
        u_scales = ws + ((N + off_n) // 128) * KB
        acc_g = gl.zeros((BM, BN), dtype=gl.float32, layout=mma_layout)
        acc_u = gl.zeros((BM, BN), dtype=gl.float32, layout=mma_layout)
        # each product is made in the registers of the previous one (use_acc=False ignores
        # their values): no separate zero tile to hold
        pg = gl.zeros((BM, BN), dtype=gl.float32, layout=mma_layout)
        pu = pg
        for ki in range(KB):
            stage = ki % STAGES
            refill = ki + STAGES - 1
            if refill < KB:  # the stage step ki - 1 read: every warp group waited for its products
                rs = refill % STAGES
                bar = bars.index(rs)
                mbarrier.expect(bar, nbytes)
                _tma_load(a_desc, [off_m, refill * BK], bar, a_smem.index(rs))
                _tma_load(w_desc, [off_n, refill * BK], bar, g_smem.index(rs))
                _tma_load(w_desc, [N + off_n, refill * BK], bar, u_smem.index(rs))
            sa = gl.load(a_scales + ki)
            sg = gl.load(g_scales + ki)
            su = gl.load(u_scales + ki)
            mbarrier.wait(bars.index(stage), (ki // STAGES) & 1)
            if SERIAL:  # one product's registers at a time (BLOCK_M 128: four would spill)
                pg = warpgroup_mma(a_smem.index(stage), g_smem.index(stage).permute((1, 0)), pg, use_acc=False,
                                   is_async=True)
                pg = warpgroup_mma_wait(0, deps=(pg, ))
                acc_g += pg * (sa * sg)[:, None]
                pg = warpgroup_mma(a_smem.index(stage), u_smem.index(stage).permute((1, 0)), pg, use_acc=False,
                                   is_async=True)
                pg = warpgroup_mma_wait(0, deps=(pg, ))
                acc_u += pg * (sa * su)[:, None]
            else:  # the up product runs while the gate product is scaled
                pg = warpgroup_mma(a_smem.index(stage), g_smem.index(stage).permute((1, 0)), pg, use_acc=False,
                                   is_async=True)
                pu = warpgroup_mma(a_smem.index(stage), u_smem.index(stage).permute((1, 0)), pu, use_acc=False,
                                   is_async=True)
                pg = warpgroup_mma_wait(1, deps=(pg, ))
                acc_g += pg * (sa * sg)[:, None]
                pu = warpgroup_mma_wait(0, deps=(pu, ))
                acc_u += pu * (sa * su)[:, None]
            _cta_barrier()
        for s in gl.static_range(STAGES):
            mbarrier.invalidate(bars.index(s))

        _act_quant_store(acc_g, acc_u, rows, cols, h_ptr, hs_ptr, pid_n, N, alpha, limit, beta, ACT)

    @gluon.jit
    def _gate_up_paired_body(x_ptr, xs_ptr, w, ws, h_ptr, hs_ptr, pid_m, pid_n, rows_total,
                             N: gl.constexpr, K: gl.constexpr, alpha, limit, beta, ACT: gl.constexpr,
                             BM: gl.constexpr, STAGES: gl.constexpr, num_warps: gl.constexpr):
        """Gate and up tiles from ONE [BM, 256] product per K step: the weight stage holds the gate
        rows over the up rows, so with 8 warps each warp group makes one half (m64n128, the
        dense kernel's MMA shape) and waits once; the halves meet in shared memory after the loop."""
        BN: gl.constexpr = 128
        BK: gl.constexpr = 128
        KB: gl.constexpr = K // BK
        smem_layout: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=8, rank=2)
        a_desc = tma.make_tensor_descriptor(x_ptr, shape=[rows_total, K], strides=[K, 1], block_shape=[BM, BK],
                                            layout=smem_layout)
        w_desc = tma.make_tensor_descriptor(w, shape=[2 * N, K], strides=[K, 1], block_shape=[BN, BK],
                                            layout=smem_layout)
        a_smem = gl.allocate_shared_memory(gl.float8e4nv, [STAGES, BM, BK], smem_layout)
        b_smem = gl.allocate_shared_memory(gl.float8e4nv, [STAGES, 2 * BN, BK], smem_layout)
        bars = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        for s in gl.static_range(STAGES):
            mbarrier.init(bars.index(s), count=1)
        off_m = pid_m * BM
        off_n = pid_n * BN
        nbytes: gl.constexpr = (BM + 2 * BN) * BK
        for s in gl.static_range(STAGES - 1):
            if s < KB:  # (compile time) a short K has fewer steps than stages
                bar = bars.index(s)
                mbarrier.expect(bar, nbytes)
                _tma_load(a_desc, [off_m, s * BK], bar, a_smem.index(s))
                _tma_load(w_desc, [off_n, s * BK], bar, b_smem.index(s).slice(0, BN))
                _tma_load(w_desc, [N + off_n, s * BK], bar, b_smem.index(s).slice(BN, BN))

        mma_layout: gl.constexpr = _mma_layout(BM, 2 * BN, num_warps)
        rows = off_m + gl.arange(0, BM, layout=gl.SliceLayout(1, mma_layout))
        half = gl.arange(0, 2 * BN, layout=gl.SliceLayout(0, mma_layout)) < BN  # gate columns
        a_scales = xs_ptr + rows.to(gl.int64) * KB
        g_scales = ws + (off_n // 128) * KB
        u_scales = ws + ((N + off_n) // 128) * KB
        acc = gl.zeros((BM, 2 * BN), dtype=gl.float32, layout=mma_layout)
        p = gl.zeros((BM, 2 * BN), dtype=gl.float32, layout=mma_layout)
        for ki in range(KB):
            stage = ki % STAGES
            refill = ki + STAGES - 1
            if refill < KB:
                rs = refill % STAGES
                bar = bars.index(rs)
                mbarrier.expect(bar, nbytes)
                _tma_load(a_desc, [off_m, refill * BK], bar, a_smem.index(rs))
                _tma_load(w_desc, [off_n, refill * BK], bar, b_smem.index(rs).slice(0, BN))
                _tma_load(w_desc, [N + off_n, refill * BK], bar, b_smem.index(rs).slice(BN, BN))
            sa = gl.load(a_scales + ki)
            col_scale = gl.where(half, gl.load(g_scales + ki), gl.load(u_scales + ki))
            mbarrier.wait(bars.index(stage), (ki // STAGES) & 1)
            p = warpgroup_mma(a_smem.index(stage), b_smem.index(stage).permute((1, 0)), p, use_acc=False,
                              is_async=True)
            p = warpgroup_mma_wait(0, deps=(p, ))
            acc += p * (sa[:, None] * col_scale[None, :])
            _cta_barrier()
        for s in gl.static_range(STAGES):
            mbarrier.invalidate(bars.index(s))

        # gate and up halves to one layout: through shared memory, rounded to bf16 first (as eager)
        epi_layout: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2)
        epi = gl.allocate_shared_memory(gl.bfloat16, [BM, 2 * BN], epi_layout)
        epi.store(acc.to(gl.bfloat16))
        _cta_barrier()
        out_layout: gl.constexpr = gl.BlockedLayout(size_per_thread=[1, 8], threads_per_warp=[2, 16],
                                                    warps_per_cta=[num_warps, 1], order=[1, 0])
        g = epi.slice(0, BN, dim=1).load(out_layout).to(gl.float32)
        u = epi.slice(BN, BN, dim=1).load(out_layout).to(gl.float32)
        out_rows = off_m + gl.arange(0, BM, layout=gl.SliceLayout(1, out_layout))
        cols = off_n + gl.arange(0, BN, layout=gl.SliceLayout(0, out_layout))
        _act_quant_store(g, u, out_rows, cols, h_ptr, hs_ptr, pid_n, N, alpha, limit, beta, ACT)

    @gluon.jit
    def _gate_up_kernel(x_ptr, xs_ptr, w_table, ws_table, block_expert, h_ptr, hs_ptr, rows_total, n_local,
                        num_m_blocks, num_n_tiles, alpha, limit, beta, N: gl.constexpr, K: gl.constexpr,
                        ACT: gl.constexpr, BM: gl.constexpr, STAGES: gl.constexpr, GROUP_M: gl.constexpr,
                        MODE: gl.constexpr, num_warps: gl.constexpr):
        pid_m, pid_n = _tile_of(gl.program_id(0), num_m_blocks, num_n_tiles, GROUP_M)
        e = gl.load(block_expert + pid_m)
        if e < n_local:
            w = gl.load(w_table + e).to(gl.pointer_type(gl.float8e4nv))
            ws = gl.load(ws_table + e).to(gl.pointer_type(gl.float32))
            if MODE == 2:
                _gate_up_paired_body(x_ptr, xs_ptr, w, ws, h_ptr, hs_ptr, pid_m, pid_n, rows_total, N, K, alpha,
                                     limit, beta, ACT, BM, STAGES, num_warps)
            else:
                _gate_up_body(x_ptr, xs_ptr, w, ws, h_ptr, hs_ptr, pid_m, pid_n, rows_total, N, K, alpha, limit,
                              beta, ACT, BM, STAGES, MODE == 1, num_warps)

    @gluon.jit
    def _down_body(h_ptr, hs_ptr, w, ws, sorted_pair, topk_w, y_ptr, pid_m, pid_n, rows_total,
                   H: gl.constexpr, K: gl.constexpr, BM: gl.constexpr, STAGES: gl.constexpr, num_warps: gl.constexpr):
        BN: gl.constexpr = 128
        BK: gl.constexpr = 128
        KB: gl.constexpr = K // BK
        smem_layout: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=8, rank=2)
        a_desc = tma.make_tensor_descriptor(h_ptr, shape=[rows_total, K], strides=[K, 1], block_shape=[BM, BK],
                                            layout=smem_layout)
        w_desc = tma.make_tensor_descriptor(w, shape=[H, K], strides=[K, 1], block_shape=[BN, BK], layout=smem_layout)
        a_smem = gl.allocate_shared_memory(gl.float8e4nv, [STAGES, BM, BK], smem_layout)
        b_smem = gl.allocate_shared_memory(gl.float8e4nv, [STAGES, BN, BK], smem_layout)
        bars = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        for s in gl.static_range(STAGES):
            mbarrier.init(bars.index(s), count=1)
        off_m = pid_m * BM
        off_n = pid_n * BN
        nbytes: gl.constexpr = (BM + BN) * BK
        for s in gl.static_range(STAGES - 1):
            if s < KB:  # (compile time) a short K has fewer steps than stages
                bar = bars.index(s)
                mbarrier.expect(bar, nbytes)
                _tma_load(a_desc, [off_m, s * BK], bar, a_smem.index(s))
                _tma_load(w_desc, [off_n, s * BK], bar, b_smem.index(s))

        mma_layout: gl.constexpr = _mma_layout(BM, BN, num_warps)
        rows = off_m + gl.arange(0, BM, layout=gl.SliceLayout(1, mma_layout))
        cols = off_n + gl.arange(0, BN, layout=gl.SliceLayout(0, mma_layout))
        a_scales = hs_ptr + rows.to(gl.int64) * KB
        b_scales = ws + (off_n // 128) * KB
        acc = gl.zeros((BM, BN), dtype=gl.float32, layout=mma_layout)
        p = gl.zeros((BM, BN), dtype=gl.float32, layout=mma_layout)  # reused for each product, as in gate/up
        for ki in range(KB):
            stage = ki % STAGES
            refill = ki + STAGES - 1
            if refill < KB:
                rs = refill % STAGES
                bar = bars.index(rs)
                mbarrier.expect(bar, nbytes)
                _tma_load(a_desc, [off_m, refill * BK], bar, a_smem.index(rs))
                _tma_load(w_desc, [off_n, refill * BK], bar, b_smem.index(rs))
            sa = gl.load(a_scales + ki)
            sb = gl.load(b_scales + ki)
            mbarrier.wait(bars.index(stage), (ki // STAGES) & 1)
            p = warpgroup_mma(a_smem.index(stage), b_smem.index(stage).permute((1, 0)), p, use_acc=False, is_async=True)
            p = warpgroup_mma_wait(0, deps=(p, ))
            acc += p * (sa * sb)[:, None]
            _cta_barrier()
        for s in gl.static_range(STAGES):
            mbarrier.invalidate(bars.index(s))
        # expert output in bf16 (as eager), times the routing weight in float32, rounded again
        pair = gl.load(sorted_pair + rows)
        valid = pair >= 0
        wt = gl.load(topk_w + gl.where(valid, pair, 0), mask=valid, other=0.0)
        y = (acc.to(gl.bfloat16).to(gl.float32) * wt[:, None]).to(gl.bfloat16)
        gl.store(y_ptr + rows.to(gl.int64)[:, None] * H + cols[None, :], y, mask=valid[:, None])

    @gluon.jit
    def _down_kernel(h_ptr, hs_ptr, w_table, ws_table, sorted_pair, block_expert, topk_w, y_ptr, rows_total, n_local,
                     num_m_blocks, num_n_tiles, H: gl.constexpr, K: gl.constexpr, BM: gl.constexpr,
                     STAGES: gl.constexpr, GROUP_M: gl.constexpr, num_warps: gl.constexpr):
        pid_m, pid_n = _tile_of(gl.program_id(0), num_m_blocks, num_n_tiles, GROUP_M)
        e = gl.load(block_expert + pid_m)
        if e < n_local:
            w = gl.load(w_table + e).to(gl.pointer_type(gl.float8e4nv))
            ws = gl.load(ws_table + e).to(gl.pointer_type(gl.float32))
            _down_body(h_ptr, hs_ptr, w, ws, sorted_pair, topk_w, y_ptr, pid_m, pid_n, rows_total, H, K, BM, STAGES,
                       num_warps)


# Both kernels take the alignment's row blocks as they are (BLOCK_M rows, one expert each);
# launch configs per BLOCK_M: docs/kernel-notes.md#moe-in-gluon
# gate/up MODE: 0 = two products per K step in flight together, 1 = one after the other,
# 2 = one product of the stacked gate and up tiles (see _gate_up_paired_body)
GATE_UP = {64: {"STAGES": 4, "num_warps": 8, "MODE": 2}, 128: {"STAGES": 3, "num_warps": 8, "MODE": 1}}
DOWN = {64: {"STAGES": 4, "num_warps": 4}, 128: {"STAGES": 4, "num_warps": 8}}


def gate_up_act(xg: torch.Tensor, xsg: torch.Tensor, w_table: torch.Tensor, ws_table: torch.Tensor,
                block_expert: torch.Tensor, block_m: int, num_m: int, n_local: int, n: int, act: int, alpha: float, limit: float,
                beta: float, group_m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """h [rows, n] FP8 and its 1 x 128 scales [rows, n / 128] of the sorted, gathered rows xg [rows, K]
    (rows = num_m * block_m)."""
    rows, k = xg.shape
    _ensure_allocator(xg.device)
    h = torch.empty(rows, n, dtype=xg.dtype, device=xg.device)
    hs = torch.empty(rows, n // 128, dtype=torch.float32, device=xg.device)
    n_tiles = n // 128
    _gate_up_kernel[(num_m * n_tiles,)](
        xg, xsg, w_table, ws_table, block_expert, h, hs, rows, n_local, num_m, n_tiles, alpha, limit, beta,
        N=n, K=k, ACT=act, BM=block_m, GROUP_M=max(group_m, 1), **GATE_UP[block_m])
    return h, hs


def down(h: torch.Tensor, hs: torch.Tensor, w_table: torch.Tensor, ws_table: torch.Tensor, sorted_pair: torch.Tensor,
         block_expert: torch.Tensor, topk_w: torch.Tensor, block_m: int, num_m: int, n_local: int, hidden: int, group_m: int,
         out_dtype: torch.dtype) -> torch.Tensor:
    """y [rows, hidden]: each sorted row's expert output times its routing weight (rows of padding
    left unwritten), rows = num_m * block_m."""
    rows, k = h.shape
    _ensure_allocator(h.device)
    y = torch.empty(rows, hidden, dtype=out_dtype, device=h.device)
    n_tiles = hidden // 128
    _down_kernel[(num_m * n_tiles,)](
        h, hs, w_table, ws_table, sorted_pair, block_expert, topk_w, y, rows, n_local, num_m, n_tiles,
        H=hidden, K=k, BM=block_m, GROUP_M=max(group_m, 1), **DOWN[block_m])
    return y
