"""The FX helpers every pattern and pass shares: one place, one meaning.

    op_name(node)           ``namespace.op`` as op counts, records and dumps name ops
    is_op(node, *names)     whether a node calls one of those ops (overload ignored)
    op_arg(node, name)      an OpOverload call's argument by its schema name
    val / tensor_val        a node's fake value (meta["val"]); the tensor or None
    shape_of / dtype_of     of that tensor, or None
    set_fake_val(node)      give a new node its fake value (Inductor needs one on every node)
    Mismatch, expect        "this subgraph is not the pattern", with the reason and the node
    stable_toposort(graph)  reorder so every node follows its inputs, old order otherwise

Op names: ATen / custom ops (OpOverload or OpOverloadPacket) are ``namespace.op``
with the overload dropped (``aten.mm``, ``_c10d_functional.all_reduce``,
``minimax.quantize_fp8``); higher-order ops ``higher_order.<name>``; Python
callables their module-qualified name (``operator.getitem``,
``torch.nn.functional.linear``; builtins bare: ``getattr``); tensor methods
(``call_method``) ``Tensor.view``; ``call_module`` of a plain module
``module.<ClassName>``; a split-graph submodule, placeholders, get_attr and
output are not ops (None).
"""

from __future__ import annotations

import functools
from typing import Any

import torch
import torch.fx
from torch.fx import Node
from torch.fx.node import _get_qualified_name

__all__ = ["op_name", "is_op", "op_arg", "val", "tensor_val", "shape_of", "dtype_of", "set_fake_val",
           "Mismatch", "expect", "stable_toposort", "submodule_of"]


# ------------------------------------------------------------------- names
def op_name(node: Node) -> str | None:
    """The ``namespace.op`` name of a node, or None for non-op nodes."""
    if node.op == "call_function":
        try:
            return _cached_callable_name(node.target)
        except TypeError:  # an unhashable target
            return _callable_name(node.target)
    if node.op == "call_method":
        return f"Tensor.{node.target}"
    if node.op == "call_module":
        mod = submodule_of(node)
        if mod is None or isinstance(mod, torch.fx.GraphModule):
            return None
        return f"module.{type(mod).__name__}"
    return None


def submodule_of(node: Node):
    """The module a call_module node calls, or None."""
    root = node.graph.owning_module
    if root is None:
        return None
    try:
        return root.get_submodule(node.target)
    except AttributeError:
        return None


@functools.lru_cache(maxsize=4096)  # big graphs call few distinct targets many times
def _cached_callable_name(target) -> str:
    return _callable_name(target)


def _callable_name(target) -> str:
    if isinstance(target, torch._ops.OpOverload):
        return target._schema.name.replace("::", ".")  # "namespace::op"; the overload lives elsewhere
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
        # F.linear and friends are C builtins in torch._C._nn: the name users write when it is that function
        short = name[len("torch._C._nn."):]
        if getattr(torch.nn.functional, short, None) is target:
            name = "torch.nn.functional." + short
    return name


def is_op(node: Any, *names: str) -> bool:
    """Whether node calls one of the ops named like `aten.mm` (overload ignored)."""
    return isinstance(node, Node) and op_name(node) in names


def op_arg(node: Node, name: str, default: Any = None) -> Any:
    """An argument of an OpOverload call by its schema name, positional or keyword, else its
    schema default (or `default`)."""
    if name in node.kwargs:
        return node.kwargs[name]
    schema = getattr(node.target, "_schema", None)
    if schema is None:
        return default
    for i, a in enumerate(schema.arguments):
        if a.name == name:
            if i < len(node.args):
                return node.args[i]
            return a.default_value if a.has_default_value() else default
    return default


# ------------------------------------------------------------- fake values
def val(node: Any) -> Any:
    """The fake tensor (or SymInt) a node carries in meta, or the constant itself."""
    return node.meta.get("val") if isinstance(node, Node) else node


def tensor_val(node: Any) -> torch.Tensor | None:
    v = node.meta.get("val") if isinstance(node, Node) else None
    return v if isinstance(v, torch.Tensor) else None


def shape_of(node: Any) -> tuple | None:
    v = tensor_val(node)
    return tuple(v.shape) if v is not None else None


def dtype_of(node: Any) -> torch.dtype | None:
    v = tensor_val(node)
    return v.dtype if v is not None else None


def set_fake_val(node: Node, fake_mode: Any = None) -> Any:
    """Fill node.meta['val'] by running its op on its inputs' fake values."""
    from torch._guards import detect_fake_mode

    args, kwargs = torch.fx.node.map_arg((node.args, node.kwargs), val)
    mode = fake_mode or detect_fake_mode(list(torch.utils._pytree.tree_leaves((args, kwargs))))
    if mode is None:
        raise RuntimeError(f"no fake mode found to infer meta of {node.format_node()}")
    with mode:
        node.meta["val"] = node.target(*args, **kwargs)
    return node.meta["val"]


# --------------------------------------------------------------- matching
class Mismatch(Exception):
    """The subgraph is not (provably) the pattern; the message says why."""

    def __init__(self, reason: str, node: Node | None = None):
        self.reason, self.node = reason, node
        self.progress = 0  # how far a match attempt got: the furthest one explains the miss best
        super().__init__(f"{reason} (at {node.name})" if node is not None else reason)


def expect(cond: bool, reason: str, node: Node | None = None) -> None:
    if not cond:
        raise Mismatch(reason, node)


# ---------------------------------------------------------------- ordering
def stable_toposort(graph: torch.fx.Graph) -> None:
    """Reorder nodes so every node follows its inputs, keeping the old order otherwise."""
    order = {n: i for i, n in enumerate(graph.nodes)}
    placed, visiting, result = set(), set(), []

    def place(n: Node):
        stack = [(n, False)]
        while stack:
            cur, ready = stack.pop()
            if cur in placed:
                continue
            if ready:
                placed.add(cur)
                visiting.discard(cur)
                result.append(cur)
                continue
            if cur in visiting:
                raise RuntimeError(f"the rewrite made a cycle through {cur.format_node()}")
            visiting.add(cur)
            stack.append((cur, True))
            for a in sorted(cur.all_input_nodes, key=order.__getitem__, reverse=True):
                if a not in placed:
                    stack.append((a, False))

    for n in list(graph.nodes):
        place(n)
    output = [n for n in result if n.op == "output"]
    anchor = None
    for n in result:
        if n.op == "output":
            continue
        if anchor is None:
            first = next(iter(graph.nodes))
            if first is not n:
                first.prepend(n)
        else:
            anchor.append(n)
        anchor = n
    for o in output:
        anchor.append(o)


# ------------------------------------------------------- matching helpers
_CASTS = ("prims.convert_element_type", "aten._to_copy")


def scalar_of(v: Any) -> float | None:
    """A real constant argument as a float (None for tensors, nodes, bools)."""
    import numbers

    return float(v) if isinstance(v, numbers.Real) and not isinstance(v, bool) else None


def is_cast(n: Any) -> bool:
    """A pure dtype cast (no device or layout change)."""
    if not is_op(n, *_CASTS):
        return False
    if is_op(n, "aten._to_copy"):
        return set(n.kwargs) <= {"dtype"}
    return True


def strip_casts(n: Any, seen: set | None = None) -> Any:
    """Follow dtype casts back to their source (recording them in `seen`)."""
    while is_cast(n):
        if seen is not None:
            seen.add(n)
        n = n.args[0]
    return n


def getitem_source(n: Any, index: int) -> Node | None:
    """If n is operator.getitem(src, index), src; else None."""
    import operator

    if isinstance(n, Node) and n.op == "call_function" and n.target is operator.getitem and n.args[1] == index:
        return n.args[0]
    return None


def is_weight(n: Any) -> bool:
    """A graph input or attribute (a parameter), or a block of its rows (experts stored stacked:
    model/moe.py's LocalExperts), not something computed in the graph."""
    if isinstance(n, Node) and is_op(n, "aten.slice") and len(n.args) >= 2:
        dim = n.args[1]
        step = n.args[4] if len(n.args) > 4 else n.kwargs.get("step", 1)
        n = n.args[0] if dim == 0 and step == 1 else None
    return isinstance(n, Node) and n.op in ("placeholder", "get_attr")


def commutative_operands(n: Node) -> list[tuple[Any, Any]]:
    """Both orders of a binary commutative op's operands."""
    a, b = n.args[0], n.args[1]
    return [(a, b), (b, a)]


def erase_unused(graph: torch.fx.Graph, nodes) -> None:
    """Erase those of `nodes` that nothing reads (users first, in reverse graph order)."""
    order = {n: i for i, n in enumerate(graph.nodes)}
    for n in sorted(set(nodes), key=order.__getitem__, reverse=True):
        if not n.users and n.op == "call_function":
            graph.erase_node(n)
