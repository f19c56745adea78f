"""The model configuration: one frozen dataclass for MiniMax-M3 and MiniMax-M2.

``MiniMaxConfig`` holds every value the model needs; each is checked when the
object is made, and an impossible value raises ``ConfigError`` (model/config_error.py)
naming the field. The class also has the conveniences the model code uses
(``moe_layers``, ``is_sparse_layer``, ``replace``, ...).

Its methods that do more delegate to their own modules, which take plain field
values: ``validate_for_parallel(tp, ep)`` to model/parallel_layout.py (can the
model be sharded over ``tp`` tensor-parallel / ``ep`` expert-parallel ranks),
``from_hf_dict`` / ``from_json_file`` / ``to_hf_dict`` / ``to_json_file`` to
model/hf_config.py (Hugging Face ``config.json``, where the fields read are
listed). The named presets are in model/presets.py.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from . import hf_config, parallel_layout
from .config_error import ConfigError

__all__ = ["MiniMaxConfig"]

MODEL_TYPES = ("minimax_m3_text", "minimax_m2")
HIDDEN_ACTS = ("swigluoai", "silu")
QK_NORM_TYPES = ("per_head", "per_layer")
SCORING_FUNCS = ("sigmoid",)
QUANT_METHODS = (None, "fp8")
MLP_TYPES = ("dense", "moe")
SCORE_TYPES = ("max",)

# Aliases seen in the wild for the activation names.
_ACT_ALIASES = {"swiglu_oai": "swigluoai", "swiglu-oai": "swigluoai", "swish": "silu"}


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

    def _field_values(self) -> dict[str, Any]:
        """Field name -> value, the plain form the helper modules take."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}

    # ---------------------------------------------------------- parallel check
    def validate_for_parallel(self, tp_size: int, ep_size: int = 1) -> None:
        """Raise ConfigError if the model cannot be sharded over tp_size x ep_size.

        See ``parallel_layout.validate_for_parallel`` for the layout assumed
        (heads, vocab, dense MLP and shared expert over ``tp_size``; routed
        experts over ``ep_size``; FP8 pieces on whole weight blocks).
        """
        parallel_layout.validate_for_parallel(self._field_values(), tp_size, ep_size)

    # ------------------------------------------------------------- HF reading
    @classmethod
    def from_hf_dict(cls, d: dict[str, Any]) -> "MiniMaxConfig":
        """Read a Hugging Face config dict (M3 text, M3 VL with text_config, or M2)."""
        return cls(**hf_config.config_kwargs_from_hf_dict(d))

    @classmethod
    def from_json_file(cls, path: str | Path) -> "MiniMaxConfig":
        """Read a config.json file, or the config.json inside a checkpoint directory."""
        return cls.from_hf_dict(hf_config.read_json_file(path))

    # ------------------------------------------------------------- HF writing
    def to_hf_dict(self) -> dict[str, Any]:
        """The HF config.json dict; ``from_hf_dict(to_hf_dict())`` gives this config back."""
        return hf_config.hf_dict_from_config_fields(self._field_values())

    def to_json_file(self, path: str | Path) -> None:
        hf_config.write_json_file(self.to_hf_dict(), path)
