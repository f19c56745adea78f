"""Tensor-parallel linear layers, in BF16 or block-scaled FP8.

    ColumnParallelLinear   output dim split over ranks; may fuse several
                           checkpoint tensors (q/k/v, gate/up) into one GEMM
    RowParallelLinear      input dim split over ranks; returns PARTIAL sums:
                           the caller all-reduces, so the collective shows in
                           the model (and the graph) right after o_proj / down
    ReplicatedLinear       every rank holds the whole weight

A linear holds either `weight` [N, K] in the model dtype, or FP8 E4M3 `weight`
[N, K] plus float32 `weight_scale_inv` [ceil(N/128), ceil(K/128)] (one scale
per 128 x 128 block, the DeepSeek / HF checkpoint layout). The FP8 forward
quantizes the activation per 1 x G group (G = 128, or 32 for MXFP8) with
`minimax::quantize_fp8` and multiplies with `minimax::fp8_block_gemm`; the
norm + quant fusion pass looks for exactly that pair.

Every parameter carries a `load_plan` (model/weights.py): which slices of
which checkpoint tensors it is made of. An FP8 shard must start and end on
128-row / 128-column block boundaries, or its scales could not be sliced; the
error names the layer.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from .. import kernels  # noqa: F401  (registers the minimax:: ops)
from ..kernels.fp8 import FP8_DTYPE, WEIGHT_BLOCK, quantize_weight_fp8
from .weights import LoadPlan, Shard, attach_plan, cols, get_plan, rows

__all__ = [
    "Piece",
    "ShardingError",
    "ParallelLinear",
    "ColumnParallelLinear",
    "RowParallelLinear",
    "ReplicatedLinear",
    "place_adjacent",
    "quantize_weight_fp8",
]


class ShardingError(ValueError):
    """A weight cannot be split the way the parallel layout asks (names the layer)."""


@dataclass(frozen=True)
class Piece:
    """Rows [start, start + length) of checkpoint tensor `<prefix>.weight` (full size `full`)."""

    prefix: str
    full: int
    start: int = 0
    length: int | None = None  # None: to the end

    @property
    def size(self) -> int:
        return self.full - self.start if self.length is None else self.length

    @property
    def is_whole(self) -> bool:
        return self.start == 0 and self.size == self.full


def _slice(name: str, dim: int, start: int, length: int, full: int) -> Shard:
    if start == 0 and length == full:
        return Shard(name)
    return rows(name, start, length) if dim == 0 else cols(name, start, length)


class ParallelLinear(nn.Module):
    """y = x @ W.T with W the local [out_features, in_features] shard (no bias in MiniMax).

    `out_pieces` lists the checkpoint row ranges stacked into W (one piece, or
    several for a fused projection); `in_range` = (start, length, full) is the
    column range of each of them that this rank holds (whole K unless row-parallel).
    """

    def __init__(
        self,
        out_pieces: list[Piece],
        in_features: int,
        *,
        in_range: tuple[int, int, int] | None = None,
        dtype: torch.dtype = torch.bfloat16,
        device: torch.device | str = "cpu",
        fp8: bool = False,
        act_group_size: int = 128,
        name: str | None = None,
    ):
        super().__init__()
        self.pieces = tuple(out_pieces)
        self.name = name or (self.pieces[0].prefix if len(self.pieces) == 1 else "+".join(p.prefix for p in self.pieces))
        in_start, in_len, in_full = in_range if in_range is not None else (0, in_features, in_features)
        if in_len != in_features:
            raise ShardingError(f"{self.name}: in_range length {in_len} != in_features {in_features}")
        self.in_features = in_features
        self.in_full = in_full  # the checkpoint tensors' whole K (a row-parallel shard holds a slice)
        self.out_features = sum(p.size for p in self.pieces)
        self.fp8 = fp8
        self.act_group_size = act_group_size

        def plan_for(suffix: str, block: int = 1) -> LoadPlan:
            # Weight (block=1) or its block scales (block=128): slices of every piece,
            # stacked along dim 0; the column range is applied to each piece.
            def blocks(start: int, length: int, full: int) -> tuple[int, int, int]:
                b0 = start // block
                return b0, math.ceil((start + length) / block) - b0, math.ceil(full / block)

            shards = []
            for p in self.pieces:
                name = f"{p.prefix}.{suffix}"
                r0, rn, rfull = blocks(p.start, p.size, p.full)
                c0, cn, cfull = blocks(in_start, in_len, in_full)
                if (r0, rn) != (0, rfull) and (c0, cn) != (0, cfull):
                    raise ShardingError(f"{self.name}: a shard cannot slice both rows and columns")
                if (c0, cn) != (0, cfull):
                    shards.append(_slice(name, 1, c0, cn, cfull))
                else:
                    shards.append(_slice(name, 0, r0, rn, rfull))
            return LoadPlan(tuple(shards), cat_dim=0)

        if fp8:
            self._check_fp8_blocks(in_start, in_len, in_full)
            w = torch.empty(self.out_features, in_features, dtype=FP8_DTYPE, device=device)
            s = torch.ones(
                math.ceil(self.out_features / WEIGHT_BLOCK), math.ceil(in_features / WEIGHT_BLOCK),
                dtype=torch.float32, device=device,
            )
            self.weight = nn.Parameter(w, requires_grad=False)
            self.weight_scale_inv = nn.Parameter(s, requires_grad=False)
            attach_plan(self.weight, plan_for("weight"))
            attach_plan(self.weight_scale_inv, plan_for("weight_scale_inv", WEIGHT_BLOCK))
        else:
            w = torch.empty(self.out_features, in_features, dtype=dtype, device=device)
            self.weight = nn.Parameter(w, requires_grad=False)
            self.weight_scale_inv = None
            attach_plan(self.weight, plan_for("weight"))

    def _check_fp8_blocks(self, in_start: int, in_len: int, in_full: int) -> None:
        b = WEIGHT_BLOCK
        for i, p in enumerate(self.pieces):
            last = i == len(self.pieces) - 1
            if p.start % b or (p.size % b and not (last and p.start + p.size == p.full)):
                raise ShardingError(
                    f"{p.prefix}: FP8 rows [{p.start}, {p.start + p.size}) of {p.full} are not on "
                    f"{b}-row block boundaries, so its weight_scale_inv cannot be sliced for this rank "
                    "(change the TP size, or use a BF16 model)"
                )
        if in_start % b or (in_len % b and in_start + in_len != in_full):
            raise ShardingError(
                f"{self.name}: FP8 columns [{in_start}, {in_start + in_len}) of {in_full} are not on "
                f"{b}-column block boundaries (change the TP size, or use a BF16 model)"
            )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.fp8:
            xq, xs = torch.ops.minimax.quantize_fp8(x, self.act_group_size)
            return torch.ops.minimax.fp8_block_gemm(xq, xs, self.weight, self.weight_scale_inv, x.dtype)
        return F.linear(x, self.weight)

    def forward_rows(self, x: torch.Tensor, start: int, count: int) -> torch.Tensor:
        """x @ W[start:start + count].T: one block of rows of a stacked weight (an expert's).
        In FP8 the block must start on a 128-row boundary (its scales are rows of the scales)."""
        w = self.weight[start:start + count]
        if not self.fp8:
            return F.linear(x, w)
        if start % WEIGHT_BLOCK:
            raise ShardingError(f"{self.name}: FP8 rows from {start} do not start on a {WEIGHT_BLOCK}-row block")
        s = self.weight_scale_inv[start // WEIGHT_BLOCK:math.ceil((start + count) / WEIGHT_BLOCK)]
        xq, xs = torch.ops.minimax.quantize_fp8(x, self.act_group_size)
        return torch.ops.minimax.fp8_block_gemm(xq, xs, w, s, x.dtype)

    @torch.no_grad()
    def set_rows(self, start: int, w: torch.Tensor) -> None:
        """Set local rows [start, start + len(w)) from a float tensor; in FP8 they must be whole
        128-row blocks (or run to the end), so quantizing them alone equals quantizing the whole."""
        end = start + w.shape[0]
        if w.shape[1:] != self.weight.shape[1:] or end > self.weight.shape[0]:
            raise ShardingError(f"{self.name}: rows {start}..{end} of shape {tuple(w.shape)} do not fit "
                                f"the local weight {tuple(self.weight.shape)}")
        if not self.fp8:
            self.weight[start:end].copy_(w)
            return
        if start % WEIGHT_BLOCK or (end % WEIGHT_BLOCK and end != self.weight.shape[0]):
            raise ShardingError(f"{self.name}: FP8 rows {start}..{end} are not whole {WEIGHT_BLOCK}-row blocks")
        q, sc = quantize_weight_fp8(w)
        self.weight[start:end].copy_(q)
        self.weight_scale_inv[start // WEIGHT_BLOCK:start // WEIGHT_BLOCK + sc.shape[0]].copy_(sc)

    @torch.no_grad()
    def set_weight(self, w: torch.Tensor) -> None:
        """Set the local weight from a float tensor [out, in]; an FP8 linear quantizes it
        in 128 x 128 blocks (quantize at load). Block-aligned shards make this equal
        to quantizing the full checkpoint tensor and slicing."""
        if tuple(w.shape) != tuple(self.weight.shape):
            raise ShardingError(f"{self.name}: weight shape {tuple(w.shape)} != local {tuple(self.weight.shape)}")
        if self.fp8:
            q, s = quantize_weight_fp8(w)
            self.weight.copy_(q)
            self.weight_scale_inv.copy_(s)
        else:
            self.weight.copy_(w)

    def extra_repr(self) -> str:
        kind = "fp8 block 128x128" if self.fp8 else str(self.weight.dtype).replace("torch.", "")
        return f"{self.name}: in={self.in_features}, out={self.out_features}, {kind}"


class ColumnParallelLinear(ParallelLinear):
    """Output dim split over ranks: each piece contributes rows [start, start+length) of its tensor."""

    def __init__(self, pieces: list[Piece], in_features: int, **kw):
        super().__init__(pieces, in_features, **kw)


class RowParallelLinear(ParallelLinear):
    """Input dim split over ranks: columns [in_start, in_start + in_features) of `<prefix>.weight`.

    Returns partial sums; the caller all-reduces (see module docstring)."""

    def __init__(self, prefix: str, in_start: int, in_features: int, in_full: int, out_features: int, **kw):
        super().__init__([Piece(prefix, out_features)], in_features, in_range=(in_start, in_features, in_full), **kw)


class ReplicatedLinear(ParallelLinear):
    """The whole `<prefix>.weight` on every rank."""

    def __init__(self, prefix: str, in_features: int, out_features: int, **kw):
        super().__init__([Piece(prefix, out_features)], in_features, **kw)


@torch.no_grad()
def place_adjacent(*linears: ParallelLinear) -> bool:
    """Re-allocate the weights (and FP8 block scales) of linears that read the same
    input as consecutive rows of one buffer, keeping their values and load plans.

    The model computes the same; a compiler may then run them as one GEMM over a
    view spanning the rows (kernels/stacked_gemm.py). FP8 scales stack only when
    every weight but the last ends on a 128-row block: otherwise nothing moves
    and this returns False.
    """
    kinds = {(lin.fp8, lin.weight.dtype, lin.in_features, lin.weight.device) for lin in linears}
    if len(kinds) != 1:
        raise ShardingError(f"place_adjacent: {[lin.name for lin in linears]} differ in dtype, K or device")
    fp8 = linears[0].fp8
    if fp8 and any(lin.out_features % WEIGHT_BLOCK for lin in linears[:-1]):
        return False
    for attr in ("weight", "weight_scale_inv") if fp8 else ("weight",):
        old = [getattr(lin, attr) for lin in linears]
        base = torch.cat([t.data for t in old], dim=0)
        start = 0
        for lin, t in zip(linears, old):
            p = nn.Parameter(base[start:start + t.shape[0]], requires_grad=False)
            attach_plan(p, get_plan(t))
            setattr(lin, attr, p)
            start += t.shape[0]
    return True
