"""Decode-step attention over the KV cache: SDPA -> `minimax::decode_attention`.

The dense layers attend with F.scaled_dot_product_attention over the whole
static cache under its mask (model/kv_cache.py). At decode, one query row per
sequence, the kernels SDPA picks read the cache at about half the copy rate
on an H200 (docs/kernel-notes.md#decode-attention). This pass puts
`minimax::decode_attention` (kernels/decode_attention.py) in their place: the
same attention, the query heads of a KV head in one tile, the cache split
over enough programs to fill the GPU (kernels/decode_attention_triton.py).

Candidates: every attention node with at most MAX_QUERY_ROWS query rows per
sequence (patterns/attention.py); prefill graphs have none, and the pass then
skips saying so. A candidate that does not match (no mask, dropout, a layout
the op does not give) stays SDPA and the record says why.
"""

from __future__ import annotations

import torch.fx

from ..kernels.decode_attention import MAX_QUERY_ROWS
from ..patterns.attention import is_sdpa, match_decode_attention, query_rows
from .base import CandidatePass, PassContext
from .manager import register_pass


@register_pass
class DecodeAttentionPass(CandidatePass):
    name = "decode_attention"
    hash_modules = ("minimax_backend.patterns.attention", "minimax_backend.kernels.decode_attention")
    no_candidates = f"no scaled-dot-product attention with <= {MAX_QUERY_ROWS} query rows per sequence (decode)"
    what = "decode-shaped attention nodes"

    def candidates(self, gm: torch.fx.GraphModule, ctx: PassContext) -> list[torch.fx.Node]:
        return [n for n in gm.graph.nodes if is_sdpa(n) and (query_rows(n) or MAX_QUERY_ROWS + 1) <= MAX_QUERY_ROWS]

    def match(self, node: torch.fx.Node, ctx: PassContext):
        return match_decode_attention(node)
