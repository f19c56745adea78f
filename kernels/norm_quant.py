"""Fused (residual add) + RMSNorm + FP8 quantization: the `minimax::rms_norm_quant_fp8` op.

    q, scales, normed, new_residual = torch.ops.minimax.rms_norm_quant_fp8(
        x, residual, weight, eps, gemma, group_size=128, want_bf16_output=False)

    x             [..., K] bfloat16 / float16 / float32 (the norm input; with a
                  residual, the value added to it)
    residual      [..., K] in x.dtype, or None
    weight        [K] (the norm weight; Gemma form uses 1 + w)
    eps, gemma    RMSNorm epsilon; Gemma form x / rms * (1 + w) or plain x / rms * w
    group_size    FP8 group along K: 128 (Hopper 1 x 128) or 32 (MXFP8)

    q             float8_e4m3fn [..., K]
    scales        float32 [..., K // group_size], powers of two (q * scale ~ normed)
    normed        the norm output in x.dtype when want_bf16_output, else an empty tensor
    new_residual  x + residual in x.dtype when a residual is given, else an empty tensor

The op is what the model computes, in one pass over the row: with a residual,
h = x + residual (rounded to x.dtype, as the model's residual add); then
RMSNorm exactly as `model/layers.py:RMSNorm` (float32 math, the same casts),
then `minimax::quantize_fp8` of the norm output in x.dtype. The CPU
implementation is literally that sequence of torch calls, so it is equal bit
for bit to the model's unfused path (a test checks it). On CUDA a Triton kernel
runs it (kernels/norm_quant_triton.py, which registers itself as the op's CUDA
kernel; this module never imports it; one program per row, float32
reductions); where Triton is missing or the dtype is one it does not handle,
the CUDA path falls back to the reference.

"want_bf16_output" keeps its name from the source engines; the output is in
x.dtype (bfloat16 in the served model). Empty outputs are 1-D tensors of size 0
(a functional op cannot return None in place of a tensor).
"""

from __future__ import annotations

from typing import Optional

import torch

from .fp8 import FP8_DTYPE, quantize_fp8_reference

__all__ = [
    "rms_norm_quant_fp8",
    "rms_norm_quant_fp8_reference",
    "rms_norm_reference",
    "SUPPORTED_GROUP_SIZES",
]

SUPPORTED_GROUP_SIZES = (32, 128)


def _check(x: torch.Tensor, residual: Optional[torch.Tensor], weight: torch.Tensor, group_size: int) -> None:
    if x.dim() == 0:
        raise ValueError("rms_norm_quant_fp8: x must have at least one dim (K is the last)")
    if not x.dtype.is_floating_point or x.dtype == FP8_DTYPE:
        raise ValueError(f"rms_norm_quant_fp8: x must be bfloat16, float16 or float32, got {x.dtype}")
    k = x.shape[-1]
    if group_size not in SUPPORTED_GROUP_SIZES:
        raise ValueError(f"rms_norm_quant_fp8: group_size must be one of {SUPPORTED_GROUP_SIZES}, got {group_size}")
    if k % group_size != 0:
        raise ValueError(
            f"rms_norm_quant_fp8: K={k} is not divisible by group_size={group_size}"
        )
    if weight.dim() != 1 or weight.shape[0] != k:
        raise ValueError(f"rms_norm_quant_fp8: weight must be [K={k}], got {tuple(weight.shape)}")
    if residual is not None and (residual.shape != x.shape or residual.dtype != x.dtype):
        raise ValueError(
            f"rms_norm_quant_fp8: residual {tuple(residual.shape)} {residual.dtype} must match "
            f"x {tuple(x.shape)} {x.dtype}"
        )


def rms_norm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float, gemma: bool) -> torch.Tensor:
    """RMSNorm as model/layers.py:RMSNorm computes it (same float32 math, same casts)."""
    x32 = x.float()
    normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    if gemma:
        return (normed * (1.0 + weight.float())).to(x.dtype)
    return (normed.to(x.dtype) * weight).to(x.dtype)


def rms_norm_quant_fp8_reference(x: torch.Tensor, residual: Optional[torch.Tensor], weight: torch.Tensor, eps: float,
                                 gemma: bool, group_size: int = 128, want_bf16_output: bool = False):
    """The unfused sequence in plain torch: the numerical reference (any device)."""
    _check(x, residual, weight, group_size)
    h = x
    new_residual = x.new_empty(0)
    if residual is not None:
        h = x + residual
        new_residual = h
    y = rms_norm_reference(h, weight, eps, gemma)
    q, s = quantize_fp8_reference(y, group_size)
    return q, s, (y if want_bf16_output else x.new_empty(0)), new_residual


@torch.library.custom_op("minimax::rms_norm_quant_fp8", mutates_args=())
def rms_norm_quant_fp8(x: torch.Tensor, residual: Optional[torch.Tensor], weight: torch.Tensor, eps: float, gemma: bool,
                       group_size: int = 128, want_bf16_output: bool = False,
                       ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    # CPU (and any device without a kernel of its own): the reference. Every
    # output is a fresh tensor (a custom op may not return its inputs' storage).
    return rms_norm_quant_fp8_reference(x, residual, weight, eps, gemma, group_size, want_bf16_output)


@rms_norm_quant_fp8.register_fake
def _rms_norm_quant_fp8_fake(x, residual, weight, eps, gemma, group_size=128, want_bf16_output=False):
    _check(x, residual, weight, group_size)
    q = torch.empty(x.shape, dtype=FP8_DTYPE, device=x.device)
    s = x.new_empty((*x.shape[:-1], x.shape[-1] // group_size), dtype=torch.float32)
    y = x.new_empty(x.shape) if want_bf16_output else x.new_empty(0)
    r = x.new_empty(x.shape) if residual is not None else x.new_empty(0)
    return q, s, y, r
