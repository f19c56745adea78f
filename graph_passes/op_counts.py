"""Count the operations of an FX graph, by the names of patterns/fx.py's op_name.

Every pass test, the compile report and the graph dump speak about ops by the
same names (``aten.mm``, ``_c10d_functional.all_reduce``, ``operator.getitem``,
``minimax.quantize_fp8``: see patterns/fx.py). Ops inside submodules that are
GraphModules (piecewise split graphs) count as if inline.
"""

from __future__ import annotations

from collections import Counter

import torch
import torch.fx

from ..patterns.fx import op_name, submodule_of

__all__ = ["op_name", "op_counts", "count", "count_delta"]  # op_name: patterns/fx.py


def op_counts(gm_or_graph: torch.fx.GraphModule | torch.fx.Graph) -> dict[str, int]:
    """How often each op occurs, as ``{name: count}`` sorted by name.

    Ops inside submodules that are themselves GraphModules (piecewise split
    graphs) are counted as if they were inline.
    """
    counts: Counter[str] = Counter()
    _accumulate(_graph_of(gm_or_graph), counts)
    return dict(sorted(counts.items()))


def count(gm_or_graph: torch.fx.GraphModule | torch.fx.Graph, name: str) -> int:
    """How often the op ``name`` (e.g. ``"aten.mm"``) occurs."""
    return op_counts(gm_or_graph).get(name, 0)


def count_delta(before: dict[str, int], after: dict[str, int]) -> dict[str, tuple[int, int]]:
    """The ops whose count changed: ``{name: (before, after)}`` sorted by name."""
    names = sorted(set(before) | set(after))
    return {
        n: (before.get(n, 0), after.get(n, 0))
        for n in names
        if before.get(n, 0) != after.get(n, 0)
    }


# ---------------------------------------------------------------- internals


def _graph_of(gm_or_graph) -> torch.fx.Graph:
    if isinstance(gm_or_graph, torch.fx.Graph):
        return gm_or_graph
    if isinstance(gm_or_graph, torch.fx.GraphModule):
        return gm_or_graph.graph
    raise TypeError(f"expected a GraphModule or Graph, got {type(gm_or_graph).__name__}")


def _accumulate(graph: torch.fx.Graph, counts: Counter) -> None:
    for node in graph.nodes:
        name = op_name(node)
        if name is not None:
            counts[name] += 1
        elif node.op == "call_module":
            mod = submodule_of(node)
            if isinstance(mod, torch.fx.GraphModule):
                _accumulate(mod.graph, counts)
