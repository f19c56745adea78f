"""The pass manager: runs the ordered passes on the WHOLE ATen graph.

Sequence parallelism changes the residual's shape across layers, so every
pass sees the full graph, never pieces. After each pass the manager lints
and recompiles the graph, checks each node still carries its fake value,
records a dump stage, logs one line, and holds the pass to what it found:
an enabled pass that expected matches and found none is a ``PassError``
in strict mode and a loud warning otherwise.
"""

from __future__ import annotations

import hashlib
import logging
import time
import warnings
from typing import Iterable, Sequence

import torch.fx

from .base import GraphPass, PassContext, PassError, PassResult, PassWarning
from .config import PASS_SWITCHES, BackendConfig

log = logging.getLogger("minimax")

DEFAULT_ORDER: tuple[str, ...] = (
    "cleanup",
    "moe_canonicalize",
    "fuse_indexer_qkv",
    "sequence_parallel",
    "fuse_norm_quant",
    "gemm_reduce_scatter",
    "moe_lower",
    "cleanup",
)

_REGISTRY: dict[str, type[GraphPass]] = {}


def register_pass(cls: type[GraphPass] | None = None, *, replace: bool = False):
    """Class decorator: make a pass available to the pipeline under ``cls.name``."""

    def add(c: type[GraphPass]) -> type[GraphPass]:
        if not c.name:
            raise ValueError(f"{c.__qualname__} has no name")
        if c.name in _REGISTRY and _REGISTRY[c.name] is not c and not replace:
            raise ValueError(f"a pass named {c.name!r} is already registered ({_REGISTRY[c.name].__qualname__})")
        _REGISTRY[c.name] = c
        return c

    return add(cls) if cls is not None else add


def unregister_pass(name: str) -> None:
    _REGISTRY.pop(name, None)


def registered_passes() -> dict[str, type[GraphPass]]:
    _load_builtin_passes()
    return dict(_REGISTRY)


def _load_builtin_passes() -> None:
    # Convention: pass <name> lives in graph_passes/<name>.py and registers
    # itself on import. A module that does not exist yet stays "not implemented".
    import importlib

    for mod in ("cleanup", *PASS_SWITCHES):
        try:
            importlib.import_module(f"{__package__}.{mod}")
        except ModuleNotFoundError as e:
            if e.name != f"{__package__}.{mod}":
                raise


def make_dumper(out_dir: str | None = None, title: str = ""):
    """The graph-dump writer of one compile (graph_passes/graph_dump.py);
    with ``out_dir=None`` it writes nothing and keeps each stage's op counts."""
    from .graph_dump import GraphDumper  # networkx (the diff) loads at the first compile, not on import

    return GraphDumper(out_dir, title)


# PassManager.run's dumper when it is given none: an in-memory GraphDumper.
_NullDumper = make_dumper


class PassManager:
    def __init__(self, config: BackendConfig, order: Sequence[str] = DEFAULT_ORDER):
        self.config = config
        self.order = tuple(order)
        registry = registered_passes()
        self.passes: list[GraphPass | str] = []  # a str is a planned pass with no implementation yet
        for name in self.order:
            if name in registry:
                self.passes.append(registry[name](config))
            elif name in PASS_SWITCHES:
                if config.mode(name) == "on":
                    raise PassError(f"pass {name} is not implemented yet; set {name}='auto' or 'off'")
                self.passes.append(name)
            else:
                raise PassError(f"unknown pass {name!r}; registered: {', '.join(sorted(registry))}")

    def stable_hash(self) -> str:
        h = hashlib.sha256(self.config.stable_hash().encode())
        for p in self.passes:
            h.update((p.uuid() if isinstance(p, GraphPass) else f"planned:{p}").encode())
        return h.hexdigest()

    def run(self, gm: torch.fx.GraphModule, ctx: PassContext, dumper=None) -> list[PassResult]:
        dumper = dumper or _NullDumper()
        results: list[PassResult] = []
        seen: dict[str, int] = {}
        for p in self.passes:
            name = p.name if isinstance(p, GraphPass) else p
            seen[name] = seen.get(name, 0) + 1
            stage = name if seen[name] == 1 else f"{name}_{seen[name]}"
            res = self._run_one(p, gm, ctx)
            results.append(res)
            log.info(res.summary())
            for d in res.details:
                log.debug("minimax:   %s: %s", name, d)
            if res.enabled:
                dumper.record(stage, gm, note=res.summary())
        return results

    def _run_one(self, p: GraphPass | str, gm: torch.fx.GraphModule, ctx: PassContext) -> PassResult:
        if isinstance(p, str):
            off = self.config.mode(p) == "off"
            return PassResult(name=p, enabled=False, skipped=f"off in config ({p}='off')" if off else "not implemented yet")
        enabled, why = p.decide(ctx)
        if not enabled:
            return p.result(enabled=False, skipped=why)
        t0 = time.perf_counter()
        try:
            res = p.apply(gm, ctx)
        except PassError:
            raise
        except Exception as e:
            raise PassError(f"pass {p.name} failed: {type(e).__name__}: {e}") from e
        res.enabled = True
        res.seconds = time.perf_counter() - t0
        _check_graph(gm, p.name)
        if res.matches == 0 and p.expects_matches(ctx):
            self._missed(p, res, ctx)
        return res

    def _missed(self, p: GraphPass, res: PassResult, ctx: PassContext) -> None:
        how = "forced on" if p.mode() == "on" else "enabled by its auto rule"
        msg = (
            f"pass {p.name} is {how} ({ctx.describe()}) but matched nothing: "
            f"{res.skipped or 'no instance of its pattern in the graph'}"
        )
        if self.config.strict:
            raise PassError(msg)
        log.warning("minimax: WARNING %s", msg)
        warnings.warn(msg, PassWarning, stacklevel=2)


def _check_graph(gm: torch.fx.GraphModule, pass_name: str) -> None:
    """Lint, recompile, and insist every value node has a fake value (Inductor needs it)."""
    try:
        gm.graph.lint()
    except Exception as e:
        raise PassError(f"pass {pass_name} left an invalid graph: {e}") from e
    missing = [
        n.name
        for n in gm.graph.nodes
        if n.op in ("call_function", "call_method", "placeholder") and "val" not in n.meta
    ]
    if missing:
        raise PassError(
            f"pass {pass_name} left nodes without meta['val'] (use patterns.set_fake_val): {', '.join(missing[:10])}"
        )
    gm.recompile()


def run_passes(config: BackendConfig, gm: torch.fx.GraphModule, ctx: PassContext, dumper=None,
               order: Iterable[str] = DEFAULT_ORDER) -> list[PassResult]:
    return PassManager(config, tuple(order)).run(gm, ctx, dumper)
