"""The expert GEMMs of the grouped MoE at prefill sizes, warp-specialized in Gluon (Hopper).

The Triton loop of moe_triton.py stays near 600 TFLOP/s at prefill sizes: a plain Triton FP8
block-scaled GEMM tops out there on a dense problem too. What goes further on Hopper is the
structure of DeepGEMM's sm_90 kernel, which Gluon can express: one producer warp issues the TMA
loads into a ring of shared-memory stages, two consumer warp groups take the stages' products
and apply the block scales, and they meet only at per-stage mbarriers (ready: the stage landed;
empty: both groups are done with it), so one group's scaling runs while the other's MMA holds
the tensor cores. On a dense GEMM this reached 943 TFLOP/s against 1179 for torch._scaled_mm
blockwise; on M3's MoE gate/up 772 against the Triton loop's 637 at 16384 tokens (one H200:
docs/kernel-notes.md#moe-in-gluon).

gate_up_act runs it over the layout of moe_triton.py (each expert's sorted rows padded to
BLOCK_M, an expert index per row block) on a [64, 128] tile per program: warp group 0 takes the
gate product, warp group 1 the up product (the same activation stage, the expert's w13 rows n
and N + n), the up tile crosses to group 0 through shared memory, and group 0 applies
SwiGLU-OAI / SiLU and the 1 x 128 FP8 quantization as the Triton kernel does. The activation
rows must already be in sorted order (TMA cannot gather rows on Hopper):
kernels/moe_quant_scatter.py quantizes them straight into it. Each program makes
the TMA descriptor of its expert's weights in the kernel (one tensor per expert, addressed
through moe_triton's pointer table), which takes a little global scratch per launch from
triton's allocator (one is set here if there is none). After it the down GEMM is the Triton
kernel: a warp-specialized down over the same 64-row blocks measured slower (kernel-notes). It
is the default on sm_90 since 2026-12-03 (kernel option moe_gemm=auto): the layer was 2-4% faster with it at 8192-16384
tokens, burst and back to back at the card's power limit (docs/kernel-notes.md#moe-at-the-power-limit).

gate_up_act_trio runs the same math over 192-row blocks: three consumer warp groups of 64 rows
each take the same stacked weight tile (the gate rows of 64 columns of h over their up rows) and
cover 128 columns of h in two passes, the first pass's h parked in shared memory until the 1 x 128
quantization (gate and up columns split in registers, the FP8 tile of h out by TMA). A third group
keeps the tensor cores busy while the others scale their products, and a weight tile serves 192
rows instead of 64: the layer is 2-6% faster at 8192-16384 tokens, and the default there (kernel
option moe_gemm=auto; moe_plan.TRIO_MIN_ROWS_PER_EXPERT).
down_trio is the down GEMM over the same blocks, warp-specialized the same way (three groups of
64 rows on one [128, 128] weight tile per K step), with the Triton down kernel's epilogue (bf16,
times the routing weight, bf16): 12% faster than the Triton kernel at 8192 tokens, even at 16384
(kernel option moe_down=auto follows the 192-row gate/up). Each down program covers three
128-column tiles one after the other (DOWN_TRIO_COL_TILES), the producer loading the next tile's
stages while the consumers store the last: another 17-20% off the down kernel at 8192-16384 tokens;
each tile of y leaves by TMA while the next one's products run (3-11% off the down on an H100).

The BF16 layer takes the same 192-row blocks (its rows put in the sorted order by
moe_quant_scatter.scatter_rows): the gate/up (_gate_up_trio_bf16_kernel) and the down
(_down_trio_kernel with FP8 off) have the FP8 kernels' structure with K steps of 64 and no scale
between steps, so each warp group sums in the wgmma accumulator and keeps one product in flight.
Under kernel option moe_bf16_passes=1 (the default) the BF16 gate/up takes a program's 128 columns
of h in one pass (gate and up products side by side from 256-row weight tiles) and the down two
column tiles a pass, loading each activation tile half as often (6-11% faster than two passes on an
H100: docs/kernel-notes.md#the-bf16-gateup-in-one-pass).

Routed and shared experts of one width. The FP8 output equals the Triton kernels' bit for bit (the
same float32 products summed in the same order: tests/test_moe_triton.py); BF16 is checked against
the CPU reference and the Triton kernels on the GPU (same file).
"""

from __future__ import annotations

import torch

from . import ffma_yield
from . import gluon_trace as trace
from .options import kernel_options

try:  # Gluon ships with triton >= 3.5; CPU installs and older triton use the Triton kernels
    import triton
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, tma, warpgroup_mma,
                                                                   warpgroup_mma_wait)

    # triton 3.6 (the GPU box) names the TMA load async_copy_global_to_shared, 3.9 async_load
    _tma_load = getattr(tma, "async_load", None) or tma.async_copy_global_to_shared
    _tma_store = getattr(tma, "async_store", None) or tma.async_copy_shared_to_global
    # and the warp group's own barrier thread_barrier, 3.9 barrier
    _group_barrier = getattr(gl, "thread_barrier", None) or gl.barrier
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor
    HAVE_GLUON = True
except ImportError:  # pragma: no cover
    HAVE_GLUON = False


def gluon_available(device: torch.device) -> bool:
    """Gluon importable and a Hopper GPU (wgmma, TMA): sm_90 exactly."""
    return HAVE_GLUON and device.type == "cuda" and torch.cuda.get_device_capability(device) == (9, 0)


def _ensure_allocator() -> None:
    """In-kernel TMA descriptors need global scratch from triton's allocator: set one on torch's
    caching allocator (the current device) unless the caller set their own. Inside a CUDA graph
    capture the scratch comes from the graph's pool, so replays keep it."""
    from triton.runtime import _allocation

    if _allocation._allocator.get() is _allocation._NULL_ALLOCATOR:
        triton.set_allocator(lambda size, align, stream: torch.empty(size, dtype=torch.int8, device="cuda"))


if HAVE_GLUON:

    @gluon.jit
    def _tile_of(pid, num_m_blocks, num_n_tiles, GROUP_M: gl.constexpr, groups_ptr):
        """(row block, column tile) of program pid: GROUP_M row blocks at a time over every
        column tile, or (GROUP_M -1) the groups by expert at groups_ptr (as moe_triton._tile_of)."""
        if GROUP_M < 0:
            b = pid // num_n_tiles
            first = gl.load(groups_ptr + 2 * b)
            size = gl.load(groups_ptr + 2 * b + 1)
            local = pid - first * num_n_tiles
            return first + local % size, local // size
        in_group = GROUP_M * num_n_tiles
        first_m = (pid // in_group) * GROUP_M
        size_m = gl.minimum(num_m_blocks - first_m, GROUP_M)
        return first_m + (pid % in_group) % size_m, (pid % in_group) // size_m

    @gluon.jit
    def _gated_act(g, u, alpha, limit, beta, ACT: gl.constexpr):
        """h = act(gate, up) (g and u: float32 holding bf16 values, as the eager MLP rounds the
        gate/up GEMM first), SwiGLU-OAI or SiLU-gated, rounded to bf16."""
        if ACT == 0:  # SwiGLU-OAI
            g = gl.minimum(g, limit)
            u = gl.minimum(gl.maximum(u, -limit), limit)
            h = (u + beta) * (g / (1.0 + gl.exp(-(g * alpha))))
        else:  # SiLU-gated
            h = g / (1.0 + gl.exp(-g)) * u
        return h.to(gl.bfloat16).to(gl.float32)

    @gluon.jit
    def _pow2_scale(amax):
        """The 1 x 128 quantization's scale of rows with these amax (power-of-two, from the exponent
        bits, as moe_triton) and its inverse."""
        amax = gl.maximum(amax, 1e-30)
        v = gl.div_rn(amax, gl.full(amax.shape, 448.0, gl.float32, amax.type.layout))
        vb = v.to(gl.int32, bitcast=True)
        ex = ((vb >> 23) & 0xFF) + ((vb & 0x7FFFFF) != 0).to(gl.int32)
        return (ex << 23).to(gl.float32, bitcast=True), ((254 - ex) << 23).to(gl.float32, bitcast=True)

    @gluon.jit
    def _act_quant_store(g, u, rows, cols, h_ptr, hs_ptr, pid_n, N: gl.constexpr, alpha, limit, beta,
                         ACT: gl.constexpr):
        """h = act(gate, up) of one [rows, 128] tile, quantized in 1 x 128 groups and stored."""
        h = _gated_act(g, u, alpha, limit, beta, ACT)
        scale, inv = _pow2_scale(gl.max(gl.abs(h), axis=1))
        q = gl.minimum(gl.maximum(h * inv[:, None], -448.0), 448.0)
        out_rows = rows.to(gl.int64)
        gl.store(h_ptr + out_rows[:, None] * N + cols[None, :], q.to(gl.float8e4nv))
        gl.store(hs_ptr + out_rows * (N // 128) + pid_n, scale)

    @gluon.jit
    def _ws_producer(a_desc, b_desc, a_smem, b0_smem, b1_smem, ready, empty, off_m, b0_row, b1_row, n_steps,
                     STAGES: gl.constexpr):
        """The producer warp: each K step's activation tile and two weight tiles (rows b0_row and
        b1_row) into the next free stage; a stage is free once both consumer groups released it."""
        BK: gl.constexpr = 128
        nbytes: gl.constexpr = a_desc.block_type.nbytes + 2 * b_desc.block_type.nbytes
        for ki in range(n_steps):
            s = ki % STAGES
            mbarrier.wait(empty.index(s), ((ki // STAGES) & 1) ^ 1)
            bar = ready.index(s)
            mbarrier.expect(bar, nbytes)
            _tma_load(a_desc, [off_m, ki * BK], bar, a_smem.index(s))
            _tma_load(b_desc, [b0_row, ki * BK], bar, b0_smem.index(s))
            _tma_load(b_desc, [b1_row, ki * BK], bar, b1_smem.index(s))

    @gluon.jit
    def _ws_product(a_smem, b_smem, ready, empty, a_scales, b_scales, n_steps, it0, STAGES: gl.constexpr,
                    layout: gl.constexpr, TRACE: gl.constexpr = False, waited=0):
        """This warp group's [64, 128] tile over the K steps: each step's product times its block scales.
        it0: the ring's iteration of the first step (earlier tiles of the program took it0 stages).
        TRACE: also the cycles it waited for loaded stages, added to `waited` (returned beside the tile)."""
        acc = gl.zeros((64, 128), dtype=gl.float32, layout=layout)
        p = gl.zeros((64, 128), dtype=gl.float32, layout=layout)
        for ki in range(n_steps):
            it = it0 + ki
            s = it % STAGES
            sa = gl.load(a_scales + ki)
            sb = gl.load(b_scales + ki)
            if TRACE:
                waited = trace.timed_wait(ready.index(s), (it // STAGES) & 1, waited)
            else:
                mbarrier.wait(ready.index(s), (it // STAGES) & 1)
            p = warpgroup_mma(a_smem.index(s), b_smem.index(s).permute((1, 0)), p, use_acc=False, is_async=True)
            p = warpgroup_mma_wait(0, deps=(p, ))
            mbarrier.arrive(empty.index(s), count=1)
            acc += p * (sa * sb)[:, None]
        return acc, waited

    @gluon.jit
    def _gate_up_ws_consumer(a_smem, b_smem, ready, empty, xs_ptr, ws, h_ptr, hs_ptr, epi_smem, epi_bar, off_m,
                             w_row, pid_n, n_steps, active, N: gl.constexpr, K: gl.constexpr, alpha, limit, beta,
                             ACT: gl.constexpr, STAGES: gl.constexpr, IS_UP: gl.constexpr):
        layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, 128, 32])
        rows = off_m + gl.arange(0, 64, layout=gl.SliceLayout(1, layout))
        acc, _ = _ws_product(a_smem, b_smem, ready, empty, xs_ptr + rows.to(gl.int64) * (K // 128),
                             ws + (w_row // 128) * (K // 128), n_steps, 0, STAGES, layout)
        v = acc.to(gl.bfloat16)  # the eager MLP rounds gate/up to bf16 first
        if IS_UP:  # hand the up tile to the gate group, which finishes the tile
            epi_smem.store(v)
            mbarrier.arrive(epi_bar, count=1)
        else:
            mbarrier.wait(epi_bar, 0)
            u = epi_smem.load(layout).to(gl.float32)
            cols = pid_n * 128 + gl.arange(0, 128, layout=gl.SliceLayout(0, layout))
            if active:
                _act_quant_store(v.to(gl.float32), u, rows, cols, h_ptr, hs_ptr, pid_n, N, alpha, limit, beta, ACT)

    @gluon.jit
    def _gate_up_ws_kernel(x_ptr, xs_ptr, w_table, ws_table, block_expert, h_ptr, hs_ptr, rows_total, n_local,
                           num_m_blocks, num_n_tiles, alpha, limit, beta, N: gl.constexpr, K: gl.constexpr,
                           ACT: gl.constexpr, STAGES: gl.constexpr, GROUP_M: gl.constexpr,
                           CONSUMER_REGS: gl.constexpr, PRODUCER_REGS: gl.constexpr, num_warps: gl.constexpr):
        """gate_up + act of one [64, 128] tile: warp group 0 the gate product, 1 the up product."""
        BM: gl.constexpr = 64
        BK: gl.constexpr = 128
        pid_m, pid_n = _tile_of(gl.program_id(0), num_m_blocks, num_n_tiles, GROUP_M, block_expert + num_m_blocks)
        e = gl.load(block_expert + pid_m)
        active = e < n_local
        e = gl.minimum(e, n_local - 1)  # idle blocks run no K step and store nothing
        n_steps = gl.where(active, K // BK, 0)
        w = gl.load(w_table + e).to(gl.pointer_type(gl.float8e4nv))
        ws = gl.load(ws_table + e).to(gl.pointer_type(gl.float32))
        smem_layout: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=8, rank=2)
        a_desc = tma.make_tensor_descriptor(x_ptr, shape=[rows_total, K], strides=[K, 1], block_shape=[BM, BK],
                                            layout=smem_layout)
        w_desc = tma.make_tensor_descriptor(w, shape=[2 * N, K], strides=[K, 1], block_shape=[128, BK],
                                            layout=smem_layout)
        a_smem = gl.allocate_shared_memory(gl.float8e4nv, [STAGES, BM, BK], smem_layout)
        g_smem = gl.allocate_shared_memory(gl.float8e4nv, [STAGES, 128, BK], smem_layout)
        u_smem = gl.allocate_shared_memory(gl.float8e4nv, [STAGES, 128, BK], smem_layout)
        epi_layout: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2)
        epi_smem = gl.allocate_shared_memory(gl.bfloat16, [BM, 128], epi_layout)
        ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        epi_bar = gl.allocate_shared_memory(gl.int64, [1, 1], mbarrier.MBarrierLayout())
        for s in gl.static_range(STAGES):
            mbarrier.init(ready.index(s), count=1)
            mbarrier.init(empty.index(s), count=2)
        mbarrier.init(epi_bar.index(0), count=1)
        off_m = pid_m * BM
        off_n = pid_n * 128
        gl.warp_specialize([
            (_gate_up_ws_consumer, (a_smem, g_smem, ready, empty, xs_ptr, ws, h_ptr, hs_ptr, epi_smem, epi_bar.index(0),
                                    off_m, off_n, pid_n, n_steps, active, N, K, alpha, limit, beta, ACT, STAGES, False)),
            (_gate_up_ws_consumer, (a_smem, u_smem, ready, empty, xs_ptr, ws, h_ptr, hs_ptr, epi_smem, epi_bar.index(0),
                                    off_m, N + off_n, pid_n, n_steps, active, N, K, alpha, limit, beta, ACT, STAGES,
                                    True)),
            (_ws_producer, (a_desc, w_desc, a_smem, g_smem, u_smem, ready, empty, off_m, off_n, N + off_n, n_steps,
                            STAGES)),
        ], [4, 1], [CONSUMER_REGS, PRODUCER_REGS])


    # ---- 192-row tiles: three 64-row groups of one expert share each weight tile ----

    @gluon.jit
    def _trio_block(block_expert, sorted_pair, w_table, ws_table, n_local, num_m_blocks, num_n_tiles,
                    K: gl.constexpr, GROUP_M: gl.constexpr, BK: gl.constexpr, DTYPE: gl.constexpr):
        """This program's 192-row block and column tile: (column tile, first row, K steps of BK, whether
        each 64-row group holds rows, the expert's weight pointer (DTYPE) and block-scale pointer, the
        latter unused in BF16). An idle block runs no K step and stores nothing."""
        pid_m, pid_n = _tile_of(gl.program_id(0), num_m_blocks, num_n_tiles, GROUP_M, block_expert + num_m_blocks)
        e = gl.load(block_expert + pid_m)
        active = e < n_local
        e = gl.minimum(e, n_local - 1)
        n_steps = gl.where(active, K // BK, 0)
        off_m = pid_m * 192
        # an expert's rows come first in its run, so a group that starts with padding is all padding
        second = active & (gl.load(sorted_pair + off_m + 64) >= 0)
        third = active & (gl.load(sorted_pair + off_m + 128) >= 0)
        w = gl.load(w_table + e).to(gl.pointer_type(DTYPE))
        ws = gl.load(ws_table + e).to(gl.pointer_type(gl.float32))
        return pid_n, off_m, n_steps, active, second, third, w, ws

    @gluon.jit
    def _trace_entry(trace_ptr, entry_ns, entry_cycle, n_steps, active, second, third):
        """A traced 192-row program's record (kernels/gluon_trace.py): its entry times (read first thing
        in the kernel), its SM and its work (K steps a pass, which 64-row groups hold rows)."""
        rec = trace_ptr + gl.program_id(0).to(gl.int64) * trace.RECORD
        gl.store(rec + trace.ENTRY_NS, entry_ns)
        gl.store(rec + trace.ENTRY_CYCLE, entry_cycle)
        gl.store(rec + trace.SM, trace.sm_id())
        gl.store(rec + trace.WORK, n_steps.to(gl.int64) * 8 + active.to(gl.int64) + 2 * second.to(gl.int64)
                 + 4 * third.to(gl.int64))
        return rec

    @gluon.jit
    def _trio_stage_tiles(STAGES: gl.constexpr, layout: gl.constexpr, DTYPE: gl.constexpr, BK: gl.constexpr,
                          B_ROWS: gl.constexpr = 128):
        """The stage ring's tiles: each stage's three 64-row activation tiles and one weight tile of
        B_ROWS rows, BK wide (128 bytes: FP8 128, BF16 64)."""
        a0 = gl.allocate_shared_memory(DTYPE, [STAGES, 64, BK], layout)
        a1 = gl.allocate_shared_memory(DTYPE, [STAGES, 64, BK], layout)
        a2 = gl.allocate_shared_memory(DTYPE, [STAGES, 64, BK], layout)
        b = gl.allocate_shared_memory(DTYPE, [STAGES, B_ROWS, BK], layout)
        return a0, a1, a2, b

    @gluon.jit
    def _trio_barriers(STAGES: gl.constexpr):
        """Each stage's ready barrier (the producer's loads landed) and empty one (the three consumer
        groups released it)."""
        ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        for s in gl.static_range(STAGES):
            mbarrier.init(ready.index(s), count=1)
            mbarrier.init(empty.index(s), count=3)
        return ready, empty

    @gluon.jit
    def _release_stages(ready, empty, n_iters, STAGES: gl.constexpr):
        """A consumer group whose rows are all padding: take each stage as it lands and release it."""
        for it in range(n_iters):
            s = it % STAGES
            mbarrier.wait(ready.index(s), (it // STAGES) & 1)
            mbarrier.arrive(empty.index(s), count=1)

    @gluon.jit
    def _trio_rows_into_stage(a_desc, a0_smem, a1_smem, a2_smem, ready, empty, it, off_m, k, second, third,
                              weight_bytes: gl.constexpr, LIVE_ROWS: gl.constexpr, STAGES: gl.constexpr):
        """The producer's iteration `it`: wait until its stage is free, expect the bytes of the loads on
        the stage's ready barrier and load the block's 64-row tiles at column k into it (the caller
        adds the weight tile, weight_bytes); the stage's index. LIVE_ROWS (kernel option
        moe_trio_rows=live): the second and third tiles only where their group holds rows (an idle
        group only releases the stage, so its tile would be padding nobody reads)."""
        row_bytes: gl.constexpr = a_desc.block_type.nbytes
        s = it % STAGES
        mbarrier.wait(empty.index(s), ((it // STAGES) & 1) ^ 1)
        bar = ready.index(s)
        if LIVE_ROWS:
            # the count must equal the loads below, or the stage never completes
            if third:
                mbarrier.expect(bar, 3 * row_bytes + weight_bytes)
            elif second:
                mbarrier.expect(bar, 2 * row_bytes + weight_bytes)
            else:
                mbarrier.expect(bar, row_bytes + weight_bytes)
            _tma_load(a_desc, [off_m, k], bar, a0_smem.index(s))
            if second | third:
                _tma_load(a_desc, [off_m + 64, k], bar, a1_smem.index(s))
            if third:
                _tma_load(a_desc, [off_m + 128, k], bar, a2_smem.index(s))
        else:
            mbarrier.expect(bar, 3 * row_bytes + weight_bytes)
            _tma_load(a_desc, [off_m, k], bar, a0_smem.index(s))
            _tma_load(a_desc, [off_m + 64, k], bar, a1_smem.index(s))
            _tma_load(a_desc, [off_m + 128, k], bar, a2_smem.index(s))
        return s

    @gluon.jit
    def _trio_producer(a_desc, w_desc, a0_smem, a1_smem, a2_smem, b_smem, ready, empty, off_m, off_n, n_steps,
                       second, third, N: gl.constexpr, STAGES: gl.constexpr, BK: gl.constexpr,
                       LIVE_ROWS: gl.constexpr, PASSES: gl.constexpr = 2, TRACE: gl.constexpr = False, rec=None):
        """The producer warp, for each pass over the program's 128 columns of h (PASSES of 128 /
        PASSES columns each) and each K step: the three 64-row activation tiles and one weight tile,
        the gate rows of the pass's columns over their up rows (two TMA loads into its halves).
        TRACE: how long it waited for free stages, into the program's record rec
        (kernels/gluon_trace.py)."""
        W_ROWS: gl.constexpr = 128 // PASSES  # gate (and up) rows of a pass
        weight_bytes: gl.constexpr = 2 * w_desc.block_type.nbytes
        if TRACE:
            gl.store(rec + trace.PRODUCER_ENTRY_CYCLE, trace.clock())
            waited = trace.clock32() * 0
        for j in gl.static_range(PASSES):
            for ki in range(n_steps):
                it = j * n_steps + ki
                if TRACE:  # the wait below, timed; the one inside _trio_rows_into_stage then passes at once
                    waited = trace.timed_wait(empty.index(it % STAGES), ((it // STAGES) & 1) ^ 1, waited)
                s = _trio_rows_into_stage(a_desc, a0_smem, a1_smem, a2_smem, ready, empty, it, off_m,
                                          ki * BK, second, third, weight_bytes, LIVE_ROWS, STAGES)
                bar = ready.index(s)
                b = b_smem.index(s)
                _tma_load(w_desc, [off_n + W_ROWS * j, ki * BK], bar, b.slice(0, W_ROWS))
                _tma_load(w_desc, [N + off_n + W_ROWS * j, ki * BK], bar, b.slice(W_ROWS, W_ROWS))
        if TRACE:
            gl.store(rec + trace.LAST_ISSUE_CYCLE, trace.clock())
            gl.store(rec + trace.EMPTY_WAIT, waited.to(gl.int64))

    @gluon.jit
    def _trio_half(a_smem, b_smem, ready, empty, a_scales, sg_ptr, su_ptr, n_steps, j, STAGES: gl.constexpr,
                   layout: gl.constexpr, TRACE: gl.constexpr = False, waited=0):
        """One 64-column half: [64, 128] = the gate (columns 0-63) and up (64-127) products of this
        group's rows, each K step scaled by the row's activation scale times the column's weight scale.
        TRACE: also the cycles it waited for loaded stages, added to `waited` (returned beside the tile)."""
        gate_cols = (gl.arange(0, 128, layout=gl.SliceLayout(0, layout)) < 64)[None, :]
        acc = gl.zeros((64, 128), dtype=gl.float32, layout=layout)
        p = gl.zeros((64, 128), dtype=gl.float32, layout=layout)
        for ki in range(n_steps):
            it = j * n_steps + ki
            s = it % STAGES
            sa = gl.load(a_scales + ki)
            s_gate = (sa * gl.load(sg_ptr + ki))[:, None]
            s_up = (sa * gl.load(su_ptr + ki))[:, None]
            if TRACE:
                waited = trace.timed_wait(ready.index(s), (it // STAGES) & 1, waited)
            else:
                mbarrier.wait(ready.index(s), (it // STAGES) & 1)
            p = warpgroup_mma(a_smem.index(s), b_smem.index(s).permute((1, 0)), p, use_acc=False, is_async=True)
            p = warpgroup_mma_wait(0, deps=(p, ))
            mbarrier.arrive(empty.index(s), count=1)
            acc += p * gl.where(gate_cols, s_gate, s_up)
        return acc, waited

    @gluon.jit
    def _gate_up_split(t):
        """A [64, 128] tile in the wgmma layout as its gate (columns 0-63) and up (64-127) halves,
        [64, 64] each, without leaving the registers: a thread of the layout holds column c and c + 64
        of its rows, so the split is a relabelling, where a pass through shared memory cost each warp
        group a 16 KB tile (docs/kernel-notes.md#gate-and-up-split-in-registers)."""
        return gl.split(gl.permute(gl.reshape(t, [64, 2, 64]), (0, 2, 1)))

    @gluon.jit
    def _halves_joined(a, b):
        """_gate_up_split's inverse: [64, 128] = a's columns, then b's."""
        return gl.reshape(gl.permute(gl.join(a, b), (0, 2, 1)), [64, 128])

    @gluon.jit
    def _tile_out_by_tma(desc, off_m, off_n, smem, tile):
        """A warp group's tile into its smem tile and out by one TMA store at (off_m, off_n); the caller
        waits for the store before it writes smem again."""
        smem.store(tile)
        fence_async_shared()
        _group_barrier()  # the whole group's rows are in smem
        _tma_store(desc, [off_m, off_n], smem)

    @gluon.jit
    def _trio_act_in_registers(acc, alpha, limit, beta, ACT: gl.constexpr, half: gl.constexpr):
        """h of one half: the gate and up columns rounded to bf16 (as the eager MLP does), SwiGLU-OAI /
        SiLU; float32 [64, 64] in `half`, the wgmma layout of a 64-column tile, which is what the split
        gives (so naming it moves nothing)."""
        g, u = _gate_up_split(acc.to(gl.bfloat16).to(gl.float32))
        return _gated_act(gl.convert_layout(g, half), gl.convert_layout(u, half), alpha, limit, beta, ACT)

    @gluon.jit
    def _trio_consumer(a_smem, b_smem, ready, empty, xs_ptr, ws, out_desc, hs_ptr, park_smem, out_smem, off_m, off_n,
                       pid_n, n_steps, live, N: gl.constexpr, K: gl.constexpr, alpha, limit, beta,
                       ACT: gl.constexpr, STAGES: gl.constexpr, TRACE: gl.constexpr = False, rec=None,
                       GROUP: gl.constexpr = 0):
        """One warp group's 64 rows of the program's [192, 128] tile of h, in two halves of 64 columns
        (the first half's h parked in shared memory as bf16, which it is), then the 1 x 128 quantization
        over both, the FP8 tile stored from out_smem by TMA (out_desc: h). A group whose rows are all
        padding only releases the stages. TRACE: its waits for loaded stages into the program's record
        rec, and group 0 (GROUP) the program's edges."""
        layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, 128, 32])
        half: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, 64, 32])
        if live:
            rows = off_m + gl.arange(0, 64, layout=gl.SliceLayout(1, layout))
            a_scales = xs_ptr + rows.to(gl.int64) * (K // 128)
            sg_ptr = ws + (off_n // 128) * (K // 128)
            su_ptr = ws + ((N + off_n) // 128) * (K // 128)
            waited = 0
            if TRACE:  # when the ring's first loads landed
                waited = trace.first_stage(ready.index(0), rec, GROUP)
            acc, waited = _trio_half(a_smem, b_smem, ready, empty, a_scales, sg_ptr, su_ptr, n_steps, 0, STAGES, layout,
                                     TRACE, waited)
            h0 = _trio_act_in_registers(acc, alpha, limit, beta, ACT, half)
            park_smem.store(h0.to(gl.bfloat16))
            acc, waited = _trio_half(a_smem, b_smem, ready, empty, a_scales, sg_ptr, su_ptr, n_steps, 1, STAGES, layout,
                                     TRACE, waited)
            if TRACE:
                if GROUP == 0:
                    gl.store(rec + trace.LAST_PRODUCT_CYCLE, trace.clock())
                gl.store(rec + trace.READY_WAIT_0 + GROUP, waited.to(gl.int64))
            h1 = _trio_act_in_registers(acc, alpha, limit, beta, ACT, half)
            h0 = park_smem.load(half).to(gl.float32)
            # 1 x 128 quantization over both halves
            scale, inv = _pow2_scale(gl.maximum(gl.max(gl.abs(h0), axis=1), gl.max(gl.abs(h1), axis=1)))
            q0 = gl.minimum(gl.maximum(h0 * inv[:, None], -448.0), 448.0)
            q1 = gl.minimum(gl.maximum(h1 * inv[:, None], -448.0), 448.0)
            q = _halves_joined(q0.to(gl.float8e4nv), q1.to(gl.float8e4nv))
            _tile_out_by_tma(out_desc, off_m, off_n, out_smem, q)
            # the scales after the tile's store is issued: before it, Triton 3.9 spilled registers
            gl.store(hs_ptr + (off_m + gl.arange(0, 64, layout=gl.SliceLayout(1, half))).to(gl.int64) * (N // 128)
                     + pid_n, scale)
            tma.store_wait(0)
        else:
            _release_stages(ready, empty, 2 * n_steps, STAGES)
        if TRACE:
            if GROUP == 0:
                gl.store(rec + trace.END_CYCLE, trace.clock())
                gl.store(rec + trace.END_NS, trace.global_ns())

    @gluon.jit
    def _gate_up_trio_kernel(a_desc, xs_ptr, w_table, ws_table, block_expert, sorted_pair, out_desc, hs_ptr, trace_ptr,
                              n_local, num_m_blocks, num_n_tiles, alpha, limit, beta, N: gl.constexpr,
                              K: gl.constexpr, ACT: gl.constexpr, STAGES: gl.constexpr, GROUP_M: gl.constexpr,
                              CONSUMER_REGS: gl.constexpr, PRODUCER_REGS: gl.constexpr, num_warps: gl.constexpr,
                              LIVE_ROWS: gl.constexpr = False, TRACE: gl.constexpr = False,
                              FFMA_YIELD: gl.constexpr = 0):
        """gate_up + act of one [192, 128] tile of h: warp groups 0, 1, 2 rows 0-63, 64-127, 128-191,
        all from the same [128, 128] weight tiles (gate over up, 64 columns of h at a time). a_desc /
        out_desc: the host's TMA descriptors of x and h ([64, 128] blocks); the expert's weights' is made
        here. TRACE: each program's record of where its time went into trace_ptr
        (kernels/gluon_trace.py; unread otherwise). FFMA_YIELD: unread here; it keys the compiled
        kernel that _launch_trio edits (kernels/ffma_yield.py)."""
        BK: gl.constexpr = 128
        if TRACE:
            entry_ns = trace.global_ns()
            entry_cycle = trace.clock()
        pid_n, off_m, n_steps, active, second, third, w, ws = _trio_block(
            block_expert, sorted_pair, w_table, ws_table, n_local, num_m_blocks, num_n_tiles, K, GROUP_M, BK,
            gl.float8e4nv)
        rec = trace_ptr
        if TRACE:
            rec = _trace_entry(trace_ptr, entry_ns, entry_cycle, n_steps, active, second, third)
        smem_layout: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=8, rank=2)
        w_desc = tma.make_tensor_descriptor(w, shape=[2 * N, K], strides=[K, 1], block_shape=[64, BK],
                                            layout=smem_layout)
        a0_smem, a1_smem, a2_smem, b_smem = _trio_stage_tiles(STAGES, smem_layout, gl.float8e4nv, BK)
        # each group's parked bf16 half (swizzled: the wgmma layout's rows would share banks) and its
        # FP8 [64, 128] tile of h on its way out by TMA
        park_layout: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2)
        park0 = gl.allocate_shared_memory(gl.bfloat16, [64, 64], park_layout)
        park1 = gl.allocate_shared_memory(gl.bfloat16, [64, 64], park_layout)
        park2 = gl.allocate_shared_memory(gl.bfloat16, [64, 64], park_layout)
        out0 = gl.allocate_shared_memory(gl.float8e4nv, [64, 128], smem_layout)
        out1 = gl.allocate_shared_memory(gl.float8e4nv, [64, 128], smem_layout)
        out2 = gl.allocate_shared_memory(gl.float8e4nv, [64, 128], smem_layout)
        ready, empty = _trio_barriers(STAGES)
        off_n = pid_n * 128
        gl.warp_specialize([
            (_trio_consumer, (a0_smem, b_smem, ready, empty, xs_ptr, ws, out_desc, hs_ptr, park0, out0, off_m, off_n,
                              pid_n, n_steps, active, N, K, alpha, limit, beta, ACT, STAGES, TRACE, rec, 0)),
            (_trio_consumer, (a1_smem, b_smem, ready, empty, xs_ptr, ws, out_desc, hs_ptr, park1, out1, off_m + 64,
                              off_n, pid_n, n_steps, second, N, K, alpha, limit, beta, ACT, STAGES, TRACE, rec, 1)),
            (_trio_consumer, (a2_smem, b_smem, ready, empty, xs_ptr, ws, out_desc, hs_ptr, park2, out2, off_m + 128,
                              off_n, pid_n, n_steps, third, N, K, alpha, limit, beta, ACT, STAGES, TRACE, rec, 2)),
            (_trio_producer, (a_desc, w_desc, a0_smem, a1_smem, a2_smem, b_smem, ready, empty, off_m, off_n, n_steps,
                              second, third, N, STAGES, BK, LIVE_ROWS, 2, TRACE, rec)),
        ], [4, 4, 1], [CONSUMER_REGS, CONSUMER_REGS, PRODUCER_REGS])


    # ---- the down GEMM over the same 192-row blocks ----

    @gluon.jit
    def _down_trio_producer(h_desc, w_desc, a0_smem, a1_smem, a2_smem, b_smem, ready, empty, off_m, off_n, n_steps,
                            second, third, STAGES: gl.constexpr, COL_TILES: gl.constexpr, BK: gl.constexpr,
                            LIVE_ROWS: gl.constexpr, TRACE: gl.constexpr = False, rec=None,
                            PAIRS: gl.constexpr = False):
        """The producer warp: for each of the program's column tiles (PAIRS: each two) and each K step,
        the three 64-row tiles of h and the [128, BK] weight tile (PAIRS: both tiles', one over the
        other). It runs on into the next column tile while the consumers store the last one, so only
        the program's first tile waits for the ring to fill. TRACE: how long it waited for free
        stages, into the program's record rec."""
        TILES: gl.constexpr = 2 if PAIRS else 1
        if TRACE:
            gl.store(rec + trace.PRODUCER_ENTRY_CYCLE, trace.clock())
            waited = trace.clock32() * 0
        for j in range(COL_TILES // TILES):
            for ki in range(n_steps):
                it = j * n_steps + ki
                if TRACE:  # the wait below, timed; the one inside _trio_rows_into_stage then passes at once
                    waited = trace.timed_wait(empty.index(it % STAGES), ((it // STAGES) & 1) ^ 1, waited)
                s = _trio_rows_into_stage(h_desc, a0_smem, a1_smem, a2_smem, ready, empty, it, off_m,
                                          ki * BK, second, third, TILES * w_desc.block_type.nbytes, LIVE_ROWS,
                                          STAGES)
                if PAIRS:
                    _tma_load(w_desc, [off_n + 256 * j, ki * BK], ready.index(s), b_smem.index(s).slice(0, 128))
                    _tma_load(w_desc, [off_n + 256 * j + 128, ki * BK], ready.index(s),
                              b_smem.index(s).slice(128, 128))
                else:
                    _tma_load(w_desc, [off_n + 128 * j, ki * BK], ready.index(s), b_smem.index(s))
        if TRACE:
            gl.store(rec + trace.LAST_ISSUE_CYCLE, trace.clock())
            gl.store(rec + trace.EMPTY_WAIT, waited.to(gl.int64))

    @gluon.jit
    def _down_trio_consumer(a_smem, b_smem, ready, empty, hs_ptr, ws, sorted_pair, topk_w, y_desc, y_smem, off_m,
                            off_n, n_steps, live, K: gl.constexpr, STAGES: gl.constexpr, COL_TILES: gl.constexpr,
                            FP8: gl.constexpr, TRACE: gl.constexpr = False, rec=None, GROUP: gl.constexpr = 0,
                            PAIRS: gl.constexpr = False):
        """One warp group's [64, 128] tiles of y, one per column tile: in FP8 the products scaled per K
        step as the Triton down kernel does, in BF16 summed on the tensor cores (PAIRS: two column
        tiles a pass over K); rounded to bf16, times the pair's routing weight (0 on padding rows,
        which nothing reads), rounded again, and stored from y_smem by TMA while the next tile's
        products run. A group whose rows are all padding only releases the stages. TRACE (FP8): its
        waits for loaded stages into the program's record rec, and group 0 (GROUP) the program's
        edges."""
        gl.static_assert(not (PAIRS and FP8), "FP8 has no paired form (its scaling needs the registers)")
        if FP8:
            layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                             instr_shape=[16, 128, 32])
        else:
            layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                             instr_shape=[16, 128, 16])
        if live:
            rows = off_m + gl.arange(0, 64, layout=gl.SliceLayout(1, layout))
            pair = gl.load(sorted_pair + rows)
            valid = pair >= 0
            wt = gl.load(topk_w + gl.where(valid, pair, 0), mask=valid, other=0.0)
            waited = 0
            if TRACE:  # when the ring's first loads landed
                waited = trace.first_stage(ready.index(0), rec, GROUP)
            if PAIRS:  # BF16, two column tiles a pass
                for j in range(COL_TILES // 2):
                    t0, t1 = _bf16_two_products(a_smem, b_smem, ready, empty, n_steps, j * n_steps, STAGES, layout)
                    _down_tile_out(y_desc, y_smem, off_m, off_n + 256 * j, t0, wt)
                    _down_tile_out(y_desc, y_smem, off_m, off_n + 256 * j + 128, t1, wt)
            else:
                for j in range(COL_TILES):
                    col0 = off_n + 128 * j
                    if FP8:
                        a_scales = hs_ptr + rows.to(gl.int64) * (K // 128)
                        b_scales = ws + (col0 // 128) * (K // 128)
                        acc, waited = _ws_product(a_smem, b_smem, ready, empty, a_scales, b_scales, n_steps,
                                                  j * n_steps, STAGES, layout, TRACE, waited)
                    else:
                        acc = _bf16_product(a_smem, b_smem, ready, empty, n_steps, j * n_steps, STAGES, layout)
                    if TRACE:
                        if j == COL_TILES - 1:
                            if GROUP == 0:
                                gl.store(rec + trace.LAST_PRODUCT_CYCLE, trace.clock())
                            gl.store(rec + trace.READY_WAIT_0 + GROUP, waited.to(gl.int64))
                    _down_tile_out(y_desc, y_smem, off_m, col0, acc, wt)
            tma.store_wait(0)
        else:
            _release_stages(ready, empty, (COL_TILES // 2 if PAIRS else COL_TILES) * n_steps, STAGES)
        if TRACE:
            if GROUP == 0:
                gl.store(rec + trace.END_CYCLE, trace.clock())
                gl.store(rec + trace.END_NS, trace.global_ns())

    @gluon.jit
    def _down_tile_out(y_desc, y_smem, off_m, col0, acc, wt):
        """A [64, 128] tile of y: the sum rounded to bf16, times the rows' routing weights, rounded again,
        out by TMA from y_smem once the tile before it has left."""
        y = acc.to(gl.bfloat16).to(gl.float32) * wt[:, None]
        tma.store_wait(0)  # the last tile has left y_smem
        _group_barrier()
        _tile_out_by_tma(y_desc, off_m, col0, y_smem, y.to(gl.bfloat16))

    @gluon.jit
    def _down_trio_kernel(h_desc, hs_ptr, w_table, ws_table, block_expert, sorted_pair, topk_w, y_desc, trace_ptr,
                          n_local, num_m_blocks, num_n_tiles, N_OUT: gl.constexpr, K: gl.constexpr,
                          STAGES: gl.constexpr, GROUP_M: gl.constexpr, CONSUMER_REGS: gl.constexpr,
                          PRODUCER_REGS: gl.constexpr, num_warps: gl.constexpr, COL_TILES: gl.constexpr = 1,
                          FP8: gl.constexpr = True, LIVE_ROWS: gl.constexpr = False, TRACE: gl.constexpr = False,
                          PAIRS: gl.constexpr = False, FFMA_YIELD: gl.constexpr = 0):
        """y of one [192, 128 * COL_TILES] tile (num_n_tiles counts those): warp groups 0, 1, 2 rows
        0-63, 64-127, 128-191 of the block, all from the same 128-row tiles of the expert's down
        weight, one 128-column tile after the other (PAIRS, BF16 only: two at a time, from 256-row
        weight tiles, so each tile of h is loaded half as often). FP8 (h with its 1 x 128 scales,
        block-scaled weights) or BF16 (hs_ptr and ws_table unused). h_desc / y_desc: the host's TMA
        descriptors of h ([64, BK] blocks) and y ([64, 128]); the expert's weights' is made here. TRACE
        (FP8): each program's record of where its time went into trace_ptr (kernels/gluon_trace.py;
        unread otherwise). FFMA_YIELD: as the gate/up's."""
        if TRACE:
            entry_ns = trace.global_ns()
            entry_cycle = trace.clock()
        if FP8:
            BK: gl.constexpr = 128
            DTYPE: gl.constexpr = gl.float8e4nv
            smem_layout: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=8, rank=2)
        else:
            BK: gl.constexpr = 64
            DTYPE: gl.constexpr = gl.bfloat16
            smem_layout: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2)
        pid_n, off_m, n_steps, active, second, third, w, ws = _trio_block(
            block_expert, sorted_pair, w_table, ws_table, n_local, num_m_blocks, num_n_tiles, K, GROUP_M, BK, DTYPE)
        rec = trace_ptr
        if TRACE:
            rec = _trace_entry(trace_ptr, entry_ns, entry_cycle, n_steps, active, second, third)
        w_desc = tma.make_tensor_descriptor(w, shape=[N_OUT, K], strides=[K, 1], block_shape=[128, BK],
                                            layout=smem_layout)
        a0_smem, a1_smem, a2_smem, b_smem = _trio_stage_tiles(STAGES, smem_layout, DTYPE, BK, 256 if PAIRS else 128)
        # each group's bf16 [64, 128] tile of y on its way out by TMA
        y_layout: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2)
        y0 = gl.allocate_shared_memory(gl.bfloat16, [64, 128], y_layout)
        y1 = gl.allocate_shared_memory(gl.bfloat16, [64, 128], y_layout)
        y2 = gl.allocate_shared_memory(gl.bfloat16, [64, 128], y_layout)
        ready, empty = _trio_barriers(STAGES)
        off_n = pid_n * 128 * COL_TILES
        gl.warp_specialize([
            (_down_trio_consumer, (a0_smem, b_smem, ready, empty, hs_ptr, ws, sorted_pair, topk_w, y_desc, y0, off_m,
                                   off_n, n_steps, active, K, STAGES, COL_TILES, FP8, TRACE, rec, 0, PAIRS)),
            (_down_trio_consumer, (a1_smem, b_smem, ready, empty, hs_ptr, ws, sorted_pair, topk_w, y_desc, y1,
                                   off_m + 64, off_n, n_steps, second, K, STAGES, COL_TILES, FP8, TRACE, rec, 1,
                                   PAIRS)),
            (_down_trio_consumer, (a2_smem, b_smem, ready, empty, hs_ptr, ws, sorted_pair, topk_w, y_desc, y2,
                                   off_m + 128, off_n, n_steps, third, K, STAGES, COL_TILES, FP8, TRACE, rec, 2,
                                   PAIRS)),
            (_down_trio_producer, (h_desc, w_desc, a0_smem, a1_smem, a2_smem, b_smem, ready, empty, off_m, off_n,
                                   n_steps, second, third, STAGES, COL_TILES, BK, LIVE_ROWS, TRACE, rec, PAIRS)),
        ], [4, 4, 1], [CONSUMER_REGS, CONSUMER_REGS, PRODUCER_REGS])


    # ---- BF16: the same 192-row blocks, the products summed on the tensor cores ----

    @gluon.jit
    def _bf16_product(a_smem, b_smem, ready, empty, n_steps, it0, STAGES: gl.constexpr, layout: gl.constexpr):
        """This warp group's [64, 128] tile over the K steps, BF16: no scale between steps, so the sum
        stays in the wgmma accumulator and one product is kept in flight while the next stage is waited
        for; a stage is released once the product after it has been issued (its own has retired).
        it0: the ring's iteration of the first step."""
        acc = gl.zeros((64, 128), dtype=gl.float32, layout=layout)
        for ki in range(n_steps):
            it = it0 + ki
            s = it % STAGES
            mbarrier.wait(ready.index(s), (it // STAGES) & 1)
            acc = warpgroup_mma(a_smem.index(s), b_smem.index(s).permute((1, 0)), acc, is_async=True)
            acc = warpgroup_mma_wait(1, deps=(acc, ))
            if ki > 0:
                mbarrier.arrive(empty.index((it - 1) % STAGES), count=1)
        acc = warpgroup_mma_wait(0, deps=(acc, ))
        if n_steps > 0:
            mbarrier.arrive(empty.index((it0 + n_steps - 1) % STAGES), count=1)
        return acc

    @gluon.jit
    def _bf16_two_products(a_smem, b_smem, ready, empty, n_steps, it0, STAGES: gl.constexpr, layout: gl.constexpr):
        """This warp group's two [64, 128] tiles over the K steps from one activation tile and a 256-row
        weight tile a stage (the first tile's rows over the second's: gate over up, or two column tiles
        of the down): two products a step, both summed in their wgmma accumulators, one step's pair
        kept in flight as in _bf16_product. it0: the ring's iteration of the first step. (One 256-wide
        product would read the activation tile once, but needs more registers at once than Triton 3.6
        lets ptxas give one instruction here.)"""
        t0 = gl.zeros((64, 128), dtype=gl.float32, layout=layout)
        t1 = gl.zeros((64, 128), dtype=gl.float32, layout=layout)
        for ki in range(n_steps):
            it = it0 + ki
            s = it % STAGES
            mbarrier.wait(ready.index(s), (it // STAGES) & 1)
            b = b_smem.index(s)
            t0 = warpgroup_mma(a_smem.index(s), b.slice(0, 128).permute((1, 0)), t0, is_async=True)
            t1 = warpgroup_mma(a_smem.index(s), b.slice(128, 128).permute((1, 0)), t1, is_async=True)
            t0, t1 = warpgroup_mma_wait(2, deps=(t0, t1))
            if ki > 0:
                mbarrier.arrive(empty.index((it - 1) % STAGES), count=1)
        t0, t1 = warpgroup_mma_wait(0, deps=(t0, t1))
        if n_steps > 0:
            mbarrier.arrive(empty.index((it0 + n_steps - 1) % STAGES), count=1)
        return t0, t1

    @gluon.jit
    def _trio_bf16_consumer(a_smem, b_smem, ready, empty, h_ptr, off_m, off_n, n_steps, live,
                            N: gl.constexpr, alpha, limit, beta, ACT: gl.constexpr, STAGES: gl.constexpr,
                            PASSES: gl.constexpr = 2):
        """One warp group's 64 rows of the program's [192, 128] tile of h in BF16: in two passes of 64
        columns (PASSES 2), each pass's gate and up products as one [64, 128] tile, or in one pass
        (PASSES 1) with the gate and up products of all 128 columns side by side; the activation, h
        stored in bf16. A group whose rows are all padding only releases the stages."""
        layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, 128, 16])
        half: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, 64, 16])
        if live:
            if PASSES == 1:
                g, u = _bf16_two_products(a_smem, b_smem, ready, empty, n_steps, 0, STAGES, layout)
                # rounded to bf16 first, as the eager MLP rounds the gate/up GEMM
                h = _gated_act(g.to(gl.bfloat16).to(gl.float32), u.to(gl.bfloat16).to(gl.float32), alpha, limit,
                               beta, ACT)
                # 32-bit offsets from the tile's corner: 64-bit addresses of 64 values a thread spill
                tile = h_ptr + off_m.to(gl.int64) * N + off_n
                rows = gl.arange(0, 64, layout=gl.SliceLayout(1, layout))
                cols = gl.arange(0, 128, layout=gl.SliceLayout(0, layout))
                gl.store(tile + (rows[:, None] * N + cols[None, :]), h.to(gl.bfloat16))
            else:
                out_rows = (off_m + gl.arange(0, 64, layout=gl.SliceLayout(1, half))).to(gl.int64)
                half_cols = gl.arange(0, 64, layout=gl.SliceLayout(0, half))
                for j in gl.static_range(2):
                    acc = _bf16_product(a_smem, b_smem, ready, empty, n_steps, j * n_steps, STAGES, layout)
                    h = _trio_act_in_registers(acc, alpha, limit, beta, ACT, half)
                    cols = off_n + 64 * j + half_cols
                    gl.store(h_ptr + out_rows[:, None] * N + cols[None, :], h.to(gl.bfloat16))
        else:
            _release_stages(ready, empty, PASSES * n_steps, STAGES)

    @gluon.jit
    def _gate_up_trio_bf16_kernel(x_ptr, w_table, block_expert, sorted_pair, h_ptr, rows_total, n_local,
                                  num_m_blocks, num_n_tiles, alpha, limit, beta, N: gl.constexpr, K: gl.constexpr,
                                  ACT: gl.constexpr, STAGES: gl.constexpr, GROUP_M: gl.constexpr,
                                  CONSUMER_REGS: gl.constexpr, PRODUCER_REGS: gl.constexpr, num_warps: gl.constexpr,
                                  LIVE_ROWS: gl.constexpr = False, PASSES: gl.constexpr = 2):
        """gate_up + act of one [192, 128] tile of h in BF16: the FP8 kernel's structure (three 64-row
        warp groups on one stacked weight tile) with K steps of 64, 64 columns of h at a time (PASSES
        2) or all 128 at once (PASSES 1: 256-row weight tiles, each activation tile loaded once)."""
        BK: gl.constexpr = 64
        pid_n, off_m, n_steps, active, second, third, w, ws = _trio_block(
            block_expert, sorted_pair, w_table, w_table, n_local, num_m_blocks, num_n_tiles, K, GROUP_M, BK,
            gl.bfloat16)
        smem_layout: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2)
        a_desc = tma.make_tensor_descriptor(x_ptr, shape=[rows_total, K], strides=[K, 1], block_shape=[64, BK],
                                            layout=smem_layout)
        w_desc = tma.make_tensor_descriptor(w, shape=[2 * N, K], strides=[K, 1], block_shape=[128 // PASSES, BK],
                                            layout=smem_layout)
        a0_smem, a1_smem, a2_smem, b_smem = _trio_stage_tiles(STAGES, smem_layout, gl.bfloat16, BK, 256 // PASSES)
        ready, empty = _trio_barriers(STAGES)
        off_n = pid_n * 128
        gl.warp_specialize([
            (_trio_bf16_consumer, (a0_smem, b_smem, ready, empty, h_ptr, off_m, off_n, n_steps, active, N,
                                   alpha, limit, beta, ACT, STAGES, PASSES)),
            (_trio_bf16_consumer, (a1_smem, b_smem, ready, empty, h_ptr, off_m + 64, off_n, n_steps, second, N,
                                   alpha, limit, beta, ACT, STAGES, PASSES)),
            (_trio_bf16_consumer, (a2_smem, b_smem, ready, empty, h_ptr, off_m + 128, off_n, n_steps, third, N,
                                   alpha, limit, beta, ACT, STAGES, PASSES)),
            (_trio_producer, (a_desc, w_desc, a0_smem, a1_smem, a2_smem, b_smem, ready, empty, off_m, off_n, n_steps,
                              second, third, N, STAGES, BK, LIVE_ROWS, PASSES)),
        ], [4, 4, 1], [CONSUMER_REGS, CONSUMER_REGS, PRODUCER_REGS])


def col_tiles_per_program(n_tiles: int, most: int) -> int:
    """128-column tiles per program: the largest divisor of n_tiles up to `most`, so every program
    covers whole tiles of the output."""
    return max(c for c in range(1, max(most, 1) + 1) if n_tiles % c == 0)


# Launch config, measured on one H200 (docs/kernel-notes.md#moe-in-gluon): the alignment's
# row blocks of 64 rows (one expert each), 4 pipeline stages, registers per thread of the
# consumer warp groups and of the producer warp.
BLOCK_M = 64
CONFIG = {"STAGES": 4, "CONSUMER_REGS": 232, "PRODUCER_REGS": 40}


def gate_up_act(xg: torch.Tensor, xsg: torch.Tensor, w_table: torch.Tensor, ws_table: torch.Tensor,
                block_expert: torch.Tensor, num_m: int, n_local: int, n: int, act: int, alpha: float, limit: float,
                beta: float, group_m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """h [rows, n] FP8 and its 1 x 128 scales [rows, n / 128] (what the Triton down kernel reads) of
    the sorted, gathered activation rows xg [rows, K] FP8 with their scales xsg [rows, K / 128]
    (rows = num_m * BLOCK_M); w_table / ws_table: the experts' w13 and block-scale addresses."""
    rows, k = xg.shape
    if rows != num_m * BLOCK_M or n % 128 or k % 128:
        raise ValueError(f"moe_gluon.gate_up_act: {rows} rows for {num_m} blocks of {BLOCK_M}, n {n}, K {k} "
                         "(whole blocks and 128-wide tiles needed)")
    _ensure_allocator()
    h = torch.empty(rows, n, dtype=xg.dtype, device=xg.device)
    hs = torch.empty(rows, n // 128, dtype=torch.float32, device=xg.device)
    n_tiles = n // 128
    _gate_up_ws_kernel[(num_m * n_tiles,)](
        xg, xsg, w_table, ws_table, block_expert, h, hs, rows, n_local, num_m, n_tiles, alpha, limit, beta,
        N=n, K=k, ACT=act, GROUP_M=group_m if group_m < 0 else max(group_m, 1), num_warps=4, **CONFIG)
    return h, hs


# 192-row tiles (gate_up_act_trio), measured on one H200
# (docs/kernel-notes.md#three-warp-groups-over-192-row-blocks): each stage holds three 64-row
# activation tiles and one stacked weight tile (40 KB); three consumer warp groups and the producer
# warp fit the register file at 168 and 24 registers a thread. With gate and up split in registers
# a fourth stage fits beside each group's parked half and outgoing FP8 tile (208 KB): 2-3% off the
# FP8 gate/up at 4096 tokens on an H100 (docs/kernel-notes.md#gate-and-up-split-in-registers).
TRIO_BLOCK_M = 192
TRIO_CONFIG = {"STAGES": 4, "CONSUMER_REGS": 168, "PRODUCER_REGS": 24}
# BF16: the same 40 KB stages (K steps of 64), no parked half.
TRIO_BF16_CONFIG = {"STAGES": 4, "CONSUMER_REGS": 168, "PRODUCER_REGS": 24}
# BF16 in one pass (kernel option moe_bf16_passes=1): 56 KB stages (a 256-row weight tile), 224 KB in
# four. Two [64, 128] accumulators and a step's two products in flight need 160 registers or more in
# every consumer group; at 168 for the workers the first group (the default partition) keeps 152 and
# ptxas serializes its products, at 160 it keeps 168 (compiled for sm_90 under Triton 3.6).
TRIO_BF16_ONE_PASS_CONFIG = {"STAGES": 4, "CONSUMER_REGS": 160, "PRODUCER_REGS": 24}


def gate_up_act_trio(xg: torch.Tensor, xsg: torch.Tensor, w_table: torch.Tensor, ws_table: torch.Tensor,
                     block_expert: torch.Tensor, sorted_pair: torch.Tensor, num_m: int, n_local: int, n: int,
                     act: int, alpha: float, limit: float, beta: float, group_m: int,
                     trace: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """gate_up_act over 192-row blocks (the experts' runs padded to 192): one weight-tile load per
    192 rows instead of per 64, and three warp groups to keep the tensor cores busy while each
    scales its products. sorted_pair marks the padding rows (-1): a block's 64-row group that holds
    none of its expert's rows is skipped, so the padding costs no more products than in 64-row
    blocks (only loads). xg in BF16 (with BF16 weights): h is bf16, no scales (xsg is returned as
    the scales, unread). trace (FP8 only): an int64 tensor of trio_trace_slots(...) values that
    receives each program's record of where its time went (kernels/gluon_trace.py), from a build of
    the kernel with the timers compiled in."""
    rows, k = xg.shape
    if xg.dtype not in (torch.float8_e4m3fn, torch.bfloat16):
        raise ValueError(f"moe_gluon.gate_up_act_trio: activations in {xg.dtype}; FP8 (e4m3) or bf16 needed")
    if rows != num_m * TRIO_BLOCK_M or n % 128 or k % 128 or sorted_pair.numel() < rows:
        raise ValueError(f"moe_gluon.gate_up_act_trio: {rows} rows for {num_m} blocks of {TRIO_BLOCK_M} "
                         f"({sorted_pair.numel()} sorted rows), n {n}, K {k} (whole blocks and 128-wide tiles needed)")
    _ensure_allocator()
    h = torch.empty(rows, n, dtype=xg.dtype, device=xg.device)
    n_tiles = n // 128
    group_m = group_m if group_m < 0 else max(group_m, 1)
    live_rows = _live_rows_only()
    if trace is not None:
        _check_trace(trace, trio_trace_slots(num_m, n), xg, "gate_up_act_trio")
    if xg.dtype == torch.bfloat16:
        passes, config = bf16_passes_and_config()
        _gate_up_trio_bf16_kernel[(num_m * n_tiles,)](
            xg, w_table, block_expert, sorted_pair, h, rows, n_local, num_m, n_tiles, alpha, limit, beta, N=n, K=k,
            ACT=act, GROUP_M=group_m, num_warps=4, LIVE_ROWS=live_rows, PASSES=passes, **config)
        return h, xsg  # no scales in BF16
    hs = torch.empty(rows, n // 128, dtype=torch.float32, device=xg.device)
    _launch_trio(
        _gate_up_trio_kernel, (num_m * n_tiles,), True, _row_tiles(xg, 128), xsg, w_table, ws_table, block_expert,
        sorted_pair, _row_tiles(h, 128), hs, hs if trace is None else trace, n_local, num_m, n_tiles, alpha, limit,
        beta, N=n, K=k, ACT=act, GROUP_M=group_m, num_warps=4, LIVE_ROWS=live_rows, TRACE=trace is not None,
        **TRIO_CONFIG)
    return h, hs


def _launch_trio(kernel, grid: tuple, fp8: bool, *args, **kwargs) -> None:
    """Launch a 192-row kernel. FP8 under kernel option moe_fp8_yield=n: its compiled cubin gets the
    yield hints first (kernels/ffma_yield.py), keyed by the FFMA_YIELD constexpr so that each setting
    has a compiled kernel of its own and the plain one is never edited (BF16 has no promotion)."""
    every = _fp8_yield_every() if fp8 else 0
    if every:
        kwargs["FFMA_YIELD"] = every
        compiled = kernel.warmup(*args, grid=grid, **kwargs)
        if hasattr(compiled, "result"):  # under Triton's asynchronous compile mode
            compiled = compiled.result()
        ffma_yield.apply_to_compiled(compiled, every)
    kernel[grid](*args, **kwargs)


def _fp8_yield_every() -> int:
    """Kernel option moe_fp8_yield: every how many promotion FFMAs one yields (0: none, as ptxas made them)."""
    value = kernel_options().moe_fp8_yield
    return 0 if value == "off" else int(value)


def trio_trace_slots(num_m: int, n: int) -> int:
    """The int64 values a traced 192-row gate/up over num_m blocks and n columns of h writes: one
    record per program (kernels/gluon_trace.py)."""
    return num_m * (n // 128) * trace.RECORD_SLOTS


def _row_tiles(t: torch.Tensor, cols: int) -> "TensorDescriptor":
    """The host's TMA descriptor of a row-major [rows, n] tensor in [64, cols] blocks (128 bytes wide,
    swizzled as the kernels' shared-memory tiles). Made here rather than in the kernel: each in-kernel
    descriptor cost a program ~1 us before its first load (tools/trace_moe_gemms.py;
    docs/kernel-notes.md#where-the-192-row-gemms-time-goes); in a CUDA graph it is part of the
    captured launch."""
    layout = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=8 * t.element_size(), rank=2)
    return TensorDescriptor(t, list(t.shape), list(t.stride()), [64, cols], layout)


def _bf16_in_one_pass() -> bool:
    """Kernel option moe_bf16_passes=1: the BF16 192-row gate/up in one pass over K, and the BF16 down
    two column tiles a pass where the output has an even number of them."""
    return kernel_options().moe_bf16_passes == "1"


def bf16_passes_and_config() -> tuple[int, dict]:
    """The BF16 192-row gate/up's passes over K and its config."""
    return (1, TRIO_BF16_ONE_PASS_CONFIG) if _bf16_in_one_pass() else (2, TRIO_BF16_CONFIG)


def _live_rows_only() -> bool:
    """Kernel option moe_trio_rows: live = the 192-row kernels' producer loads only the 64-row tiles of
    groups that hold rows (the default); all = every tile of a block."""
    return kernel_options().moe_trio_rows == "live"


# The down GEMM over the 192-row blocks (down_trio): 4 stages of 40 KB and each group's outgoing
# [64, 128] bf16 tile of y (208 KB; docs/kernel-notes.md#the-downs-output-by-tma).
DOWN_TRIO_CONFIG = {"STAGES": 4, "CONSUMER_REGS": 168, "PRODUCER_REGS": 24}
# Column tiles of 128 per down program, one after the other through the same stage ring: K is
# only 24 steps at M3's width, so a program of one tile spent a large part of its time filling
# the ring and storing; 3 measured best on one H200 (docs/kernel-notes.md#moe-down-column-tiles).
DOWN_TRIO_COL_TILES = 3
# BF16 down with two column tiles a pass (kernel option moe_bf16_passes=1): 56 KB stages (a 256-row
# weight tile), three beside the groups' outgoing tiles of y (216 KB); registers as the one-pass
# gate/up (TRIO_BF16_ONE_PASS_CONFIG); two pairs per program where the width allows.
DOWN_TRIO_PAIRS_CONFIG = {"STAGES": 3, "CONSUMER_REGS": 160, "PRODUCER_REGS": 24}
DOWN_TRIO_PAIR_COL_TILES = 4


def down_trio(h: torch.Tensor, hs: torch.Tensor, w_table: torch.Tensor, ws_table: torch.Tensor,
              block_expert: torch.Tensor, sorted_pair: torch.Tensor, topk_w: torch.Tensor, num_m: int, n_local: int,
              n_out: int, group_m: int, trace: torch.Tensor | None = None) -> torch.Tensor:
    """y [rows, n_out] bf16 = h @ w2.T of each row's expert, times its pair's routing weight
    (topk_w, float32, by pair), over the 192-row blocks gate_up_act_trio wrote h in (block_expert,
    its groups, sorted_pair as there); the rows of padding hold no meaningful value (the combine never
    reads them). FP8: the same products, scaling and rounding as the Triton down kernel, bit for bit.
    BF16 h (and weights): hs unread. trace (FP8 only): an int64 tensor of down_trace_slots(...) values
    that receives each program's record of where its time went (kernels/gluon_trace.py)."""
    rows, k = h.shape
    if h.dtype not in (torch.float8_e4m3fn, torch.bfloat16):
        raise ValueError(f"moe_gluon.down_trio: h in {h.dtype}; FP8 (e4m3) or bf16 needed")
    if rows != num_m * TRIO_BLOCK_M or n_out % 128 or k % 128 or sorted_pair.numel() < rows:
        raise ValueError(f"moe_gluon.down_trio: {rows} rows for {num_m} blocks of {TRIO_BLOCK_M} "
                         f"({sorted_pair.numel()} sorted rows), n_out {n_out}, K {k} (whole blocks and 128-wide tiles needed)")
    _ensure_allocator()
    if trace is not None:
        _check_trace(trace, down_trace_slots(num_m, n_out), h, "down_trio")
    y = torch.empty(rows, n_out, dtype=torch.bfloat16, device=h.device)
    fp8 = h.dtype != torch.bfloat16
    pairs = not fp8 and _bf16_in_one_pass() and n_out // 128 % 2 == 0
    if pairs:
        col_tiles = 2 * col_tiles_per_program(n_out // 256, DOWN_TRIO_PAIR_COL_TILES // 2)
    else:
        col_tiles = col_tiles_per_program(n_out // 128, DOWN_TRIO_COL_TILES)
    n_groups = n_out // 128 // col_tiles
    _launch_trio(
        _down_trio_kernel, (num_m * n_groups,), fp8, _row_tiles(h, 128 if fp8 else 64), hs, w_table, ws_table,
        block_expert, sorted_pair, topk_w, _row_tiles(y, 128), hs if trace is None else trace, n_local, num_m,
        n_groups, N_OUT=n_out, K=k, GROUP_M=group_m if group_m < 0 else max(group_m, 1), num_warps=4,
        COL_TILES=col_tiles, FP8=fp8,
        LIVE_ROWS=_live_rows_only(), TRACE=trace is not None, PAIRS=pairs,
        **(DOWN_TRIO_PAIRS_CONFIG if pairs else DOWN_TRIO_CONFIG))
    return y


def down_trace_slots(num_m: int, n_out: int) -> int:
    """The int64 values a traced down over num_m blocks and n_out columns of y writes: one record per
    program, each program DOWN_TRIO_COL_TILES (or fewer, a divisor) 128-column tiles."""
    return num_m * (n_out // 128 // col_tiles_per_program(n_out // 128, DOWN_TRIO_COL_TILES)) * trace.RECORD_SLOTS


def _check_trace(buf: torch.Tensor, wanted: int, x: torch.Tensor, name: str) -> None:
    """A trace buffer the kernel can fill: int64, one record per program, on the kernel's device, FP8 input."""
    if x.dtype != torch.float8_e4m3fn or buf.dtype != torch.int64 or buf.numel() < wanted or buf.device != x.device:
        raise ValueError(f"moe_gluon.{name}: trace must be an int64 tensor of at least {wanted} values on {x.device} "
                         f"with FP8 activations; got {buf.dtype}, {buf.numel()} values on {buf.device}, activations "
                         f"in {x.dtype}")
