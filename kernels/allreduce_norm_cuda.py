"""One-kernel CUDA path of `minimax::allreduce_rms_norm_quant` (see kernels/allreduce_norm.py).

A one-shot all-reduce over symmetric memory with the residual add, the
RMSNorm and the 1 x G FP8 quantization in the same Triton kernel:

    copy x -> my symmetric buffer; barrier       every rank's partial is readable
    kernel: h = sum over ranks of their buffers, then exactly the math of
            kernels/norm_quant_triton.py (h rounded to x.dtype as the
            all-reduce's output is, + residual, norm, scales, FP8)
    barrier                                      nobody overwrites a buffer a peer still reads

Every rank reads every rank's rows (one-shot: latency-bound sizes, up to the
pass's allreduce_fusion_max_tokens), so all ranks hold the whole result, as
after an all-reduce. The partial sums are added in float32 in rank order and
rounded once; NCCL may add in another order (equal for 2 ranks).

It is chosen by the kernel option `allreduce_norm=symm_mem`
(MINIMAX_ALLREDUCE_NORM); the default stays the unfused sequence until the
path has been run and timed on several GPUs (docs/measurements/2026-12-01.md
lists the runs). The kernel itself, `allreduce_norm_rows`, takes the ranks'
partials as a list of tensors: on the CPU (TRITON_INTERPRET=1) the tests give
it local tensors; here they are the peers' symmetric buffers.

Buffers: one per (device, group, tokens, K, dtype), allocated and
rendezvoused on first use (a collective) and kept, so a CUDA graph's pointers
stay valid; the first call at a size may not happen during capture (the
compiled model's warm-up call makes it).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Optional

import torch

from .allreduce_norm import allreduce_rms_norm_quant, allreduce_rms_norm_quant_reference
from .fp8 import FP8_DTYPE
from .interpreter import triton_interpreting
from .norm_quant_triton import HAVE_TRITON
from .options import kernel_options

if HAVE_TRITON:
    import triton
    import triton.language as tl

    from .norm_quant_triton import _columns, _norm_quant_tile, _round_to_bf16

__all__ = ["MAX_RANKS", "supported", "allreduce_norm_rows"]

MAX_RANKS = 8  # the kernel takes up to eight partial-sum pointers
_DTYPES = (torch.bfloat16, torch.float32)
_TILE_G = 128  # the tile's group width when nothing is quantized (group_size 0)


def supported(x: torch.Tensor, residual: Optional[torch.Tensor], weight: torch.Tensor, group_size: int,
              ranks: int) -> bool:
    """Whether the kernel takes these inputs (else the op runs the unfused sequence)."""
    g = group_size or _TILE_G
    return (HAVE_TRITON and (x.is_cuda or triton_interpreting()) and 2 <= ranks <= MAX_RANKS
            and x.dim() == 2 and x.dtype in _DTYPES and weight.dtype in _DTYPES and x.numel() > 0
            and x.shape[1] % g == 0 and (g & (g - 1)) == 0 and (residual is None or residual.dtype == x.dtype))


if HAVE_TRITON:

    @triton.jit
    def _add_partial(h, p, off, mask, RANK: tl.constexpr, RANKS: tl.constexpr):
        if RANK < RANKS:
            h += tl.load(p + off, mask=mask, other=0.0).to(tl.float32)
        return h

    @triton.jit
    def _allreduce_norm_quant_kernel(
        p0, p1, p2, p3, p4, p5, p6, p7,  # the ranks' partial sums (the first RANKS are used)
        res_ptr, w_ptr,
        q_ptr, s_ptr, y_ptr, r_ptr,
        M, K_f, n_groups,
        stride_p, stride_res, stride_q, stride_s, stride_y, stride_r,
        eps,
        G: tl.constexpr,
        NG: tl.constexpr,
        ROWS: tl.constexpr,
        RANKS: tl.constexpr,
        HAS_RESIDUAL: tl.constexpr,
        GEMMA: tl.constexpr,
        WANT_Y: tl.constexpr,
        QUANT: tl.constexpr,
        ROUND_BF16: tl.constexpr,
    ):
        pid = tl.program_id(0)
        col, cmask = _columns(0, n_groups, G, NG)
        w = tl.load(w_ptr + col, mask=cmask, other=0.0).to(tl.float32)
        if GEMMA:
            w = 1.0 + w
        for i in tl.static_range(ROWS):
            row = pid * ROWS + i
            mask = cmask & ((col * 0 + row) < M)
            row64 = row.to(tl.int64)
            off = row64 * stride_p + col
            h = tl.load(p0 + off, mask=mask, other=0.0).to(tl.float32)
            h = _add_partial(h, p1, off, mask, 1, RANKS)
            h = _add_partial(h, p2, off, mask, 2, RANKS)
            h = _add_partial(h, p3, off, mask, 3, RANKS)
            h = _add_partial(h, p4, off, mask, 4, RANKS)
            h = _add_partial(h, p5, off, mask, 5, RANKS)
            h = _add_partial(h, p6, off, mask, 6, RANKS)
            h = _add_partial(h, p7, off, mask, 7, RANKS)
            if ROUND_BF16:
                h = _round_to_bf16(h)  # the all-reduce's output is in x.dtype
            if HAS_RESIDUAL:
                h = h + tl.load(res_ptr + row64 * stride_res + col, mask=mask, other=0.0).to(tl.float32)
                if ROUND_BF16:
                    h = _round_to_bf16(h)
                tl.store(r_ptr + row64 * stride_r + col, h.to(r_ptr.dtype.element_ty), mask=mask)
            ss = tl.sum(tl.sum(h * h, axis=1), axis=0)
            var = tl.math.div_rn(ss, K_f) + eps
            rstd = tl.math.div_rn(tl.full(var.shape, 1.0, tl.float32), tl.math.sqrt_rn(var))
            _norm_quant_tile(h, rstd, w, q_ptr, s_ptr, y_ptr, row, M, stride_q, stride_s, stride_y, col, cmask,
                             0, n_groups, NG, GEMMA, WANT_Y, ROUND_BF16, True, QUANT)


def allreduce_norm_rows(partials: list[torch.Tensor], residual: Optional[torch.Tensor], weight: torch.Tensor,
                        eps: float, gemma: bool, group_size: int, want_normed: bool
                        ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The op's four outputs from the ranks' partial sums [T, K] (one stride), in one launch."""
    if not HAVE_TRITON:
        raise RuntimeError("allreduce_norm_rows needs triton (pip install triton)")
    x = partials[0]
    if not supported(x, residual, weight, group_size, len(partials)):
        raise ValueError(f"allreduce_norm_rows: inputs the kernel does not take ({len(partials)} partials of "
                         f"{tuple(x.shape)} {x.dtype}, group_size {group_size})")
    if any(p.shape != x.shape or p.dtype != x.dtype or p.stride() != x.stride() for p in partials):
        raise ValueError("allreduce_norm_rows: the partial sums must share shape, dtype and strides")
    if x.stride(1) != 1:
        raise ValueError("allreduce_norm_rows: rows must be contiguous")
    m, k = x.shape
    quant = group_size > 0
    g = group_size or _TILE_G
    want_y = want_normed or not quant  # without quantization the normed rows are the output
    res = residual.contiguous() if residual is not None else None
    weight = weight.contiguous()
    q = torch.empty((m, k) if quant else (0,), dtype=FP8_DTYPE if quant else x.dtype, device=x.device)
    s = torch.empty((m, k // g) if quant else (0,), dtype=torch.float32, device=x.device)
    y = torch.empty((m, k), dtype=x.dtype, device=x.device) if want_y else x.new_empty(0)
    r = torch.empty((m, k), dtype=x.dtype, device=x.device) if res is not None else x.new_empty(0)
    tile = triton.next_power_of_2(k // g) * g
    rows = max(1, min(16, 2048 // tile))
    warps = 1 if tile <= 256 else 2 if tile <= 512 else 4 if tile <= 2048 else 8
    ptrs = list(partials) + [x] * (MAX_RANKS - len(partials))
    dummy = y if want_y else (q if quant else r)
    _allreduce_norm_quant_kernel[(triton.cdiv(m, rows),)](
        *ptrs, res if res is not None else x, weight,
        q if quant else dummy, s if quant else dummy, y if want_y else dummy, r if res is not None else dummy,
        m, float(k), k // g,
        x.stride(0), res.stride(0) if res is not None else 0, q.stride(0) if quant else 0,
        s.stride(0) if quant else 0, y.stride(0) if want_y else 0, r.stride(0) if res is not None else 0,
        float(eps),
        G=g, NG=triton.next_power_of_2(k // g), ROWS=rows, RANKS=len(partials),
        HAS_RESIDUAL=res is not None, GEMMA=bool(gemma), WANT_Y=want_y, QUANT=quant,
        ROUND_BF16=x.dtype == torch.bfloat16, num_warps=warps,
    )
    if not want_normed and quant:
        y = x.new_empty(0)
    return q, s, y, r


# ------------------------------------------------------------------ symmetric memory (GPUs only)
@dataclass
class _Buffers:
    handle: object  # the _SymmetricMemory handle (barrier)
    own: torch.Tensor  # [T, K], this rank's partial goes here
    peers: list  # every rank's buffer, rank order (own included)


_BUFFERS: dict = {}


def _buffers(tokens: int, k: int, dtype: torch.dtype, group_name: str, device: torch.device) -> _Buffers:
    from .gemm_rs_cuda import _is_capturing, _peer_view, _resolve_group

    key = (device.index, group_name, tokens, k, dtype)
    buf = _BUFFERS.get(key)
    if buf is not None:
        return buf
    if _is_capturing():
        raise RuntimeError(
            f"minimax::allreduce_rms_norm_quant: no symmetric buffer yet for {tokens} x {k} {dtype} on group "
            f"{group_name!r}, and allocating + rendezvousing one cannot happen during CUDA graph capture: run the "
            "op once at this token count before capturing (the compiled model's warm-up call does)")
    os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")  # we never use multicast
    import torch.distributed._symmetric_memory as symm_mem

    world = _resolve_group(group_name).size()
    try:
        own = symm_mem.empty((tokens, k), dtype=dtype, device=device)
        handle = symm_mem.rendezvous(own, group_name)  # collective over the group
    except Exception as e:
        raise RuntimeError(
            f"minimax::allreduce_rms_norm_quant: could not set up symmetric memory for group {group_name!r} "
            f"({type(e).__name__}: {e}); it needs all ranks on NVLink-connected GPUs of one host. Unset "
            "MINIMAX_ALLREDUCE_NORM (the unfused path) instead.") from e
    if handle.world_size != world:
        raise RuntimeError(f"minimax::allreduce_rms_norm_quant: symmetric memory reports {handle.world_size} "
                           f"ranks, group {group_name!r} has {world}")
    peers = [own if d == handle.rank else _peer_view(handle, d, (tokens, k), dtype) for d in range(world)]
    buf = _BUFFERS[key] = _Buffers(handle=handle, own=own, peers=peers)
    return buf


def _symm_mem_path(x, residual, weight, eps, gemma, group_size, want_normed, group_name):
    buf = _buffers(x.shape[0], x.shape[1], x.dtype, group_name, x.device)
    buf.own.copy_(x)
    buf.handle.barrier(channel=0)  # every rank's partial is in its buffer
    out = allreduce_norm_rows(buf.peers, residual, weight, eps, gemma, group_size, want_normed)
    buf.handle.barrier(channel=0)  # every rank has read every buffer: the next call may overwrite
    return out


@allreduce_rms_norm_quant.register_kernel("cuda")
def _allreduce_rms_norm_quant_cuda(x, residual, weight, eps, gemma, group_size, want_normed, tp_size, group_name):
    if (kernel_options().allreduce_norm == "symm_mem" and tp_size > 1
            and supported(x, residual, weight, group_size, tp_size) and x.is_contiguous()):
        return _symm_mem_path(x, residual, weight, eps, gemma, group_size, want_normed, group_name)
    return allreduce_rms_norm_quant_reference(x, residual, weight, eps, gemma, group_size, want_normed, tp_size,
                                              group_name)
