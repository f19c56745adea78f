"""The model configuration: one frozen dataclass for MiniMax-M3 and MiniMax-M2.

``MiniMaxConfig`` is read from a Hugging Face ``config.json`` (``from_hf_dict``
/ ``from_json_file``) and written back in the same format (``to_hf_dict``).
Every value is checked when the object is made; an impossible value raises
``ConfigError`` naming the field. ``validate_for_parallel(tp, ep)`` checks that
the model can be sharded over ``tp`` tensor-parallel / ``ep`` expert-parallel
ranks.

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

import dataclasses
import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = ["MiniMaxConfig", "ConfigError", "load_preset", "PRESET_NAMES", "PRESET_DIR"]

PRESET_DIR = Path(__file__).resolve().parent / "presets"
PRESET_NAMES: tuple[str, ...] = ("tiny-m3", "tiny-m3-fp8", "tiny-m2", "m3", "m3-slice")

MODEL_TYPES = ("minimax_m3_text", "minimax_m2")
HIDDEN_ACTS = ("swigluoai", "silu")
QK_NORM_TYPES = ("per_head", "per_layer")
SCORING_FUNCS = ("sigmoid",)
QUANT_METHODS = (None, "fp8")
MLP_TYPES = ("dense", "moe")
SCORE_TYPES = ("max",)
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

# Aliases seen in the wild for the activation names.
_ACT_ALIASES = {"swiglu_oai": "swigluoai", "swiglu-oai": "swigluoai", "swish": "silu"}


class ConfigError(ValueError):
    """An impossible or unsupported configuration value. ``.field`` names the field."""

    def __init__(self, field_name: str, message: str):
        self.field = field_name
        super().__init__(f"{field_name}: {message}")


@dataclass(frozen=True)
class MiniMaxConfig:
    """Everything the model needs to know. Defaults are the real MiniMax-M3."""

    model_type: str = "minimax_m3_text"
    vocab_size: int = 200064
    hidden_size: int = 6144
    num_hidden_layers: int = 60
    num_attention_heads: int = 64
    num_key_value_heads: int = 4
    head_dim: int = 128
    rotary_dim: int = 64  # NeoX RoPE on the first rotary_dim dims of each head
    rope_theta: float = 5_000_000.0
    max_position_embeddings: int = 1_048_576
    rms_norm_eps: float = 1e-6
    use_gemma_norm: bool = True  # x / rms(x) * (1 + w); False: x / rms(x) * w
    use_qk_norm: bool = True
    qk_norm_type: str = "per_head"  # "per_head" (M3) | "per_layer" (M2: whole projection)
    hidden_act: str = "swigluoai"  # "swigluoai" (M3) | "silu" (M2)
    swiglu_alpha: float = 1.702
    swiglu_limit: float = 7.0
    swiglu_beta: float = 1.0  # the "+ beta" on the up branch
    intermediate_size: int = 3072  # one routed expert
    dense_intermediate_size: int = 12288  # the MLP of the dense layers
    shared_intermediate_size: int = 3072  # the shared expert; 0 = none
    num_local_experts: int = 128
    num_experts_per_tok: int = 4
    n_shared_experts: int = 1
    scoring_func: str = "sigmoid"
    use_routing_bias: bool = True  # e_score_correction_bias, used for selection only
    routed_scaling_factor: float = 2.0
    norm_topk_prob: bool = True  # renormalize the selected scores to sum 1
    mlp_layer_types: tuple[str, ...] = ("dense",) * 3 + ("moe",) * 57
    sparse_attention_layers: tuple[int, ...] = tuple(range(3, 60))
    index_n_heads: int = 4
    index_head_dim: int = 128
    index_topk_blocks: int = 16
    index_block_size: int = 128
    index_local_blocks: int = 1  # the query's own block and the ones before it, always kept
    index_init_blocks: int = 0  # the first blocks of the sequence, always kept
    index_score_type: str = "max"  # how key scores pool into a block score
    num_mtp_modules: int = 1
    tie_word_embeddings: bool = False
    aux_hidden_state_layers: tuple[int, ...] = ()
    weight_block_size: tuple[int, int] = (128, 128)
    quant_method: str | None = None  # None | "fp8"

    # ------------------------------------------------------------------ checks
    def __post_init__(self) -> None:
        # Normalize containers (lists from JSON) to tuples so the config stays hashable.
        for name in ("mlp_layer_types", "sparse_attention_layers", "aux_hidden_state_layers", "weight_block_size"):
            value = getattr(self, name)
            if isinstance(value, (list, tuple)):
                object.__setattr__(self, name, tuple(value))
            else:
                raise ConfigError(name, f"must be a list or tuple, got {type(value).__name__}")
        act = _ACT_ALIASES.get(self.hidden_act, self.hidden_act)
        object.__setattr__(self, "hidden_act", act)
        self._validate()

    def _validate(self) -> None:
        def positive_int(name: str) -> None:
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
                raise ConfigError(name, f"must be a positive integer, got {v!r}")

        def non_negative_int(name: str) -> None:
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 0:
                raise ConfigError(name, f"must be a non-negative integer, got {v!r}")

        def positive_number(name: str) -> None:
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v <= 0:
                raise ConfigError(name, f"must be a positive finite number, got {v!r}")

        def one_of(name: str, allowed: tuple) -> None:
            v = getattr(self, name)
            if v not in allowed:
                raise ConfigError(name, f"unsupported value {v!r}; expected one of {list(allowed)}")

        def boolean(name: str) -> None:
            if not isinstance(getattr(self, name), bool):
                raise ConfigError(name, f"must be a bool, got {getattr(self, name)!r}")

        one_of("model_type", MODEL_TYPES)
        for name in ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
                     "num_key_value_heads", "head_dim", "max_position_embeddings"):
            positive_int(name)
        for name in ("rope_theta", "rms_norm_eps", "swiglu_alpha", "swiglu_limit", "routed_scaling_factor"):
            positive_number(name)
        if isinstance(self.swiglu_beta, bool) or not isinstance(self.swiglu_beta, (int, float)):
            raise ConfigError("swiglu_beta", f"must be a number, got {self.swiglu_beta!r}")
        for name in ("use_gemma_norm", "use_qk_norm", "use_routing_bias", "norm_topk_prob", "tie_word_embeddings"):
            boolean(name)
        one_of("qk_norm_type", QK_NORM_TYPES)
        one_of("hidden_act", HIDDEN_ACTS)
        one_of("scoring_func", SCORING_FUNCS)
        one_of("quant_method", QUANT_METHODS)

        if self.num_attention_heads % self.num_key_value_heads:
            raise ConfigError(
                "num_key_value_heads",
                f"{self.num_key_value_heads} does not divide num_attention_heads {self.num_attention_heads}",
            )
        positive_int("rotary_dim")
        if self.rotary_dim > self.head_dim:
            raise ConfigError("rotary_dim", f"{self.rotary_dim} is larger than head_dim {self.head_dim}")
        if self.rotary_dim % 2:
            raise ConfigError("rotary_dim", f"must be even (NeoX RoPE rotates pairs), got {self.rotary_dim}")

        # Per-layer MLP types.
        if len(self.mlp_layer_types) != self.num_hidden_layers:
            raise ConfigError(
                "mlp_layer_types",
                f"has {len(self.mlp_layer_types)} entries but num_hidden_layers is {self.num_hidden_layers}",
            )
        for i, t in enumerate(self.mlp_layer_types):
            if t not in MLP_TYPES:
                raise ConfigError("mlp_layer_types", f"layer {i}: {t!r} is not one of {list(MLP_TYPES)}")
        has_moe = "moe" in self.mlp_layer_types
        has_dense = "dense" in self.mlp_layer_types

        # Dense MLP.
        non_negative_int("dense_intermediate_size")
        if has_dense and self.dense_intermediate_size == 0:
            raise ConfigError("dense_intermediate_size", "must be positive when some layers are dense")

        # MoE.
        for name in ("intermediate_size", "num_local_experts", "num_experts_per_tok"):
            positive_int(name) if has_moe else non_negative_int(name)
        if has_moe and self.num_experts_per_tok > self.num_local_experts:
            raise ConfigError(
                "num_experts_per_tok",
                f"top-k {self.num_experts_per_tok} is larger than num_local_experts {self.num_local_experts}",
            )
        non_negative_int("n_shared_experts")
        non_negative_int("shared_intermediate_size")
        if self.n_shared_experts > 1:
            raise ConfigError(
                "n_shared_experts",
                f"{self.n_shared_experts} shared experts are not supported (0 or 1; "
                "shared_intermediate_size is the width of the one shared expert)",
            )
        if (self.n_shared_experts == 0) != (self.shared_intermediate_size == 0):
            raise ConfigError(
                "shared_intermediate_size",
                f"{self.shared_intermediate_size} is inconsistent with n_shared_experts {self.n_shared_experts} "
                "(both zero or both positive)",
            )

        # Sparse attention and its indexer.
        self._check_layer_ids("sparse_attention_layers", self.sparse_attention_layers)
        index_fields = ("index_n_heads", "index_head_dim", "index_topk_blocks", "index_block_size",
                        "index_local_blocks")
        for name in index_fields:
            positive_int(name) if self.sparse_attention_layers else non_negative_int(name)
        non_negative_int("index_init_blocks")
        one_of("index_score_type", SCORE_TYPES)
        if self.sparse_attention_layers:
            self._check_indexer()

        non_negative_int("num_mtp_modules")
        self._check_layer_ids("aux_hidden_state_layers", self.aux_hidden_state_layers)

        if len(self.weight_block_size) != 2 or any(
            isinstance(b, bool) or not isinstance(b, int) or b <= 0 for b in self.weight_block_size
        ):
            raise ConfigError("weight_block_size", f"must be two positive integers, got {self.weight_block_size!r}")

    def _check_indexer(self) -> None:
        if self.index_local_blocks + self.index_init_blocks > self.index_topk_blocks:
            raise ConfigError(
                "index_local_blocks",
                f"{self.index_local_blocks} local + {self.index_init_blocks} init blocks do not fit in "
                f"index_topk_blocks {self.index_topk_blocks}",
            )
        heads, kv, idx = self.num_attention_heads, self.num_key_value_heads, self.index_n_heads
        if heads % idx or idx % kv:
            raise ConfigError(
                "index_n_heads",
                f"{idx} index heads must divide num_attention_heads {heads} and be a multiple of "
                f"num_key_value_heads {kv} (each index head serves query heads of one KV group)",
            )
        if self.rotary_dim > self.index_head_dim:
            raise ConfigError("index_head_dim", f"{self.index_head_dim} is smaller than rotary_dim {self.rotary_dim} "
                                                "(the indexer uses the main branch's RoPE)")

    def _check_layer_ids(self, name: str, ids: tuple[int, ...]) -> None:
        for i in ids:
            if isinstance(i, bool) or not isinstance(i, int) or not 0 <= i < self.num_hidden_layers:
                raise ConfigError(name, f"layer id {i!r} is out of range [0, {self.num_hidden_layers})")
        if len(set(ids)) != len(ids):
            raise ConfigError(name, f"has repeated layer ids: {list(ids)}")

    # ------------------------------------------------------------ conveniences
    @property
    def is_m3(self) -> bool:
        return self.model_type == "minimax_m3_text"

    @property
    def is_fp8(self) -> bool:
        return self.quant_method == "fp8"

    @property
    def moe_layers(self) -> tuple[int, ...]:
        return tuple(i for i, t in enumerate(self.mlp_layer_types) if t == "moe")

    @property
    def dense_layers(self) -> tuple[int, ...]:
        return tuple(i for i, t in enumerate(self.mlp_layer_types) if t == "dense")

    def is_moe_layer(self, i: int) -> bool:
        return self.mlp_layer_types[i] == "moe"

    def is_sparse_layer(self, i: int) -> bool:
        return i in self.sparse_attention_layers

    def replace(self, **changes: Any) -> "MiniMaxConfig":
        """A copy with some fields changed (validated again).

        Changing ``num_hidden_layers`` without giving ``mlp_layer_types`` keeps the
        leading layer types and fills new layers with the last layer's type;
        sparse and aux layer ids beyond the new depth are dropped, and new layers
        are sparse when the last old layer was sparse.
        """
        n = changes.get("num_hidden_layers", self.num_hidden_layers)
        if n != self.num_hidden_layers and isinstance(n, int) and n > 0:
            if "mlp_layer_types" not in changes:
                types = list(self.mlp_layer_types[:n])
                types += [self.mlp_layer_types[-1]] * (n - len(types))
                changes["mlp_layer_types"] = tuple(types)
            if "sparse_attention_layers" not in changes:
                sparse = [i for i in self.sparse_attention_layers if i < n]
                if self.sparse_attention_layers and self.sparse_attention_layers[-1] == self.num_hidden_layers - 1:
                    sparse += list(range(self.num_hidden_layers, n))
                changes["sparse_attention_layers"] = tuple(sparse)
            if "aux_hidden_state_layers" not in changes:
                changes["aux_hidden_state_layers"] = tuple(i for i in self.aux_hidden_state_layers if i < n)
        unknown = set(changes) - {f.name for f in dataclasses.fields(self)}
        if unknown:
            raise ConfigError(sorted(unknown)[0], f"not a MiniMaxConfig field (unknown: {sorted(unknown)})")
        return dataclasses.replace(self, **changes)

    # ---------------------------------------------------------- parallel check
    def validate_for_parallel(self, tp_size: int, ep_size: int = 1) -> None:
        """Raise ConfigError if the model cannot be sharded over tp_size x ep_size.

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
        if self.num_attention_heads % tp_size:
            raise ConfigError(
                "num_attention_heads",
                f"{self.num_attention_heads} heads are not divisible by tp_size {tp_size}",
            )
        kv = self.num_key_value_heads
        if kv % tp_size and tp_size % kv:
            raise ConfigError(
                "num_key_value_heads",
                f"{kv} KV heads neither divide nor are divisible by tp_size {tp_size}",
            )
        idx = self.index_n_heads
        if self.sparse_attention_layers and idx % tp_size and tp_size % idx:
            raise ConfigError(
                "index_n_heads",
                f"{idx} index heads neither divide nor are divisible by tp_size {tp_size}",
            )
        if self.vocab_size % tp_size:
            raise ConfigError("vocab_size", f"{self.vocab_size} is not divisible by tp_size {tp_size}")
        if self.dense_layers and self.dense_intermediate_size % tp_size:
            raise ConfigError(
                "dense_intermediate_size",
                f"{self.dense_intermediate_size} is not divisible by tp_size {tp_size}",
            )
        if self.shared_intermediate_size % tp_size:
            raise ConfigError(
                "shared_intermediate_size",
                f"{self.shared_intermediate_size} is not divisible by tp_size {tp_size}",
            )
        moe_tp = tp_size // ep_size
        if self.moe_layers:
            if self.num_local_experts % ep_size:
                raise ConfigError(
                    "num_local_experts",
                    f"{self.num_local_experts} experts are not divisible by ep_size {ep_size}",
                )
            if self.intermediate_size % moe_tp:
                raise ConfigError(
                    "intermediate_size",
                    f"{self.intermediate_size} is not divisible by the MoE TP size {moe_tp} "
                    f"(tp_size {tp_size} / ep_size {ep_size})",
                )
        if self.is_fp8:
            self._check_fp8_blocks(tp_size, moe_tp)

    def _check_fp8_blocks(self, tp_size: int, moe_tp: int) -> None:
        bn, bk = self.weight_block_size
        kv_local = max(self.num_key_value_heads // tp_size, 1)
        # (field, per-rank length, block, what it is)
        pieces = [
            ("num_attention_heads", self.num_attention_heads // tp_size * self.head_dim, bn,
             "q_proj rows per rank (heads/tp * head_dim)"),
            ("num_key_value_heads", kv_local * self.head_dim, bn, "k_proj/v_proj rows per rank"),
            ("num_attention_heads", self.num_attention_heads // tp_size * self.head_dim, bk,
             "o_proj columns per rank"),
        ]
        if self.sparse_attention_layers:
            pieces.append(("index_n_heads", max(self.index_n_heads // tp_size, 1) * self.index_head_dim, bn,
                           "index_q_proj rows per rank"))
        if self.dense_layers:
            pieces.append(("dense_intermediate_size", self.dense_intermediate_size // tp_size, bn,
                           "dense gate/up rows (and down columns) per rank"))
        if self.shared_intermediate_size:
            pieces.append(("shared_intermediate_size", self.shared_intermediate_size // tp_size, bn,
                           "shared expert gate/up rows (and down columns) per rank"))
        if self.moe_layers:
            pieces.append(("intermediate_size", self.intermediate_size // moe_tp, bn,
                           "expert w1/w3 rows (and w2 columns) per rank"))
        for name, length, block, what in pieces:
            if length % block:
                raise ConfigError(
                    name,
                    f"FP8 {what} = {length} is not a multiple of the weight block {block} "
                    f"at tp_size {tp_size} (weight_block_size {list(self.weight_block_size)})",
                )

    # ------------------------------------------------------------- HF reading
    @classmethod
    def from_hf_dict(cls, d: dict[str, Any]) -> "MiniMaxConfig":
        """Read a Hugging Face config dict (M3 text, M3 VL with text_config, or M2)."""
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
            return cls.from_hf_dict(text)
        if model_type in ("minimax_m3_text", "minimax_m3_vl_text"):
            return cls(**_read_m3(d))
        if model_type == "minimax_m2":
            return cls(**_read_m2(d))
        raise ConfigError(
            "model_type",
            f"unknown model_type {model_type!r}; expected one of "
            f"{['minimax_m3_text', 'minimax_m3_vl', 'minimax_m3_vl_text', 'minimax_m2']}",
        )

    @classmethod
    def from_json_file(cls, path: str | Path) -> "MiniMaxConfig":
        """Read a config.json file, or the config.json inside a checkpoint directory."""
        p = Path(path)
        if p.is_dir():
            p = p / "config.json"
        try:
            d = json.loads(p.read_text())
        except FileNotFoundError:
            raise ConfigError("path", f"no config file at {p}") from None
        except json.JSONDecodeError as e:
            raise ConfigError("path", f"{p} is not valid JSON: {e}") from None
        return cls.from_hf_dict(d)

    # ------------------------------------------------------------- HF writing
    def to_hf_dict(self) -> dict[str, Any]:
        """The HF config.json dict; ``from_hf_dict(to_hf_dict())`` gives this config back."""
        d: dict[str, Any] = {
            "model_type": self.model_type,
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "num_hidden_layers": self.num_hidden_layers,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.head_dim,
            "max_position_embeddings": self.max_position_embeddings,
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta,
            "rotary_dim": self.rotary_dim,
            "partial_rotary_factor": self.rotary_dim / self.head_dim,
            "hidden_act": self.hidden_act,
            "use_qk_norm": self.use_qk_norm,
            "qk_norm_type": self.qk_norm_type,
            "intermediate_size": self.intermediate_size,
            "num_local_experts": self.num_local_experts,
            "num_experts_per_tok": self.num_experts_per_tok,
            "scoring_func": self.scoring_func,
            "use_routing_bias": self.use_routing_bias,
            "routed_scaling_factor": self.routed_scaling_factor,
            "norm_topk_prob": self.norm_topk_prob,
            "tie_word_embeddings": self.tie_word_embeddings,
        }
        if self.model_type == "minimax_m2":
            d["architectures"] = ["MiniMaxM2ForCausalLM"]
            d["rope_parameters"] = {
                "rope_type": "default",
                "rope_theta": self.rope_theta,
                "partial_rotary_factor": self.rotary_dim / self.head_dim,
            }
            d["use_mtp"] = self.num_mtp_modules > 0
            d["num_mtp_modules"] = self.num_mtp_modules
            d["shared_intermediate_size"] = 0
            # M2 fixes these; write them only if a caller changed them, so we read them back.
            if self.use_gemma_norm:
                d["use_gemma_norm"] = True
            if self.hidden_act != "silu":
                d.update(swiglu_alpha=self.swiglu_alpha, swiglu_beta=self.swiglu_beta, swiglu_limit=self.swiglu_limit)
        else:
            d["architectures"] = ["MiniMaxM3ForCausalLM"]
            d.update(
                use_gemma_norm=self.use_gemma_norm,
                swiglu_alpha=self.swiglu_alpha,
                swiglu_beta=self.swiglu_beta,
                swiglu_limit=self.swiglu_limit,
                dense_intermediate_size=self.dense_intermediate_size,
                shared_intermediate_size=self.shared_intermediate_size,
                n_shared_experts=self.n_shared_experts,
                num_mtp_modules=self.num_mtp_modules,
                moe_layer_freq=[1 if t == "moe" else 0 for t in self.mlp_layer_types],
            )
            d["sparse_attention_config"] = {
                "use_sparse_attention": bool(self.sparse_attention_layers),
                "sparse_attention_freq": [
                    1 if i in self.sparse_attention_layers else 0 for i in range(self.num_hidden_layers)
                ],
                "sparse_num_index_heads": self.index_n_heads,
                "sparse_index_dim": self.index_head_dim,
                "sparse_topk_blocks": self.index_topk_blocks,
                "sparse_block_size": self.index_block_size,
                "sparse_score_type": self.index_score_type,
                "sparse_init_block": self.index_init_blocks,
                "sparse_local_block": self.index_local_blocks,
                "sparse_disable_index_value": 1,
            }
        if self.model_type == "minimax_m2" and (
            self.dense_layers or self.sparse_attention_layers or self.shared_intermediate_size
        ):
            # Not expressible in a real M2 config; keep them so the round trip holds.
            d["moe_layer_freq"] = [1 if t == "moe" else 0 for t in self.mlp_layer_types]
            d["dense_intermediate_size"] = self.dense_intermediate_size
            d["shared_intermediate_size"] = self.shared_intermediate_size
            d["n_shared_experts"] = self.n_shared_experts
        if self.aux_hidden_state_layers:
            d["aux_hidden_state_layers"] = list(self.aux_hidden_state_layers)
        if self.quant_method == "fp8":
            d["quantization_config"] = {
                "quant_method": "fp8",
                "fmt": "float8_e4m3fn",
                "activation_scheme": "dynamic",
                "weight_block_size": list(self.weight_block_size),
            }
        return d

    def to_json_file(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_hf_dict(), indent=2) + "\n")


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


# -------------------------------------------------------------------- presets
def load_preset(name: str) -> MiniMaxConfig:
    """One of PRESET_NAMES, read from model/presets/<name>.json (HF format)."""
    if name not in PRESET_NAMES:
        raise ConfigError("preset", f"unknown preset {name!r}; expected one of {list(PRESET_NAMES)}")
    return MiniMaxConfig.from_json_file(PRESET_DIR / f"{name}.json")
