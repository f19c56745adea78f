"""FX patterns the passes match, one file per pattern family
(e.g. ``patterns/sequence_parallel.py``, ``patterns/norm_quant.py``).

A pattern file holds the search side (what subgraph of the functional ATen
graph a pass looks for) and the replace side (what it becomes), written
either as ``torch._inductor.pattern_matcher`` search/replace pairs or as
small match dataclasses that know how to replace themselves and erase the
old nodes (the style of ``micro_pipeline_tp.py``).

This module holds the small helpers every pattern family shares: naming ops
the way op counts do (``namespace.op``), reading an op's argument by its
schema name, pairing a ``_c10d_functional`` collective with its
``wait_tensor``, and giving new nodes their fake-tensor ``meta["val"]``
(Inductor needs it on every node).
"""

from __future__ import annotations

from typing import Any, Iterable

import torch
import torch.fx
from torch.fx import Node

C10D = "_c10d_functional"


def op_name(node: Node) -> str | None:
    """`aten.mm`, `_c10d_functional.all_reduce`, `minimax.quantize_fp8`; None if not an op call."""
    if node.op != "call_function":
        return None
    t = node.target
    if isinstance(t, torch._ops.OpOverload):
        return f"{t.namespace}.{t._opname}"
    if isinstance(t, torch._ops.OpOverloadPacket):
        return f"{t._qualified_op_name.replace('::', '.')}"
    if isinstance(t, torch._ops.HigherOrderOperator):
        return f"higher_order.{t.name()}"
    return getattr(t, "__name__", str(t))


def is_op(node: Any, *names: str) -> bool:
    """Whether node calls one of the ops named like `aten.mm` (overload ignored)."""
    return isinstance(node, Node) and op_name(node) in names


def op_arg(node: Node, name: str, default: Any = None) -> Any:
    """An argument of an OpOverload call by its schema name, positional or keyword."""
    if name in node.kwargs:
        return node.kwargs[name]
    schema = getattr(node.target, "_schema", None)
    if schema is None:
        return default
    for i, a in enumerate(schema.arguments):
        if a.name == name:
            return node.args[i] if i < len(node.args) else default
    return default


def is_collective(node: Any, kind: str | None = None) -> bool:
    """A `_c10d_functional` collective (not `wait_tensor`); kind e.g. 'all_reduce'."""
    name = op_name(node) if isinstance(node, Node) else None
    if name is None or not name.startswith(C10D + ".") or name == f"{C10D}.wait_tensor":
        return False
    return kind is None or name == f"{C10D}.{kind}"


def collective_group(node: Node) -> str | None:
    """The process group name a collective runs on, else None."""
    if not is_collective(node):
        return None
    g = op_arg(node, "group_name")
    return g if isinstance(g, str) else None


def wait_of(collective: Node) -> Node | None:
    """The `wait_tensor` that consumes a collective (its only user in a functional graph)."""
    waits = [u for u in collective.users if is_op(u, f"{C10D}.wait_tensor")]
    return waits[0] if len(waits) == 1 else None


def collective_of(wait: Node, kind: str | None = None) -> Node | None:
    """The collective a `wait_tensor` waits on (optionally of one kind), else None."""
    if not is_op(wait, f"{C10D}.wait_tensor"):
        return None
    src = wait.args[0]
    return src if is_collective(src, kind) else None


def find_collectives(graph: torch.fx.Graph, kind: str | None = None) -> Iterable[tuple[Node, Node | None]]:
    """(collective, wait) pairs in graph order."""
    for n in graph.nodes:
        if is_collective(n, kind):
            yield n, wait_of(n)


def val(node: Any) -> Any:
    """The fake tensor (or SymInt) a node carries in meta, or the constant itself."""
    return node.meta.get("val") if isinstance(node, Node) else node


def set_fake_val(node: Node, fake_mode: Any = None) -> Any:
    """Fill node.meta['val'] by running its op on its inputs' fake values.

    New nodes made by a pass need this before Inductor sees the graph."""
    from torch._guards import detect_fake_mode

    args, kwargs = torch.fx.node.map_arg((node.args, node.kwargs), val)
    mode = fake_mode or detect_fake_mode(list(torch.utils._pytree.tree_leaves((args, kwargs))))
    if mode is None:
        raise RuntimeError(f"no fake mode found to infer meta of {node.format_node()}")
    with mode:
        node.meta["val"] = node.target(*args, **kwargs)
    return node.meta["val"]
