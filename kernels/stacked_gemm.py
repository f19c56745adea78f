"""One GEMM for several linears that read the same input: `minimax::stacked_gemm`.

    y = torch.ops.minimax.stacked_gemm(x, x_scale, weights, weight_scales, out_dtype)
        x              [M, K] (BF16), or FP8 E4M3 data with x_scale [M, K / G] (1 x G groups)
        weights        [N_i, K] each; FP8 weights come with their 128 x 128 block scales
        y              [M, sum N_i] in out_dtype = cat_i(x @ weights[i].T)

The model places such weights as consecutive rows of one buffer
(model/linear.py: place_adjacent), and then this is one GEMM over a view
that spans them: one launch and one read of x instead of one per linear.
When the weights are not consecutive (the caller re-allocated one), it runs
one GEMM each and concatenates, and says so once in the log. The GEMM is
F.linear or minimax::fp8_block_gemm, so every device and backend those
have, this has.
"""

from __future__ import annotations

import logging
from typing import Optional, Sequence

import torch
import torch.nn.functional as F

from .fp8 import WEIGHT_BLOCK

__all__ = ["stacked_gemm", "stacked_view", "rows_are_stacked"]

log = logging.getLogger("minimax")
_WARNED: set[tuple] = set()


def rows_are_stacked(tensors: Sequence[torch.Tensor]) -> bool:
    """Whether 2-D row-major tensors are consecutive row ranges of one storage."""
    first = tensors[0]
    if first.dim() != 2 or first.stride(1) != 1:
        return False
    width = first.shape[1]
    try:
        storage = first.untyped_storage()
        same = [t.untyped_storage()._cdata == storage._cdata for t in tensors]
    except (RuntimeError, AttributeError):
        return False
    offset = first.storage_offset()
    for t, ok in zip(tensors, same):
        if not ok or t.dim() != 2 or t.shape[1] != width or t.stride() != (width, 1) or t.dtype != first.dtype:
            return False
        if t.storage_offset() != offset:
            return False
        offset += t.shape[0] * width
    return True


def stacked_view(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """The [sum rows, K] view spanning tensors that rows_are_stacked."""
    first = tensors[0]
    rows = sum(t.shape[0] for t in tensors)
    return first.as_strided((rows, first.shape[1]), (first.shape[1], 1), first.storage_offset())


def _check(x, x_scale, weights, weight_scales) -> None:
    if not weights:
        raise ValueError("stacked_gemm: no weights")
    k = x.shape[-1]
    if any(w.dim() != 2 or w.shape[1] != k for w in weights):
        raise ValueError(f"stacked_gemm: every weight must be [N, {k}], got {[tuple(w.shape) for w in weights]}")
    if (x_scale is None) != (len(weight_scales) == 0) or (x_scale is not None and len(weight_scales) != len(weights)):
        raise ValueError("stacked_gemm: FP8 needs x_scale and one scale tensor per weight; BF16 neither")


def _scales_stack(weights, weight_scales) -> bool:
    """FP8: the block scales stack with the weights only if every weight but the last
    ends on a 128-row block boundary (else one block row would mix two weights)."""
    return all(w.shape[0] % WEIGHT_BLOCK == 0 for w in weights[:-1]) and rows_are_stacked(weight_scales)


def _gemm(x, x_scale, w, ws, out_dtype):
    if x_scale is None:
        return F.linear(x, w).to(out_dtype)
    return torch.ops.minimax.fp8_block_gemm(x, x_scale, w, ws, out_dtype)


@torch.library.custom_op("minimax::stacked_gemm", mutates_args=())
def stacked_gemm(x: torch.Tensor, x_scale: Optional[torch.Tensor], weights: Sequence[torch.Tensor],
                 weight_scales: Sequence[torch.Tensor], out_dtype: torch.dtype) -> torch.Tensor:
    _check(x, x_scale, weights, weight_scales)
    fp8 = x_scale is not None
    if rows_are_stacked(weights) and (not fp8 or _scales_stack(weights, weight_scales)):
        w = stacked_view(weights)
        ws = stacked_view(weight_scales) if fp8 else None
        return _gemm(x, x_scale, w, ws, out_dtype)
    key = tuple(tuple(w.shape) for w in weights)
    if key not in _WARNED:
        _WARNED.add(key)
        log.warning("minimax: stacked_gemm: weights %s are not consecutive rows of one buffer: "
                    "one GEMM each instead of one", [list(k) for k in key])
    scales = weight_scales if fp8 else [None] * len(weights)
    return torch.cat([_gemm(x, x_scale, w, ws, out_dtype) for w, ws in zip(weights, scales)], dim=-1)


@stacked_gemm.register_fake
def _stacked_gemm_fake(x, x_scale, weights, weight_scales, out_dtype):
    _check(x, x_scale, weights, weight_scales)
    return x.new_empty((*x.shape[:-1], sum(w.shape[0] for w in weights)), dtype=out_dtype)
