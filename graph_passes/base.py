"""What a pass is, and the record it returns.

A pass is a small class registered under its name (``@register_pass``; the
name is also its ``BackendConfig`` switch when the config has one), with

    decide(gm, ctx)   whether it runs on this graph, and if not why
                      (mode off / on / auto, then its ``auto_rule(gm, ctx)``)
    apply(gm, ctx)    rewrite the graph, return a ``PassResult``

and a stable hash of its source and options (compile caches). The record is
immutable: matches, a breakdown, details, why it did nothing, whether
matches were expected (finding none is then a miss) and how many candidates
it saw (fewer matches than candidates is a partial match). Passes only
rewrite and count; the manager lints, recompiles, refreshes fake tensors
(for passes that change shapes), logs and holds each pass to its record.

``CandidatePass`` is the common loop of passes that find candidate nodes and
try a match object on each (``replace()`` rewrites one, in the style of
PyTorch's micro_pipeline_tp.py).
"""

from __future__ import annotations

import dataclasses
import hashlib
import inspect
import json
import sys
from collections import Counter
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, ClassVar, Mapping, Sequence

import torch
import torch.fx

from .config import PASS_SWITCHES, BackendConfig


class PassError(RuntimeError):
    """A pass failed, or (strict mode) an enabled pass matched nothing it should have."""


class PassWarning(UserWarning):
    """Non-strict twin of PassError, and the warning of a partial match."""


@dataclass(frozen=True)
class PassResult:
    name: str
    enabled: bool = True
    matches: int = 0
    expected: bool = False  # matches were expected: none is a miss (error in strict mode)
    candidates: int | None = None  # places it tried; fewer matches is a partial match
    skipped: str | None = None  # why the pass did nothing (disabled, or nothing to match)
    details: tuple[str, ...] = ()
    graph_changed: bool = False
    breakdown: Mapping[str, int] = field(default_factory=dict)  # e.g. {"per-layer": 4, "embed": 1}
    seconds: float = 0.0

    def __post_init__(self):
        object.__setattr__(self, "details", tuple(self.details))
        object.__setattr__(self, "breakdown", MappingProxyType(dict(self.breakdown)))

    @property
    def partial(self) -> bool:
        return self.candidates is not None and 0 < self.matches < self.candidates

    def summary(self) -> str:
        """The one log line: 'minimax: sequence_parallel matched 12 (per-layer 4, embed 1)'."""
        if not self.enabled:
            return f"minimax: {self.name} skipped: {self.skipped or 'disabled'}"
        line = f"minimax: {self.name} matched {self.matches}"
        if self.breakdown:
            line += " (" + ", ".join(f"{k} {v}" for k, v in self.breakdown.items()) + ")"
        if self.skipped:
            line += f": {self.skipped}"
        return line + f" [{self.seconds * 1e3:.0f} ms]"

    def to_dict(self) -> dict[str, Any]:
        d = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        d["details"], d["breakdown"] = list(self.details), dict(self.breakdown)
        return d


def _group_size(group_name: str) -> int | None:
    """The group's size, or None when this process does not know the group."""
    from ..patterns.collectives import group_size

    try:
        return group_size(group_name)
    except Exception:
        return None


def _stream_tokens(gm: torch.fx.GraphModule) -> int | None:
    """Rows of the first all-reduce's input (the embedding's [T, H]) when static."""
    from ..patterns.fx import op_name, val

    for node in gm.graph.nodes:
        if op_name(node) == "_c10d_functional.all_reduce":
            v = val(node.args[0])
            if isinstance(v, torch.Tensor) and v.dim() >= 1 and isinstance(v.shape[0], int):
                return v.shape[0]
            return None
    return None


@dataclass(frozen=True)
class PassContext:
    """What a pass may know besides the graph: config, parallel sizes, inputs."""

    config: BackendConfig
    tp_size: int = 1
    ep_size: int = 1
    pp_size: int = 1
    rank: int = 0
    world_size: int = 1
    group_names: tuple[str, ...] = ()  # process groups the graph's collectives use
    example_inputs: Sequence[Any] = ()  # fake tensors / SymInts of the ATen graph's inputs
    fake_mode: Any = None  # FakeTensorMode of the trace: build meta["val"] of new nodes with it
    num_tokens: int | None = None  # rows of the residual stream (the first all-reduce), None if unknown

    @classmethod
    def from_graph(cls, config: BackendConfig, gm: torch.fx.GraphModule, example_inputs: Sequence[Any] = ()):
        from torch._guards import detect_fake_mode

        from ..patterns.collectives import collective_group

        groups = sorted({g for n in gm.graph.nodes if (g := collective_group(n)) is not None})
        dist_on = torch.distributed.is_available() and torch.distributed.is_initialized()
        world = torch.distributed.get_world_size() if dist_on else 1
        rank = torch.distributed.get_rank() if dist_on else 0
        sizes = [s for s in map(_group_size, groups) if s is not None]
        tp = config.tp_size or (max(sizes) if sizes else world)
        return cls(
            config=config,
            tp_size=tp,
            ep_size=config.ep_size or 1,
            pp_size=config.pp_size,
            rank=rank,
            world_size=world,
            group_names=tuple(groups),
            example_inputs=tuple(example_inputs),
            fake_mode=detect_fake_mode(list(example_inputs)),
            num_tokens=_stream_tokens(gm),
        )

    def describe(self) -> str:
        return f"tp={self.tp_size} ep={self.ep_size} pp={self.pp_size} rank={self.rank}/{self.world_size}"


class GraphPass:
    """Base of every pass. Subclasses set ``name`` and implement ``apply``."""

    name: ClassVar[str] = ""
    # Other BackendConfig fields the pass reads: part of its hash.
    config_fields: ClassVar[tuple[str, ...]] = ()
    # Extra modules whose source changes the pass (its patterns): part of its hash.
    hash_modules: ClassVar[tuple[str, ...]] = ()
    # The rewrite changes tensor shapes: the manager recomputes every node's fake value after it.
    changes_shapes: ClassVar[bool] = False

    def __init__(self, config: BackendConfig):
        self.config = config

    @property
    def switch(self) -> str | None:
        """The BackendConfig field holding this pass's auto/on/off mode (None: always runs)."""
        return self.name if self.name in PASS_SWITCHES else None

    # ---- enabling -------------------------------------------------------
    def mode(self) -> str:
        return self.config.mode(self.switch) if self.switch else "on"

    def auto_rule(self, gm: torch.fx.GraphModule, ctx: PassContext) -> str | None:
        """Under "auto": None to run, or the reason the pass stays off."""
        return None

    def decide(self, gm: torch.fx.GraphModule, ctx: PassContext) -> tuple[bool, str | None]:
        mode = self.mode()
        if mode == "off":
            return False, f"off in config ({self.switch}='off')"
        if mode == "on":
            return True, None
        why = self.auto_rule(gm, ctx)
        return (why is None), (None if why is None else f"auto: {why}")

    # ---- work -----------------------------------------------------------
    def apply(self, gm: torch.fx.GraphModule, ctx: PassContext) -> PassResult:
        raise NotImplementedError

    def result(self, **kw) -> PassResult:
        """A record of this pass; matches are expected unless the pass says otherwise."""
        kw.setdefault("expected", True)
        return PassResult(name=self.name, **kw)

    # ---- identity (compile cache) ---------------------------------------
    def uuid(self) -> str:
        h = hashlib.sha256()
        for mod_name in (type(self).__module__, *self.hash_modules):
            h.update(_module_source(mod_name).encode())
        cfg = {f: getattr(self.config, f) for f in (*([self.switch] if self.switch else []), *self.config_fields)}
        h.update(json.dumps({"name": self.name, "cls": type(self).__qualname__, "config": cfg}, sort_keys=True).encode())
        return h.hexdigest()

    def stable_hash(self) -> str:
        return self.uuid()


def _module_source(mod_name: str) -> str:
    mod = sys.modules.get(mod_name)
    try:
        return inspect.getsource(mod) if mod is not None else mod_name
    except (OSError, TypeError):  # defined in a REPL / no file: fall back to the name
        return mod_name


class CandidatePass(GraphPass):
    """A pass that finds candidate nodes (e.g. every MoE top-k) and tries to match each.

    Subclasses give ``candidates(gm, ctx)``, ``match(node, ctx)`` (a match object with
    ``kind``, ``describe()`` and ``replace(graph, fake_mode) -> new node``, or a raised
    ``Mismatch`` that says why not) and ``no_candidates`` (the skip reason). Under "on" a
    graph with no candidate at all is a miss; under "auto" only candidates found and not
    matched are. A candidate the matcher fails on with any other error is left alone
    too (a matcher bug must not corrupt the graph) and the record says so.
    """

    no_candidates: ClassVar[str] = "no candidate in the graph"
    what: ClassVar[str] = "candidates"

    def candidates(self, gm: torch.fx.GraphModule, ctx: PassContext) -> list[torch.fx.Node]:
        raise NotImplementedError

    def match(self, node: torch.fx.Node, ctx: PassContext):
        raise NotImplementedError

    def apply(self, gm: torch.fx.GraphModule, ctx: PassContext) -> PassResult:
        from ..patterns.fx import Mismatch

        nodes = self.candidates(gm, ctx)
        if not nodes:
            return self.result(matches=0, candidates=0, skipped=self.no_candidates, expected=self.mode() == "on")
        kinds: Counter = Counter()
        details, misses = [], []
        for node in nodes:
            if getattr(node, "_erased", False):  # taken by an earlier candidate's replace()
                continue
            name = node.name
            try:
                m = self.match(node, ctx)
                description = m.describe()  # before replace(), which may erase what it reads
                new = m.replace(gm.graph, ctx.fake_mode)
            except Mismatch as e:
                misses.append(f"{name} left alone: {e}")
                continue
            except Exception as e:  # noqa: BLE001 - see the class docstring
                misses.append(f"{name} left alone: matcher error {type(e).__name__}: {e}")
                continue
            kinds[m.kind] += 1
            details.append(f"{name} -> {new.name}: {description}")
        matches = sum(kinds.values())
        skipped = "; ".join(misses) if misses else None
        if misses and matches:
            skipped = f"rewrote {matches} of {len(nodes)} {self.what}; {skipped}"
        return self.result(matches=matches, candidates=len(nodes), graph_changed=matches > 0,
                           breakdown=dict(kinds), details=details + misses, skipped=skipped)
