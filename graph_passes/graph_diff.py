"""The structural diff between two stages of a graph.

How the diff matches nodes (passes rename little, a re-trace renames all):
each node gets a *label* (its op, constant arguments and output shape) and a
*fingerprint* (its label plus the labels of its inputs, in argument order:
one Weisfeiler-Lehman step looking upstream only). A node of the new stage is
unchanged if the old stage has a node with the same fingerprint (same name
preferred, else graph order); "changed" if a node of the same name and op
exists but its inputs, constants or shape differ; otherwise "added". Old
nodes left over are "removed". networkx then groups the changes into
connected regions, so a rewrite reads as "these nodes became those".

``snapshot(graph)`` copies what the diff needs at record time (passes rewrite
the same GraphModule in place); ``diff_nodes(prev, cur)`` compares two
snapshots. The graph dump (graph_dump.py) records one snapshot per stage.
"""

from __future__ import annotations

import hashlib
from collections import Counter, defaultdict, deque
from dataclasses import dataclass, field

import networkx as nx
import torch
import torch.fx

from .op_counts import op_name

__all__ = ["NodeInfo", "Region", "StageDiff", "snapshot", "diff_nodes"]

# An unchanged node with more inputs + users than this (a rotary table or a
# mask shared by all layers) does not glue change regions together.
_HUB_DEGREE = 8
# Fewer than this share of op nodes carried over: the graph was traced anew
# (Dynamo -> ATen), so a node-level diff is noise; compare op counts instead.
_RETRACE_SHARE = 0.1

_NOT_OPS = ("placeholder", "get_attr", "output")


@dataclass(frozen=True)
class NodeInfo:
    """What the diff needs of one node, copied at record time: passes rewrite
    the same GraphModule in place, so the previous graph is gone later."""

    name: str
    kind: str  # op name (aten.mm) or FX node kind (placeholder, get_attr, output)
    label: str  # the node on its own: kind, constant args, output shape
    inputs: tuple[str, ...]  # input node names in argument order
    fingerprint: str  # label + its inputs' labels


@dataclass
class Region:
    """One connected group of changes: these old nodes became those."""

    removed: list[str] = field(default_factory=list)  # names in the previous stage
    changed: list[str] = field(default_factory=list)  # names in this stage
    added: list[str] = field(default_factory=list)  # names in this stage
    # The ops involved, e.g. "_c10d_functional.all_reduce, ... -> ...": alike
    # regions (one per layer) share it, so a view can fold them together.
    summary: str = ""


@dataclass
class StageDiff:
    ops: dict[str, tuple[int, int]]  # op -> (before, after), changed ones only
    unchanged: int
    added: list[str]
    changed: list[str]
    removed: list[str]
    regions: list[Region]
    retraced: bool  # almost nothing carried over: a new trace, not a rewrite
    removed_lines: dict[str, str] = field(default_factory=dict)  # old code lines


def snapshot(graph: torch.fx.Graph) -> list[NodeInfo]:
    """Label and fingerprint every node of the (top-level) graph.

    The fingerprint is one Weisfeiler-Lehman step over inputs only, done
    here: networkx's WL hash also mixes in a node's users (so the producer
    of a rewritten consumer would count as changed) and changed its
    directed-graph hashes in networkx 3.5."""
    labels: dict[str, str] = {}
    out = []
    n_placeholders = 0
    for node in graph.nodes:
        if node.op == "placeholder":
            # Position, not name: Dynamo says L_x_, AOT says arg0_1.
            kind, head = "placeholder", f"placeholder#{n_placeholders}"
            n_placeholders += 1
        elif node.op in ("get_attr", "output"):
            kind, head = node.op, f"{node.op}:{node.target}"
        else:
            kind = op_name(node) or f"{node.op}:{node.target}"
            head = kind
        inputs: list[str] = []
        label = f"{head}({_args_text(node, inputs)})->{_val_text(node)}"
        labels[node.name] = label
        upstream = "|".join(labels.get(i, i) for i in inputs)
        fp = hashlib.blake2b(f"{label}<-{upstream}".encode(), digest_size=10).hexdigest()
        out.append(NodeInfo(node.name, kind, label, tuple(inputs), fp))
    return out


def diff_nodes(prev: list[NodeInfo], cur: list[NodeInfo]) -> StageDiff:
    """Match ``cur`` against ``prev``; see the module docstring."""
    prev_by_name = {n.name: n for n in prev}
    partner: dict[str, str] = {}  # cur name -> prev name of unchanged nodes
    taken: set[str] = set()
    # 1. Same name, same fingerprint: untouched by an in-place pass.
    for c in cur:
        p = prev_by_name.get(c.name)
        if p is not None and p.fingerprint == c.fingerprint:
            partner[c.name] = p.name
            taken.add(p.name)
    # 2. Same fingerprint under another name, first come first served.
    pool: dict[str, deque] = defaultdict(deque)
    for p in prev:
        if p.name not in taken:
            pool[p.fingerprint].append(p.name)
    for c in cur:
        if c.name not in partner and pool.get(c.fingerprint):
            partner[c.name] = pool[c.fingerprint].popleft()
            taken.add(partner[c.name])
    # 3. Same name and op, other inputs / constants / shape: rewired in place.
    changed = []
    for c in cur:
        p = prev_by_name.get(c.name)
        if c.name not in partner and p is not None and p.name not in taken and p.kind == c.kind:
            changed.append(c.name)
            taken.add(p.name)
    changed_set = set(changed)
    added = [c.name for c in cur if c.name not in partner and c.name not in changed_set]
    removed = [p.name for p in prev if p.name not in taken]

    # Judge by op nodes only: placeholders carry over even across a re-trace.
    ops_now = [c.name for c in cur if c.kind not in _NOT_OPS]
    retraced = bool(ops_now) and sum(n in partner for n in ops_now) < _RETRACE_SHARE * len(ops_now)
    regions = [] if retraced else _regions(prev, cur, partner, changed, added, removed)
    return StageDiff({}, len(partner), added, changed, removed, regions, retraced)


def _regions(prev, cur, partner, changed, added, removed) -> list[Region]:
    """Group changes that touch each other, directly or through one shared
    unchanged neighbour, into regions (connected components).

    Added and removed nodes glue regions; a "changed" node only joins one.
    Otherwise a residual stream of rewired adds would chain every layer's
    rewrite into one region."""
    # Old nodes that live on are represented by their new counterpart.
    to_cur = {p: c for c, p in partner.items()}
    to_cur.update({c: c for c in changed})
    items = {("cur", n) for n in added + changed} | {("prev", n) for n in removed}

    degree: Counter[str] = Counter()
    kind = {n.name: n.kind for n in cur}
    prev_kind = {n.name: n.kind for n in prev}
    for n in cur:
        degree[n.name] += len(n.inputs)
        for i in n.inputs:
            degree[i] += 1

    def is_anchor(v) -> bool:
        side, name = v
        return side == "cur" and kind.get(name) not in _NOT_OPS and degree[name] <= _HUB_DEGREE

    g = nx.Graph()
    g.add_nodes_from(items)

    changed_set = set(changed)

    def glues(v) -> bool:  # an added or removed node, not a merely changed one
        return v in items and not (v[0] == "cur" and v[1] in changed_set)

    def link(a, b):
        if a in items and b in items:
            if glues(a) or glues(b):
                g.add_edge(a, b)
        elif glues(a) and is_anchor(b):
            g.add_edge(a, b)
        elif glues(b) and is_anchor(a):
            g.add_edge(a, b)

    for n in cur:
        for i in n.inputs:
            link(("cur", n.name), ("cur", i))
    for n in prev:
        a = ("cur", to_cur[n.name]) if n.name in to_cur else ("prev", n.name)
        for i in n.inputs:
            link(a, ("cur", to_cur[i]) if i in to_cur else ("prev", i))

    pos = {("cur", n.name): k for k, n in enumerate(cur)}
    pos.update({("prev", n.name): k for k, n in enumerate(prev)})
    regions = []
    for comp in nx.connected_components(g):
        mine = sorted((v for v in comp if v in items), key=lambda v: pos[v])
        if not mine:
            continue
        r = Region()
        for side, name in mine:
            if side == "prev":
                r.removed.append(name)
            elif name in changed_set:
                r.changed.append(name)
            else:
                r.added.append(name)
        r.summary = f"{_ops_text(r.removed, prev_kind)} -> {_ops_text(r.added, kind)}"
        if r.changed:
            r.summary += f" (changed: {_ops_text(r.changed, kind)})"
        regions.append((pos[mine[0]], r))
    return [r for _, r in sorted(regions, key=lambda t: t[0])]


def _ops_text(names: list[str], kind: dict[str, str]) -> str:
    counts = Counter(kind[n] for n in names)  # keeps first-seen order
    return ", ".join(k if c == 1 else f"{k} x{c}" for k, c in counts.items()) or "nothing"


class _Input:
    """Stands for a node argument in a label; its position is in ``inputs``."""

    def __repr__(self):
        return "%"


def _args_text(node: torch.fx.Node, inputs: list[str]) -> str:
    def leaf(a):
        if isinstance(a, torch.fx.Node):
            inputs.append(a.name)
            return _Input()
        return a

    args = torch.fx.node.map_aggregate(node.args, leaf)
    kwargs = torch.fx.node.map_aggregate(dict(sorted(node.kwargs.items())), leaf)
    text = ", ".join(repr(a) for a in args)
    if kwargs:
        text += ", " + ", ".join(f"{k}={v!r}" for k, v in kwargs.items())
    return text


def _val_text(node: torch.fx.Node) -> str:
    # ATen graphs keep the fake value in "val", Dynamo graphs in "example_value".
    val = node.meta.get("val", node.meta.get("example_value"))
    if val is None and "tensor_meta" in node.meta:
        tm = node.meta["tensor_meta"]
        return f"{str(getattr(tm, 'dtype', '')).replace('torch.', '')}{list(getattr(tm, 'shape', []))}"
    return _value_text(val)


def _value_text(v) -> str:
    if isinstance(v, torch.Tensor):
        return f"{str(v.dtype).replace('torch.', '')}{list(v.shape)}"
    if isinstance(v, (list, tuple)):
        return "(" + ", ".join(_value_text(x) for x in v) + ")"
    if v is None:
        return ""
    if isinstance(v, (int, float, bool, torch.SymInt, torch.SymFloat, torch.SymBool)):
        return str(v)
    return type(v).__name__
