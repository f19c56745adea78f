"""FP8 (E4M3) block-scaled quantization and GEMM: the `minimax::` reference ops.

Two ops, both functional `torch.library.custom_op`s with fake (meta) kernels so
that torch.compile captures them as single graph nodes:

    torch.ops.minimax.quantize_fp8(x, group_size) -> (q, scales)
        x [..., K] -> q float8_e4m3fn [..., K], scales float32 [..., K // G].
        One power-of-two scale per group of G consecutive values along K
        (G = 128 for the Hopper kernels, 32 for MXFP8). Power-of-two scales make
        the 1 x 128 format exactly convertible to MXFP8 (E8M0 scales).

    torch.ops.minimax.fp8_block_gemm(xq, xs, w, ws, out_dtype) -> y [..., N]
        y = dequant(xq, xs) @ dequant(w, ws).T, with w float8_e4m3fn [N, K] and
        ws float32 [ceil(N/128), ceil(K/128)] (one scale per 128 x 128 block,
        DeepSeek / HF `weight_scale_inv` layout: w_real = w_fp8 * ws).

The implementations here are plain torch in float32: the numerical reference
that the GPU kernels are tested against, registered for every device type.
The CUDA kernels are registered by the GPU modules, which import this one
(never the other way round): fp8_block_gemm's by kernels/fp8_gemm_cuda.py
(cuBLAS blockwise or Triton), quantize_fp8's by kernels/norm_quant_triton.py
(the norm + quant kernel without the norm). Importing minimax_backend.kernels
imports both.
"""

from __future__ import annotations

import math

import torch

__all__ = [
    "FP8_DTYPE",
    "FP8_MAX",
    "WEIGHT_BLOCK",
    "quantize_fp8",
    "fp8_block_gemm",
    "quantize_fp8_reference",
    "quantize_weight_fp8",
    "dequantize_weight_fp8",
]

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0  # largest finite E4M3 value
WEIGHT_BLOCK = 128  # weights: one scale per 128 x 128 block
# amax floor: an all-zero group still gets a finite scale (2**-126) and q = 0.
_AMAX_FLOOR = 1e-30


def _check_group(x: torch.Tensor, group_size: int) -> None:
    if group_size <= 0:
        raise ValueError(f"quantize_fp8: group_size must be positive, got {group_size}")
    if x.dim() == 0:
        raise ValueError("quantize_fp8: input must have at least one dim (K is the last)")
    k = x.shape[-1]
    if k % group_size != 0:
        raise ValueError(
            f"quantize_fp8: last dim K={k} is not divisible by group_size={group_size}; "
            f"pad K to a multiple of {group_size} or use another group size"
        )


def quantize_fp8_reference(x: torch.Tensor, group_size: int = 128) -> tuple[torch.Tensor, torch.Tensor]:
    """Plain-torch per-group FP8 quantization (what the op runs; callable directly)."""
    _check_group(x, group_size)
    k = x.shape[-1]
    groups = x.float().reshape(*x.shape[:-1], k // group_size, group_size)
    amax = groups.abs().amax(dim=-1).clamp(min=_AMAX_FLOOR)
    # Round the scale UP to a power of two so that amax / scale <= 448 always.
    scales = torch.exp2(torch.ceil(torch.log2(amax / FP8_MAX)))
    q = (groups / scales.unsqueeze(-1)).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return q.reshape(x.shape), scales


@torch.library.custom_op("minimax::quantize_fp8", mutates_args=())
def quantize_fp8(x: torch.Tensor, group_size: int = 128) -> tuple[torch.Tensor, torch.Tensor]:
    return quantize_fp8_reference(x, group_size)


@quantize_fp8.register_fake
def _quantize_fp8_fake(x: torch.Tensor, group_size: int = 128) -> tuple[torch.Tensor, torch.Tensor]:
    _check_group(x, group_size)
    q = torch.empty(x.shape, dtype=FP8_DTYPE, device=x.device)
    scales = x.new_empty((*x.shape[:-1], x.shape[-1] // group_size), dtype=torch.float32)
    return q, scales


def _check_gemm(xq: torch.Tensor, xs: torch.Tensor, w: torch.Tensor, ws: torch.Tensor) -> None:
    if w.dim() != 2:
        raise ValueError(f"fp8_block_gemm: weight must be 2-D [N, K], got shape {tuple(w.shape)}")
    n, k = w.shape
    if xq.shape[-1] != k:
        raise ValueError(f"fp8_block_gemm: input K={xq.shape[-1]} does not match weight K={k}")
    if xs.shape[:-1] != xq.shape[:-1] or xs.shape[-1] == 0 or k % xs.shape[-1] != 0:
        raise ValueError(
            f"fp8_block_gemm: activation scales {tuple(xs.shape)} do not tile input {tuple(xq.shape)}"
        )
    want = (math.ceil(n / WEIGHT_BLOCK), math.ceil(k / WEIGHT_BLOCK))
    if tuple(ws.shape) != want:
        raise ValueError(
            f"fp8_block_gemm: weight scales have shape {tuple(ws.shape)}, expected {want} "
            f"for a [{n}, {k}] weight in {WEIGHT_BLOCK} x {WEIGHT_BLOCK} blocks"
        )


def dequantize_weight_fp8(w: torch.Tensor, ws: torch.Tensor, block: int = WEIGHT_BLOCK) -> torch.Tensor:
    """float32 weight from FP8 data [N, K] and block scales [ceil(N/b), ceil(K/b)]."""
    n, k = w.shape
    full = ws.float().repeat_interleave(block, 0)[:n].repeat_interleave(block, 1)[:, :k]
    return w.float() * full


@torch.library.custom_op("minimax::fp8_block_gemm", mutates_args=())
def fp8_block_gemm(
    xq: torch.Tensor, xs: torch.Tensor, w: torch.Tensor, ws: torch.Tensor, out_dtype: torch.dtype
) -> torch.Tensor:
    _check_gemm(xq, xs, w, ws)
    group = xq.shape[-1] // xs.shape[-1]
    x = xq.float() * xs.float().repeat_interleave(group, dim=-1)
    return (x @ dequantize_weight_fp8(w, ws).T).to(out_dtype)


@fp8_block_gemm.register_fake
def _fp8_block_gemm_fake(
    xq: torch.Tensor, xs: torch.Tensor, w: torch.Tensor, ws: torch.Tensor, out_dtype: torch.dtype
) -> torch.Tensor:
    _check_gemm(xq, xs, w, ws)
    return xq.new_empty((*xq.shape[:-1], w.shape[0]), dtype=out_dtype)


def quantize_weight_fp8(w: torch.Tensor, block: int = WEIGHT_BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize a [N, K] weight to FP8 with one float32 scale per block x block tile.

    Returns (w_fp8 [N, K], weight_scale_inv [ceil(N/b), ceil(K/b)]) in the
    checkpoint convention w ~= w_fp8 * scale_inv. Ragged edge tiles are allowed.
    Used to quantize a BF16 checkpoint at load time and to build test weights.
    """
    if w.dim() != 2:
        raise ValueError(f"quantize_weight_fp8: weight must be 2-D, got shape {tuple(w.shape)}")
    n, k = w.shape
    nb, kb = math.ceil(n / block), math.ceil(k / block)
    padded = w.float().new_zeros(nb * block, kb * block)
    padded[:n, :k] = w.float()
    tiles = padded.view(nb, block, kb, block)
    amax = tiles.abs().amax(dim=(1, 3)).clamp(min=_AMAX_FLOOR)
    scale = amax / FP8_MAX
    q = (tiles / scale[:, None, :, None]).clamp(-FP8_MAX, FP8_MAX)
    q = q.view(nb * block, kb * block)[:n, :k].to(FP8_DTYPE)
    return q.contiguous(), scale.float()
