"""What reaches the MoE router, call by call: a watch on the MoE ops' inputs for diagnostics.

    with watch_router_inputs() as calls:
        compiled(ids, positions)
    calls[i].x, .router_weight, .correction_bias, .top_k      # one per minimax::moe / mega_moe call

BF16 and FP8 runs of the same model differ by rounding, and a token whose k-th and (k+1)-th
expert scores are nearly tied can pick another expert in one run and not in the other, which moves
that token's output far more than rounding does (docs/measurements/2026-12-05.md).
tools/routing_flips.py compares these inputs' top-k with eager's to name such tokens. The ops'
implementations (the reference here and on the CPU, kernels/moe_triton.py's CUDA kernel) report
every call they run; a CUDA graph's replay runs no Python, so only calls that execute the
implementation outside a capture (the warm-up run in the first call of a compiled model, a run
without CUDA graphs) are seen.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Iterator, Optional

import torch

__all__ = ["RouterCall", "watch_router_inputs", "watching", "notify"]


@dataclass(frozen=True)
class RouterCall:
    x: torch.Tensor  # a copy of the op's input rows
    router_weight: torch.Tensor
    correction_bias: Optional[torch.Tensor]
    top_k: int


_WATCHERS: list[list[RouterCall]] = []


@contextlib.contextmanager
def watch_router_inputs() -> Iterator[list[RouterCall]]:
    calls: list[RouterCall] = []
    _WATCHERS.append(calls)
    try:
        yield calls
    finally:  # by identity: two watches' lists may hold the same calls
        del _WATCHERS[next(i for i, c in enumerate(_WATCHERS) if c is calls)]


def watching() -> bool:
    """Whether a watch is open (the ops check this first, before reading their arguments)."""
    return bool(_WATCHERS)


def notify(x: torch.Tensor, router_weight: torch.Tensor, correction_bias: Optional[torch.Tensor],
           top_k: int) -> None:
    """Called by the ops' implementations first thing, where watching() (reading the arguments
    costs nothing otherwise)."""
    if x.is_cuda and torch.cuda.is_current_stream_capturing():
        return  # a copy made now would become part of the CUDA graph, replayed on every call
    call = RouterCall(x.detach().clone(), router_weight, correction_bias, int(top_k))
    for calls in _WATCHERS:
        calls.append(call)
