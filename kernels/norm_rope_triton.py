"""Triton kernel of `minimax::rms_norm_rope` (see kernels/norm_rope.py).

One program takes HEADS heads of one token as a [HEADS, BLOCK_D] tile, read
once from HBM (the rotation's partner columns, d +- rotary_dim / 2 of the same
head, come from the same cache lines). All math is float32, in the model's order:

    rstd = 1 / sqrt(sum(x * x) / head_dim + eps)
    y    = Gemma: round(x * rstd * (1 + w));  plain: round(round(x * rstd) * w)
    out  = d < half:      round(y[d] * cos - y[d + half] * sin)
           d < 2 * half:  round(y[d] * cos + y[d - half] * sin)
           else:          y[d]

where round() is to x.dtype. Bit-equal to the reference wherever the sum of
squares is (its order is a tree here), as in kernels/norm_quant_triton.py,
whose rounding helper and division conventions it shares: the products are
not contracted into FMAs (`enable_fp_fusion=False`), the reference rounds each.
"""

from __future__ import annotations

import torch

from .interpreter import triton_interpreting as _interpreting
from .norm_quant_triton import HAVE_TRITON
from .norm_rope import check_norm_rope_args, rms_norm_rope, rms_norm_rope_reference

if HAVE_TRITON:
    import triton
    import triton.language as tl

    from .norm_quant_triton import _round_to_bf16, scaled_norm

__all__ = ["supported", "rms_norm_rope_triton", "heads_per_program"]

_DTYPES = (torch.bfloat16, torch.float32)


def supported(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether the Triton kernel handles these inputs (else the caller uses the reference)."""
    return (HAVE_TRITON and (x.is_cuda or _interpreting()) and x.dtype in _DTYPES and weight.dtype in _DTYPES
            and x.numel() > 0 and x.stride(-1) == 1)


def heads_per_program(heads: int, block_d: int) -> int:
    """Heads per program: 512 values (4 heads of 128), never more than exist. With one warp the
    fastest of 2-32 heads x 1-8 warps at 8192 and 16384 tokens on an H100, 12% faster than 16 heads
    x 4 warps, and within 2-4% of the best at 64 and 1024 (docs/kernel-notes.md#qk-norm--rope)."""
    return max(1, min(triton.next_power_of_2(heads), 512 // block_d))


if HAVE_TRITON:

    @triton.jit
    def _rms_norm_rope_kernel(x_ptr, w_ptr, cos_ptr, sin_ptr, out_ptr, heads, stride_xt, stride_xh, stride_c,
                              stride_s, d_f, eps, D: tl.constexpr, HALF: tl.constexpr, BLOCK_D: tl.constexpr,
                              HEADS: tl.constexpr, GEMMA: tl.constexpr, ROUND_BF16: tl.constexpr):
        tok = tl.program_id(0)
        h = tl.program_id(1) * HEADS + tl.arange(0, HEADS)
        d = tl.arange(0, BLOCK_D)
        rot = d < 2 * HALF
        partner = tl.where(d < HALF, d + HALF, d - HALF)
        dmask = d < D
        mask = (h < heads)[:, None] & dmask[None, :]
        row = x_ptr + tok.to(tl.int64) * stride_xt + h.to(tl.int64)[:, None] * stride_xh
        x = tl.load(row + d[None, :], mask=mask, other=0.0).to(tl.float32)
        xp = tl.load(row + partner[None, :], mask=mask & rot[None, :], other=0.0).to(tl.float32)
        w = tl.load(w_ptr + d, mask=dmask, other=0.0).to(tl.float32)
        wp = tl.load(w_ptr + partner, mask=rot, other=0.0).to(tl.float32)
        if GEMMA:
            w = 1.0 + w
            wp = 1.0 + wp
        # IEEE division and sqrt, as torch's mean and CPU rsqrt (see kernels/norm_quant_triton.py)
        var = tl.math.div_rn(tl.sum(x * x, axis=1), d_f) + eps
        rstd = tl.math.div_rn(tl.full(var.shape, 1.0, tl.float32), tl.math.sqrt_rn(var))[:, None]
        y = scaled_norm(x, rstd, w[None, :], GEMMA, ROUND_BF16)
        yp = scaled_norm(xp, rstd, wp[None, :], GEMMA, ROUND_BF16)
        c = tl.load(cos_ptr + tok.to(tl.int64) * stride_c + d % HALF, mask=rot, other=0.0)[None, :]
        s = tl.load(sin_ptr + tok.to(tl.int64) * stride_s + d % HALF, mask=rot, other=0.0)[None, :]
        first = (d < HALF)[None, :]
        # each product rounded on its own, then the sum: the reference's order (no FMA, see launch)
        a = y * c
        b = yp * s
        r = tl.where(first, a - b, a + b)
        if ROUND_BF16:
            r = _round_to_bf16(r)
        out = tl.where(rot[None, :], r, y)
        optr = out_ptr + tok.to(tl.int64) * heads * D + h.to(tl.int64)[:, None] * D + d[None, :]
        tl.store(optr, out.to(out_ptr.dtype.element_ty), mask=mask)


def rms_norm_rope_triton(x: torch.Tensor, weight: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, eps: float,
                         gemma: bool, heads_per_prog: int | None = None, num_warps: int = 1) -> torch.Tensor:
    """Launch the kernel (CUDA tensors, or CPU tensors under TRITON_INTERPRET=1)."""
    if not HAVE_TRITON:
        raise RuntimeError("rms_norm_rope_triton needs triton (pip install triton)")
    check_norm_rope_args(x, weight, cos, sin)
    if x.stride(-1) != 1:
        x = x.contiguous()
    t, heads, d = x.shape
    half = cos.shape[1]
    out = torch.empty((t, heads, d), dtype=x.dtype, device=x.device)
    if out.numel() == 0:
        return out
    cos = cos if cos.stride(1) == 1 else cos.contiguous()
    sin = sin if sin.stride(1) == 1 else sin.contiguous()
    block_d = triton.next_power_of_2(d)
    hp = heads_per_prog or heads_per_program(heads, block_d)
    _rms_norm_rope_kernel[(t, triton.cdiv(heads, hp))](
        x, weight.contiguous(), cos, sin, out, heads, x.stride(0), x.stride(1), cos.stride(0), sin.stride(0),
        float(d), float(eps), D=d, HALF=half, BLOCK_D=block_d, HEADS=hp,
        GEMMA=bool(gemma), ROUND_BF16=x.dtype == torch.bfloat16, num_warps=num_warps, enable_fp_fusion=False,
    )
    return out


@rms_norm_rope.register_kernel("cuda")
def _rms_norm_rope_cuda(x, weight, cos, sin, eps, gemma):
    if supported(x, weight):
        return rms_norm_rope_triton(x, weight, cos, sin, eps, gemma)
    return rms_norm_rope_reference(x, weight, cos, sin, eps, gemma)
