"""Token-count buckets for CUDA graphs, and running a model at them.

CUDA graphs are captured per token count (cudagraph_capture.py), so callers
pad every call to one of a few bucket sizes. Under sequence parallelism every
bucket is rounded up to a multiple of the TP size (``effective_buckets``), so
a padded input splits evenly over the ranks and the graph needs no padding of
its own.

For our model a pad is safe to append at the end of each sequence: the pad
tokens take the next positions, attention is causal (real tokens never see
them), the MoE treats tokens independently, and the KV-cache slots they write
lie past every real position (masked until a real token overwrites them). So
the logits of the real tokens are unchanged.

Padding runs along the sequence dimension; a batch of B sequences pads each
to S' with B * S' a bucket. When no bucket fits (B does not divide one, or
the pad would run past the KV cache) the call runs unpadded.
"""

from __future__ import annotations

import time
from typing import Any, Callable, Sequence

import torch

__all__ = ["BucketedRunner", "effective_buckets", "pad_tokens", "padded_length", "pick_bucket"]


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


def padded_length(batch: int, seq: int, buckets: Sequence[int], multiple: int = 1,
                  last_position: int | None = None, max_positions: int | None = None) -> int:
    """Sequence length S' >= seq with batch * S' a bucket; `seq` itself when none fits."""
    for b in effective_buckets(buckets, multiple):
        if b < batch * seq or b % batch:
            continue
        target = b // batch
        if max_positions is not None and last_position is not None and last_position + target - seq >= max_positions:
            return seq  # the pad would write past the KV cache
        return target
    return seq


def pad_tokens(input_ids: torch.Tensor, positions: torch.Tensor, length: int) -> tuple[torch.Tensor, torch.Tensor]:
    """[B, S] ids / positions -> [B, length]: pad ids 0 at the next positions."""
    batch, seq = input_ids.shape
    if length < seq:
        raise ValueError(f"cannot pad {seq} tokens down to {length}")
    extra = length - seq
    if extra == 0:
        return input_ids, positions
    pad_ids = input_ids.new_zeros(batch, extra)
    step = torch.arange(1, extra + 1, device=positions.device, dtype=positions.dtype)
    pad_pos = positions[:, -1:] + step[None]
    return torch.cat([input_ids, pad_ids], 1), torch.cat([positions, pad_pos], 1)


def _slice(out: Any, batch: int, length: int, seq: int) -> Any:
    if isinstance(out, torch.Tensor):
        return out[:, :seq] if out.dim() >= 2 and tuple(out.shape[:2]) == (batch, length) else out
    if isinstance(out, (tuple, list)):
        return type(out)(_slice(o, batch, length, seq) for o in out)
    return out


def _kept_after_padding(logits_to_keep: int | torch.Tensor, seq: int, length: int,
                        device: torch.device) -> int | torch.Tensor | None:
    """The model's logits_to_keep for a call padded from seq to length positions. None: every
    position (the argument is not passed, so models without it run). A count n of the last
    positions becomes the indices of the last n real ones when pads follow them, a tensor
    (a graph input: every length in a bucket shares one graph)."""
    if isinstance(logits_to_keep, torch.Tensor):
        return logits_to_keep  # positions of the real tokens: pads are appended after them
    if logits_to_keep == 0:
        return None
    if length == seq:
        return logits_to_keep
    if isinstance(logits_to_keep, bool) or not 0 < logits_to_keep <= seq:
        raise ValueError(f"logits_to_keep={logits_to_keep!r}: a count of the input's {seq} positions, "
                         f"a tensor of positions, or 0 for all")
    return torch.arange(seq - logits_to_keep, seq, device=device)


class BucketedRunner:
    """`runner(input_ids, positions[, logits_to_keep])`: the model's outputs for the real tokens,
    run at a bucket size."""

    def __init__(self, model: Callable, buckets: Sequence[int], multiple: int = 1, max_positions: int | None = None):
        self.model = model
        self.buckets = effective_buckets(buckets, multiple)
        self.max_positions = max_positions

    def length_for(self, input_ids: torch.Tensor, positions: torch.Tensor) -> int:
        batch, seq = input_ids.shape
        last = int(positions[:, -1].max()) if self.max_positions is not None else None
        return padded_length(batch, seq, self.buckets, 1, last, self.max_positions)

    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor, logits_to_keep: int | torch.Tensor = 0):
        """logits_to_keep as the model takes it; a count means the last REAL positions (see
        _kept_after_padding)."""
        batch, seq = input_ids.shape
        length = self.length_for(input_ids, positions)
        ids, pos = pad_tokens(input_ids, positions, length)
        keep = _kept_after_padding(logits_to_keep, seq, length, input_ids.device)
        out = self.model(ids, pos) if keep is None else self.model(ids, pos, logits_to_keep=keep)
        return _slice(out, batch, length, seq)

    def warm_up(self, device: torch.device | str, batch: int = 1, sizes: Sequence[int] | None = None,
                progress: Callable[[str], None] = print) -> dict[int, float]:
        """Compile and capture every bucket (or `sizes`) now, one progress line each; seconds per size.

        Runs token id 0 at positions 0.. : it writes those KV-cache slots, which
        the first real prefill overwrites. Sizes must be multiples of `batch`.
        """
        sizes = [b for b in (sizes or self.buckets) if b % batch == 0]
        if self.max_positions is not None:
            sizes = [b for b in sizes if b // batch <= self.max_positions]
        timings = {}
        for i, size in enumerate(sizes, 1):
            seq = size // batch
            ids = torch.zeros(batch, seq, dtype=torch.long, device=device)
            pos = torch.arange(seq, device=device).expand(batch, -1).contiguous()
            t0 = time.perf_counter()
            with torch.no_grad():
                self(ids, pos)
            if torch.device(device).type == "cuda":
                torch.cuda.synchronize(device)
            timings[size] = time.perf_counter() - t0
            progress(f"[minimax] warm-up {i}/{len(sizes)}: {size} tokens in {timings[size]:.1f}s")
        return timings
