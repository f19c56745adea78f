"""GEMM + reduce-scatter as one op: ``minimax::gemm_rs``.

    torch.ops.minimax.gemm_rs(x, weight, x_scale, weight_scale, bias,
                              pad_rows, min_tokens, group_size, group_name,
                              out_dtype=None) -> Tensor[(M + pad_rows) / group_size, N]

computes, on every rank of the group,

    y   = x @ weight.T (+ bias)               this rank's partial sum, [M, N]
    y   = pad y with pad_rows zero rows       [M + pad_rows, N]
    out = reduce_scatter(y, "sum")            rank r keeps rows r*M'/g ... (r+1)*M'/g

which is what the graph held before the GEMM-RS pass: a row-parallel matmul,
the sequence-parallel pass's row padding (``aten.constant_pad_nd`` up to a
multiple of the TP size) and ``_c10d_functional.reduce_scatter_tensor`` +
``wait_tensor``.

Two GEMMs, one op:

* BF16 (or any float dtype): ``x [M, K]`` and ``weight [N, K]`` in the model
  dtype (the ``F.linear`` layout: the graph's ``aten.mm(x, permute(w))``),
  ``x_scale = weight_scale = None``; ``bias`` from an ``aten.addmm``.
* FP8 block-scaled: ``x`` is the E4M3 activation ``[M, K]`` with float32
  ``x_scale [M, K/G]``, ``weight`` E4M3 ``[N, K]`` with ``weight_scale
  [ceil(N/128), ceil(K/128)]`` (``minimax::fp8_block_gemm``'s inputs);
  ``out_dtype`` is required. Where the activation was quantized does not
  matter: right before, or upstream (a fused norm+quant, a gathered FP8
  tensor).

``min_tokens`` picks the path at run time: ``M >= min_tokens`` on CUDA takes
the overlapped kernel (``kernels/gemm_rs_cuda.py``, symmetric memory and
copy-engine pushes; that module registers the op's CUDA kernel, this one
never imports it); below it, on CPU, or where symmetric memory is not
available, matmul + reduce-scatter. Both are correct for any M, and both can
be captured in a CUDA graph, where M is fixed per graph.

The CPU path is the numerical reference: the same ATen ops as the unfused
graph, in the same order, so on gloo it equals the graph's original
reduce-scatter output exactly (any dtype).
"""

from __future__ import annotations

from typing import Optional

import torch

from . import fp8 as _fp8  # noqa: F401  (minimax::fp8_block_gemm, used by the FP8 path)

__all__ = ["gemm_rs", "gemm_rs_reference", "local_gemm", "output_rows", "check_args"]


def output_rows(m, pad_rows: int, group_size: int):
    """Rows of the op's output on each rank."""
    return (m + pad_rows) // group_size


def check_args(x, weight, x_scale, weight_scale, bias, pad_rows, group_size, out_dtype) -> None:
    """The errors the op raises for arguments that do not make a GEMM + reduce-scatter."""
    if x.dim() != 2 or weight.dim() != 2:
        raise ValueError(
            f"minimax::gemm_rs: x and weight must be 2-D ([M, K] and [N, K]), got {tuple(x.shape)} and {tuple(weight.shape)}"
        )
    if x.shape[1] != weight.shape[1]:
        raise ValueError(f"minimax::gemm_rs: x K={x.shape[1]} does not match weight K={weight.shape[1]} (weight is [N, K])")
    if group_size < 1:
        raise ValueError(f"minimax::gemm_rs: group_size must be >= 1, got {group_size}")
    if pad_rows < 0:
        raise ValueError(f"minimax::gemm_rs: pad_rows must be >= 0, got {pad_rows}")
    torch._check(
        (x.shape[0] + pad_rows) % group_size == 0,
        lambda: f"minimax::gemm_rs: {x.shape[0]} rows + {pad_rows} padding do not split over {group_size} ranks",
    )
    if (x_scale is None) != (weight_scale is None):
        raise ValueError("minimax::gemm_rs: x_scale and weight_scale come together (FP8) or not at all (BF16)")
    if x_scale is not None and out_dtype is None:
        raise ValueError("minimax::gemm_rs: the FP8 GEMM needs out_dtype")
    if x_scale is None and out_dtype is not None and out_dtype != x.dtype:
        raise ValueError(f"minimax::gemm_rs: a {x.dtype} matmul gives {x.dtype}, not out_dtype={out_dtype}")
    if bias is not None and bias.numel() != weight.shape[0]:
        raise ValueError(f"minimax::gemm_rs: bias must have N={weight.shape[0]} elements, got shape {tuple(bias.shape)}")


def local_gemm(
    x: torch.Tensor,
    weight: torch.Tensor,
    x_scale: Optional[torch.Tensor] = None,
    weight_scale: Optional[torch.Tensor] = None,
    bias: Optional[torch.Tensor] = None,
    out_dtype: Optional[torch.dtype] = None,
) -> torch.Tensor:
    """This rank's partial sum ``x @ weight.T (+ bias)``: the GEMM both paths share.

    BF16 uses ``aten.mm`` / ``aten.addmm`` exactly as the graph did. FP8 uses
    ``minimax::fp8_block_gemm`` (the reference on CPU; on CUDA its kernel,
    kernels/fp8_gemm_cuda.py: cuBLAS block-scaled ``_scaled_mm`` where it
    applies, else Triton).
    """
    if x_scale is None:
        return torch.mm(x, weight.t()) if bias is None else torch.addmm(bias.reshape(-1), x, weight.t())
    y = torch.ops.minimax.fp8_block_gemm(x, x_scale, weight, weight_scale, out_dtype)
    return y if bias is None else y + bias.reshape(-1).to(y.dtype)


def gemm_rs_reference(x, weight, x_scale, weight_scale, bias, pad_rows: int, group_size: int, group_name: str,
                      out_dtype: Optional[torch.dtype] = None) -> torch.Tensor:
    """matmul + pad + functional reduce-scatter: the unfused path and the CPU reference."""
    y = local_gemm(x, weight, x_scale, weight_scale, bias, out_dtype)
    if pad_rows:
        y = torch.constant_pad_nd(y, [0, 0, 0, pad_rows], 0.0)
    if group_size == 1:
        return y
    c10d = torch.ops._c10d_functional
    return c10d.wait_tensor(c10d.reduce_scatter_tensor(y, "sum", group_size, group_name))


@torch.library.custom_op("minimax::gemm_rs", mutates_args=())
def gemm_rs(
    x: torch.Tensor,
    weight: torch.Tensor,
    x_scale: Optional[torch.Tensor],
    weight_scale: Optional[torch.Tensor],
    bias: Optional[torch.Tensor],
    pad_rows: int,
    min_tokens: int,
    group_size: int,
    group_name: str,
    out_dtype: Optional[torch.dtype] = None,
) -> torch.Tensor:
    # CPU (and any device without a kernel of its own): matmul + reduce-scatter
    check_args(x, weight, x_scale, weight_scale, bias, pad_rows, group_size, out_dtype)
    return gemm_rs_reference(x, weight, x_scale, weight_scale, bias, pad_rows, group_size, group_name, out_dtype)


@gemm_rs.register_fake
def _gemm_rs_fake(x, weight, x_scale, weight_scale, bias, pad_rows, min_tokens, group_size, group_name, out_dtype=None):
    check_args(x, weight, x_scale, weight_scale, bias, pad_rows, group_size, out_dtype)
    rows = output_rows(x.shape[0], pad_rows, group_size)
    return x.new_empty((rows, weight.shape[0]), dtype=out_dtype or x.dtype)
