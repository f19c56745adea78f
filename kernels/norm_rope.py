"""Per-head RMSNorm followed by NeoX RoPE: the `minimax::rms_norm_rope` op.

    out = torch.ops.minimax.rms_norm_rope(x, weight, cos, sin, eps, gemma)

    x          [T, heads, head_dim] bfloat16 / float16 / float32; the last dim contiguous,
               the others any stride (q and k are column slices of the QKV GEMM's output)
    weight     [head_dim], the norm weight (Gemma form uses 1 + w)
    cos, sin   float32 [T, rotary_dim // 2], one row per token
    out        [T, heads, head_dim] in x.dtype, contiguous

What the model's attention computes between the QKV projection and the attention
(model/layers.py: `RMSNorm` over head_dim, then `apply_rope`): the norm in float32
rounded to x.dtype, then the first rotary_dim dims rotated in float32 (the first
half pairs with the second half) and rounded again, the rest passed through.
Inductor runs it as a reduction kernel and a pointwise one over q, each reading
the whole of q; the Triton kernel (kernels/norm_rope_triton.py, which registers
itself as the op's CUDA kernel) reads each head once. The CPU implementation is
literally the model's sequence of torch calls (a test checks it bit for bit).
"""

from __future__ import annotations

import torch

from .norm_quant import rms_norm_reference

__all__ = ["rms_norm_rope", "rms_norm_rope_reference", "rope_reference", "check_norm_rope_args"]


def check_norm_rope_args(x: torch.Tensor, weight: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> None:
    if x.dim() != 3:
        raise ValueError(f"rms_norm_rope: x must be [tokens, heads, head_dim], got {tuple(x.shape)}")
    if not x.dtype.is_floating_point or x.element_size() == 1:
        raise ValueError(f"rms_norm_rope: x must be bfloat16, float16 or float32, got {x.dtype}")
    t, _, d = x.shape
    if weight.dim() != 1 or weight.shape[0] != d:
        raise ValueError(f"rms_norm_rope: weight must be [head_dim={d}], got {tuple(weight.shape)}")
    for name, c in (("cos", cos), ("sin", sin)):
        if c.dim() != 2 or c.shape[0] != t or c.dtype != torch.float32:
            raise ValueError(f"rms_norm_rope: {name} must be float32 [tokens={t}, rotary_dim / 2], "
                             f"got {c.dtype} {tuple(c.shape)}")
    if cos.shape != sin.shape:
        raise ValueError(f"rms_norm_rope: cos {tuple(cos.shape)} and sin {tuple(sin.shape)} differ")
    if cos.shape[1] == 0:
        raise ValueError("rms_norm_rope: rotary_dim must be positive (cos and sin have no columns)")
    if 2 * cos.shape[1] > d:
        raise ValueError(f"rms_norm_rope: rotary_dim {2 * cos.shape[1]} is larger than head_dim {d}")


def rope_reference(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """NeoX RoPE as model/layers.py:apply_rope computes it (same float32 math, same casts)."""
    half = cos.shape[-1]
    x1 = x[..., :half].float()
    x2 = x[..., half:2 * half].float()
    c, s = cos[:, None, :], sin[:, None, :]
    rotated = torch.cat([x1 * c - x2 * s, x2 * c + x1 * s], dim=-1).to(x.dtype)
    return torch.cat([rotated, x[..., 2 * half:]], dim=-1)


def rms_norm_rope_reference(x: torch.Tensor, weight: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, eps: float,
                            gemma: bool) -> torch.Tensor:
    """The unfused sequence in plain torch: the numerical reference (any device)."""
    check_norm_rope_args(x, weight, cos, sin)
    return rope_reference(rms_norm_reference(x, weight, eps, gemma), cos, sin).contiguous()


@torch.library.custom_op("minimax::rms_norm_rope", mutates_args=())
def rms_norm_rope(x: torch.Tensor, weight: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, eps: float,
                  gemma: bool) -> torch.Tensor:
    # CPU (and any device without a kernel of its own): the reference.
    return rms_norm_rope_reference(x, weight, cos, sin, eps, gemma)


@rms_norm_rope.register_fake
def _rms_norm_rope_fake(x, weight, cos, sin, eps, gemma):
    check_norm_rope_args(x, weight, cos, sin)
    return torch.empty(x.shape, dtype=x.dtype, device=x.device)
