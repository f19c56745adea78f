"""Load plans: where each local tensor of the model comes from in an HF checkpoint.

Every parameter and persistent buffer of the model carries a ``load_plan``
attribute. A plan is a list of pieces; each piece names one checkpoint tensor
(by its full Hugging Face name) and the slice of it this rank holds. The local
tensor is the concatenation of the pieces along ``cat_dim``.

Examples (TP 2, rank 1)::

    # o_proj is row-parallel: this rank holds columns [H/2, H) of the weight
    cols("model.layers.0.self_attn.o_proj.weight", H // 2, H // 2)

    # fused QKV, column-parallel: three row slices, concatenated along dim 0
    LoadPlan((rows(q, 512, 512), rows(k, 128, 128), rows(v, 128, 128)))

The loader (model/checkpoint_loader.py) reads exactly these slices with safetensors'
``get_slice`` and never materializes a whole tensor a rank does not need; the
random-checkpoint writer builds the model at TP 1 and writes each piece back
under its name (splitting fused tensors).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = [
    "Shard",
    "LoadPlan",
    "attach_plan",
    "get_plan",
    "whole",
    "rows",
    "cols",
    "plan",
    "block_range",
]


@dataclass(frozen=True)
class Shard:
    """One checkpoint tensor, or a contiguous slice of it along one dim.

    ``dim=None`` means the whole tensor (``start``/``length`` are ignored and
    should be 0). Otherwise the slice is ``[start, start + length)`` along
    ``dim`` of the checkpoint tensor.
    """

    name: str
    dim: int | None = None
    start: int = 0
    length: int = 0

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise ValueError(f"Shard.name must be a non-empty string, got {self.name!r}")
        if self.dim is not None:
            if self.dim < 0:
                raise ValueError(f"Shard {self.name}: dim must be >= 0, got {self.dim}")
            if self.start < 0 or self.length <= 0:
                raise ValueError(
                    f"Shard {self.name}: need start >= 0 and length > 0, got "
                    f"start={self.start} length={self.length}"
                )

    @property
    def is_whole(self) -> bool:
        return self.dim is None

    def index(self, ndim: int) -> tuple[slice, ...]:
        """The indexing tuple that selects this piece from a tensor of ``ndim`` dims."""
        idx = [slice(None)] * ndim
        if self.dim is not None:
            if self.dim >= ndim:
                raise ValueError(f"Shard {self.name}: dim {self.dim} but tensor has {ndim} dims")
            idx[self.dim] = slice(self.start, self.start + self.length)
        return tuple(idx)

    def piece_shape(self, full_shape: tuple[int, ...]) -> tuple[int, ...]:
        """Shape of this piece given the full checkpoint tensor's shape."""
        shape = list(full_shape)
        if self.dim is not None:
            shape[self.dim] = self.length
        return tuple(shape)

    def fits(self, full_shape: tuple[int, ...]) -> bool:
        """Whether the slice lies inside a checkpoint tensor of ``full_shape``."""
        if self.dim is None:
            return True
        return self.dim < len(full_shape) and self.start + self.length <= full_shape[self.dim]

    def __str__(self) -> str:
        if self.dim is None:
            return self.name
        return f"{self.name}[dim {self.dim}: {self.start}:{self.start + self.length}]"


@dataclass(frozen=True)
class LoadPlan:
    """The local tensor = cat(pieces, dim=cat_dim)."""

    pieces: tuple[Shard, ...]
    cat_dim: int = 0

    def __post_init__(self) -> None:
        if isinstance(self.pieces, Shard):
            object.__setattr__(self, "pieces", (self.pieces,))
        else:
            object.__setattr__(self, "pieces", tuple(self.pieces))
        if not self.pieces:
            raise ValueError("LoadPlan needs at least one piece")
        for p in self.pieces:
            if not isinstance(p, Shard):
                raise TypeError(f"LoadPlan pieces must be Shard, got {type(p).__name__}")

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(p.name for p in self.pieces)

    def __str__(self) -> str:
        body = " + ".join(str(p) for p in self.pieces)
        return body if len(self.pieces) == 1 else f"cat[dim {self.cat_dim}]({body})"


def whole(name: str) -> LoadPlan:
    """The whole checkpoint tensor ``name`` (replicated parameters, norms, biases)."""
    return LoadPlan((Shard(name),))


def rows(name: str, start: int, length: int) -> Shard:
    """Rows ``[start, start+length)`` (dim 0) of ``name``: a column-parallel weight's shard."""
    return Shard(name, 0, start, length)


def cols(name: str, start: int, length: int) -> Shard:
    """Columns ``[start, start+length)`` (dim 1) of ``name``: a row-parallel weight's shard."""
    return Shard(name, 1, start, length)


def plan(*pieces: Shard | str, cat_dim: int = 0) -> LoadPlan:
    """Build a plan from pieces; a bare string means the whole tensor of that name."""
    return LoadPlan(tuple(Shard(p) if isinstance(p, str) else p for p in pieces), cat_dim)


def block_range(start: int, length: int, block: int) -> tuple[int, int]:
    """Map an element range to the range of ``block``-sized scale blocks covering it.

    For FP8 ``weight_scale_inv`` tensors (one scale per 128 x 128 block): a
    weight slice ``[start, start+length)`` maps to scale rows
    ``[start // block, ceil((start+length) / block))``. The caller is responsible
    for slices being block aligned (config.validate_for_parallel checks it).
    """
    b0 = start // block
    b1 = -(-(start + length) // block)
    return b0, b1 - b0


def attach_plan(tensor: torch.Tensor, load_plan: LoadPlan | Shard | str) -> torch.Tensor:
    """Set ``tensor.load_plan`` (accepts a LoadPlan, a single Shard, or a name) and return the tensor."""
    if isinstance(load_plan, str):
        load_plan = whole(load_plan)
    elif isinstance(load_plan, Shard):
        load_plan = LoadPlan((load_plan,))
    elif not isinstance(load_plan, LoadPlan):
        raise TypeError(f"attach_plan wants a LoadPlan, Shard or str, got {type(load_plan).__name__}")
    tensor.load_plan = load_plan
    return tensor


def get_plan(tensor: torch.Tensor) -> LoadPlan | None:
    """The tensor's plan, or None."""
    return getattr(tensor, "load_plan", None)
