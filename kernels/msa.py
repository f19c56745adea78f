"""MiniMax sparse attention (MSA): the `minimax::` ops for block selection and block-sparse attention.

    blocks = torch.ops.minimax.msa_select(index_q, index_k, positions,
                                          block_size, topk, local_blocks, init_blocks)
        index_q    [T, Hi, D]  the indexer's queries (normed, roped), T = B * S tokens
        index_k    [B, L, D]   the indexer's keys of every key slot (slot j = position j):
                               the index-K cache, or the S current keys without a cache
        positions  [B, S]      each query's absolute position
        blocks     int32 [T, Hi, K], K = min(topk, ceil(L / block_size)): per query and
                   index head, the key blocks to attend to, best first, -1 padded at the end

        Scores s[t, h, j] = index_q[t, h] . index_k[b, j] in float32, keys after the
        query's position masked out, max-pooled over blocks of `block_size` key slots
        anchored at position 0. The query's own block and the `local_blocks - 1`
        before it, and the first `init_blocks` blocks, are forced in (their score is
        +inf; never a block after the query's own). Then the top-K blocks; blocks
        whose score is -inf (entirely in the query's future) are -1.

    out = torch.ops.minimax.msa_attention(q, k, v, blocks, positions, block_size, scale)
        q          [T, Hq, d]
        k, v       [B, Hkv, L, d]  the KV cache (or the current keys and values)
        blocks     [T, Hi, K] from msa_select; query head i uses index head i // (Hq / Hi)
                   and KV head i // (Hq / Hkv)
        out        [T, Hq, d] in q.dtype: exact softmax(q k^T * scale) v over the keys
                   of the selected blocks at slots <= the query's position

Dense attention equals this while a query sees at most topk * block_size keys
(every past block is selected then). The implementations here are plain torch
in float32: the numerical reference, registered for every device. On CUDA the
Triton kernels of kernels/msa_triton.py take over: that module imports this
one and registers the ops' CUDA kernels (this one never imports it).
"""

from __future__ import annotations

import torch

__all__ = ["msa_select", "msa_attention", "msa_select_reference", "msa_attention_reference", "num_key_blocks",
           "check_select", "check_attention"]


def num_key_blocks(key_slots: int, block_size: int) -> int:
    return -(-key_slots // block_size)


def check_select(index_q, index_k, positions, block_size, topk, local_blocks, init_blocks) -> None:
    if index_q.dim() != 3 or index_k.dim() != 3 or positions.dim() != 2:
        raise ValueError(
            f"msa_select: want index_q [T, Hi, D], index_k [B, L, D], positions [B, S]; got "
            f"{tuple(index_q.shape)}, {tuple(index_k.shape)}, {tuple(positions.shape)}"
        )
    batch, seq = positions.shape
    if index_q.shape[0] != batch * seq:
        raise ValueError(f"msa_select: index_q has {index_q.shape[0]} tokens, positions {batch} x {seq}")
    if index_k.shape[0] != batch or index_k.shape[2] != index_q.shape[2]:
        raise ValueError(f"msa_select: index_k {tuple(index_k.shape)} does not fit index_q {tuple(index_q.shape)} "
                         f"and batch {batch}")
    if block_size <= 0 or topk <= 0 or local_blocks < 1 or init_blocks < 0:
        raise ValueError(f"msa_select: need block_size, topk > 0, local_blocks >= 1 and init_blocks >= 0; got "
                         f"{block_size}, {topk}, {local_blocks}, {init_blocks}")
    if local_blocks + init_blocks > topk:
        raise ValueError(f"msa_select: {local_blocks} local + {init_blocks} init blocks do not fit in top-{topk}")


def forced_blocks(positions: torch.Tensor, block_size: int, local_blocks: int, init_blocks: int,
                  n_blocks: int) -> torch.Tensor:
    """bool [B, S, n_blocks]: the blocks every query keeps (own, local before it, init)."""
    own = (positions // block_size)[..., None]
    blk = torch.arange(n_blocks, device=positions.device)
    local = (blk <= own) & (blk > own - local_blocks)
    init = (blk < init_blocks) & (blk <= own)
    return local | init


def block_scores_reference(index_q, index_k, positions, block_size, local_blocks, init_blocks) -> torch.Tensor:
    """float32 [B, S, Hi, n_blocks]: max score per key block, forced blocks +inf, future blocks -inf."""
    batch, seq = positions.shape
    heads, dim = index_q.shape[1:]
    slots = index_k.shape[1]
    nb = num_key_blocks(slots, block_size)
    q = index_q.reshape(batch, seq, heads, dim).float()
    scores = torch.einsum("bshd,bld->bshl", q, index_k.float())
    future = torch.arange(slots, device=positions.device) > positions[..., None]  # [B, S, L]
    scores = scores.masked_fill(future[:, :, None, :], float("-inf"))
    scores = torch.nn.functional.pad(scores, (0, nb * block_size - slots), value=float("-inf"))
    blocks = scores.view(batch, seq, heads, nb, block_size).amax(-1)
    forced = forced_blocks(positions, block_size, local_blocks, init_blocks, nb)
    return blocks.masked_fill(forced[:, :, None, :], float("inf"))


def top_blocks(block_scores: torch.Tensor, topk: int) -> torch.Tensor:
    """int32 [..., K] from block scores [..., n_blocks]: best first, -1 for blocks at -inf."""
    k = min(topk, block_scores.shape[-1])
    values, idx = block_scores.topk(k, dim=-1, sorted=True)
    return idx.masked_fill(values == float("-inf"), -1).to(torch.int32)


def msa_select_reference(index_q, index_k, positions, block_size, topk, local_blocks=1, init_blocks=0):
    check_select(index_q, index_k, positions, block_size, topk, local_blocks, init_blocks)
    scores = block_scores_reference(index_q, index_k, positions, block_size, local_blocks, init_blocks)
    return top_blocks(scores, topk).flatten(0, 1)


def _select_shape(index_q, index_k, block_size, topk) -> tuple[int, int, int]:
    return index_q.shape[0], index_q.shape[1], min(topk, num_key_blocks(index_k.shape[1], block_size))


@torch.library.custom_op("minimax::msa_select", mutates_args=())
def msa_select(index_q: torch.Tensor, index_k: torch.Tensor, positions: torch.Tensor, block_size: int, topk: int,
               local_blocks: int, init_blocks: int) -> torch.Tensor:
    return msa_select_reference(index_q, index_k, positions, block_size, topk, local_blocks, init_blocks)


@msa_select.register_fake
def _msa_select_fake(index_q, index_k, positions, block_size, topk, local_blocks, init_blocks):
    check_select(index_q, index_k, positions, block_size, topk, local_blocks, init_blocks)
    return index_q.new_empty(_select_shape(index_q, index_k, block_size, topk), dtype=torch.int32)


# ------------------------------------------------------------------ attention
def check_attention(q, k, v, blocks, positions, block_size) -> None:
    if q.dim() != 3 or k.dim() != 4 or v.shape != k.shape or blocks.dim() != 3:
        raise ValueError(
            f"msa_attention: want q [T, Hq, d], k = v [B, Hkv, L, d], blocks [T, Hi, K]; got "
            f"{tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}, {tuple(blocks.shape)}"
        )
    batch, seq = positions.shape
    tokens, hq, dim = q.shape
    if tokens != batch * seq or blocks.shape[0] != tokens or k.shape[0] != batch or k.shape[3] != dim:
        raise ValueError(f"msa_attention: shapes do not agree: q {tuple(q.shape)}, k {tuple(k.shape)}, "
                         f"blocks {tuple(blocks.shape)}, positions {tuple(positions.shape)}")
    hkv, hi = k.shape[1], blocks.shape[1]
    if hq % hi or hq % hkv:
        raise ValueError(f"msa_attention: {hq} query heads are not a multiple of {hi} index heads and {hkv} KV heads")
    if blocks.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"msa_attention: blocks must be int32 or int64, got {blocks.dtype}")


def selected_key_mask(blocks: torch.Tensor, positions: torch.Tensor, block_size: int, key_slots: int) -> torch.Tensor:
    """bool [B, S, Hi, L]: key slots of the selected blocks at or before each query's position."""
    batch, seq = positions.shape
    nb = num_key_blocks(key_slots, block_size)
    idx = blocks.long().reshape(batch, seq, blocks.shape[1], blocks.shape[2])
    idx = idx.masked_fill(idx < 0, nb)  # -1 lands in a spare column, dropped below
    keep = torch.zeros(batch, seq, blocks.shape[1], nb + 1, dtype=torch.bool, device=blocks.device)
    keep.scatter_(-1, idx, True)
    keep = keep[..., :nb].repeat_interleave(block_size, dim=-1)[..., :key_slots]
    causal = torch.arange(key_slots, device=positions.device) <= positions[..., None]  # [B, S, L]
    return keep & causal[:, :, None, :]


def msa_attention_reference(q, k, v, blocks, positions, block_size, scale):
    check_attention(q, k, v, blocks, positions, block_size)
    batch, seq = positions.shape
    hq, hkv, hi = q.shape[1], k.shape[1], blocks.shape[1]
    slots = k.shape[2]
    keep = selected_key_mask(blocks, positions, block_size, slots)  # [B, S, Hi, L]
    out = []
    for b in range(batch):  # one sequence at a time keeps the [Hq, S, L] scores small
        qb = q[b * seq:(b + 1) * seq].float().transpose(0, 1)  # [Hq, S, d]
        kb = k[b].float().repeat_interleave(hq // hkv, dim=0)  # [Hq, L, d]
        vb = v[b].float().repeat_interleave(hq // hkv, dim=0)
        mask = keep[b].transpose(0, 1).repeat_interleave(hq // hi, dim=0)  # [Hq, S, L]
        scores = (qb @ kb.transpose(1, 2) * scale).masked_fill(~mask, float("-inf"))
        out.append((torch.softmax(scores, dim=-1) @ vb).transpose(0, 1))  # [S, Hq, d]
    return torch.cat(out, dim=0).to(q.dtype)


@torch.library.custom_op("minimax::msa_attention", mutates_args=())
def msa_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, blocks: torch.Tensor, positions: torch.Tensor,
                  block_size: int, scale: float) -> torch.Tensor:
    return msa_attention_reference(q, k, v, blocks, positions, block_size, scale)


@msa_attention.register_fake
def _msa_attention_fake(q, k, v, blocks, positions, block_size, scale):
    check_attention(q, k, v, blocks, positions, block_size)
    return torch.empty_like(q)
