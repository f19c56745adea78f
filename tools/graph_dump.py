"""The graph dump's command line: the per-stage op-count table of a dump folder.

    python -m minimax_backend.tools.graph_dump summarize DIR
    minimax-compile summarize DIR           # the same, through tools/cli.py

DIR is one compile's folder or a dump folder holding several. The dumps
themselves are written during compiles by the writer in the compiler,
graph_passes/graph_dump.py (GraphDumper); this module only reads them.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

__all__ = ["summarize", "main"]


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
