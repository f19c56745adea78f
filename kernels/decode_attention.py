"""Attention of a few query rows per sequence over a KV cache: the `minimax::decode_attention` op.

    out = torch.ops.minimax.decode_attention(q, k, v, mask, scale)
        q      [B, Hq, S, d]    the new tokens' queries (S: 1 at decode, a few for drafts)
        k, v   [B, Hkv, L, d]   the whole cache, Hq a multiple of Hkv (grouped-query)
        mask   [Bm, 1, Sm, L]   Bm in (1, B), Sm in (1, S): bool (True = attend) or an
                                additive float bias (0 / -inf), as SDPA's attn_mask
        out    [B, Hq, S, d]    in q.dtype, laid out as [B, S, Hq, d] in memory (the
                                layout SDPA's kernels return, so the graph's views after
                                it stay valid)

It is F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale,
enable_gqa=True), except that a row whose keys are all masked gives zeros
(SDPA's math gives NaN there). The backend's pass graph_passes/decode_attention.py
puts it in place of SDPA where the query rows are few: the dense layers'
decode step, where SDPA's kernels read the cache at about half the copy
rate (docs/kernel-notes.md#decode-attention). The reference here is plain
torch in float32, registered for every device; kernels/decode_attention_triton.py
registers the CUDA kernel (this module never imports it).
"""

from __future__ import annotations

import torch

__all__ = ["decode_attention", "decode_attention_reference", "check_decode_attention", "MAX_QUERY_ROWS"]

# Query rows per sequence the op takes: one program holds S x Hq/Hkv rows (16 heads per KV
# head in M3), so a few tokens at most; longer queries are prefill work for SDPA.
MAX_QUERY_ROWS = 4


def check_decode_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor) -> None:
    """Raise ValueError naming what does not fit the op's shapes."""
    if q.dim() != 4 or k.dim() != 4 or v.shape != k.shape or mask.dim() != 4:
        raise ValueError(f"decode_attention: want q [B, Hq, S, d], k = v [B, Hkv, L, d], mask [B, 1, S, L]; got "
                         f"{tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}, {tuple(mask.shape)}")
    batch, hq, seq, dim = q.shape
    _, hkv, slots, kdim = k.shape
    if k.shape[0] != batch or kdim != dim:
        raise ValueError(f"decode_attention: k {tuple(k.shape)} does not fit q {tuple(q.shape)}")
    if hq % hkv:
        raise ValueError(f"decode_attention: {hq} query heads are not a multiple of {hkv} KV heads")
    if seq > MAX_QUERY_ROWS:
        raise ValueError(f"decode_attention: {seq} query rows per sequence; the op takes at most {MAX_QUERY_ROWS}")
    mb, mh, ms, ml = mask.shape
    if mb not in (1, batch) or mh != 1 or ms not in (1, seq) or ml != slots:
        raise ValueError(f"decode_attention: mask {tuple(mask.shape)} must be [1 or {batch}, 1, 1 or {seq}, {slots}]")
    if mask.dtype != torch.bool and not mask.is_floating_point():
        raise ValueError(f"decode_attention: mask must be bool or floating point, got {mask.dtype}")


def decode_attention_reference(q, k, v, mask, scale: float) -> torch.Tensor:
    check_decode_attention(q, k, v, mask)
    group = q.shape[1] // k.shape[1]
    kf = k.float().repeat_interleave(group, dim=1)
    vf = v.float().repeat_interleave(group, dim=1)
    scores = q.float() @ kf.transpose(-1, -2) * scale  # [B, Hq, S, L]
    if mask.dtype == torch.bool:
        scores = scores.masked_fill(~mask, float("-inf"))
    else:
        scores = scores + mask.float()
    top = scores.amax(-1, keepdim=True)
    weights = torch.exp(scores - torch.where(top == float("-inf"), 0.0, top))
    total = weights.sum(-1, keepdim=True)
    out = (weights / torch.where(total == 0, 1.0, total)) @ vf
    return _sdpa_layout(q).copy_(out)


def _sdpa_layout(q: torch.Tensor) -> torch.Tensor:
    """An empty [B, Hq, S, d] in q's dtype laid out as [B, S, Hq, d]."""
    batch, hq, seq, dim = q.shape
    return q.new_empty(batch, seq, hq, dim).transpose(1, 2)


@torch.library.custom_op("minimax::decode_attention", mutates_args=())
def decode_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor,
                     scale: float) -> torch.Tensor:
    return decode_attention_reference(q, k, v, mask, scale)


@decode_attention.register_fake
def _decode_attention_fake(q, k, v, mask, scale):
    check_decode_attention(q, k, v, mask)
    return _sdpa_layout(q)
