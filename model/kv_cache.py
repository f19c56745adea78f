"""A static, preallocated KV cache: one K and one V buffer per attention layer.

Buffers are [batch, local_kv_heads, max_len, head_dim]. A forward writes the
new keys and values at their `positions` and attends over the whole buffer
with the mask k_pos <= q_pos. So one model does prefill (positions
0..P-1) and decode (position t) with the same code, and static shapes.
Slots past the current position are masked, whatever they hold.

The writes are indexed assignments (`index_put_`), not `scatter_`: compiled,
both become a functional op plus a copy back into the buffer, and Inductor
turns `index_put` back into an in-place write of the new rows only, while a
functional `scatter` stays a rewrite of the whole buffer, twice per step
(at decode, batch 64 with an 8k cache, about 1 GB per layer and per K or V:
docs/measurements/2026-12-02.md).

Sparse (MSA) layers keep one more buffer, the index-K cache [batch, max_len,
index_head_dim]: the indexer's single key head per token, written at the same
positions. Decode scores the new token's index queries against it to pick the
key blocks to attend to (kernels/msa.py).
"""

from __future__ import annotations

import torch
from torch import nn

__all__ = ["KVCache", "cache_mask"]


class KVCache(nn.Module):
    def __init__(self, batch: int, max_len: int, num_kv_heads: int, head_dim: int, *, dtype, device,
                 index_head_dim: int = 0):
        super().__init__()
        shape = (batch, num_kv_heads, max_len, head_dim)
        # Not persistent: not part of the checkpoint, no load plan.
        self.register_buffer("k", torch.zeros(shape, dtype=dtype, device=device), persistent=False)
        self.register_buffer("v", torch.zeros(shape, dtype=dtype, device=device), persistent=False)
        index_shape = (batch, max_len, index_head_dim) if index_head_dim else (0,)
        self.register_buffer("index_k", torch.zeros(index_shape, dtype=dtype, device=device), persistent=False)

    @property
    def batch(self) -> int:
        return self.k.shape[0]

    @property
    def max_len(self) -> int:
        return self.k.shape[2]

    def update(self, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Write k, v [B, h, S, d] at positions [B, S]; return the whole buffers."""
        rows = _batch_rows(positions)
        # advanced indices around a slice: the indexed view is [B, S, h, d]
        self.k[rows, :, positions] = k.transpose(1, 2)
        self.v[rows, :, positions] = v.transpose(1, 2)
        return self.k, self.v

    def update_index(self, index_k: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Write the indexer's keys [B, S, D] at positions [B, S]; return the whole index-K buffer."""
        if self.index_k.dim() != 3:
            raise RuntimeError("this KV cache has no index-K buffer (the layer is not a sparse one)")
        self.index_k[_batch_rows(positions), positions] = index_k
        return self.index_k


def _batch_rows(positions: torch.Tensor) -> torch.Tensor:
    """[B, 1]: each sequence's row in the cache, broadcast against positions [B, S]."""
    return torch.arange(positions.shape[0], device=positions.device)[:, None]


def cache_mask(positions: torch.Tensor, max_len: int) -> torch.Tensor:
    """Boolean attention mask [B, 1, S, max_len]: query at position p sees keys at slots <= p."""
    slots = torch.arange(max_len, device=positions.device)
    return slots[None, None, None, :] <= positions[:, None, :, None]
