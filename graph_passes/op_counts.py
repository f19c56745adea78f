"""Name and count the operations of an FX graph.

Every pass test, the compile report and the graph dump speak about ops by the
same names, so the naming lives here, in one place:

- ATen / custom ops (OpOverload or OpOverloadPacket): ``namespace.op`` with the
  overload dropped: ``aten.mm``, ``_c10d_functional.all_reduce``,
  ``_c10d_functional.wait_tensor``, ``minimax.quantize_fp8``.
- Higher-order ops: ``higher_order.<name>`` (e.g. ``higher_order.cond``).
- Python callables (Dynamo-level graphs, ``operator`` glue in ATen graphs):
  the module-qualified name, ``torch.matmul``, ``torch.nn.functional.linear``,
  ``operator.getitem``, ``math.sqrt``; Python builtins stay bare
  (``getattr``). We keep the ``operator.`` prefix so that every name has the
  ``namespace.op`` shape and a table never mixes ``getitem`` with ``aten.*``.
- Tensor methods (``call_method`` nodes of Dynamo graphs): ``Tensor.view``.
- ``call_module`` of a plain ``nn.Module``: ``module.<ClassName>``; a
  ``call_module`` of a GraphModule (a split/piecewise graph) is not an op:
  ``op_counts`` counts the ops inside it instead.
- placeholder / get_attr / output: not ops (``None``).
"""

from __future__ import annotations

import functools
from collections import Counter

import torch
import torch.fx
from torch.fx.node import _get_qualified_name

__all__ = ["op_name", "op_counts", "count", "count_delta"]


def op_name(node: torch.fx.Node) -> str | None:
    """The ``namespace.op`` name of a node, or None for non-op nodes."""
    if node.op == "call_function":
        try:
            return _cached_callable_name(node.target)
        except TypeError:  # an unhashable target
            return _callable_name(node.target)
    if node.op == "call_method":
        return f"Tensor.{node.target}"
    if node.op == "call_module":
        mod = _submodule(node)
        if mod is None or isinstance(mod, torch.fx.GraphModule):
            return None
        return f"module.{type(mod).__name__}"
    return None


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
            mod = _submodule(node)
            if isinstance(mod, torch.fx.GraphModule):
                _accumulate(mod.graph, counts)


def _submodule(node: torch.fx.Node):
    root = node.graph.owning_module
    if root is None:
        return None
    try:
        return root.get_submodule(node.target)
    except AttributeError:
        return None


# Big graphs call few distinct targets many times; naming one is not free.
@functools.lru_cache(maxsize=4096)
def _cached_callable_name(target) -> str:
    return _callable_name(target)


def _callable_name(target) -> str:
    if isinstance(target, torch._ops.OpOverload):
        # _schema.name is "namespace::op"; the overload lives elsewhere.
        return target._schema.name.replace("::", ".")
    if isinstance(target, torch._ops.OpOverloadPacket):
        return target._qualified_op_name.replace("::", ".")
    if isinstance(target, torch._ops.HigherOrderOperator):
        return f"higher_order.{target.name()}"
    if isinstance(target, str):
        return target
    try:
        name = _get_qualified_name(target)
    except Exception:  # odd callables (partials, lambdas): still give a name
        name = getattr(target, "__qualname__", None) or repr(target)
    if name.startswith("_operator."):
        name = "operator." + name[len("_operator."):]
    elif name.startswith("torch._C._nn."):
        # F.linear and friends are C builtins living in torch._C._nn; show the
        # name users write when it is the same function.
        short = name[len("torch._C._nn."):]
        if getattr(torch.nn.functional, short, None) is target:
            name = "torch.nn.functional." + short
    return name

