"""What a pass is: a small class with a name, a switch, an ``apply`` that
returns a ``PassResult`` record, and a stable hash of its source + config.

A pass subclass sets ``name`` (and ``switch``: the ``BackendConfig`` field
holding its auto/on/off mode), writes ``apply``, and where it has one, an
``auto_rule``. The manager decides, runs, checks and logs; the pass only
rewrites and counts.
"""

from __future__ import annotations

import dataclasses
import hashlib
import inspect
import json
import sys
from dataclasses import dataclass, field
from typing import Any, ClassVar, Sequence

import torch
import torch.fx

from .config import BackendConfig


class PassError(RuntimeError):
    """A pass failed, or (strict mode) an enabled pass matched nothing it should have."""


class PassWarning(UserWarning):
    """Non-strict twin of PassError: an enabled pass matched nothing it should have."""


@dataclass
class PassResult:
    name: str
    enabled: bool = True
    matches: int = 0
    skipped: str | None = None  # why the pass did nothing (disabled, or nothing to match)
    details: list[str] = field(default_factory=list)
    graph_changed: bool = False
    breakdown: dict[str, int] = field(default_factory=dict)  # e.g. {"per-layer": 4, "embed": 1}
    seconds: float = 0.0

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
        return dataclasses.asdict(self)


def _group_size(group_name: str) -> int | None:
    """The group's size, or None when this process does not know the group."""
    from ..patterns.collectives import group_size

    try:
        return group_size(group_name)
    except Exception:
        return None


def _stream_tokens(gm: torch.fx.GraphModule) -> int | None:
    """Rows of the first all-reduce's input (the embedding's [T, H]) when static."""
    from ..patterns import op_name, val

    for node in gm.graph.nodes:
        if op_name(node) == "_c10d_functional.all_reduce":
            v = val(node.args[0])
            if isinstance(v, torch.Tensor) and v.dim() >= 1 and isinstance(v.shape[0], int):
                return v.shape[0]
            return None
    return None


@dataclass
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
    shared: dict[str, Any] = field(default_factory=dict)  # notes passes leave for later passes

    @classmethod
    def from_graph(cls, config: BackendConfig, gm: torch.fx.GraphModule, example_inputs: Sequence[Any] = ()):
        from ..patterns import collective_group

        groups = sorted({g for n in gm.graph.nodes if (g := collective_group(n)) is not None})
        dist_on = torch.distributed.is_available() and torch.distributed.is_initialized()
        world = torch.distributed.get_world_size() if dist_on else 1
        rank = torch.distributed.get_rank() if dist_on else 0
        sizes = [s for s in map(_group_size, groups) if s is not None]
        tp = config.tp_size or (max(sizes) if sizes else world)
        from torch._guards import detect_fake_mode

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
            shared={"graph_module": gm},
        )

    def describe(self) -> str:
        return f"tp={self.tp_size} ep={self.ep_size} pp={self.pp_size} rank={self.rank}/{self.world_size}"


class GraphPass:
    """Base of every pass. Subclasses set ``name`` and implement ``apply``."""

    name: ClassVar[str] = ""
    # BackendConfig field with this pass's auto/on/off mode; None = always runs.
    switch: ClassVar[str | None] = None
    # Other BackendConfig fields the pass reads: part of its hash.
    config_fields: ClassVar[tuple[str, ...]] = ()
    # Extra modules whose source changes the pass (its patterns): part of its hash.
    hash_modules: ClassVar[tuple[str, ...]] = ()

    def __init__(self, config: BackendConfig):
        self.config = config

    # ---- enabling -------------------------------------------------------
    def mode(self) -> str:
        return self.config.mode(self.switch) if self.switch else "on"

    def auto_rule(self, ctx: PassContext) -> str | None:
        """Under "auto": None to run, or the reason the pass stays off."""
        return None

    def decide(self, ctx: PassContext) -> tuple[bool, str | None]:
        mode = self.mode()
        if mode == "off":
            return False, f"off in config ({self.switch}='off')"
        if mode == "on":
            return True, None
        why = self.auto_rule(ctx)
        return (why is None), (None if why is None else f"auto: {why}")

    def is_enabled(self, ctx: PassContext) -> bool:
        return self.decide(ctx)[0]

    def expects_matches(self, ctx: PassContext) -> bool:
        """Whether finding nothing is a failure. Default: an enabled pass
        (forced on, or its auto rule says the graph has what it rewrites)."""
        return self.is_enabled(ctx)

    # ---- work -----------------------------------------------------------
    def apply(self, gm: torch.fx.GraphModule, ctx: PassContext) -> PassResult:
        raise NotImplementedError

    def result(self, **kw) -> PassResult:
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
    """A pass that finds candidates (e.g. every MoE top-k) and tries to match each.

    Under "on", a graph with no candidate at all is a miss; under "auto" only
    candidates that were found but not matched are. A partial match (some
    candidates rewritten, some left alone) is logged and warned about, never
    silent: `finish` builds that record.
    """

    def __init__(self, config: BackendConfig):
        super().__init__(config)
        self._candidates = 0

    def expects_matches(self, ctx: PassContext) -> bool:
        if self.mode() == "on":
            return True
        return self.is_enabled(ctx) and self._candidates > 0

    def finish(self, gm: torch.fx.GraphModule, breakdown: dict[str, int], details: list[str],
               misses: list[str], what: str) -> PassResult:
        import logging
        import warnings

        matches = sum(breakdown.values())
        if matches:
            gm.graph.lint()
            gm.recompile()
        if misses and matches:
            msg = f"{self.name} rewrote {matches} of {self._candidates} {what}; " + "; ".join(misses)
            logging.getLogger("minimax").warning("minimax: WARNING %s", msg)
            warnings.warn(msg, PassWarning, stacklevel=3)
        return self.result(matches=matches, graph_changed=matches > 0, breakdown=breakdown,
                           details=details + misses, skipped="; ".join(misses) if misses else None)
