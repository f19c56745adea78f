"""Token-count buckets for CUDA graphs: which padded size a call runs at.

Under sequence parallelism every bucket is rounded up to a multiple of the TP
size, so a padded input splits evenly over the ranks and the graph needs no
padding of its own.
"""

from __future__ import annotations

from typing import Sequence

__all__ = ["effective_buckets", "pick_bucket"]


def effective_buckets(buckets: Sequence[int], multiple: int = 1) -> tuple[int, ...]:
    """The buckets rounded up to `multiple`, sorted, without repeats."""
    if multiple < 1:
        raise ValueError(f"bucket multiple must be >= 1, got {multiple}")
    return tuple(sorted({-(-b // multiple) * multiple for b in buckets}))


def pick_bucket(tokens: int, buckets: Sequence[int], multiple: int = 1) -> int | None:
    """Smallest effective bucket holding `tokens`; None above the largest (run without a graph)."""
    if tokens < 1:
        raise ValueError(f"token count must be >= 1, got {tokens}")
    for b in effective_buckets(buckets, multiple):
        if b >= tokens:
            return b
    return None
