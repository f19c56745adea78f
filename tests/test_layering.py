"""The package's import layering: kernels < patterns < graph_passes < tools, and the model
uses the kernels only. A module may import its own layer or lower ones, never a higher one,
and no set of modules may import each other in a circle (lazy imports inside functions
count too: they are how circles hide).
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
LAYERS = {"kernels": 0, "patterns": 1, "graph_passes": 2, "tools": 3}
ALLOWED = {  # which top-level folders each may import
    "kernels": {"kernels"},
    "model": {"model", "kernels"},
    "patterns": {"patterns", "kernels"},
    "graph_passes": {"graph_passes", "patterns", "kernels"},
    "tools": {"tools", "graph_passes", "patterns", "kernels", "model"},
}


def _modules() -> dict[str, Path]:
    mods = {}
    for top in ALLOWED:
        for path in (ROOT / top).rglob("*.py"):
            rel = path.relative_to(ROOT).with_suffix("")
            name = ".".join(rel.parts)
            mods[name.removesuffix(".__init__")] = path
    return mods


def import_graph() -> dict[str, set[str]]:
    """module -> the package modules it imports (anywhere in its source)."""
    mods = _modules()
    graph = {}
    for name, path in mods.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        deps = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    parts = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join(parts + ([base] if base else []))
                targets = [f"{base}.{a.name}" for a in node.names] + [base]
            else:
                continue
            for t in targets:
                t = t.removeprefix("minimax_backend.")
                while t and t not in mods:
                    t = t.rpartition(".")[0]
                # a package's own __init__ runs before any of its modules: not an edge
                if t and t != name and not name.startswith(t + "."):
                    deps.add(t)
        graph[name] = deps
    return graph


def test_no_module_imports_a_higher_layer():
    bad = []
    for name, deps in import_graph().items():
        top = name.split(".")[0]
        for d in deps:
            if d.split(".")[0] not in ALLOWED[top]:
                bad.append(f"{name} -> {d}")
    assert not bad, "imports against the layering:\n" + "\n".join(sorted(bad))


def test_no_import_cycles():
    import networkx as nx

    g = nx.DiGraph([(a, b) for a, deps in import_graph().items() for b in deps])
    cycles = [c for c in nx.simple_cycles(g)]
    assert not cycles, "import cycles:\n" + "\n".join(" -> ".join(c + [c[0]]) for c in sorted(cycles)[:20])
