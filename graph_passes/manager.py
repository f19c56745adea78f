"""The pass manager: runs the ordered passes on the WHOLE ATen graph.

Sequence parallelism changes the residual's shape across layers, so every
pass sees the full graph, never pieces. After each pass the manager lints
and recompiles the graph, recomputes the fake tensors where the pass changes
shapes, checks each node still carries its fake value, records a dump
stage, logs one line, and holds the pass to its record: a pass that expected
matches and found none is a ``PassError`` in strict mode and a loud warning
otherwise; a partial match (fewer matches than candidates) is a warning.

A pass is registered once, under its name (``@register_pass``); a pass whose
name is a ``BackendConfig`` switch lives in ``graph_passes/<name>.py`` and
runs in the order of the switches (config.DEFAULT_ORDER).
"""

from __future__ import annotations

import dataclasses
import hashlib
import importlib
import logging
import time
import warnings
from typing import Iterable, Sequence

import torch.fx

from .base import GraphPass, PassContext, PassError, PassResult, PassWarning
from .config import DEFAULT_ORDER, PASS_SWITCHES, BackendConfig
from .meta_refresh import refresh_fake_meta

log = logging.getLogger("minimax")

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
    for name in ("cleanup", *PASS_SWITCHES):  # each registers itself on import
        importlib.import_module(f"{__package__}.{name}")
    return dict(_REGISTRY)


def make_dumper(out_dir: str | None = None, title: str = ""):
    """The graph-dump writer of one compile (graph_passes/graph_dump.py);
    with ``out_dir=None`` it writes nothing and keeps each stage's op counts."""
    from .graph_dump import GraphDumper  # networkx (the diff) loads at the first compile, not on import

    return GraphDumper(out_dir, title)


class PassManager:
    def __init__(self, config: BackendConfig, order: Sequence[str] = DEFAULT_ORDER):
        self.config = config
        self.order = tuple(order)
        registry = registered_passes()
        unknown = [n for n in self.order if n not in registry]
        if unknown:
            raise PassError(f"unknown pass(es) {unknown}; registered: {', '.join(sorted(registry))}")
        self.passes: list[GraphPass] = [registry[name](config) for name in self.order]

    def stable_hash(self) -> str:
        """The config, every pass's source and options, and the kernel switches (they pick the code
        the compiled graph runs): the key a compile cache may use."""
        from ..kernels.options import kernel_options

        h = hashlib.sha256(self.config.stable_hash().encode())
        h.update(kernel_options().stable_hash().encode())
        for p in self.passes:
            h.update(p.uuid().encode())
        return h.hexdigest()

    def run(self, gm: torch.fx.GraphModule, ctx: PassContext, dumper=None) -> list[PassResult]:
        dumper = dumper or make_dumper()  # in memory: each stage's op counts
        results: list[PassResult] = []
        seen: dict[str, int] = {}
        for p in self.passes:
            seen[p.name] = seen.get(p.name, 0) + 1
            stage = p.name if seen[p.name] == 1 else f"{p.name}_{seen[p.name]}"
            res = self._run_one(p, gm, ctx)
            results.append(res)
            log.info(res.summary())
            for d in res.details:
                log.debug("minimax:   %s: %s", p.name, d)
            if res.enabled:
                dumper.record(stage, gm, note=res.summary())
        return results

    def _run_one(self, p: GraphPass, gm: torch.fx.GraphModule, ctx: PassContext) -> PassResult:
        enabled, why = p.decide(gm, ctx)
        if not enabled:
            return p.result(enabled=False, skipped=why, expected=False)
        t0 = time.perf_counter()
        try:
            res = p.apply(gm, ctx)
        except PassError:
            raise
        except Exception as e:
            raise PassError(f"pass {p.name} failed: {type(e).__name__}: {e}") from e
        _check_graph(gm, p.name, refresh=res.graph_changed and p.changes_shapes)
        res = dataclasses.replace(res, enabled=True, seconds=time.perf_counter() - t0)
        if res.matches == 0 and res.expected:
            self._missed(p, res, ctx)
        elif res.partial:
            msg = f"{p.name} matched {res.matches} of {res.candidates} candidates: {res.skipped}"
            log.warning("minimax: WARNING %s", msg)
            warnings.warn(msg, PassWarning, stacklevel=2)
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


def _check_graph(gm: torch.fx.GraphModule, pass_name: str, refresh: bool) -> None:
    """Lint, recompile, recompute fake values where shapes changed, and insist every value
    node has one (Inductor needs it)."""
    try:
        gm.graph.lint()
    except Exception as e:
        raise PassError(f"pass {pass_name} left an invalid graph: {e}") from e
    gm.recompile()
    if refresh:
        refresh_fake_meta(gm)
    missing = [
        n.name
        for n in gm.graph.nodes
        if n.op in ("call_function", "call_method", "placeholder") and "val" not in n.meta
    ]
    if missing:
        raise PassError(
            f"pass {pass_name} left nodes without meta['val'] (use patterns.fx.set_fake_val): {', '.join(missing[:10])}"
        )


def run_passes(config: BackendConfig, gm: torch.fx.GraphModule, ctx: PassContext, dumper=None,
               order: Iterable[str] = DEFAULT_ORDER) -> list[PassResult]:
    return PassManager(config, tuple(order)).run(gm, ctx, dumper)
