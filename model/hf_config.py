"""Hugging Face ``config.json`` <-> the field values of ``MiniMaxConfig``.

``config_kwargs_from_hf_dict`` turns an HF config dict into the keyword
arguments of ``MiniMaxConfig`` (``MiniMaxConfig.from_hf_dict`` builds the
config from them), ``hf_dict_from_config_fields`` turns the field values back
into the HF dict (``MiniMaxConfig.to_hf_dict``); ``read_json_file`` /
``write_json_file`` do the file side. Plain dicts in and out: this module does
not need the class.

What is read from an HF config
------------------------------
``model_type`` "minimax_m3_text" (or "minimax_m3_vl" with the text model under
``text_config``):
    vocab_size, hidden_size, num_hidden_layers, num_attention_heads,
    num_key_value_heads, head_dim, rms_norm_eps, use_gemma_norm, rope_theta,
    rotary_dim / partial_rotary_factor (also inside ``rope_parameters`` /
    ``rope_scaling``), max_position_embeddings, hidden_act ("swigluoai" or
    "silu"), swiglu_alpha, swiglu_beta, swiglu_limit, use_qk_norm,
    qk_norm_type, intermediate_size (routed expert), dense_intermediate_size,
    shared_intermediate_size, n_shared_experts, num_local_experts,
    num_experts_per_tok, scoring_func, use_routing_bias,
    routed_scaling_factor, norm_topk_prob, num_mtp_modules,
    tie_word_embeddings, quantization_config.
    ``moe_layer_freq``: a list with one entry per layer (0 dense, 1 MoE), or an
    int k: layer i is MoE when ``i >= first_k_dense_replace`` (default 0) and
    ``i % k == 0``. Absent: the first 3 layers dense, the rest MoE (M3).
    Sparse attention (MSA) and its indexer, from either form:
      - M3's ``sparse_attention_config`` dict: ``use_sparse_attention``
        (default True when the dict is present), ``sparse_attention_freq``
        (0/1 per layer; or ``sparse_attention_layers`` / ``sparse_layer_ids``,
        a list of ids; default: every layer after the leading dense ones),
        ``sparse_num_index_heads``, ``sparse_index_dim``, ``sparse_block_size``,
        ``sparse_topk_blocks``, ``sparse_score_type`` ("max" only),
        ``sparse_init_block``, ``sparse_local_block``,
        ``sparse_disable_index_value`` (must be 1: no index value path). An
        unknown key is a ConfigError: nothing is silently ignored.
      - transformers' MiniMaxM3VLTextConfig (``model_type`` "minimax_m3_vl_text"):
        ``layer_types`` ("minimax_m3_sparse" / "full_attention"),
        ``mlp_layer_types`` ("sparse" = MoE / "dense"), ``index_n_heads``,
        ``index_head_dim``, ``index_block_size``, ``index_topk_blocks``,
        ``index_local_blocks``. transformers rewrites ``hidden_act`` to "silu"
        there while its modeling computes SwiGLU-OAI: read as "swigluoai".
      Keys of the dict win over the flat names (as transformers reads them).
      Neither present: no sparse layers.
``model_type`` "minimax_m2" (transformers' ``MiniMaxM2Config`` and the hub's
``config.json``): the same names where they exist. Rope: new transformers writes
``rope_parameters = {"rope_theta", "partial_rotary_factor", "rope_type"}``; old
hub configs write top-level ``rope_theta`` and ``rotary_dim``; both are read
(HF's own default theta is 5e6, partial factor 1.0). Fixed for M2: plain
RMSNorm, SiLU, no dense layers, no shared expert, QK norm over the whole
projection (``qk_norm_type`` "per_layer", ``use_qk_norm`` True unless the
config says otherwise), sigmoid router with correction bias, renormalized
top-k, routed scaling 1.0 unless given, no sparse attention. MTP modules only
when ``use_mtp`` is true (transformers' M2 has none).

``aux_hidden_state_layers`` is not an HF field: it is read from the key of the
same name when present (our own ``to_hf_dict`` writes it when non-empty).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Mapping

from .config_error import ConfigError

__all__ = ["config_kwargs_from_hf_dict", "hf_dict_from_config_fields", "read_json_file", "write_json_file"]

# transformers' names for the per-layer types (MiniMaxM3VLTextConfig.layer_types / mlp_layer_types).
HF_ATTENTION_TYPES = {"minimax_m3_sparse": True, "full_attention": False}
HF_MLP_TYPES = {"sparse": "moe", "dense": "dense", "moe": "moe"}
# Keys of M3's sparse_attention_config (and older aliases) this reader knows.
SPARSE_KEYS = (
    "use_sparse_attention", "sparse_num_index_heads", "sparse_index_dim", "sparse_block_size",
    "sparse_topk_blocks", "sparse_score_type", "sparse_init_block", "sparse_local_block",
    "sparse_attention_freq", "sparse_disable_index_value",
    "sparse_attention_layers", "sparse_layer_ids", "num_index_heads", "index_n_heads", "index_head_dim",
    "index_topk_blocks", "index_topk", "index_block_size", "index_local_blocks",
)


# ------------------------------------------------------------- HF reading
def config_kwargs_from_hf_dict(d: dict[str, Any]) -> dict[str, Any]:
    """The MiniMaxConfig keyword arguments of a Hugging Face config dict (M3 text, M3 VL with text_config, or M2)."""
    if not isinstance(d, dict):
        raise ConfigError("config", f"expected a dict, got {type(d).__name__}")
    model_type = d.get("model_type")
    if model_type == "minimax_m3_vl":
        text = d.get("text_config")
        if not isinstance(text, dict):
            raise ConfigError("text_config", "a minimax_m3_vl config needs a text_config dict")
        text = dict(text)
        text.setdefault("model_type", "minimax_m3_text")
        # Top-level quantization / tying apply to the text model when the text config lacks them.
        for key in ("quantization_config", "tie_word_embeddings"):
            if key not in text and key in d:
                text[key] = d[key]
        return config_kwargs_from_hf_dict(text)
    if model_type in ("minimax_m3_text", "minimax_m3_vl_text"):
        return _read_m3(d)
    if model_type == "minimax_m2":
        return _read_m2(d)
    raise ConfigError(
        "model_type",
        f"unknown model_type {model_type!r}; expected one of "
        f"{['minimax_m3_text', 'minimax_m3_vl', 'minimax_m3_vl_text', 'minimax_m2']}",
    )


def read_json_file(path: str | Path) -> Any:
    """The parsed contents of a config.json file, or of the config.json inside a checkpoint directory."""
    p = Path(path)
    if p.is_dir():
        p = p / "config.json"
    try:
        return json.loads(p.read_text())
    except FileNotFoundError:
        raise ConfigError("path", f"no config file at {p}") from None
    except json.JSONDecodeError as e:
        raise ConfigError("path", f"{p} is not valid JSON: {e}") from None


# ------------------------------------------------------------- HF writing
def hf_dict_from_config_fields(c: Mapping[str, Any]) -> dict[str, Any]:
    """The HF config.json dict of a config's field values; reading it back gives the same values."""
    dense_layers = "dense" in c["mlp_layer_types"]
    d: dict[str, Any] = {
        "model_type": c["model_type"],
        "vocab_size": c["vocab_size"],
        "hidden_size": c["hidden_size"],
        "num_hidden_layers": c["num_hidden_layers"],
        "num_attention_heads": c["num_attention_heads"],
        "num_key_value_heads": c["num_key_value_heads"],
        "head_dim": c["head_dim"],
        "max_position_embeddings": c["max_position_embeddings"],
        "rms_norm_eps": c["rms_norm_eps"],
        "rope_theta": c["rope_theta"],
        "rotary_dim": c["rotary_dim"],
        "partial_rotary_factor": c["rotary_dim"] / c["head_dim"],
        "hidden_act": c["hidden_act"],
        "use_qk_norm": c["use_qk_norm"],
        "qk_norm_type": c["qk_norm_type"],
        "intermediate_size": c["intermediate_size"],
        "num_local_experts": c["num_local_experts"],
        "num_experts_per_tok": c["num_experts_per_tok"],
        "scoring_func": c["scoring_func"],
        "use_routing_bias": c["use_routing_bias"],
        "routed_scaling_factor": c["routed_scaling_factor"],
        "norm_topk_prob": c["norm_topk_prob"],
        "tie_word_embeddings": c["tie_word_embeddings"],
    }
    if c["model_type"] == "minimax_m2":
        d["architectures"] = ["MiniMaxM2ForCausalLM"]
        d["rope_parameters"] = {
            "rope_type": "default",
            "rope_theta": c["rope_theta"],
            "partial_rotary_factor": c["rotary_dim"] / c["head_dim"],
        }
        d["use_mtp"] = c["num_mtp_modules"] > 0
        d["num_mtp_modules"] = c["num_mtp_modules"]
        d["shared_intermediate_size"] = 0
        # M2 fixes these; write them only if a caller changed them, so we read them back.
        if c["use_gemma_norm"]:
            d["use_gemma_norm"] = True
        if c["hidden_act"] != "silu":
            d.update(swiglu_alpha=c["swiglu_alpha"], swiglu_beta=c["swiglu_beta"], swiglu_limit=c["swiglu_limit"])
    else:
        d["architectures"] = ["MiniMaxM3ForCausalLM"]
        d.update(
            use_gemma_norm=c["use_gemma_norm"],
            swiglu_alpha=c["swiglu_alpha"],
            swiglu_beta=c["swiglu_beta"],
            swiglu_limit=c["swiglu_limit"],
            dense_intermediate_size=c["dense_intermediate_size"],
            shared_intermediate_size=c["shared_intermediate_size"],
            n_shared_experts=c["n_shared_experts"],
            num_mtp_modules=c["num_mtp_modules"],
            moe_layer_freq=[1 if t == "moe" else 0 for t in c["mlp_layer_types"]],
        )
        d["sparse_attention_config"] = {
            "use_sparse_attention": bool(c["sparse_attention_layers"]),
            "sparse_attention_freq": [
                1 if i in c["sparse_attention_layers"] else 0 for i in range(c["num_hidden_layers"])
            ],
            "sparse_num_index_heads": c["index_n_heads"],
            "sparse_index_dim": c["index_head_dim"],
            "sparse_topk_blocks": c["index_topk_blocks"],
            "sparse_block_size": c["index_block_size"],
            "sparse_score_type": c["index_score_type"],
            "sparse_init_block": c["index_init_blocks"],
            "sparse_local_block": c["index_local_blocks"],
            "sparse_disable_index_value": 1,
        }
    if c["model_type"] == "minimax_m2" and (
        dense_layers or c["sparse_attention_layers"] or c["shared_intermediate_size"]
    ):
        # Not expressible in a real M2 config; keep them so the round trip holds.
        d["moe_layer_freq"] = [1 if t == "moe" else 0 for t in c["mlp_layer_types"]]
        d["dense_intermediate_size"] = c["dense_intermediate_size"]
        d["shared_intermediate_size"] = c["shared_intermediate_size"]
        d["n_shared_experts"] = c["n_shared_experts"]
    if c["aux_hidden_state_layers"]:
        d["aux_hidden_state_layers"] = list(c["aux_hidden_state_layers"])
    if c["quant_method"] == "fp8":
        d["quantization_config"] = {
            "quant_method": "fp8",
            "fmt": "float8_e4m3fn",
            "activation_scheme": "dynamic",
            "weight_block_size": list(c["weight_block_size"]),
        }
    return d


def write_json_file(d: dict[str, Any], path: str | Path) -> None:
    """Write an HF config dict as config.json text (indented, with a final newline)."""
    Path(path).write_text(json.dumps(d, indent=2) + "\n")


# ----------------------------------------------------------------- HF readers
def _get(d: dict, *names: str, default: Any = None) -> Any:
    """The first of ``names`` present (and not None) in ``d``."""
    for n in names:
        if n in d and d[n] is not None:
            return d[n]
    return default


def _rope(d: dict, head_dim: int, default_theta: float, default_factor: float) -> tuple[int, float]:
    """(rotary_dim, rope_theta) from top-level fields or rope_parameters / rope_scaling."""
    rp = d.get("rope_parameters")
    if rp is None:
        rp = d.get("rope_scaling")
    if rp is not None and not isinstance(rp, dict):
        raise ConfigError("rope_parameters", f"must be a dict, got {type(rp).__name__}")
    rp = rp or {}
    rope_type = rp.get("rope_type", rp.get("type", "default"))
    if rope_type not in ("default", None):
        raise ConfigError("rope_parameters.rope_type", f"unsupported rope type {rope_type!r} (only 'default')")
    theta = _get(rp, "rope_theta", default=_get(d, "rope_theta", default=default_theta))
    factor = _get(rp, "partial_rotary_factor", default=_get(d, "partial_rotary_factor"))
    rotary_dim = _get(d, "rotary_dim", default=_get(rp, "rotary_dim"))
    if factor is not None and (isinstance(factor, bool) or not isinstance(factor, (int, float)) or not 0 < factor <= 1):
        raise ConfigError("partial_rotary_factor", f"must be in (0, 1], got {factor!r}")
    if rotary_dim is None:
        rotary_dim = int(head_dim * (factor if factor is not None else default_factor))
    elif factor is not None and int(head_dim * factor) != rotary_dim:
        raise ConfigError(
            "rotary_dim",
            f"rotary_dim {rotary_dim} disagrees with partial_rotary_factor {factor} x head_dim {head_dim}",
        )
    return rotary_dim, theta


def _head_dim(d: dict) -> int:
    hd = d.get("head_dim")
    if hd is None:
        hidden, heads = d.get("hidden_size"), d.get("num_attention_heads")
        if isinstance(hidden, int) and isinstance(heads, int) and heads > 0:
            hd = hidden // heads
    return hd


def _quant(d: dict) -> dict[str, Any]:
    q = d.get("quantization_config")
    if q is None:
        return {"quant_method": None}
    if not isinstance(q, dict):
        raise ConfigError("quantization_config", f"must be a dict, got {type(q).__name__}")
    method = q.get("quant_method")
    if method != "fp8":
        raise ConfigError("quantization_config.quant_method", f"unsupported quantization {method!r} (only 'fp8')")
    fmt = q.get("fmt", "float8_e4m3fn")
    if fmt not in ("float8_e4m3fn", "e4m3"):
        raise ConfigError("quantization_config.fmt", f"unsupported FP8 format {fmt!r} (only float8_e4m3fn)")
    block = q.get("weight_block_size", [128, 128])
    if not isinstance(block, (list, tuple)):
        raise ConfigError("weight_block_size", f"must be a list of two ints, got {block!r}")
    return {"quant_method": "fp8", "weight_block_size": tuple(block)}


def _layer_types(d: dict, n_layers: Any, default_dense: int) -> tuple[str, ...]:
    if "mlp_layer_types" in d and d["mlp_layer_types"] is not None:
        types = d["mlp_layer_types"]
        if not isinstance(types, (list, tuple)):
            raise ConfigError("mlp_layer_types", f"must be a list of per-layer types, got {types!r}")
        for i, t in enumerate(types):
            if t not in HF_MLP_TYPES:
                raise ConfigError("mlp_layer_types", f"layer {i}: {t!r} is not one of {list(HF_MLP_TYPES)}")
        return tuple(HF_MLP_TYPES[t] for t in types)  # transformers says "sparse" for a MoE layer
    freq = d.get("moe_layer_freq")
    if not isinstance(n_layers, int) or isinstance(n_layers, bool) or n_layers <= 0:
        raise ConfigError("num_hidden_layers", f"must be a positive integer, got {n_layers!r}")
    if freq is None:
        k = _get(d, "first_k_dense_replace", default=default_dense)
        return tuple("dense" if i < k else "moe" for i in range(n_layers))
    if isinstance(freq, (list, tuple)):
        out = []
        for i, v in enumerate(freq):
            if v in (0, 1, False, True):
                out.append("moe" if v else "dense")
            else:
                raise ConfigError("moe_layer_freq", f"entry {i} is {v!r}; expected 0 (dense) or 1 (MoE)")
        if len(out) != n_layers:
            raise ConfigError(
                "moe_layer_freq", f"has {len(out)} entries but num_hidden_layers is {n_layers}"
            )
        return tuple(out)
    if isinstance(freq, int) and not isinstance(freq, bool) and freq > 0:
        k = _get(d, "first_k_dense_replace", default=0)
        return tuple("moe" if i >= k and i % freq == 0 else "dense" for i in range(n_layers))
    raise ConfigError("moe_layer_freq", f"must be a list of 0/1 per layer or a positive int, got {freq!r}")


def _sparse(d: dict, n_layers: int, mlp_types: tuple[str, ...], head_dim: int) -> dict[str, Any]:
    """The indexer fields and the sparse layers, from transformers' flat names
    (index_*, layer_types) and/or M3's own sparse_attention_config, whose keys win
    where both are given (as transformers' MiniMaxM3VLTextConfig reads them)."""
    out = {
        "index_n_heads": _get(d, "index_n_heads", default=4),
        "index_head_dim": _get(d, "index_head_dim", default=head_dim),
        "index_topk_blocks": _get(d, "index_topk_blocks", default=16),
        "index_block_size": _get(d, "index_block_size", default=128),
        "index_local_blocks": _get(d, "index_local_blocks", default=1),
        "index_init_blocks": 0,
        "index_score_type": "max",
    }
    layer_types = d.get("layer_types")
    layers: tuple[int, ...] = ()
    if layer_types is not None:
        if not isinstance(layer_types, (list, tuple)) or len(layer_types) != n_layers:
            raise ConfigError("layer_types", f"must be a list of {n_layers} entries (one per layer), got {layer_types!r}")
        for i, t in enumerate(layer_types):
            if t not in HF_ATTENTION_TYPES:
                raise ConfigError("layer_types", f"layer {i}: {t!r} is not one of {list(HF_ATTENTION_TYPES)}")
        layers = tuple(i for i, t in enumerate(layer_types) if HF_ATTENTION_TYPES[t])
    sc = d.get("sparse_attention_config")
    if sc is None:
        out["sparse_attention_layers"] = layers
        return out
    if not isinstance(sc, dict):
        raise ConfigError("sparse_attention_config", f"must be a dict, got {type(sc).__name__}")
    unknown = sorted(set(sc) - set(SPARSE_KEYS))
    if unknown:
        raise ConfigError(f"sparse_attention_config.{unknown[0]}",
                          f"unknown key(s) {unknown}: this model cannot honour them (known: {list(SPARSE_KEYS)})")
    out["index_n_heads"] = _get(sc, "sparse_num_index_heads", "num_index_heads", "index_n_heads",
                                default=out["index_n_heads"])
    out["index_head_dim"] = _get(sc, "sparse_index_dim", "index_head_dim", default=out["index_head_dim"])
    out["index_topk_blocks"] = _get(sc, "sparse_topk_blocks", "index_topk_blocks", "index_topk",
                                    default=out["index_topk_blocks"])
    out["index_block_size"] = _get(sc, "sparse_block_size", "index_block_size", default=out["index_block_size"])
    out["index_local_blocks"] = _get(sc, "sparse_local_block", "index_local_blocks", default=out["index_local_blocks"])
    out["index_init_blocks"] = _get(sc, "sparse_init_block", default=0)
    out["index_score_type"] = _get(sc, "sparse_score_type", default="max")
    if not _get(sc, "sparse_disable_index_value", default=1):
        raise ConfigError("sparse_attention_config.sparse_disable_index_value",
                          "0 asks for the indexer's value path, which this model does not implement "
                          "(M3 ships with it disabled: 1)")
    if not sc.get("use_sparse_attention", True):
        out["sparse_attention_layers"] = ()
        return out
    ids = _get(sc, "sparse_attention_layers", "sparse_layer_ids")
    freq = sc.get("sparse_attention_freq")
    if ids is not None:
        if not isinstance(ids, (list, tuple)):
            raise ConfigError("sparse_attention_config.sparse_attention_layers", f"must be a list, got {ids!r}")
        layers = tuple(ids)
    elif freq is not None:
        if not isinstance(freq, (list, tuple)) or len(freq) != n_layers:
            raise ConfigError(
                "sparse_attention_config.sparse_attention_freq",
                f"must be a list of {n_layers} entries (one per layer), got {freq!r}",
            )
        layers = tuple(i for i, v in enumerate(freq) if v)
    elif layer_types is None:
        n_dense = 0
        while n_dense < len(mlp_types) and mlp_types[n_dense] == "dense":
            n_dense += 1
        layers = tuple(range(n_dense, n_layers))
    out["sparse_attention_layers"] = layers
    return out


def _aux(d: dict) -> tuple[int, ...]:
    a = d.get("aux_hidden_state_layers")
    if a is None:
        return ()
    if not isinstance(a, (list, tuple)):
        raise ConfigError("aux_hidden_state_layers", f"must be a list of layer ids, got {a!r}")
    return tuple(a)


def _common(d: dict) -> dict[str, Any]:
    return {
        "vocab_size": d.get("vocab_size"),
        "hidden_size": d.get("hidden_size"),
        "num_hidden_layers": d.get("num_hidden_layers"),
        "num_attention_heads": d.get("num_attention_heads"),
        "num_key_value_heads": _get(d, "num_key_value_heads", default=d.get("num_attention_heads")),
        "tie_word_embeddings": bool(d.get("tie_word_embeddings", False)),
        "aux_hidden_state_layers": _aux(d),
        **_quant(d),
    }


def _m3_activation(d: dict) -> str:
    """transformers' MiniMaxM3VLTextConfig rewrites hidden_act to "silu" (its modeling
    computes SwiGLU-OAI inline from swiglu_alpha / swiglu_limit and keeps hidden_act
    only as a fallback name), so a config it saved says "silu" for a SwiGLU-OAI model."""
    act = _get(d, "hidden_act", default="swigluoai")
    if d.get("model_type") == "minimax_m3_vl_text" and act == "silu":
        return "swigluoai"
    return act


def _read_m3(d: dict) -> dict[str, Any]:
    kw = _common(d)
    head_dim = _head_dim(d)
    kw["head_dim"] = head_dim
    if not isinstance(head_dim, int) or isinstance(head_dim, bool) or head_dim <= 0:
        raise ConfigError("head_dim", f"must be a positive integer, got {head_dim!r}")
    kw["rotary_dim"], kw["rope_theta"] = _rope(d, head_dim, 5_000_000.0, 0.5)
    n_layers = kw["num_hidden_layers"]
    mlp_types = _layer_types(d, n_layers, default_dense=3)
    kw["mlp_layer_types"] = mlp_types
    kw.update(_sparse(d, n_layers, mlp_types, head_dim))
    n_shared = _get(d, "n_shared_experts", default=1)
    kw.update(
        model_type="minimax_m3_text",
        max_position_embeddings=_get(d, "max_position_embeddings", default=1_048_576),
        rms_norm_eps=_get(d, "rms_norm_eps", default=1e-6),
        use_gemma_norm=bool(_get(d, "use_gemma_norm", default=True)),
        use_qk_norm=bool(_get(d, "use_qk_norm", default=True)),
        qk_norm_type=_get(d, "qk_norm_type", default="per_head"),
        hidden_act=_m3_activation(d),
        swiglu_alpha=_get(d, "swiglu_alpha", default=1.702),
        swiglu_beta=_get(d, "swiglu_beta", default=1.0),
        swiglu_limit=_get(d, "swiglu_limit", default=7.0),
        intermediate_size=d.get("intermediate_size"),
        dense_intermediate_size=_get(d, "dense_intermediate_size", default=0),
        shared_intermediate_size=_get(d, "shared_intermediate_size", default=0 if n_shared == 0 else None),
        n_shared_experts=n_shared,
        num_local_experts=_get(d, "num_local_experts", "num_experts"),
        num_experts_per_tok=d.get("num_experts_per_tok"),
        scoring_func=_get(d, "scoring_func", default="sigmoid"),
        use_routing_bias=bool(_get(d, "use_routing_bias", default=True)),
        routed_scaling_factor=_get(d, "routed_scaling_factor", default=1.0),
        norm_topk_prob=bool(_get(d, "norm_topk_prob", default=True)),
        num_mtp_modules=_get(d, "num_mtp_modules", default=0),
    )
    return kw


def _read_m2(d: dict) -> dict[str, Any]:
    kw = _common(d)
    # transformers' MiniMaxM2Config defaults fill what the dict leaves out.
    for key, default in (("vocab_size", 200064), ("hidden_size", 3072), ("num_hidden_layers", 62),
                         ("num_attention_heads", 48), ("num_key_value_heads", 8)):
        if kw[key] is None:
            kw[key] = default
    head_dim = _get(d, "head_dim", default=128)
    kw["head_dim"] = head_dim
    if not isinstance(head_dim, int) or isinstance(head_dim, bool) or head_dim <= 0:
        raise ConfigError("head_dim", f"must be a positive integer, got {head_dim!r}")
    kw["rotary_dim"], kw["rope_theta"] = _rope(d, head_dim, 5_000_000.0, 1.0)
    n_layers = kw["num_hidden_layers"]
    mlp_types = _layer_types(d, n_layers, default_dense=0)
    kw["mlp_layer_types"] = mlp_types
    kw.update(_sparse(d, n_layers, mlp_types, head_dim))
    shared = _get(d, "shared_intermediate_size", default=0)
    n_shared = _get(d, "n_shared_experts", default=1 if shared else 0)
    kw.update(
        model_type="minimax_m2",
        max_position_embeddings=_get(d, "max_position_embeddings", default=196608),
        rms_norm_eps=_get(d, "rms_norm_eps", default=1e-6),
        use_gemma_norm=bool(_get(d, "use_gemma_norm", default=False)),
        use_qk_norm=bool(_get(d, "use_qk_norm", default=True)),
        qk_norm_type=_get(d, "qk_norm_type", default="per_layer"),
        hidden_act=_get(d, "hidden_act", default="silu"),
        swiglu_alpha=_get(d, "swiglu_alpha", default=1.702),
        swiglu_beta=_get(d, "swiglu_beta", default=1.0),
        swiglu_limit=_get(d, "swiglu_limit", default=7.0),
        intermediate_size=_get(d, "intermediate_size", default=1536),
        dense_intermediate_size=_get(d, "dense_intermediate_size", default=0),
        shared_intermediate_size=shared,
        n_shared_experts=n_shared,
        num_local_experts=_get(d, "num_local_experts", "num_experts", default=256),
        num_experts_per_tok=_get(d, "num_experts_per_tok", default=8),
        scoring_func=_get(d, "scoring_func", default="sigmoid"),
        use_routing_bias=bool(_get(d, "use_routing_bias", default=True)),
        routed_scaling_factor=_get(d, "routed_scaling_factor", default=1.0),
        norm_topk_prob=bool(_get(d, "norm_topk_prob", default=True)),
        num_mtp_modules=_get(d, "num_mtp_modules", default=0) if d.get("use_mtp", False) else 0,
    )
    return kw
