"""Matching and building functional collectives in an ATen graph.

The model issues every collective as `torch.ops._c10d_functional.<op>`
followed by `wait_tensor`; in the graph that is always a pair of nodes. The
passes match and build the pair together so no graph is ever left with a
collective whose result is not waited on.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterable

import torch
import torch.fx as fx

from .fx import is_op, op_arg, op_name

C10D = "_c10d_functional"
c10d = torch.ops._c10d_functional


def is_collective(node: Any, kind: str | None = None) -> bool:
    """A `_c10d_functional` collective (not `wait_tensor`); kind e.g. 'all_reduce'."""
    name = op_name(node) if isinstance(node, fx.Node) else None
    if name is None or not name.startswith(C10D + ".") or name == f"{C10D}.wait_tensor":
        return False
    return kind is None or name == f"{C10D}.{kind}"


def collective_group(node: fx.Node) -> str | None:
    """The process group name a collective runs on, else None."""
    if not is_collective(node):
        return None
    g = op_arg(node, "group_name")
    return g if isinstance(g, str) else None


def wait_of(collective: fx.Node) -> fx.Node | None:
    """The `wait_tensor` that consumes a collective (its only user in a functional graph)."""
    waits = [u for u in collective.users if is_op(u, f"{C10D}.wait_tensor")]
    return waits[0] if len(waits) == 1 else None


def collective_of(wait: fx.Node, kind: str | None = None) -> fx.Node | None:
    """The collective a `wait_tensor` waits on (optionally of one kind), else None."""
    if not is_op(wait, f"{C10D}.wait_tensor"):
        return None
    src = wait.args[0]
    return src if is_collective(src, kind) else None


def find_collectives(graph: fx.Graph, kind: str | None = None) -> Iterable[tuple[fx.Node, fx.Node | None]]:
    """(collective, wait) pairs in graph order."""
    for n in graph.nodes:
        if is_collective(n, kind):
            yield n, wait_of(n)


@dataclass
class Collective:
    """A functional collective and the wait_tensor that completes it."""

    start: fx.Node
    wait: fx.Node

    @property
    def input(self) -> fx.Node:
        return self.start.args[0]

    @property
    def group_name(self) -> str:
        return self.start.args[-1]


def find_all_reduces(graph: fx.Graph, reduce_op: str = "sum") -> list[Collective]:
    """Every all_reduce(x, reduce_op, group) with exactly one wait, in graph order."""
    return [
        Collective(start, wait)
        for start, wait in find_collectives(graph, "all_reduce")
        if wait is not None and len(start.users) == 1 and start.args[1] == reduce_op
    ]


def group_size(group_name: str) -> int:
    # c10d keeps a name -> ProcessGroup registry; present in torch 2.11 and 2.13.
    from torch.distributed.distributed_c10d import _resolve_process_group

    return _resolve_process_group(group_name).size()


def insert_reduce_scatter(graph: fx.Graph, x: fx.Node, group_size: int, group_name: str) -> fx.Node:
    """reduce_scatter(x) along dim 0 + wait; call with graph.inserting_*() set."""
    start = graph.call_function(c10d.reduce_scatter_tensor.default, (x, "sum", group_size, group_name))
    return graph.call_function(c10d.wait_tensor.default, (start,))


def insert_all_gather(graph: fx.Graph, x: fx.Node, group_size: int, group_name: str) -> fx.Node:
    """all_gather(x) along dim 0 + wait; call with graph.inserting_*() set."""
    start = graph.call_function(c10d.all_gather_into_tensor.default, (x, group_size, group_name))
    return graph.call_function(c10d.wait_tensor.default, (start,))
