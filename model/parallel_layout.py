"""Can a model be sharded over ``tp_size`` x ``ep_size`` ranks? ``validate_for_parallel``.

The checks behind ``MiniMaxConfig.validate_for_parallel``: head, vocab, MLP and
expert counts divisible by the parallel sizes, and, for FP8, every per-rank
piece of a block-quantized weight on a ``weight_block_size`` boundary. They
take the config's field values as a plain dict, so this module does not need
the ``MiniMaxConfig`` class.
"""

from __future__ import annotations

from typing import Any, Mapping

from .config_error import ConfigError

__all__ = ["validate_for_parallel"]


def validate_for_parallel(c: Mapping[str, Any], tp_size: int, ep_size: int = 1) -> None:
    """Raise ConfigError if the model with the field values ``c`` cannot be sharded over tp_size x ep_size.

    Layout assumed (see model/parallel.py): attention heads, the vocab, the
    dense MLP and the shared expert are split over ``tp_size`` ranks; KV heads
    are split when divisible, replicated when fewer than ``tp_size``; routed
    experts are split over ``ep_size`` ranks and each expert's intermediate
    dim over the remaining ``tp_size // ep_size`` (the MoE TP size). For FP8
    every per-rank piece of a block-quantized weight must start and end on
    a ``weight_block_size`` boundary (the scales are sliced by whole blocks).
    """
    for name, v in (("tp_size", tp_size), ("ep_size", ep_size)):
        if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
            raise ConfigError(name, f"must be a positive integer, got {v!r}")
    if tp_size % ep_size:
        raise ConfigError("ep_size", f"ep_size {ep_size} must divide tp_size {tp_size}")
    if c["num_attention_heads"] % tp_size:
        raise ConfigError(
            "num_attention_heads",
            f"{c['num_attention_heads']} heads are not divisible by tp_size {tp_size}",
        )
    kv = c["num_key_value_heads"]
    if kv % tp_size and tp_size % kv:
        raise ConfigError(
            "num_key_value_heads",
            f"{kv} KV heads neither divide nor are divisible by tp_size {tp_size}",
        )
    idx = c["index_n_heads"]
    if c["sparse_attention_layers"] and idx % tp_size and tp_size % idx:
        raise ConfigError(
            "index_n_heads",
            f"{idx} index heads neither divide nor are divisible by tp_size {tp_size}",
        )
    if c["vocab_size"] % tp_size:
        raise ConfigError("vocab_size", f"{c['vocab_size']} is not divisible by tp_size {tp_size}")
    if _has_dense_layers(c) and c["dense_intermediate_size"] % tp_size:
        raise ConfigError(
            "dense_intermediate_size",
            f"{c['dense_intermediate_size']} is not divisible by tp_size {tp_size}",
        )
    if c["shared_intermediate_size"] % tp_size:
        raise ConfigError(
            "shared_intermediate_size",
            f"{c['shared_intermediate_size']} is not divisible by tp_size {tp_size}",
        )
    moe_tp = tp_size // ep_size
    if _has_moe_layers(c):
        if c["num_local_experts"] % ep_size:
            raise ConfigError(
                "num_local_experts",
                f"{c['num_local_experts']} experts are not divisible by ep_size {ep_size}",
            )
        if c["intermediate_size"] % moe_tp:
            raise ConfigError(
                "intermediate_size",
                f"{c['intermediate_size']} is not divisible by the MoE TP size {moe_tp} "
                f"(tp_size {tp_size} / ep_size {ep_size})",
            )
    if c["quant_method"] == "fp8":
        _check_fp8_blocks(c, tp_size, moe_tp)


def _has_dense_layers(c: Mapping[str, Any]) -> bool:
    return "dense" in c["mlp_layer_types"]


def _has_moe_layers(c: Mapping[str, Any]) -> bool:
    return "moe" in c["mlp_layer_types"]


def _check_fp8_blocks(c: Mapping[str, Any], tp_size: int, moe_tp: int) -> None:
    bn, bk = c["weight_block_size"]
    heads, head_dim = c["num_attention_heads"], c["head_dim"]
    kv_local = max(c["num_key_value_heads"] // tp_size, 1)
    # (field, per-rank length, block, what it is)
    pieces = [
        ("num_attention_heads", heads // tp_size * head_dim, bn,
         "q_proj rows per rank (heads/tp * head_dim)"),
        ("num_key_value_heads", kv_local * head_dim, bn, "k_proj/v_proj rows per rank"),
        ("num_attention_heads", heads // tp_size * head_dim, bk,
         "o_proj columns per rank"),
    ]
    if c["sparse_attention_layers"]:
        pieces.append(("index_n_heads", max(c["index_n_heads"] // tp_size, 1) * c["index_head_dim"], bn,
                       "index_q_proj rows per rank"))
    if _has_dense_layers(c):
        pieces.append(("dense_intermediate_size", c["dense_intermediate_size"] // tp_size, bn,
                       "dense gate/up rows (and down columns) per rank"))
    if c["shared_intermediate_size"]:
        pieces.append(("shared_intermediate_size", c["shared_intermediate_size"] // tp_size, bn,
                       "shared expert gate/up rows (and down columns) per rank"))
    if _has_moe_layers(c):
        pieces.append(("intermediate_size", c["intermediate_size"] // moe_tp, bn,
                       "expert w1/w3 rows (and w2 columns) per rank"))
    for name, length, block, what in pieces:
        if length % block:
            raise ConfigError(
                name,
                f"FP8 {what} = {length} is not a multiple of the weight block {block} "
                f"at tp_size {tp_size} (weight_block_size {list(c['weight_block_size'])})",
            )
