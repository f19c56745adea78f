"""Dump every stage of a compile, and what each pass changed.

The backend calls ``GraphDumper.record(stage, gm)`` after capture, after each
pass and at the end; ``finish()`` writes one browsable ``index.html``
(graph_dump_html.py). Per stage, in ``<out_dir>/<title>[-rank<R>][-<n>]/``:

    NN_<stage>.py         the graph as readable Python (gm.print_readable)
    NN_<stage>.ops.json   {op name: count}, names from graph_passes.op_counts
    NN_<stage>.diff.txt   op-count delta and the nodes added / changed /
                          removed against the previous stage, grouped into
                          change regions (how nodes are matched: graph_diff.py)

Every stage is also a torch structured-trace artifact (``minimax_<stage>``),
so ``TORCH_TRACE=dir`` + ``tlparse`` shows our stages beside Inductor's.

Without an out_dir the dumper writes nothing and keeps only the op counts of
each stage in memory (``.stages``), still emitting the trace artifacts.

Command line (tools/graph_dump.py):
``python -m minimax_backend.tools.graph_dump summarize DIR`` prints the
per-stage op-count table of a dump folder.
"""

from __future__ import annotations

import itertools
import json
import logging
import re
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.fx

from .graph_diff import NodeInfo, StageDiff, diff_nodes, snapshot
from .graph_dump_html import render_index
from .op_counts import count_delta, op_counts

__all__ = ["GraphDumper", "StageRecord"]

log = logging.getLogger("minimax")

# Regions and lines listed in a diff.txt before "... more".
_MAX_REGIONS = 200
_MAX_REGION_LINES = 60

_compile_ids = itertools.count(1)


# ------------------------------------------------------------------ records


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

    def __init__(self, out_dir: str | Path | None = None, title: str = ""):
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
        path = self.dir / "index.html"
        path.write_text(render_index(self), encoding="utf-8")
        return path


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
