"""GPU path of the MoE ops: expert-sorted grouped GEMMs in Triton.

minimax::moe and minimax::mega_moe (kernels/moe.py) keep their structure on
the GPU (routing, the exchange, the combine: kernels/moe_reference.py and
kernels/moe_parallel.py); what changes is how the local experts run. This
module registers the ops' CUDA kernels (the end of the file); the op modules
never import it. Instead of one GEMM pair per expert, the (token, slot) pairs
routed to this rank's experts are sorted by expert and three kernels run:

    align_by_expert   (torch ops, no host sync) pairs sorted by expert, each
                      expert's run padded to a multiple of BLOCK_M; the
                      expert of every BLOCK_M-row block; each pair's row.
                      On the GPU the same layout comes from Triton
                      instead: one program at decode sizes, chunks of
                      pairs in two launches past them
                      (kernels/moe_align_triton.py; the kernel option
                      moe_align=torch keeps the sort)
    gate_up + act     grouped GEMM over the sorted rows (tokens gathered by
                      index, no permuted copy of x), gate and up tiles of the
                      fused [2n, H] weight side by side, SwiGLU-OAI (or SiLU)
                      in the epilogue, and for FP8 the 1 x 128 quantization of
                      the result too (one power-of-two scale per row and
                      128-column tile): the activation never exists in BF16
                      in memory
    down              grouped GEMM of the activations with w2, the routing
                      weight applied in the epilogue
    combine           each token sums its k rows in float32

The router's selection after its logits GEMM (sigmoid, bias, top-k,
renormalize) is one kernel too (kernels/moe_route_triton.py).

The shared expert runs as one more expert in the same three launches (every
token, weight 1, its own width: under TP it is a slice, narrower than a
routed expert), and the combine adds it as eager does, after rounding the
routed sum to the model dtype. moe_shared=separate (MINIMAX_MOE_SHARED, see
kernels/options.py) runs it in its own launches instead (to compare). The grids stop at the blocks that can hold
pairs (at most one per pair), not at every local expert's worst-case padding.

Weights stay where the model keeps them (one tensor per expert): every kernel
reads a small device table of their addresses, built once per set of weights
(so CUDA-graph capture finds it ready). Shapes are static for a given token
count (grid = the worst case; idle blocks exit at once), so everything here
captures into a CUDA graph. FP8 weights use the DeepSeek 128 x 128 block
scales of kernels/fp8.py; the activation is quantized in 1 x 128 groups, as
minimax::quantize_fp8 does.

Under TRITON_INTERPRET=1 the same kernels run on CPU tensors (tests). The
interpreter's bf16 tl.dot is wrong (triton 3.9) and its float32 -> bf16
cast truncates, so the kernels upcast before dot and round with integer ops
when interpreting, as the GPU's cvt.rn does.

Not done here: the combine writes k rows per token (bf16) and sums them,
where an atomic-add epilogue would skip that; the grouped GEMMs load through
cp.async and reach about half of a plain GEMM's rate at prefill sizes
(docs/kernel-notes.md#moe-tiles). At prefill sizes the gate/up kernel
takes gate and up from one product per K step and both kernels run their
programs in groups of row blocks, so activation rows stay in L2 across
column tiles (kernels/moe_plan.py:tile_config; the kernel options moe_gate_up / moe_group_m pin
either way). By default (kernel option moe_gemm=auto) the FP8 gate/up GEMM
at those tiles runs as the warp-specialized Gluon kernel of kernels/moe_gluon.py
on an sm_90 GPU (same bits; the layer 2-4% faster at 8192-16384 tokens:
docs/kernel-notes.md#moe-at-the-power-limit); moe_gemm=triton keeps this file's loop.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from . import moe_gluon, moe_plan
from .fp8 import FP8_DTYPE, quantize_fp8_reference
from .interpreter import triton_interpreting as _interpreting
from .launch_overlap import overlap_launches, pdl_launch
from .moe import mega_moe, moe
from .moe_align_triton import align_with_triton
from .moe_expert_groups import with_expert_groups
from .moe_parallel import mega_moe_reference
from .moe_probe import notify as notify_router_inputs
from .moe_probe import watching as watching_router_inputs
from .moe_quant_scatter import quantize_scatter_fp8, scatter_rows
from .moe_reference import MoEWeights, gated_mlp, local_experts_reference, moe_reference
from .moe_route_triton import route_fits, route_mode, route_triton, router_logits_and_fp8
from .moe_select_align import Selection, select_align_fits, select_and_align
from .norm_quant_triton import quantize_fp8_triton
from .options import kernel_options

try:  # optional: CPU installs use the reference only
    import triton
    import triton.language as tl

    from .launch_overlap import wait_then_release
    from .norm_quant_triton import round_e4m3

    HAVE_TRITON = True
except ImportError:  # pragma: no cover
    triton = tl = None
    HAVE_TRITON = False

__all__ = ["HAVE_TRITON", "Alignment", "align_by_expert", "grouped_gated_mlp", "TritonMoEWeights", "supported",
           "single_expert_alignment"]


_ACT = {"swigluoai": 0, "silu": 1}


def supported(x: torch.Tensor, w: MoEWeights) -> bool:
    """Whether the Triton kernels take these inputs (else the reference runs)."""
    if not HAVE_TRITON or not (x.is_cuda or _interpreting()):
        return False
    if x.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        return False
    n = w.w2[0].shape[1]
    if w.fp8:
        # 1 x 128 activation groups, 128-row weight blocks: gate and up halves on block edges
        return w.group == 128 and n % 128 == 0 and w.w13[0].dtype == FP8_DTYPE
    return all(t.dtype == x.dtype for t in (*w.w13, *w.w2))


# ------------------------------------------------------------------ routing
@dataclass
class Alignment:
    sorted_pair: torch.Tensor  # [max_rows] int32: pair (token * k + slot) at each sorted row, -1 = padding
    block_expert: torch.Tensor  # [max_blocks] int32: local expert of each BLOCK_M rows, >= n_local = idle
    pair_row: torch.Tensor  # [pairs] int32: sorted row of each pair, -1 = not a local expert
    block_m: int

    @property
    def max_rows(self) -> int:
        return self.sorted_pair.shape[0]


def align_by_expert(ids: torch.Tensor, expert_offset: int, n_local: int, block_m: int,
                    shared_id: int = -2) -> Alignment:
    """Sort the (token, slot) pairs of the local experts by expert, runs padded to block_m.

    shared_id >= 0: pairs with that id go to one more local expert, n_local (the
    shared expert run in the same launches); the layout then has n_local + 1.
    Device-side torch ops with static shapes (the worst case: every pair local,
    every run padded), so no host sync and CUDA-graph safe."""
    pairs = ids.numel()
    dev = ids.device
    flat = ids.reshape(-1).to(torch.int64)
    local = flat - expert_offset
    is_local = (local >= 0) & (local < n_local)
    if shared_id >= 0:
        local = torch.where(flat == shared_id, n_local, local)
        is_local = is_local | (flat == shared_id)
        n_local += 1
    e = torch.where(is_local, local, torch.full_like(local, n_local))  # bucket n_local: not ours
    max_rows = triton_cdiv(pairs + n_local * (block_m - 1), block_m) * block_m
    counts = torch.zeros(n_local + 1, dtype=torch.int64, device=dev).scatter_add_(0, e, torch.ones_like(e))
    padded = (counts[:n_local] + block_m - 1) // block_m * block_m
    pstart = torch.cumsum(padded, 0) - padded
    pstart = torch.cat([pstart, torch.full((1,), max_rows, dtype=torch.int64, device=dev)])
    cstart = torch.cumsum(counts, 0) - counts
    order = torch.argsort(e, stable=True)
    e_sorted = e[order]
    dest = pstart[e_sorted] + torch.arange(pairs, device=dev) - cstart[e_sorted]
    dest = torch.where(e_sorted < n_local, dest, torch.full_like(dest, max_rows))
    sorted_pair = torch.full((max_rows + 1,), -1, dtype=torch.int32, device=dev)
    sorted_pair.scatter_(0, dest, order.to(torch.int32))  # the dump row max_rows is dropped
    pair_row = torch.empty(pairs, dtype=torch.int32, device=dev)
    pair_row.scatter_(0, order, torch.where(e_sorted < n_local, dest, torch.full_like(dest, -1)).to(torch.int32))
    max_blocks = max_rows // block_m
    cum_blocks = torch.cumsum(padded // block_m, 0)
    block_expert = torch.searchsorted(cum_blocks, torch.arange(max_blocks, device=dev), right=True).to(torch.int32)
    return Alignment(sorted_pair[:max_rows], block_expert, pair_row, block_m)


def triton_cdiv(a: int, b: int) -> int:
    return -(-a // b)


_SINGLE: dict = {}


def _cached(cache: dict, key, make, device: torch.device, limit: int = 256):
    """cache[key], made by make() on a miss. Not kept when made while a CUDA graph is being
    captured (such a tensor holds its data only in the graph's replays); the cache is
    emptied past `limit` entries (keys are token counts or weight addresses)."""
    value = cache.get(key)
    if value is None:
        value = make()
        if not (device.type == "cuda" and torch.cuda.is_current_stream_capturing()):
            if len(cache) >= limit:
                cache.clear()
            cache[key] = value
    return value


def _align(ids: torch.Tensor, expert_offset: int, n_local: int, block_m: int, shared_id: int = -2) -> Alignment:
    """align_by_expert, or the same layout from Triton (the default, moe_align=triton): one program
    at decode sizes, chunks of pairs in two launches past them, instead of ~15-40 torch kernels
    (equal output; measured: docs/kernel-notes.md#moe-alignment). The kernel option
    moe_align=torch keeps the torch sort everywhere (to compare)."""
    if (kernel_options().moe_align == "triton" and HAVE_TRITON and ids.numel() > 0
            and (ids.is_cuda or _interpreting())):
        return Alignment(*align_with_triton(ids, expert_offset, n_local, block_m, shared_id), block_m)
    return align_by_expert(ids, expert_offset, n_local, block_m, shared_id)


def single_expert_alignment(tokens: int, block_m: int, device: torch.device) -> Alignment:
    """The layout when every token goes to one expert with weight 1 (the shared expert):
    rows in token order, so it depends on the token count only and is built once.

    Equal to align_by_expert(zeros(tokens, 1), 0, 1, block_m) without its ~40 launches
    per call."""

    def make() -> Alignment:
        max_rows = triton_cdiv(tokens + block_m - 1, block_m) * block_m
        rows = torch.arange(max_rows, dtype=torch.int32, device=device)
        return Alignment(
            sorted_pair=torch.where(rows < tokens, rows, torch.full_like(rows, -1)),
            block_expert=torch.where(torch.arange(max_rows // block_m, device=device) * block_m < tokens,
                                     0, 1).to(torch.int32),
            pair_row=rows[:tokens].clone(),
            block_m=block_m,
        )

    return _cached(_SINGLE, (tokens, block_m, device.type, device.index), make, device)


# ------------------------------------------------------------ pointer tables
_TABLES: dict = {}


def _table(tensors, aligned: bool = True) -> torch.Tensor:
    """int64 device tensor of the tensors' addresses, cached by address (stable weights).
    `aligned`: the kernels load these with a 16-byte alignment hint (weights; the block
    scales of one expert inside a stacked scale tensor need not be)."""

    def make() -> torch.Tensor:
        for t in tensors:
            if not t.is_contiguous():
                raise ValueError("grouped MoE kernels need contiguous expert weights")
            if aligned and t.data_ptr() % 16:
                raise ValueError("grouped MoE kernels need 16-byte aligned expert weights (the kernels assume it)")
        return torch.tensor([t.data_ptr() for t in tensors], dtype=torch.int64, device=tensors[0].device)

    key = tuple((t.data_ptr(), t.device.type, t.device.index) for t in tensors)
    return _cached(_TABLES, key, make, tensors[0].device, limit=4096)


# ------------------------------------------------------------------ kernels
if HAVE_TRITON:

    @triton.jit
    def _round_bf16(v):
        """float32 -> nearest bfloat16 (ties to even), kept in float32."""
        bits = v.to(tl.int32, bitcast=True)
        lsb = (bits >> 16) & 1
        bits = (bits + 0x7FFF + lsb) & -65536
        return bits.to(tl.float32, bitcast=True)

    @triton.jit
    def _round_out(v, OUT_KIND: tl.constexpr, INTERP: tl.constexpr):
        """Round float32 to the model dtype (OUT_KIND 1 bf16, 2 fp16; 0 float32: as is), kept in float32."""
        if OUT_KIND == 1:
            if INTERP:
                v = _round_bf16(v)  # the interpreter's cast truncates
            else:
                v = v.to(tl.bfloat16).to(tl.float32)
        elif OUT_KIND == 2:
            v = v.to(tl.float16).to(tl.float32)
        return v

    @triton.jit
    def _tile_of(pid, num_m_blocks, num_n_tiles, GROUP_M: tl.constexpr, groups_ptr):
        """(row block, column tile) of program pid. GROUP_M 0: row blocks fastest over all of
        them, so the blocks of one expert run together and share its weight tile in L2, but a
        block's activation rows are read again for each column tile, a whole sweep later.
        GROUP_M g: g row blocks at a time, each group's column tiles before the next group's,
        so the activations of g blocks stay in L2 across the column tiles. GROUP_M -1: groups
        that follow the experts (expert_group_table: each block's group's first block and size
        at groups_ptr), so an expert's weight tile is read once for all its blocks."""
        if GROUP_M == 0:
            return pid % num_m_blocks, pid // num_m_blocks
        if GROUP_M < 0:  # a group's programs are [first * num_n_tiles, (first + size) * num_n_tiles)
            b = pid // num_n_tiles
            first = tl.load(groups_ptr + 2 * b)
            size = tl.load(groups_ptr + 2 * b + 1)
            local = pid - first * num_n_tiles
            return first + local % size, local // size
        in_group = GROUP_M * num_n_tiles
        first_m = (pid // in_group) * GROUP_M
        size_m = tl.minimum(num_m_blocks - first_m, GROUP_M)
        return first_m + (pid % in_group) % size_m, (pid % in_group) // size_m

    @triton.jit
    def _gate_up_scales(xs_ptr, ws, token, valid, stride_xs, pid_n, N_HALF, kb, kb_total, BN: tl.constexpr):
        """FP8 scales of K block kb: the activation rows' (1 x 128), the gate and up weight
        tiles' (128 x 128 blocks)."""
        a_s = tl.load(xs_ptr + token * stride_xs + kb, mask=valid, other=0.0)
        g_s = tl.load(ws + ((pid_n * BN) // 128) * kb_total + kb)
        u_s = tl.load(ws + ((N_HALF + pid_n * BN) // 128) * kb_total + kb)
        return a_s, g_s, u_s

    @triton.jit
    def _gate_up_two_dots(x_ptr, xs_ptr, w, ws, token, valid, pid_n, N_HALF, stride_x, stride_xs,
                          K: tl.constexpr, FP8: tl.constexpr, UPCAST: tl.constexpr, IEEE: tl.constexpr,
                          BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
        """The [BM, BN] gate and up tiles of x[token] @ w13.T over K: one product each per K step."""
        offs_n = pid_n * BN + tl.arange(0, BN)
        n_ok = offs_n < N_HALF
        offs_k = tl.arange(0, BK)
        kb_total = tl.cdiv(K, 128)
        acc_g = tl.zeros((BM, BN), dtype=tl.float32)
        acc_u = tl.zeros((BM, BN), dtype=tl.float32)
        for k0 in range(0, K, BK):
            k_ok = (k0 + offs_k) < K
            a = tl.load(x_ptr + token[:, None] * stride_x + (k0 + offs_k)[None, :],
                        mask=valid[:, None] & k_ok[None, :], other=0.0)
            bg = tl.load(w + offs_n[:, None].to(tl.int64) * K + (k0 + offs_k)[None, :],
                         mask=n_ok[:, None] & k_ok[None, :], other=0.0)
            bu = tl.load(w + (N_HALF + offs_n)[:, None].to(tl.int64) * K + (k0 + offs_k)[None, :],
                         mask=n_ok[:, None] & k_ok[None, :], other=0.0)
            if UPCAST:
                a = a.to(tl.float32)
                bg = bg.to(tl.float32)
                bu = bu.to(tl.float32)
            if FP8:
                a_s, g_s, u_s = _gate_up_scales(xs_ptr, ws, token, valid, stride_xs, pid_n, N_HALF, k0 // 128,
                                                kb_total, BN)
                acc_g += tl.dot(a, tl.trans(bg), out_dtype=tl.float32) * (a_s[:, None] * g_s)
                acc_u += tl.dot(a, tl.trans(bu), out_dtype=tl.float32) * (a_s[:, None] * u_s)
            elif IEEE:  # float32 models: no silent TF32
                acc_g = tl.dot(a, tl.trans(bg), acc_g, input_precision="ieee", out_dtype=tl.float32)
                acc_u = tl.dot(a, tl.trans(bu), acc_u, input_precision="ieee", out_dtype=tl.float32)
            else:
                acc_g = tl.dot(a, tl.trans(bg), acc_g, out_dtype=tl.float32)
                acc_u = tl.dot(a, tl.trans(bu), acc_u, out_dtype=tl.float32)
        return acc_g, acc_u

    @triton.jit
    def _gate_up_one_dot(x_ptr, xs_ptr, w, ws, token, valid, pid_n, N_HALF, stride_x, stride_xs,
                         K: tl.constexpr, FP8: tl.constexpr, UPCAST: tl.constexpr, IEEE: tl.constexpr,
                         BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
        """The same two tiles from one [BM, 2 BN] product per K step: the weight tile holds gate
        and up rows interleaved (column 2j of the product is gate column j, 2j + 1 up column j),
        so one wider MMA reads the activation tile once instead of twice, and the split after
        the loop pairs columns each thread already holds."""
        j = tl.arange(0, 2 * BN)
        is_up = j % 2
        offs_n = pid_n * BN + j // 2
        w_row = tl.where(is_up == 1, N_HALF + offs_n, offs_n).to(tl.int64)
        n_ok = offs_n < N_HALF
        offs_k = tl.arange(0, BK)
        kb_total = tl.cdiv(K, 128)
        acc = tl.zeros((BM, 2 * BN), dtype=tl.float32)
        for k0 in range(0, K, BK):
            k_ok = (k0 + offs_k) < K
            a = tl.load(x_ptr + token[:, None] * stride_x + (k0 + offs_k)[None, :],
                        mask=valid[:, None] & k_ok[None, :], other=0.0)
            b = tl.load(w + w_row[:, None] * K + (k0 + offs_k)[None, :], mask=n_ok[:, None] & k_ok[None, :],
                        other=0.0)
            if UPCAST:
                a = a.to(tl.float32)
                b = b.to(tl.float32)
            if FP8:
                a_s, g_s, u_s = _gate_up_scales(xs_ptr, ws, token, valid, stride_xs, pid_n, N_HALF, k0 // 128,
                                                kb_total, BN)
                col_s = tl.where(is_up == 1, u_s, g_s)
                acc += tl.dot(a, tl.trans(b), out_dtype=tl.float32) * (a_s[:, None] * col_s[None, :])
            elif IEEE:
                acc = tl.dot(a, tl.trans(b), acc, input_precision="ieee", out_dtype=tl.float32)
            else:
                acc = tl.dot(a, tl.trans(b), acc, out_dtype=tl.float32)
        return tl.split(tl.reshape(acc, (BM, BN, 2)))

    @triton.jit
    def _gate_up_act_rows(x_ptr, xs_ptr, w, ws, sorted_pair, h_ptr, hs_ptr, row0, pid_n, N_HALF, top_k, stride_x,
                          stride_xs, stride_h, stride_hs, alpha, limit, beta, K: tl.constexpr, ACT: tl.constexpr,
                          FP8: tl.constexpr, OUT_KIND: tl.constexpr, INTERP: tl.constexpr, UPCAST: tl.constexpr,
                          IEEE: tl.constexpr, ROWS: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
                          ONE_DOT: tl.constexpr):
        """h for ROWS sorted rows from row0 and one BN-column tile: the gate/up product, the
        activation, and in FP8 the 1 x 128 quantization of h."""
        rows = row0 + tl.arange(0, ROWS)
        pair = tl.load(sorted_pair + rows)
        valid = pair >= 0
        token = tl.where(valid, pair // top_k, 0).to(tl.int64)
        offs_n = pid_n * BN + tl.arange(0, BN)
        n_ok = offs_n < N_HALF
        if ONE_DOT:
            acc_g, acc_u = _gate_up_one_dot(x_ptr, xs_ptr, w, ws, token, valid, pid_n, N_HALF, stride_x, stride_xs,
                                            K, FP8, UPCAST, IEEE, ROWS, BN, BK)
        else:
            acc_g, acc_u = _gate_up_two_dots(x_ptr, xs_ptr, w, ws, token, valid, pid_n, N_HALF, stride_x, stride_xs,
                                             K, FP8, UPCAST, IEEE, ROWS, BN, BK)
        # The eager MLP rounds the gate/up GEMM to the activation dtype first.
        g = _round_out(acc_g, OUT_KIND, INTERP)
        u = _round_out(acc_u, OUT_KIND, INTERP)
        if ACT == 0:  # SwiGLU-OAI
            g = tl.minimum(g, limit)
            u = tl.minimum(tl.maximum(u, -limit), limit)
            h = (u + beta) * (g * tl.sigmoid(g * alpha))
        else:  # SiLU-gated
            h = g * tl.sigmoid(g) * u
        h = _round_out(h, OUT_KIND, INTERP)
        out_rows = rows.to(tl.int64)
        if FP8:
            # 1 x 128 quantization of h (BN == 128): power-of-two scale from the exponent bits.
            amax = tl.maximum(tl.max(tl.where(n_ok[None, :], tl.abs(h), 0.0), axis=1), 1e-30)
            v = tl.math.div_rn(amax, tl.full(amax.shape, 448.0, tl.float32))
            vb = v.to(tl.int32, bitcast=True)
            ex = ((vb >> 23) & 0xFF) + ((vb & 0x7FFFFF) != 0).to(tl.int32)
            scale = (ex << 23).to(tl.float32, bitcast=True)
            inv = ((254 - ex) << 23).to(tl.float32, bitcast=True)
            q = tl.minimum(tl.maximum(h * inv[:, None], -448.0), 448.0)
            if INTERP:
                q = round_e4m3(q)
            tl.store(h_ptr + out_rows[:, None] * stride_h + offs_n[None, :], q.to(tl.float8e4nv),
                     mask=n_ok[None, :] & (out_rows[:, None] >= 0))
            tl.store(hs_ptr + out_rows * stride_hs + pid_n, scale)
        else:
            tl.store(h_ptr + out_rows[:, None] * stride_h + offs_n[None, :], h.to(h_ptr.dtype.element_ty),
                     mask=n_ok[None, :] & (out_rows[:, None] >= 0))

    # K (and top_k below) are constexpr: the loops need Python ints as bounds under the
    # interpreter of triton 3.6 with numpy 2 (a runtime int arrives as a 1-element array
    # there: "only 0-dimensional arrays can be converted", seen on the GPU box). One
    # compile per model width either way.
    @triton.jit
    def _gate_up_act_kernel(
        x_ptr, xs_ptr, w_table, ws_table, sorted_pair, block_expert, h_ptr, hs_ptr,
        K: tl.constexpr, N, N_SHARED, top_k, n_local, num_m_blocks, num_n_tiles, stride_x, stride_xs, stride_h,
        stride_hs,
        alpha, limit, beta, SHARED: tl.constexpr,
        ACT: tl.constexpr, FP8: tl.constexpr, OUT_KIND: tl.constexpr, INTERP: tl.constexpr,
        UPCAST: tl.constexpr, IEEE: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
        ONE_DOT: tl.constexpr = False, GROUP_M: tl.constexpr = 0, PDL: tl.constexpr = False,
        HALVES: tl.constexpr = False,
    ):
        wait_then_release(PDL)  # kernels/launch_overlap.py
        pid_m, pid_n = _tile_of(tl.program_id(0), num_m_blocks, num_n_tiles, GROUP_M, block_expert + num_m_blocks)
        e = tl.load(block_expert + pid_m)
        # N_HALF: this expert's intermediate width, N, or N_SHARED for the shared expert (SHARED:
        # the last one; its slice can be narrower); tiles past it have nothing to do
        N_HALF = N
        if SHARED:
            N_HALF = tl.where(e == n_local - 1, N_SHARED, N)
        if (e < n_local) & (pid_n * BN < N_HALF):
            # expert weights have the activation's element type (bf16 / fp16 / fp32, or fp8 with fp8).
            # A pointer read from memory has no known alignment: without the hint (allocations are
            # 512-byte aligned) Triton loads the weight tiles byte by byte.
            w = tl.load(w_table + e).to(tl.pointer_type(x_ptr.dtype.element_ty))
            if not INTERP:  # a compiler hint only; older interpreters reject it on a pointer
                w = tl.multiple_of(w, 16)
            ws = w
            if FP8:
                ws = tl.load(ws_table + e).to(tl.pointer_type(tl.float32))
            row0 = pid_m * BM
            # HALVES (kernel option moe_half_blocks): an expert's run ends inside its last block, so
            # where the second half of a block is padding only the first half is multiplied
            half_idle = False
            if HALVES:  # a compile-time test: without it one copy of the loop
                half_idle = tl.load(sorted_pair + row0 + BM // 2) < 0
            if half_idle:
                _gate_up_act_rows(x_ptr, xs_ptr, w, ws, sorted_pair, h_ptr, hs_ptr, row0, pid_n, N_HALF, top_k,
                                  stride_x, stride_xs, stride_h, stride_hs, alpha, limit, beta, K, ACT, FP8,
                                  OUT_KIND, INTERP, UPCAST, IEEE, BM // 2, BN, BK, ONE_DOT)
            else:
                _gate_up_act_rows(x_ptr, xs_ptr, w, ws, sorted_pair, h_ptr, hs_ptr, row0, pid_n, N_HALF, top_k,
                                  stride_x, stride_xs, stride_h, stride_hs, alpha, limit, beta, K, ACT, FP8,
                                  OUT_KIND, INTERP, UPCAST, IEEE, BM, BN, BK, ONE_DOT)

    @triton.jit
    def _down_acc(h_ptr, hs_ptr, w, ws, rows, offs_n, n_ok, pid_n, stride_h, stride_hs,
                  K: tl.constexpr, FP8: tl.constexpr, UPCAST: tl.constexpr, IEEE: tl.constexpr,
                  BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
        """One [BM, BN] tile of h @ w.T over K (a compile-time width: the weight's row stride,
        so its loads stay 16-byte vectors; a runtime stride made them scalar, much slower:
        docs/kernel-notes.md#moe-weight-strides)."""
        offs_k = tl.arange(0, BK)
        acc = tl.zeros((BM, BN), dtype=tl.float32)
        kb_total = tl.cdiv(K, 128)
        for k0 in range(0, K, BK):
            k_ok = (k0 + offs_k) < K
            a = tl.load(h_ptr + rows[:, None] * stride_h + (k0 + offs_k)[None, :],
                        mask=k_ok[None, :] & (rows[:, None] >= 0), other=0.0)
            b = tl.load(w + offs_n[:, None].to(tl.int64) * K + (k0 + offs_k)[None, :],
                        mask=n_ok[:, None] & k_ok[None, :], other=0.0)
            if UPCAST:
                a = a.to(tl.float32)
                b = b.to(tl.float32)
            if FP8:
                kb = k0 // 128
                a_s = tl.load(hs_ptr + rows * stride_hs + kb)
                b_s = tl.load(ws + ((pid_n * BN) // 128) * kb_total + kb)
                acc += tl.dot(a, tl.trans(b), out_dtype=tl.float32) * (a_s[:, None] * b_s)
            elif IEEE:
                acc = tl.dot(a, tl.trans(b), acc, input_precision="ieee", out_dtype=tl.float32)
            else:
                acc = tl.dot(a, tl.trans(b), acc, out_dtype=tl.float32)
        return acc

    @triton.jit
    def _down_rows(h_ptr, hs_ptr, w, ws, sorted_pair, topk_w, y_ptr, row0, pid_n, is_shared, N, stride_h, stride_hs,
                   stride_y, K: tl.constexpr, K_SHARED: tl.constexpr, SHARED: tl.constexpr, FP8: tl.constexpr,
                   OUT_KIND: tl.constexpr, INTERP: tl.constexpr, UPCAST: tl.constexpr, IEEE: tl.constexpr,
                   ROWS: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
        """y for ROWS sorted rows from row0 and one BN-column tile: the down product in the model
        dtype times each pair's routing weight."""
        rows = (row0 + tl.arange(0, ROWS)).to(tl.int64)
        pair = tl.load(sorted_pair + rows)
        valid = pair >= 0
        offs_n = pid_n * BN + tl.arange(0, BN)
        n_ok = offs_n < N
        # SHARED and K_SHARED != K: two copies of the loop, each with its own pipeline
        # buffers (the host caps the stages to fit both in shared memory); one width: one loop
        if SHARED and K_SHARED != K:  # (a compile-time test)
            if is_shared:
                acc = _down_acc(h_ptr, hs_ptr, w, ws, rows, offs_n, n_ok, pid_n, stride_h, stride_hs,
                                K_SHARED, FP8, UPCAST, IEEE, ROWS, BN, BK)
            else:
                acc = _down_acc(h_ptr, hs_ptr, w, ws, rows, offs_n, n_ok, pid_n, stride_h, stride_hs,
                                K, FP8, UPCAST, IEEE, ROWS, BN, BK)
        else:
            acc = _down_acc(h_ptr, hs_ptr, w, ws, rows, offs_n, n_ok, pid_n, stride_h, stride_hs,
                            K, FP8, UPCAST, IEEE, ROWS, BN, BK)
        # expert output in the model dtype (as eager), times the routing weight in float32
        wt = tl.load(topk_w + tl.where(valid, pair, 0), mask=valid, other=0.0)
        y = _round_out(acc, OUT_KIND, INTERP) * wt[:, None]
        y = _round_out(y, OUT_KIND, INTERP)
        tl.store(y_ptr + rows[:, None] * stride_y + offs_n[None, :], y.to(y_ptr.dtype.element_ty),
                 mask=n_ok[None, :] & valid[:, None])

    @triton.jit
    def _down_kernel(
        h_ptr, hs_ptr, w_table, ws_table, sorted_pair, block_expert, topk_w, y_ptr,
        N, n_local, num_m_blocks, num_n_tiles, stride_h, stride_hs, stride_y,
        K: tl.constexpr, K_SHARED: tl.constexpr, SHARED: tl.constexpr,
        FP8: tl.constexpr, OUT_KIND: tl.constexpr, INTERP: tl.constexpr, UPCAST: tl.constexpr,
        IEEE: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, GROUP_M: tl.constexpr = 0,
        PDL: tl.constexpr = False, HALVES: tl.constexpr = False,
    ):
        wait_then_release(PDL)
        # K: a routed expert's intermediate width; SHARED: the last expert is the shared one,
        # K_SHARED wide (a TP slice can be narrower). The widths are compile-time constants:
        # they are the weights' row strides, and a runtime stride made the weight loads
        # scalar (measured: docs/kernel-notes.md#moe-weight-strides)
        pid_m, pid_n = _tile_of(tl.program_id(0), num_m_blocks, num_n_tiles, GROUP_M, block_expert + num_m_blocks)
        e = tl.load(block_expert + pid_m)
        if e < n_local:
            w = tl.load(w_table + e).to(tl.pointer_type(h_ptr.dtype.element_ty))
            if not INTERP:  # alignment hint, see _gate_up_act_kernel
                w = tl.multiple_of(w, 16)
            ws = w
            if FP8:
                ws = tl.load(ws_table + e).to(tl.pointer_type(tl.float32))
            row0 = pid_m * BM
            half_idle = False
            if HALVES:  # as in _gate_up_act_kernel: a block whose second half is padding
                half_idle = tl.load(sorted_pair + row0 + BM // 2) < 0
            if half_idle:
                _down_rows(h_ptr, hs_ptr, w, ws, sorted_pair, topk_w, y_ptr, row0, pid_n, e == n_local - 1, N,
                           stride_h, stride_hs, stride_y, K, K_SHARED, SHARED, FP8, OUT_KIND, INTERP, UPCAST, IEEE,
                           BM // 2, BN, BK)
            else:
                _down_rows(h_ptr, hs_ptr, w, ws, sorted_pair, topk_w, y_ptr, row0, pid_n, e == n_local - 1, N,
                           stride_h, stride_hs, stride_y, K, K_SHARED, SHARED, FP8, OUT_KIND, INTERP, UPCAST, IEEE,
                           BM, BN, BK)

    @triton.jit
    def _combine_kernel(y_ptr, pair_row, out_ptr, N, top_k: tl.constexpr, stride_y, stride_out,
                        SHARED: tl.constexpr, OUT_KIND: tl.constexpr, INTERP: tl.constexpr, BN: tl.constexpr,
                        PDL: tl.constexpr = False):
        wait_then_release(PDL)
        # SHARED: slot top_k is the shared expert. The routed sum (float32) is rounded to the
        # model dtype first, then the shared expert's row added and rounded: eager's
        # `routed.to(x.dtype) + shared(x)`. Otherwise the float32 routed sum is written.
        t = tl.program_id(0).to(tl.int64)
        offs = tl.program_id(1) * BN + tl.arange(0, BN)
        ok = offs < N
        slots: tl.constexpr = top_k + 1 if SHARED else top_k
        acc = tl.zeros((BN,), dtype=tl.float32)
        for j in range(top_k):
            r = tl.load(pair_row + t * slots + j).to(tl.int64)
            acc += tl.load(y_ptr + r * stride_y + offs, mask=ok & ((offs * 0 + r) >= 0), other=0.0).to(tl.float32)
        if SHARED:
            r = tl.load(pair_row + t * slots + top_k).to(tl.int64)
            acc = _round_out(acc, OUT_KIND, INTERP) + tl.load(y_ptr + r * stride_y + offs, mask=ok).to(tl.float32)
            acc = _round_out(acc, OUT_KIND, INTERP)
        tl.store(out_ptr + t * stride_out + offs, acc.to(out_ptr.dtype.element_ty), mask=ok)


# --------------------------------------------------------------- launching
_OUT_KIND = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}
_SHARED_COLUMNS: dict = {}


def _shared_column(tokens: int, expert: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """The shared expert as one more routing slot: (ids [T, 1] = expert, weights [T, 1] = 1).

    Cached per token count like single_expert_alignment."""
    return _cached(_SHARED_COLUMNS, (tokens, expert, device.type, device.index),
                   lambda: (torch.full((tokens, 1), expert, dtype=torch.int64, device=device),
                            torch.ones(tokens, 1, dtype=torch.float32, device=device)), device)


def used_blocks(al: Alignment, pairs: int) -> int:
    """BLOCK_M-row blocks that can hold pairs: every expert's run starts at row 0 onward and
    a non-empty block holds at least one pair, so at most `pairs` blocks are in use. The
    grids stop there instead of at the worst-case padding of every local expert (at one
    token and 128 experts: 5 blocks instead of 121, the rest were programs that exit)."""
    return min(al.max_rows // al.block_m, pairs)


def grouped_gated_mlp(x: torch.Tensor, ids: Optional[torch.Tensor], weights: Optional[torch.Tensor], w13: list,
                      w2: list,
                      w13_scale: Optional[list], w2_scale: Optional[list], expert_offset: int, kind: str,
                      alpha: float, limit: float, beta: float, num_experts: int,
                      config: Optional[dict] = None, single_expert: bool = False,
                      shared: Optional[tuple] = None, selection: Optional[Selection] = None,
                      x_fp8: Optional[tuple] = None, overlap: bool = False) -> torch.Tensor:
    """sum over the pairs routed to these experts of weight * expert(x): float32 [T, H].

    single_expert: the caller's promise that there is one expert and every token
    goes to it (ids all 0, k = 1: the shared expert), so the layout is the cached
    single_expert_alignment instead of a sort per call.

    shared = (w13, w2, w13_scale, w2_scale) of the shared expert (scales None for
    BF16): it runs as one more expert in the same launches (every token, weight 1,
    its own width), and the result is eager's `routed.to(x.dtype) + shared(x)`,
    [T, H] in x.dtype. At decode sizes that halves the launches and lets the
    shared expert's tiles share the GPU with the routed ones instead of running
    after them on a few SMs.

    selection: the router's logits instead of ids and weights (both None): the selection,
    the shared slot and the alignment then run in one launch (kernels/moe_select_align.py),
    where select_align_fits says one program takes them.

    x_fp8: (x's FP8 values, its 1 x 128 scales) as minimax::quantize_fp8 gives them, made by the
    caller (the router's logits kernel at decode sizes) for the Triton gate/up; the Gluon paths
    (prefill sizes) quantize x into the experts' sorted order themselves and do not read it.

    overlap: the Triton launches as programmatic dependent launches (kernels/launch_overlap.py;
    the caller's choice, overlap_launches, taken at decode sizes)."""
    t, hidden = x.shape
    if (selection is None) == (ids is None or weights is None):
        raise ValueError("grouped_gated_mlp: pass ids and weights, or a selection instead of both")
    n_local = len(w13)
    n = w2[0].shape[1]
    fp8 = bool(w13_scale)
    n_shared = n
    if shared is not None:
        if single_expert:
            raise ValueError("grouped_gated_mlp: single_expert and shared exclude each other")
        sh_w13, sh_w2, sh_w13_s, sh_w2_s = shared
        if (sh_w13_s is not None) != fp8:
            raise ValueError("grouped_gated_mlp: the shared expert and the routed ones differ in precision")
        # its id is num_experts, past every routed id (offset + n_local would be the next
        # rank's first expert); the alignment maps it to local expert n_local
        shared_id = num_experts
        if selection is None:
            sid, sw = _shared_column(t, shared_id, x.device)
            ids = torch.cat([ids, sid], dim=1)
            weights = torch.cat([weights.to(torch.float32), sw], dim=1)
        w13, w2 = [*w13, sh_w13], [*w2, sh_w2]
        if fp8:
            w13_scale, w2_scale = [*w13_scale, sh_w13_s], [*w2_scale, sh_w2_s]
        n_shared = sh_w2.shape[1]
    routed_k = selection.top_k if selection is not None else ids.shape[1] - (shared is not None)
    k = routed_k + (shared is not None)
    n_experts = len(w13)
    n_max = max(n, n_shared)
    cfg = config or moe_plan.tile_config(t, routed_k, num_experts, fp8, float32=x.dtype == torch.float32)
    # local_pairs: the pairs this rank's experts take, on average (routing spreads them; the shared
    # slot takes every token)
    local_pairs = t * routed_k * n_local // max(num_experts, 1) + (t if shared is not None else 0)
    # BF16 at prefill sizes: the Gluon GEMMs over 192-row blocks, as FP8 below
    bf16_gluon = not fp8 and moe_plan.gluon_bf16_fits(x.device, x.dtype, hidden, n, n_shared, local_pairs, n_experts)
    if bf16_gluon:
        cfg = moe_plan.bf16_gluon_order(cfg)
    bm, bn, bk = cfg["BM"], cfg["BN"], cfg["BK"]
    bn_down = cfg.get("BN_DOWN", bn)
    launch = {kk: cfg[kk] for kk in ("num_warps", "num_stages") if kk in cfg}
    down_launch = {"num_warps": cfg.get("down_warps", cfg.get("num_warps", 4)),
                   "num_stages": cfg.get("down_stages", cfg.get("num_stages", 3))}
    one_dot = cfg.get("ONE_DOT", False)
    group_m = cfg.get("GROUP_M", 0)
    if fp8 and (bn != 128 or bk != 128):
        raise ValueError("FP8 grouped GEMMs need BN = BK = 128 (the quantization group)")
    if fp8 and 128 % bn_down:
        raise ValueError("FP8 grouped GEMMs need a down BLOCK_N that divides 128 (the weight scale block)")
    out_dt = x.dtype
    interp = _interpreting()
    ieee = x.dtype == torch.float32 and not interp  # float32 in, float32 math (Triton's default is TF32)
    upcast = interp and not fp8  # the interpreter's bf16 tl.dot is wrong; its fp8 dot is right
    halves = moe_plan.half_blocks_fit(bm, x.dtype == torch.bfloat16 and not fp8,
                                      moe_plan.rows_per_expert(t, routed_k, num_experts))
    if group_m < 0 and not cfg.get("EXPERT_GROUPS"):
        raise ValueError("grouped_gated_mlp: GROUP_M -1 (groups by expert) needs EXPERT_GROUPS, the largest group")
    gluon = fp8 and moe_plan.gluon_fits(x.device, x.dtype, hidden, cfg, n, n_shared)
    # the Gluon gate/up over 192-row blocks (three 64-row groups share each weight tile): the
    # experts' runs are padded to 192, and the down GEMM runs over the same blocks (Gluon) or takes
    # them as 64-row thirds (Triton)
    trio = (gluon and moe_plan.trio_fits(local_pairs, n_experts)) or bf16_gluon
    gluon_down = moe_plan.gluon_down_fits(trio)
    align_m = moe_gluon.TRIO_BLOCK_M if trio else bm
    parts = align_m // bm  # the down kernel's 64-row blocks in each gate/up block
    if single_expert:
        if n_local != 1 or k != 1 or expert_offset != 0 or selection is not None:
            raise ValueError("grouped_gated_mlp: single_expert needs one expert, k = 1, offset 0 and ids")
        al = single_expert_alignment(t, align_m, x.device)
    elif selection is not None:
        ids, weights, *layout = select_and_align(
            selection.logits, selection.correction_bias, routed_k, selection.norm_topk_prob,
            selection.routed_scaling, expert_offset, n_local, align_m, shared_id if shared is not None else -2,
            overlap=overlap)
        al = Alignment(*layout, align_m)
    else:
        al = _align(ids, expert_offset, n_local, align_m, shared_id if shared is not None else -2)
    num_m = used_blocks(al, ids.numel())
    rows = num_m * align_m
    dev = x.device
    # the program order in 192-row blocks: groups of GROUP_M 64-row blocks in thirds (at least one)
    trio_group_m = max(group_m // parts, 1) if group_m > 0 else group_m
    if trio:
        gate_up_blocks = _with_groups(al.block_expert, num_m, trio_group_m,
                                      max(cfg.get("EXPERT_GROUPS", parts) // parts, 1))
        # the Triton down's 64-row blocks (the Gluon down reads gate_up_blocks)
        block_expert = None if gluon_down else _parts(al, num_m, parts, n_experts,
                                                      gate_up_blocks if group_m < 0 else None)
        num_m = parts * num_m  # in 64-row blocks
    else:
        block_expert = _with_groups(al.block_expert, num_m, group_m, cfg.get("EXPERT_GROUPS", 0))
    if x_fp8 is not None and not fp8:
        raise ValueError("grouped_gated_mlp: x_fp8 given for BF16 experts")
    if gluon:
        # Hopper, FP8 prefill: the warp-specialized Gluon gate/up kernel (kernels/moe_gluon.py) loads
        # whole tiles by TMA, which cannot gather rows: x quantized straight into the sorted order
        xq, xs = quantize_scatter_fp8(x, al.pair_row, al.sorted_pair, rows, k, skip_padding_groups=True)
    elif bf16_gluon:  # the same for BF16, without the quantization
        xq = scatter_rows(x, al.pair_row, al.sorted_pair, rows, k, skip_padding_groups=True)
        xs = x.new_empty(1, 1, dtype=torch.float32)
    elif x_fp8 is not None:
        xq, xs = x_fp8
    elif fp8:
        # one Triton kernel on the GPU (bit-equal to the reference, tests/test_norm_quant_gpu.py)
        # instead of the reference's ~10 elementwise kernels: at decode sizes launches dominate
        on_gpu = x.is_cuda and x.dtype in (torch.bfloat16, torch.float16)
        xq, xs = quantize_fp8_triton(x, 128) if on_gpu else quantize_fp8_reference(x, 128)
    else:
        xq = x if x.stride(1) == 1 else x.contiguous()  # rows may be strided (a view of a packed gather)
        xs = x.new_empty(1, 1, dtype=torch.float32)
    if fp8:
        w13_t, ws13_t = _table(w13), _table(w13_scale, aligned=False)
        w2_t, ws2_t = _table(w2), _table(w2_scale, aligned=False)
    else:
        w13_t = ws13_t = _table(w13)
        w2_t = ws2_t = _table(w2)
    tw = weights.reshape(-1).to(torch.float32).contiguous()
    if trio:
        h, hs = moe_gluon.gate_up_act_trio(xq, xs, w13_t, ws13_t, gate_up_blocks, al.sorted_pair, num_m // parts,
                                           n_experts, n, _ACT[kind], float(alpha), float(limit), float(beta),
                                           trio_group_m)
    elif gluon:
        h, hs = moe_gluon.gate_up_act(xq, xs, w13_t, ws13_t, block_expert, num_m, n_experts, n,
                                      _ACT[kind], float(alpha), float(limit), float(beta), group_m)
    else:
        h = torch.empty(rows, n_max, dtype=FP8_DTYPE if fp8 else out_dt, device=dev)
        hs = torch.empty(rows, n_max // 128 if fp8 else 1, dtype=torch.float32, device=dev)
        n_tiles = triton.cdiv(n_max, bn)
        _gate_up_act_kernel[(num_m * n_tiles,)](
            xq, xs, w13_t, ws13_t, al.sorted_pair, block_expert, h, hs,
            hidden, n, n_shared, k, n_experts, num_m, n_tiles, xq.stride(0), xs.stride(0), h.stride(0), hs.stride(0),
            float(alpha), float(limit), float(beta), shared is not None,
            ACT=_ACT[kind], FP8=fp8, OUT_KIND=_OUT_KIND[out_dt], INTERP=interp, UPCAST=upcast, IEEE=ieee, BM=bm, BN=bn,
            BK=bk, ONE_DOT=one_dot, GROUP_M=group_m, HALVES=halves, **launch, **pdl_launch(overlap),
        )
    if gluon_down:
        # the Gluon down GEMM over the same 192-row blocks, in the gate/up's order
        y = moe_gluon.down_trio(h, hs, w2_t, ws2_t, gate_up_blocks, al.sorted_pair, tw, num_m // parts, n_experts,
                                hidden, trio_group_m)
    else:
        y = torch.empty(rows, hidden, dtype=out_dt, device=dev)
        down_launch["num_stages"] = moe_plan.down_stages(down_launch["num_stages"], n_shared != n,
                                                bm, bn_down, bk, 1 if fp8 else x.element_size())
        n_tiles = triton.cdiv(hidden, bn_down)
        _down_kernel[(num_m * n_tiles,)](
            h, hs, w2_t, ws2_t, al.sorted_pair, block_expert, tw, y,
            hidden, n_experts, num_m, n_tiles, h.stride(0), hs.stride(0), y.stride(0),
            K=n, K_SHARED=n_shared, SHARED=shared is not None,
            FP8=fp8, OUT_KIND=_OUT_KIND[out_dt], INTERP=interp, UPCAST=upcast, IEEE=ieee, BM=bm, BN=bn_down, BK=bk,
            GROUP_M=group_m, HALVES=halves, **down_launch, **pdl_launch(overlap),
        )
    out = torch.empty(t, hidden, dtype=out_dt if shared is not None else torch.float32, device=dev)
    cb = 1024 if hidden >= 1024 else triton.next_power_of_2(hidden)
    _combine_kernel[(t, triton.cdiv(hidden, cb))](
        y, al.pair_row, out, hidden, routed_k, y.stride(0), out.stride(0),
        SHARED=shared is not None, OUT_KIND=_OUT_KIND[out_dt], INTERP=interp, BN=cb,
        **pdl_launch(overlap))
    return out


def _with_groups(block_expert: torch.Tensor, num_m: int, group_m: int, cap: int) -> torch.Tensor:
    """block_expert as the kernels read it: with GROUP_M -1, each block's group (first block, size)
    after the blocks' experts, where _tile_of finds it."""
    if group_m >= 0:
        return block_expert
    return with_expert_groups(block_expert, num_m, cap)


def _parts(al: Alignment, num_m: int, parts: int, idle: int, groups: Optional[torch.Tensor]) -> torch.Tensor:
    """The 64-row blocks of a layout in blocks of parts x 64 rows (al), as the down kernel reads
    them: each part's expert, idle where its rows are all padding (an expert's rows come first in
    its run, so a part is padding when its first row is), and with `groups` (the large blocks as
    _with_groups made them) each part's group: the same groups, in parts."""
    size = al.block_m // parts
    first_rows = al.sorted_pair[: num_m * al.block_m].view(parts * num_m, size)[:, 0]
    experts = torch.where(first_rows >= 0, al.block_expert[:num_m].repeat_interleave(parts), idle)
    if groups is None:
        return experts
    scaled = (groups[num_m:].view(num_m, 2) * parts).repeat_interleave(parts, dim=0)
    return torch.cat([experts, scaled.reshape(-1)])


def triton_experts(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, w: MoEWeights) -> torch.Tensor:
    """The ExpertsFn of kernels/moe_reference.py on the GPU (falls back to the reference when unsupported)."""
    if x.shape[0] == 0 or not supported(x, w):
        return local_experts_reference(x, ids, weights, w)
    return grouped_gated_mlp(x, ids, weights, w.w13, w.w2, w.w13_scale, w.w2_scale, w.expert_offset,
                             w.activation, w.alpha, w.limit, w.beta, w.num_experts)


class TritonMoEWeights(MoEWeights):
    """MoEWeights whose experts run as grouped GEMMs (fused activation), the shared
    expert in the same launches as the routed ones where both fit the kernels."""

    def route(self, x: torch.Tensor):
        """The router's selection in one kernel after the logits GEMM (kernels/moe_route_triton.py);
        the kernel option moe_route=torch keeps the op-for-op path."""
        if route_mode() == "triton" and route_fits(x, self.router_weight.shape[0], self.top_k):
            return route_triton(x, self.router_weight, self.correction_bias, self.top_k, self.norm_topk_prob,
                                self.routed_scaling)
        return super().route(x)

    def _shared_as_expert(self) -> MoEWeights:
        sh = MoEWeights.__new__(MoEWeights)
        sh.__dict__.update(self.__dict__)
        sh.w13, sh.w2 = [self.shared_w13], [self.shared_w2]
        sh.w13_scale = [self.shared_w13_scale] if self.shared_w13_scale is not None else None
        sh.w2_scale = [self.shared_w2_scale] if self.shared_w2_scale is not None else None
        return sh

    def _merges_shared(self, x: torch.Tensor, experts) -> bool:
        """Whether the shared expert runs in the routed experts' launches (kernels/moe_triton.py's
        shared_in_grouped_launch, where both fit the kernels)."""
        return (self.shared and experts is triton_experts and x.shape[0] > 0 and self.n_local > 0
                and moe_plan.shared_in_grouped_launch(x.shape[0], self.top_k, self.num_experts, self.fp8,
                                             x.dtype == torch.float32, self.w2[0].shape[1], self.shared_w2.shape[1])
                and supported(x, self) and supported(x, self._shared_as_expert()))

    def _grouped(self, x: torch.Tensor, ids, weights, selection=None, x_fp8=None, overlap=False) -> torch.Tensor:
        return grouped_gated_mlp(x, ids, weights, self.w13, self.w2, self.w13_scale, self.w2_scale,
                                 self.expert_offset, self.activation, self.alpha, self.limit, self.beta,
                                 self.num_experts, shared=(self.shared_w13, self.shared_w2,
                                                           self.shared_w13_scale, self.shared_w2_scale),
                                 selection=selection, x_fp8=x_fp8, overlap=overlap)

    def block(self, x: torch.Tensor, experts) -> torch.Tensor:
        """At decode sizes (moe_select=fused): the router's logits (and, for FP8 experts, x's
        quantization in the same launch), then the selection, the shared slot and the alignment in
        one launch (kernels/moe_select_align.py) before the GEMMs; on sm_90 the five launches with
        programmatic dependent launch (moe_overlap)."""
        if (kernel_options().moe_select == "fused" and route_mode() == "triton"
                and kernel_options().moe_align == "triton" and route_fits(x, self.num_experts, self.top_k)
                and select_align_fits(x.shape[0], self.top_k, self.num_experts, True)
                and self._merges_shared(x, experts)):
            overlap = overlap_launches(x.device)  # the five launches with PDL (kernels/launch_overlap.py)
            logits, x_fp8 = router_logits_and_fp8(x, self.router_weight, quantize=self.fp8, overlap=overlap)
            selection = Selection(logits, self.correction_bias, self.top_k, self.norm_topk_prob, self.routed_scaling)
            return self._grouped(x, None, None, selection, x_fp8, overlap)
        return super().block(x, experts)

    def partial(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, experts) -> torch.Tensor:
        if not self._merges_shared(x, experts):
            return super().partial(x, ids, weights, experts)
        return self._grouped(x, ids, weights)

    def shared_expert(self, x: torch.Tensor) -> torch.Tensor:
        sh = self._shared_as_expert()
        if x.shape[0] == 0 or not supported(x, sh):
            return gated_mlp(x, self.shared_w13, self.shared_w2, self.shared_w13_scale, self.shared_w2_scale,
                             self.activation, self.alpha, self.limit, self.beta, self.group)
        ids, ones = _shared_column(x.shape[0], 0, x.device)  # the one expert, weight 1 (cached)
        return grouped_gated_mlp(x, ids, ones, sh.w13, sh.w2, sh.w13_scale, sh.w2_scale, 0, self.activation,
                                 self.alpha, self.limit, self.beta, 1, single_expert=True).to(x.dtype)


# ------------------------------------------------------------ the ops' CUDA kernels
def _gpu_path(reference):
    """The CUDA kernel of an op: the same code with the Triton grouped GEMMs for the
    experts. The kernel option moe_kernel=reference keeps the plain-torch experts (e.g.
    to compare on the GPU); without Triton the reference runs on CUDA too."""

    def impl(x, *args):
        if watching_router_inputs():
            notify_router_inputs(x, args[0], args[1], args[10])
        if kernel_options().moe_kernel == "reference" or not HAVE_TRITON:
            return reference(x, *args)
        return reference(x, *args, experts=triton_experts, weights_cls=TritonMoEWeights)

    return impl


moe.register_kernel("cuda")(_gpu_path(moe_reference))
mega_moe.register_kernel("cuda")(_gpu_path(mega_moe_reference))
