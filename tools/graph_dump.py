"""Dump every stage of a compile, and what each pass changed.

The backend calls ``GraphDumper.record(stage, gm)`` after capture, after each
pass and at the end; ``finish()`` writes one browsable ``index.html``. Per
stage, in ``<out_dir>/<title>[-rank<R>][-<n>]/``:

    NN_<stage>.py         the graph as readable Python (gm.print_readable)
    NN_<stage>.ops.json   {op name: count}, names from graph_passes.op_counts
    NN_<stage>.diff.txt   op-count delta and the nodes added / changed /
                          removed against the previous stage, grouped into
                          change regions

Every stage is also a torch structured-trace artifact (``minimax_<stage>``),
so ``TORCH_TRACE=dir`` + ``tlparse`` shows our stages beside Inductor's.

How the diff matches nodes (passes rename little, a re-trace renames all):
each node gets a *label* (its op, constant arguments and output shape) and a
*fingerprint* (its label plus the labels of its inputs, in argument order:
one Weisfeiler-Lehman step looking upstream only). A node of the new stage is
unchanged if the old stage has a node with the same fingerprint (same name
preferred, else graph order); "changed" if a node of the same name and op
exists but its inputs, constants or shape differ; otherwise "added". Old
nodes left over are "removed". networkx then groups the changes into
connected regions, so a rewrite reads as "these nodes became those".

Command line: ``python -m minimax_backend.tools.graph_dump summarize DIR``
prints the per-stage op-count table of a dump folder.
"""

from __future__ import annotations

import argparse
import hashlib
import itertools
import json
import logging
import re
import sys
from collections import Counter, defaultdict, deque
from dataclasses import dataclass, field
from pathlib import Path

import networkx as nx
import torch
import torch.fx

from minimax_backend.graph_passes.op_counts import count_delta, op_counts, op_name

__all__ = [
    "GraphDumper",
    "StageRecord",
    "StageDiff",
    "Region",
    "NodeInfo",
    "snapshot",
    "diff_nodes",
    "summarize",
    "main",
]

log = logging.getLogger("minimax")

# An unchanged node with more inputs + users than this (a rotary table or a
# mask shared by all layers) does not glue change regions together.
_HUB_DEGREE = 8
# Fewer than this share of op nodes carried over: the graph was traced anew
# (Dynamo -> ATen), so a node-level diff is noise; compare op counts instead.
_RETRACE_SHARE = 0.1
# Regions and lines listed in a diff.txt before "... more".
_MAX_REGIONS = 200
_MAX_REGION_LINES = 60

_compile_ids = itertools.count(1)
_NOT_OPS = ("placeholder", "get_attr", "output")


# ------------------------------------------------------------------ records


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


@dataclass
class StageRecord:
    index: int
    stage: str
    note: str
    ops: dict[str, int]
    code: str | None = None  # only when writing files
    n_nodes: int = 0
    line_of: dict[str, int] = field(default_factory=dict)  # node -> code line index
    diff: StageDiff | None = None
    file_stem: str = ""


# ------------------------------------------------------------------ dumper


class GraphDumper:
    """Records the stages of one compile; see the module docstring.

    ``out_dir=None`` keeps only ``.stages`` (op counts) in memory and writes
    nothing, but still emits the structured-trace artifacts.
    """

    def __init__(self, out_dir: str | Path | None, title: str = ""):
        self.title = title or f"compile-{next(_compile_ids)}"
        self.rank = _dist_rank()
        self.records: list[StageRecord] = []
        self.dir: Path | None = None
        if out_dir is not None:
            base = _safe(self.title) + ("" if self.rank is None else f"-rank{self.rank}")
            self.dir = _claim_dir(Path(out_dir), base)
        self._prev_nodes: list[NodeInfo] | None = None
        self._prev_lines: list[str] = []
        self._prev_line_of: dict[str, int] = {}

    @property
    def stages(self) -> list[tuple[str, dict[str, int]]]:
        return [(r.stage, r.ops) for r in self.records]

    def record(self, stage: str, gm: torch.fx.GraphModule | torch.fx.Graph, note: str = "") -> StageRecord:
        rec = StageRecord(index=len(self.records), stage=stage, note=note, ops=op_counts(gm))
        self.records.append(rec)
        if self.dir is None:
            _emit_trace(stage, lambda: _readable_code(gm), rec.ops, None)
            return rec

        graph = gm if isinstance(gm, torch.fx.Graph) else gm.graph
        rec.code = _readable_code(gm)
        rec.line_of = _node_lines(rec.code)
        nodes = snapshot(graph)
        rec.n_nodes = len(nodes)
        if self._prev_nodes is not None:
            try:
                rec.diff = diff_nodes(self._prev_nodes, nodes)
                rec.diff.ops = count_delta(self.records[-2].ops, rec.ops)
                rec.diff.removed_lines = {
                    n: _show_line(self._prev_lines, self._prev_line_of.get(n)) or n
                    for n in rec.diff.removed
                }
            except Exception as e:  # a dump must never break the compile
                log.warning("graph dump: diff of stage %r failed: %s", stage, e)
        self._prev_nodes = nodes
        self._prev_lines = rec.code.splitlines()
        self._prev_line_of = rec.line_of

        rec.file_stem = f"{rec.index:02d}_{_safe(stage)}"
        diff_text = _diff_text(self, rec)
        header = f"# {self.title}: stage {rec.index:02d} {stage!r}" + (f"\n# note: {note}" if note else "")
        (self.dir / f"{rec.file_stem}.py").write_text(header + "\n\n" + rec.code)
        (self.dir / f"{rec.file_stem}.ops.json").write_text(json.dumps(rec.ops, indent=1) + "\n")
        (self.dir / f"{rec.file_stem}.diff.txt").write_text(diff_text)
        _emit_trace(stage, lambda: rec.code, rec.ops, diff_text)
        return rec

    def finish(self) -> Path | None:
        """Write ``index.html`` for this compile; returns its path (None
        without an out_dir). Calling it again rewrites the page."""
        if self.dir is None:
            return None
        from minimax_backend.tools.graph_dump_html import render_index

        path = self.dir / "index.html"
        path.write_text(render_index(self), encoding="utf-8")
        return path


# ------------------------------------------------------------------ snapshot + diff


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


# ------------------------------------------------------------------ code text


def _readable_code(gm) -> str:
    """The graph as Python with shapes, falling back to plainer forms."""
    if isinstance(gm, torch.fx.Graph):
        return gm.python_code("self", verbose=True).src
    try:
        # Regenerates from gm.graph, so it is right even before gm.recompile().
        return gm.print_readable(print_output=False)
    except Exception:
        try:
            return gm.graph.python_code("self").src
        except Exception:
            return str(gm.graph)


_ASSIGN = re.compile(r'^(\s*)([A-Za-z_]\w*)\s*(?::\s*"[^"]*")?\s*=\s')
_FORWARD = re.compile(r"^(\s*)def forward\(")
_DEL_TAIL = re.compile(r";\s+(?:\w+\s*=\s*)+None\s*$")


def _node_lines(code: str) -> dict[str, int]:
    """Node name -> line index of its assignment in the top-level forward."""
    out: dict[str, int] = {}
    body_indent = None
    for k, line in enumerate(code.splitlines()):
        if body_indent is None:
            m = _FORWARD.match(line)
            if m:
                body_indent = len(m.group(1)) + 4
            continue
        m = _ASSIGN.match(line)
        # Exactly the body's indentation: nested submodule code is deeper.
        if m and len(m.group(1)) == body_indent:
            out.setdefault(m.group(2), k)
        elif line.startswith(" " * body_indent + "return "):
            out.setdefault("output", k)
    return out


def _show_line(lines: list[str], k: int | None) -> str | None:
    """A code line without indentation and without the `; x = None` frees."""
    if k is None or k >= len(lines):
        return None
    return _DEL_TAIL.sub("", lines[k]).strip()


def _diff_text(dumper: GraphDumper, rec: StageRecord) -> str:
    head = f"{rec.file_stem}  ({dumper.title}, stage {rec.stage!r})"
    out = [head] + ([f"note: {rec.note}"] if rec.note else []) + [""]
    if rec.index == 0:
        out.append("first stage: nothing to compare against. op counts:")
        out += [f"  {op:<48} {n:>6}" for op, n in rec.ops.items()]
        return "\n".join(out) + "\n"
    prev = dumper.records[rec.index - 1]
    out.append(f"against {prev.index:02d} {prev.stage!r}")
    out.append("")
    d = rec.diff
    if d is None:
        out.append("no diff (it failed; see the log)")
        return "\n".join(out) + "\n"
    if d.ops:
        out.append("op counts (before -> after):")
        for op, (a, b) in d.ops.items():
            out.append(f"  {op:<48} {a:>6} -> {b:<6} {b - a:+d}")
    else:
        out.append("op counts: unchanged")
    out.append("")
    out.append(
        f"nodes: {d.unchanged} unchanged, {len(d.changed)} changed, "
        f"{len(d.added)} added, {len(d.removed)} removed"
        + ("" if d.retraced or not d.regions else f", in {len(d.regions)} region(s)")
    )
    if d.retraced:
        out.append("the graph was traced anew (names and ops differ throughout): compare op counts")
        return "\n".join(out) + "\n"
    kinds = Counter(r.summary for r in d.regions)
    if kinds:
        out.append("")
        out.append("kinds of change (regions alike):")
        out += [f"  {n:>4} x  {summary}" for summary, n in kinds.items()]
    lines = rec.code.splitlines()
    for k, r in enumerate(d.regions[:_MAX_REGIONS], 1):
        out.append("")
        out.append(f"region {k}: {r.summary}")
        body = [f"  - {d.removed_lines.get(n, n)}" for n in r.removed]
        body += [f"  ~ {_show_line(lines, rec.line_of.get(n)) or n}" for n in r.changed]
        body += [f"  + {_show_line(lines, rec.line_of.get(n)) or n}" for n in r.added]
        out += body[:_MAX_REGION_LINES]
        if len(body) > _MAX_REGION_LINES:
            out.append(f"  ... {len(body) - _MAX_REGION_LINES} more")
    if len(d.regions) > _MAX_REGIONS:
        out.append(f"\n... {len(d.regions) - _MAX_REGIONS} more regions")
    return "\n".join(out) + "\n"


# ------------------------------------------------------------------ plumbing


def _safe(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9._-]+", "_", name).strip("_") or "stage"


def _dist_rank() -> int | None:
    try:
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            return dist.get_rank()
    except Exception:
        pass
    return None


def _claim_dir(out_dir: Path, base: str) -> Path:
    """A fresh folder per compile: mkdir is atomic, so ranks and recompiles
    writing to one out_dir each get their own (base, base-2, base-3, ...)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    for n in itertools.count(1):
        d = out_dir / (base if n == 1 else f"{base}-{n}")
        try:
            d.mkdir()
            return d
        except FileExistsError:
            continue
    raise AssertionError("unreachable")


def _emit_trace(stage: str, code_fn, ops: dict[str, int], diff_text: str | None) -> None:
    """Structured-trace artifacts for tlparse (a no-op unless TORCH_TRACE is
    set; the payloads are built only then)."""
    try:
        from torch._logging import trace_structured
    except ImportError:  # older torch
        return
    try:
        trace_structured(
            "artifact",
            metadata_fn=lambda: {"name": f"minimax_{stage}", "encoding": "string"},
            payload_fn=code_fn,
        )
        trace_structured(
            "artifact",
            metadata_fn=lambda: {"name": f"minimax_{stage}_ops", "encoding": "json"},
            payload_fn=lambda: ops,
        )
        if diff_text is not None:
            trace_structured(
                "artifact",
                metadata_fn=lambda: {"name": f"minimax_{stage}_diff", "encoding": "string"},
                payload_fn=lambda: diff_text,
            )
    except Exception as e:  # logging must never break the compile
        log.debug("graph dump: structured trace failed: %s", e)


# ------------------------------------------------------------------ command line


def _stage_files(d: Path) -> list[tuple[int, str, Path]]:
    out = []
    for p in d.glob("*.ops.json"):
        m = re.match(r"^(\d+)_(.*)\.ops\.json$", p.name)
        if m:
            out.append((int(m.group(1)), m.group(2), p))
    return sorted(out)


def summarize(path: str | Path) -> str:
    """The op-count table (rows = ops, columns = stages) of a compile folder,
    or of every compile folder under ``path``."""
    root = Path(path)
    if not root.is_dir():
        raise FileNotFoundError(f"no such folder: {root}")
    if _stage_files(root):
        dirs = [root]
    else:
        dirs = sorted(d for d in root.iterdir() if d.is_dir() and _stage_files(d))
    if not dirs:
        raise FileNotFoundError(f"no graph dump (*.ops.json) in {root}")
    blocks = []
    for d in dirs:
        stages = _stage_files(d)
        counts = [json.loads(p.read_text()) for _, _, p in stages]
        ops = sorted(set().union(*counts))
        width = max([len("op")] + [len(o) for o in ops])
        lines = [f"== {d.name}  ({d})"]
        lines += [f"  {i:02d} {name}" for i, name, _ in stages]
        lines.append(f"{'op':<{width}} " + " ".join(f"{i:02d}".rjust(6) + " " for i, _, _ in stages))
        for op in ops:
            cells, last = [], None
            for c in counts:
                n = c.get(op, 0)
                mark = "*" if last is not None and n != last else " "
                cells.append(f"{n:>6}{mark}")
                last = n
            lines.append(f"{op:<{width}} " + " ".join(cells))
        lines.append("(* = changed from the previous stage)")
        blocks.append("\n".join(lines))
    return "\n\n".join(blocks)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m minimax_backend.tools.graph_dump", description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("summarize", help="print the per-stage op-count table of a dump folder")
    s.add_argument("dir", help="a compile folder, or a dump folder holding several")
    args = parser.parse_args(argv)
    try:
        print(summarize(args.dir))
    except FileNotFoundError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
