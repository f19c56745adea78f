"""All-reduce + residual add + RMSNorm + FP8 quantization as one op: `minimax::allreduce_rms_norm_quant`.

    q, scales, normed, new_residual = torch.ops.minimax.allreduce_rms_norm_quant(
        x, residual, weight, eps, gemma, group_size, want_normed, tp_size, group_name)

    x          [T, K] this rank's partial sum (the o_proj / down_proj output before its all-reduce)
    residual   [T, K] the residual stream, or None (the first layer's input norm)
    group_size FP8 group along K (128 on Hopper); 0: no quantization (a BF16 consumer,
               e.g. the MoE, which quantizes inside its own op): q and scales are empty

    h = sum over the TP group of x (+ residual); normed = RMSNorm(h) (Gemma or plain,
    as model/layers.py); q, scales = the 1 x group_size FP8 quantization of normed;
    new_residual = h when a residual is given; normed is returned when want_normed
    (else an empty tensor), as minimax::rms_norm_quant_fp8 does.

Below the sequence-parallel token floor every block ends in an all-reduce that
the next RMSNorm and its quantization read; serving engines fuse the four into
one kernel (one-shot / two-shot all-reduce over symmetric memory with the add,
the norm and the quantization in its epilogue). The implementation here is the
unfused sequence (the functional all-reduce, then minimax::rms_norm_quant_fp8):
the numerical reference, and the default on every device. The one-kernel CUDA
path (kernels/allreduce_norm_cuda.py) is behind the kernel option
allreduce_norm=symm_mem until it has run on several GPUs
(docs/measurements/2026-12-01.md says what is left).
"""

from __future__ import annotations

from typing import Optional

import torch

__all__ = ["allreduce_rms_norm_quant", "allreduce_rms_norm_quant_reference"]


def allreduce_rms_norm_quant_reference(x, residual, weight, eps: float, gemma: bool, group_size: int,
                                       want_normed: bool, tp_size: int, group_name: str):
    if x.dim() != 2:
        raise ValueError(f"allreduce_rms_norm_quant: x must be [tokens, K], got {tuple(x.shape)}")
    if tp_size > 1:
        c10d = torch.ops._c10d_functional
        x = c10d.wait_tensor(c10d.all_reduce(x, "sum", group_name))
    if group_size:
        return torch.ops.minimax.rms_norm_quant_fp8(x, residual, weight, eps, gemma, group_size, want_normed)
    from .norm_quant import rms_norm_reference

    h = x if residual is None else x + residual
    return (x.new_empty(0), x.new_empty(0, dtype=torch.float32), rms_norm_reference(h, weight, eps, gemma),
            h if residual is not None else x.new_empty(0))


@torch.library.custom_op("minimax::allreduce_rms_norm_quant", mutates_args=())
def allreduce_rms_norm_quant(x: torch.Tensor, residual: Optional[torch.Tensor], weight: torch.Tensor, eps: float,
                             gemma: bool, group_size: int, want_normed: bool, tp_size: int, group_name: str,
                             ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    # rms_norm_quant_fp8 returns fresh tensors (a custom op may not return its inputs' storage)
    return allreduce_rms_norm_quant_reference(x, residual, weight, eps, gemma, group_size, want_normed, tp_size,
                                              group_name)


@allreduce_rms_norm_quant.register_fake
def _fake(x, residual, weight, eps, gemma, group_size, want_normed, tp_size, group_name):
    if group_size:
        return torch.ops.minimax.rms_norm_quant_fp8(x, residual, weight, eps, gemma, group_size, want_normed)
    return (x.new_empty(0), x.new_empty(0, dtype=torch.float32), torch.empty_like(x),
            torch.empty_like(x) if residual is not None else x.new_empty(0))
