"""What a forward of the model must do at least: matrix FLOPs and bytes read, from the config.

    decode_bytes(config, batch, context, tp, ep, fp8)   bytes one decode step must read on one rank
    prefill_flops(config, tokens, tp)                   matrix FLOPs of one prefill on one rank

Decode reads every weight the batch touches once (all of attention, the
dense MLPs, the shared expert and lm_head; of the routed experts, those the
batch's tokens pick: counted in the step measured where the caller has them,
else for B tokens with top-k of E, E * (1 - (1 - k/E)^B) on average) and the
KV cache each query attends to (dense layers: every key; MSA layers: the
index-K cache plus the selected blocks' keys and values).
Over the copy bandwidth measured on the card this is the decode floor.
Prefill FLOPs count 2 per multiply-add of every GEMM with the routed experts
at top-k, and attention's QK and PV products (causal; MSA: over the selected
keys only, at most topk * block per query); over a plain GEMM's measured rate
this is the prefill floor. Embedding lookups, norms and the router's top-k
are left out (small).
"""

from __future__ import annotations

from typing import Sequence

__all__ = ["decode_bytes", "prefill_flops", "weight_bytes"]


def _attention_params(c, tp: int) -> int:
    d, hq, hkv = c.head_dim, c.num_attention_heads, c.num_key_value_heads
    kv_local = max(hkv // tp, 1)
    return c.hidden_size * (hq // tp * d + 2 * kv_local * d) + hq // tp * d * c.hidden_size


def _indexer_params(c, tp: int) -> int:
    return c.hidden_size * (max(c.index_n_heads // tp, 1) + 1) * c.index_head_dim


def weight_bytes(c, tp: int = 1, ep: int = 1, fp8: bool = False) -> dict[str, float]:
    """Bytes per rank by kind: 'always' (read by every forward) and 'expert' (one routed expert)."""
    wb = 1.0 if fp8 else 2.0  # FP8 block scales add 1/16384 per byte: left out
    always = 0.0
    for i in range(c.num_hidden_layers):
        always += wb * _attention_params(c, tp)
        if i in c.sparse_attention_layers:
            always += wb * _indexer_params(c, tp)
        if c.mlp_layer_types[i] == "dense":
            always += wb * 3 * c.hidden_size * c.dense_intermediate_size / tp
        else:
            always += wb * 3 * c.hidden_size * c.shared_intermediate_size / tp
            always += 4.0 * c.hidden_size * c.num_local_experts  # the float32 router
    always += 2.0 * c.hidden_size * c.vocab_size / tp  # lm_head (BF16)
    expert = wb * 3 * c.hidden_size * c.intermediate_size / (tp // ep)
    return {"always": always, "expert": expert}


def _touched_experts(c, batch: int, ep: int) -> float:
    e, k = c.num_local_experts, c.num_experts_per_tok
    return e / ep * (1.0 - (1.0 - k / e) ** batch)


def decode_bytes(c, batch: int, context: int, tp: int = 1, ep: int = 1, fp8: bool = False,
                 touched_experts: Sequence[int] | None = None) -> float:
    """touched_experts: how many distinct local experts each MoE layer's router picked in the
    step measured (a random model's tokens can share experts more than uniform routing
    would); None: the uniform-routing average."""
    w = weight_bytes(c, tp, ep, fp8)
    moe_layers = sum(1 for t in c.mlp_layer_types if t == "moe")
    if touched_experts is None:
        total = w["always"] + moe_layers * _touched_experts(c, batch, ep) * w["expert"]
    else:
        if len(touched_experts) != moe_layers:
            raise ValueError(f"decode_bytes: {len(touched_experts)} touched-expert counts for {moe_layers} MoE layers")
        total = w["always"] + sum(touched_experts) * w["expert"]
    kv_local = max(c.num_key_value_heads // tp, 1)
    kv_per_key = 2 * kv_local * c.head_dim * 2.0  # K and V, BF16
    seen = context + 1
    for i in range(c.num_hidden_layers):
        if i in c.sparse_attention_layers:
            selected = min(seen, c.index_topk_blocks * c.index_block_size)
            total += batch * (seen * c.index_head_dim * 2.0 + selected * kv_per_key)
        else:
            total += batch * seen * kv_per_key
    return total


def prefill_flops(c, tokens: int, tp: int = 1, logits_positions: int | None = None) -> float:
    """logits_positions: the positions the lm_head runs on (a prefill that samples keeps the
    last one); None: every token."""
    h = c.hidden_size
    per_token = 0.0
    attn = 0.0
    hq_local = c.num_attention_heads // tp
    causal_keys = tokens * (tokens + 1) / 2  # sum over queries of the keys each sees
    window = c.index_topk_blocks * c.index_block_size
    sparse_keys = sum(min(p + 1, window) for p in range(tokens)) if c.sparse_attention_layers else 0
    for i in range(c.num_hidden_layers):
        per_token += _attention_params(c, tp)
        if i in c.sparse_attention_layers:
            per_token += _indexer_params(c, tp)
            keys = sparse_keys
            attn += 2.0 * max(c.index_n_heads // tp, 1) * c.index_head_dim * causal_keys  # index scores
        else:
            keys = causal_keys
        attn += 4.0 * hq_local * c.head_dim * keys
        if c.mlp_layer_types[i] == "dense":
            per_token += 3 * h * c.dense_intermediate_size / tp
        else:
            per_token += 3 * h * (c.shared_intermediate_size / tp + c.num_experts_per_tok * c.intermediate_size / tp)
    lm_head = 2.0 * (tokens if logits_positions is None else logits_positions) * h * c.vocab_size / tp
    return 2.0 * tokens * per_token + lm_head + attn
