"""Tensor / expert parallel layout and the three collectives the model uses.

One process group (the TP group, all ranks) carries every collective. Expert
parallelism lives inside it: with tp_size ranks and ep_size expert groups,

    moe_tp_size = tp_size // ep_size          ranks that share one expert
    ep_rank     = tp_rank // moe_tp_size      which slice of experts this rank owns
    moe_tp_rank = tp_rank %  moe_tp_size      which slice of each owned expert's
                                              intermediate dim this rank holds

Every rank runs its own experts on ALL of its tokens; the partial sums of
all ranks are added by ONE all-reduce over the TP group at the end of the MoE
block. EP 1 is plain tensor-parallel experts; EP = TP is whole experts per rank.

Collectives are `torch.ops._c10d_functional.*` followed by `wait_tensor`, so
torch.compile captures them as graph nodes. At TP 1 they are the identity and
no collective node appears in the graph at all.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

__all__ = ["ParallelState", "ParallelError", "all_reduce", "all_gather", "reduce_scatter"]


class ParallelError(ValueError):
    """An impossible tensor / expert parallel layout."""


@dataclass(frozen=True)
class ParallelState:
    tp_rank: int = 0
    tp_size: int = 1
    ep_rank: int = 0
    ep_size: int = 1
    group_name: str | None = None

    def __post_init__(self) -> None:
        if self.tp_size < 1:
            raise ParallelError(f"tp_size must be >= 1, got {self.tp_size}")
        if not 0 <= self.tp_rank < self.tp_size:
            raise ParallelError(f"tp_rank must be in [0, {self.tp_size}), got {self.tp_rank}")
        if self.ep_size < 1 or self.tp_size % self.ep_size != 0:
            raise ParallelError(
                f"ep_size={self.ep_size} must be >= 1 and divide tp_size={self.tp_size} "
                "(expert groups are carved out of the TP ranks)"
            )
        want_ep_rank = self.tp_rank // (self.tp_size // self.ep_size)
        if self.ep_rank != want_ep_rank:
            raise ParallelError(
                f"ep_rank={self.ep_rank} does not match tp_rank={self.tp_rank}: with tp_size="
                f"{self.tp_size} and ep_size={self.ep_size} it must be tp_rank // moe_tp_size = {want_ep_rank}"
            )
        if self.tp_size > 1 and not self.group_name:
            raise ParallelError(f"tp_size={self.tp_size} needs a process group name (group_name)")

    @property
    def moe_tp_size(self) -> int:
        return self.tp_size // self.ep_size

    @property
    def moe_tp_rank(self) -> int:
        return self.tp_rank % self.moe_tp_size

    @classmethod
    def single(cls) -> "ParallelState":
        """One device: no parallelism, no collectives."""
        return cls()

    @classmethod
    def create(cls, tp_rank: int, tp_size: int, ep_size: int = 1, group_name: str | None = None) -> "ParallelState":
        """Derive ep_rank from the layout (handy in tests)."""
        if ep_size < 1 or tp_size % ep_size != 0:
            raise ParallelError(f"ep_size={ep_size} must be >= 1 and divide tp_size={tp_size}")
        return cls(tp_rank, tp_size, tp_rank // (tp_size // ep_size), ep_size, group_name)

    @classmethod
    def from_world(cls, ep_size: int = 1) -> "ParallelState":
        """TP over the whole default process group (as launched by torchrun)."""
        if not (dist.is_available() and dist.is_initialized()):
            raise ParallelError(
                "ParallelState.from_world: torch.distributed is not initialized "
                "(call dist.init_process_group first, or use ParallelState.single())"
            )
        world = dist.get_world_size()
        if ep_size < 1 or world % ep_size != 0:
            raise ParallelError(
                f"ep_size={ep_size} must be >= 1 and divide the world size {world} (= tp_size)"
            )
        group_name = dist.group.WORLD.group_name if world > 1 else None
        return cls.create(dist.get_rank(), world, ep_size, group_name)


def _wait(t: torch.Tensor) -> torch.Tensor:
    return torch.ops._c10d_functional.wait_tensor(t)


def all_reduce(x: torch.Tensor, ps: ParallelState) -> torch.Tensor:
    """Sum over the TP group."""
    if ps.tp_size == 1:
        return x
    return _wait(torch.ops._c10d_functional.all_reduce(x, "sum", ps.group_name))


def all_gather(x: torch.Tensor, ps: ParallelState, dim: int = 0) -> torch.Tensor:
    """Concatenate every rank's x along `dim` (rank order)."""
    if ps.tp_size == 1:
        return x
    dim = dim % x.dim()
    out = _wait(torch.ops._c10d_functional.all_gather_into_tensor(x.contiguous(), ps.tp_size, ps.group_name))
    if dim == 0:
        return out
    # The op stacks along dim 0; move each rank's block into place along `dim`.
    return torch.cat(out.chunk(ps.tp_size, dim=0), dim=dim)


def reduce_scatter(x: torch.Tensor, ps: ParallelState, dim: int = 0) -> torch.Tensor:
    """Sum over the TP group, each rank keeping its 1/tp_size slice along `dim`."""
    if ps.tp_size == 1:
        return x
    dim = dim % x.dim()
    if x.shape[dim] % ps.tp_size != 0:
        raise ParallelError(
            f"reduce_scatter: dim {dim} has size {x.shape[dim]}, not divisible by tp_size={ps.tp_size}"
        )
    if dim != 0:
        x = torch.cat(x.chunk(ps.tp_size, dim=dim), dim=0)
    return _wait(torch.ops._c10d_functional.reduce_scatter_tensor(x.contiguous(), "sum", ps.tp_size, ps.group_name))
