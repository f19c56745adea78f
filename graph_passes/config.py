"""The one config object of the backend: every switch and threshold.

Users pass it as ``torch.compile(model, backend="minimax", options={...})``
(a dict, or a ``BackendConfig``); with no options the JSON in the
``MINIMAX_OPTIONS`` environment variable is used, so a launcher can steer a
compile without touching the code. Unknown keys and wrong types are errors
that name the field (a typo must never silently fall back to a default).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
from dataclasses import dataclass, field
from typing import Any, Mapping

ENV_VAR = "MINIMAX_OPTIONS"

MODES = ("auto", "on", "off")
CODEGENS = ("inductor", "fx")


class BackendOptionError(ValueError):
    """An option the backend does not know, or a value of the wrong kind."""


def _pass_switch(doc: str):
    """The auto/on/off field of the pass of the same name (graph_passes/<name>.py)."""
    return field(default="auto", metadata={"choices": MODES, "pass": True, "doc": doc})


@dataclass(frozen=True)
class BackendConfig:
    # Per-pass switch: "auto" follows the pass's own rule, "on" forces it (and
    # makes finding nothing a failure), "off" skips it. The passes run in this
    # order, between a cleanup first and last (PASS_SWITCHES, DEFAULT_ORDER).
    moe_canonicalize: str = _pass_switch("eager MoE -> one minimax::moe op")
    fuse_indexer_qkv: str = _pass_switch("sparse layers: QKV + indexer projections -> one GEMM")
    sequence_parallel: str = _pass_switch("residual stream split by token across TP ranks")
    fuse_norm_quant: str = _pass_switch("RMSNorm + FP8 quantize -> one kernel")
    fuse_norm_rope: str = _pass_switch("per-head RMSNorm (QK norm) + RoPE -> one kernel")
    gemm_reduce_scatter: str = _pass_switch("matmul + reduce-scatter -> one overlapped op")
    moe_lower: str = _pass_switch("minimax::moe -> MegaMoE (dispatch, expert GEMMs, combine)")
    fuse_allreduce_norm_quant: str = _pass_switch("all-reduce + residual add + RMSNorm + FP8 quant -> one op")

    # Fused GEMM-RS only at or above this many tokens (matmul + RS below): from here on it
    # was never slower at any K, BF16 or FP8 (docs/measurements/2026-11-30.md, "GEMM + reduce-scatter").
    gemm_rs_min_tokens: int = 512
    # fuse_allreduce_norm_quant up to this many tokens (where engines use a one-shot
    # all-reduce); not measured yet on our GPUs.
    allreduce_fusion_max_tokens: int = 128
    # Sequence parallelism (auto) only at or above this many tokens: below it, it cost time at
    # decode sizes; sizes between 16 and 1024 are not measured, so off there until they are
    # (docs/measurements/2026-11-30.md, "End to end").
    sequence_parallel_min_tokens: int = 1024
    # The FP8 format: 1 x 128 activation groups, 128 x 128 weight blocks (what Hopper's
    # kernels take). The only one implemented; MXFP8 (groups of 32) needs Blackwell.
    quant_format: str = field(default="fp8_block128", metadata={"choices": ("fp8_block128",)})
    # Gather FP8 data + scales instead of BF16 before the QKV GEMM (half the bytes).
    fp8_allgather: bool = False

    # An enabled pass that matches nothing it should have: error (strict) or warning.
    strict: bool = False
    # Where GraphDumper writes one dump per compile; None = op counts in memory only.
    dump_dir: str | None = field(default=None, metadata={"hash": False})
    codegen: str = field(default="inductor", metadata={"choices": CODEGENS})
    # Capture the generated code in CUDA graphs, one per token count up to the
    # largest bucket (graph_passes/cudagraph_capture.py); skipped on CPU.
    cudagraphs: bool = True
    # Sizes callers pad to (graph_passes/bucketing.py); rounded up to a multiple of
    # the TP size under sequence parallelism. Larger inputs run without a graph.
    cudagraph_buckets: tuple[int, ...] = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192)
    # Return copies of the graph's output buffers, so earlier results stay valid
    # after the next replay; False hands out the buffers themselves (faster).
    cudagraph_copy_outputs: bool = True
    # Let Dynamo check the model's parameters through their modules' dict tags: one check
    # per unchanged module tree instead of one per tensor (M3's ~1600 expert weights cost
    # ~2 ms of guards per call on the CPU machine). A parameter replaced in its module is
    # still caught; a tensor resized in place is not. Sets torch._dynamo.config's
    # use_recursive_dict_tags_for_guards for the process (it has no per-compile scope).
    module_dict_guards: bool = True

    # Hints the graph cannot tell: None = read from the graph's collectives /
    # torch.distributed (tp) or assume no expert parallelism (ep = 1).
    tp_size: int | None = None
    ep_size: int | None = None
    pp_size: int = 1

    def __post_init__(self):
        if isinstance(self.dump_dir, os.PathLike):
            object.__setattr__(self, "dump_dir", os.fspath(self.dump_dir))
        for f in dataclasses.fields(self):
            _check_field(f, getattr(self, f.name))
        if self.tp_size and self.ep_size and self.tp_size % self.ep_size:
            raise BackendOptionError(f"ep_size={self.ep_size} must divide tp_size={self.tp_size}")

    # ---- construction -------------------------------------------------
    @classmethod
    def valid_keys(cls) -> list[str]:
        return [f.name for f in dataclasses.fields(cls)]

    @classmethod
    def from_options(cls, options: "BackendConfig | Mapping[str, Any] | None" = None) -> "BackendConfig":
        """None (then $MINIMAX_OPTIONS, then defaults), a dict, or a BackendConfig."""
        if isinstance(options, BackendConfig):
            return options
        if options is None:
            raw = os.environ.get(ENV_VAR, "").strip()
            if not raw:
                return cls()
            try:
                options = json.loads(raw)
            except json.JSONDecodeError as e:
                raise BackendOptionError(f"${ENV_VAR} is not valid JSON: {e}") from None
            if not isinstance(options, dict):
                raise BackendOptionError(f"${ENV_VAR} must hold a JSON object, got {type(options).__name__}")
        if not isinstance(options, Mapping):
            raise BackendOptionError(
                f"minimax backend options must be a dict or BackendConfig, got {type(options).__name__}"
            )
        valid = cls.valid_keys()
        unknown = sorted(set(options) - set(valid))
        if unknown:
            raise BackendOptionError(
                f"unknown minimax backend option(s) {unknown}; valid keys: {', '.join(valid)}"
            )
        kw = dict(options)
        if isinstance(kw.get("cudagraph_buckets"), list):  # JSON has no tuples
            kw["cudagraph_buckets"] = tuple(kw["cudagraph_buckets"])
        return cls(**kw)

    def replace(self, **changes) -> "BackendConfig":
        return self.from_options({**self.to_dict(), **changes})

    # ---- identity ------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def stable_hash(self) -> str:
        """sha256 of the fields that change the generated code (not dump_dir)."""
        d = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.metadata.get("hash", True)}
        return hashlib.sha256(json.dumps(d, sort_keys=True).encode()).hexdigest()

    def mode(self, pass_name: str) -> str:
        return getattr(self, pass_name)


_TYPES = {
    "gemm_rs_min_tokens": int,
    "allreduce_fusion_max_tokens": int,
    "sequence_parallel_min_tokens": int,
    "fp8_allgather": bool,
    "strict": bool,
    "cudagraphs": bool,
    "cudagraph_copy_outputs": bool,
    "module_dict_guards": bool,
    "pp_size": int,
}


def _check_field(f: dataclasses.Field, value: Any) -> None:
    name = f.name
    choices = f.metadata.get("choices")
    if choices is not None:
        if value not in choices:
            raise BackendOptionError(f"option {name}={value!r}: must be one of {', '.join(map(repr, choices))}")
        return
    want = _TYPES.get(name)
    if want is bool:
        if not isinstance(value, bool):
            raise BackendOptionError(f"option {name}={value!r}: must be a bool")
    elif want is int:
        if isinstance(value, bool) or not isinstance(value, int) or value < (0 if name.endswith("_min_tokens") else 1):
            raise BackendOptionError(f"option {name}={value!r}: must be a positive int")
    elif name in ("tp_size", "ep_size"):
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
            raise BackendOptionError(f"option {name}={value!r}: must be None or an int >= 1")
    elif name == "dump_dir":
        if value is not None and not isinstance(value, (str, os.PathLike)):
            raise BackendOptionError(f"option dump_dir={value!r}: must be a path string or None")
    elif name == "cudagraph_buckets":
        ok = isinstance(value, tuple) and value and all(
            isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in value
        )
        if not ok or list(value) != sorted(set(value)):
            raise BackendOptionError(
                f"option cudagraph_buckets={value!r}: must be a non-empty increasing tuple of positive ints"
            )


# The passes with a switch, in pipeline order, and the whole pipeline (cleanup first and last).
PASS_SWITCHES: tuple[str, ...] = tuple(f.name for f in dataclasses.fields(BackendConfig) if f.metadata.get("pass"))
DEFAULT_ORDER: tuple[str, ...] = ("cleanup", *PASS_SWITCHES, "cleanup")
