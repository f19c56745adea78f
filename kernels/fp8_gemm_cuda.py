"""CUDA implementation of `minimax::fp8_block_gemm` (Hopper, sm_90).

    y = fp8_block_gemm_cuda(xq, xs, w, ws, out_dtype)
        xq float8_e4m3fn [..., K], xs float32 [..., K / G] (row-major, one scale
        per 1 x G group, G = 128 or 32), w float8_e4m3fn [N, K], ws float32
        [ceil(N/128), ceil(K/128)] -> y [..., N] in out_dtype.

Three backends, chosen per call:

* at most 64 rows (decode): a Triton kernel that streams the weight once
  (kernels/fp8_small_m_triton.py); no padding of the rows around it;

* ``torch._scaled_mm`` with blockwise scales (cuBLASLt; 1 x 128 activation
  groups and 128 x 128 weight blocks, sm_90 with a recent cuBLAS; faster than
  the BF16 matmul, measured: docs/kernel-notes.md#fp8-block-gemm). cuBLAS wants the activation scales M-major (column-major
  [M, K/128]): that relayout happens here, after any all-gather, which is why
  the graph carries row-major ("unswizzled") scales. Only for G = 128.
* A Triton kernel (DeepSeek-style: fp8 tl.dot per K block, scaled in float32),
  for G = 32 (MXFP8 groups, which cuBLAS blockwise does not take on sm_90)
  and wherever ``_scaled_mm`` refuses the shapes.

The kernel option fp8_gemm (``MINIMAX_FP8_GEMM=scaled_mm|triton|auto``, kernels/options.py)
forces one (auto: the above).
The first ``_scaled_mm`` failure for a shape class is remembered so later calls
(and CUDA graph capture) never go through an exception.

This module registers ``fp8_block_gemm_cuda`` as the CUDA kernel of the op
(defined with its reference in kernels/fp8.py, which never imports this one).
Without Triton, shapes cuBLAS refuses run the plain-torch reference.
"""

from __future__ import annotations

import torch

from .fp8 import WEIGHT_BLOCK, dequantize_weight_fp8, fp8_block_gemm
from .fp8_small_m_triton import fp8_small_m_gemm, small_m_supports
from .interpreter import triton_interpreting
from .options import kernel_options

try:
    import triton
    import triton.language as tl

    HAVE_TRITON = True
except ImportError:  # pragma: no cover
    triton = None
    tl = None
    HAVE_TRITON = False

__all__ = ["fp8_block_gemm_cuda", "fp8_block_gemm_scaled_mm", "scaled_mm_supports", "fp8_block_gemm_triton", "HAVE_TRITON"]

_SCALED_MM_BROKEN: set[tuple] = set()  # shape classes where _scaled_mm raised once
_PAD_WEIGHT_SCALES: bool | None = None  # which scale_b layout this torch build takes (found on first use)


def fp8_block_gemm_cuda(xq: torch.Tensor, xs: torch.Tensor, w: torch.Tensor, ws: torch.Tensor,
                        out_dtype: torch.dtype, out: torch.Tensor | None = None) -> torch.Tensor:
    """out: a contiguous [M, N] tensor of out_dtype (2-D input) to write into; cuBLAS writes
    it directly where it can, which saves GEMM-RS a copy per row block. Returns the result."""
    if out is not None and (xq.dim() != 2 or out.shape != (xq.shape[0], w.shape[0]) or out.dtype != out_dtype
                            or not out.is_contiguous()):
        raise ValueError(f"fp8_block_gemm_cuda: out must be a contiguous [{xq.shape[0]}, {w.shape[0]}] "
                         f"{out_dtype} tensor for a 2-D input, got {tuple(out.shape)} {out.dtype}")
    k = xq.shape[-1]
    group = k // xs.shape[-1]
    lead = xq.shape[:-1]
    a = xq.reshape(-1, k)
    sa = xs.reshape(-1, xs.shape[-1])
    n = w.shape[0]
    if a.shape[0] == 0:
        return out if out is not None else xq.new_empty((*lead, n), dtype=out_dtype)
    choice = kernel_options().fp8_gemm
    if choice == "auto" and HAVE_TRITON and small_m_supports(a.shape[0], k, group):
        y = fp8_small_m_gemm(a, sa, w, ws, out_dtype)
        return y.reshape(*lead, n) if out is None else out.copy_(y)
    key = (group, k % 16, n % 16, (k // WEIGHT_BLOCK) % 4)
    if choice != "triton" and scaled_mm_supports(a.shape[0], k, group) and key not in _SCALED_MM_BROKEN:
        try:
            return fp8_block_gemm_scaled_mm(a, sa, w, ws, out_dtype, out=out).reshape(*lead, n)
        except (RuntimeError, ValueError):
            if choice == "scaled_mm":
                raise
            _SCALED_MM_BROKEN.add(key)
    if not HAVE_TRITON:
        x = a.float() * sa.float().repeat_interleave(group, dim=-1)
        y = (x @ dequantize_weight_fp8(w, ws).T).to(out_dtype)
    else:
        y = fp8_block_gemm_triton(a, sa, w, ws, out_dtype)
    return y.reshape(*lead, n) if out is None else out.copy_(y)


def _weight_scales_for_cublas(ws: torch.Tensor, padded: bool) -> torch.Tensor:
    """scale_b for b = w.t() [K, N]: checked as scale_b.t() [N/128, K/128] row-major;
    some torch builds want that row stride rounded up to a multiple of 4."""
    if not padded:
        return ws.contiguous().t()
    nb, kb = ws.shape
    kb4 = -(-kb // 4) * 4
    buf = ws.new_zeros(nb, kb4)
    buf[:, :kb] = ws
    return buf[:, :kb].t()


def scaled_mm_supports(m: int, k: int, group: int) -> bool:
    """Shapes where cuBLAS blockwise is known to be right on sm_90.

    With K / 128 not a multiple of 4, _scaled_mm returned WRONG numbers without
    raising (measured: docs/kernel-notes.md#fp8-block-gemm), so the layout cannot
    be found by trying; those shapes go to the Triton kernel. M is padded to a
    multiple of 4 below, so any M is fine.
    """
    return group == WEIGHT_BLOCK and k % (4 * WEIGHT_BLOCK) == 0


def fp8_block_gemm_scaled_mm(a: torch.Tensor, sa: torch.Tensor, w: torch.Tensor, ws: torch.Tensor,
                             out_dtype: torch.dtype, out: torch.Tensor | None = None) -> torch.Tensor:
    """cuBLASLt blockwise FP8 GEMM: a [M, K] x w [N, K]^T with 1x128 / 128x128 scales.

    Rows are padded to a multiple of 4 (the M-major scales' 16-byte alignment)
    and the result sliced; shapes outside scaled_mm_supports raise ValueError."""
    m, k = a.shape
    if not scaled_mm_supports(m, k, k // sa.shape[1]):
        raise ValueError(f"_scaled_mm blockwise is not trusted for K={k}, group {k // sa.shape[1]}")
    if m % 4 == 0:
        return _scaled_mm_blockwise(a, sa, w, ws, out_dtype, out=out)
    pad = 4 - m % 4
    a4 = torch.cat([a, a.new_zeros(pad, k)])
    sa4 = torch.cat([sa.float(), sa.new_ones(pad, sa.shape[1], dtype=torch.float32)])
    y = _scaled_mm_blockwise(a4, sa4, w, ws, out_dtype)[:m]
    return y if out is None else out.copy_(y)


def _scaled_mm_blockwise(a, sa, w, ws, out_dtype, out=None):
    global _PAD_WEIGHT_SCALES
    m = a.shape[0]
    # 1 x 128 activation scales, M-major: shape [M, K/128], strides (1, M)
    sa_mmajor = sa.float().t().contiguous().t()
    b = w.t()  # [K, N], column-major
    layouts = (False, True) if _PAD_WEIGHT_SCALES is None else (_PAD_WEIGHT_SCALES,)
    last = None
    for padded in layouts:
        try:
            y = torch._scaled_mm(a.contiguous(), b, scale_a=sa_mmajor,
                                 scale_b=_weight_scales_for_cublas(ws, padded), out_dtype=out_dtype,
                                 **({} if out is None else {"out": out}))
        except (RuntimeError, ValueError) as e:  # the layout of scale_b differs across torch versions
            last = e
            continue
        if ws.shape[1] % 4:  # (with K/128 a multiple of 4 both layouts are the same)
            _PAD_WEIGHT_SCALES = padded
        return y
    raise RuntimeError(f"torch._scaled_mm blockwise failed for M={m}, N={w.shape[0]}, K={a.shape[1]}: {last}")


if HAVE_TRITON:

    @triton.jit
    def _fp8_block_gemm_kernel(
        a_ptr, b_ptr, c_ptr, as_ptr, bs_ptr,
        M, N, K: tl.constexpr,  # constexpr: a runtime loop bound fails triton 3.6's interpreter with numpy 2
        stride_am, stride_bn, stride_cm, stride_asm, stride_bsn,
        G: tl.constexpr,
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
        GROUP_M: tl.constexpr,
    ):
        # BLOCK_K == G: one activation scale per K step; the weight scale changes every 128.
        pid = tl.program_id(0)
        num_m = tl.cdiv(M, BLOCK_M)
        num_n = tl.cdiv(N, BLOCK_N)
        group_id = pid // (GROUP_M * num_n)
        first_m = group_id * GROUP_M
        size_m = tl.minimum(num_m - first_m, GROUP_M)
        pid_m = first_m + (pid % (GROUP_M * num_n)) % size_m
        pid_n = (pid % (GROUP_M * num_n)) // size_m

        offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        offs_k = tl.arange(0, G)
        rm = offs_m % M
        rn = offs_n % N
        a_ptrs = a_ptr + rm[:, None].to(tl.int64) * stride_am + offs_k[None, :]
        b_ptrs = b_ptr + rn[None, :].to(tl.int64) * stride_bn + offs_k[:, None]  # w^T tile [G, BLOCK_N]
        as_ptrs = as_ptr + rm.to(tl.int64) * stride_asm
        bs_ptrs = bs_ptr + (rn // 128) * stride_bsn
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for kb in range(0, tl.cdiv(K, G)):
            k0 = kb * G
            kmask = offs_k < K - k0
            a = tl.load(a_ptrs, mask=kmask[None, :], other=0.0)
            b = tl.load(b_ptrs, mask=kmask[:, None], other=0.0)
            sa = tl.load(as_ptrs + kb)
            sb = tl.load(bs_ptrs + k0 // 128)
            acc += tl.dot(a, b) * sa[:, None] * sb[None, :]
            a_ptrs += G
            b_ptrs += G
        c = acc.to(c_ptr.dtype.element_ty)
        c_ptrs = c_ptr + offs_m[:, None].to(tl.int64) * stride_cm + offs_n[None, :]
        tl.store(c_ptrs, c, mask=(offs_m[:, None] < M) & (offs_n[None, :] < N))


def _triton_config(m: int, group: int) -> dict:
    if m <= 64:
        bm = 64
    else:
        bm = 128
    return {"BLOCK_M": bm, "BLOCK_N": 128, "GROUP_M": 8, "num_warps": 4 if bm <= 64 else 8,
            "num_stages": 3 if group == 128 else 4}


def fp8_block_gemm_triton(a: torch.Tensor, sa: torch.Tensor, w: torch.Tensor, ws: torch.Tensor,
                          out_dtype: torch.dtype, config: dict | None = None) -> torch.Tensor:
    """Triton blockwise FP8 GEMM (CUDA, or CPU tensors under TRITON_INTERPRET=1)."""
    if not HAVE_TRITON:
        raise RuntimeError("fp8_block_gemm_triton needs triton")
    m, k = a.shape
    n = w.shape[0]
    group = k // sa.shape[-1]
    if group > WEIGHT_BLOCK or WEIGHT_BLOCK % group or k % group:
        raise ValueError(f"fp8_block_gemm_triton: activation group {group} must divide 128 and K={k}")
    a = a.contiguous()
    w = w.contiguous()
    sa = sa.float().contiguous()
    ws = ws.float().contiguous()
    c = torch.empty((m, n), dtype=out_dtype, device=a.device)
    cfg = {**_triton_config(m, group), **(config or {})}
    launch = {k_: cfg.pop(k_) for k_ in ("num_warps", "num_stages") if k_ in cfg}
    if triton_interpreting():
        launch = {}
    grid = (triton.cdiv(m, cfg["BLOCK_M"]) * triton.cdiv(n, cfg["BLOCK_N"]),)
    _fp8_block_gemm_kernel[grid](
        a, w, c, sa, ws, m, n, k,
        a.stride(0), w.stride(0), c.stride(0), sa.stride(0), ws.stride(0),
        G=group, **cfg, **launch,
    )
    return c


@fp8_block_gemm.register_kernel("cuda")
def _fp8_block_gemm_cuda(xq, xs, w, ws, out_dtype):
    return fp8_block_gemm_cuda(xq, xs, w, ws, out_dtype)
