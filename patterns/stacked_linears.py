"""Linears that read one activation and whose weights are consecutive rows of one buffer.

Search side: every linear of the functional ATen graph (``match_linear``:
``mm(x, permute(W, [1, 0]))`` or ``quantize_fp8(x) -> fp8_block_gemm``),
grouped by the activation ``x`` it reads (and, for FP8, the quantization
group). A group of two or more is a match when its weights (and FP8 block
scales) are consecutive row ranges of one storage, which the fake tensors of
the graph's parameters show (the model places the sparse layers' QKV and
indexer projections so: model/linear.py ``place_adjacent``). Groups whose
weights are not stacked are reported, not rewritten.

Replace side: one ``minimax.stacked_gemm`` over the group (FP8: on the first
linear's quantized activation; the other quantizations die), a column slice
of its output per old linear, and the old GEMMs erased.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

import torch
import torch.fx as fx

from minimax_backend.kernels.fp8 import WEIGHT_BLOCK
from minimax_backend.kernels.stacked_gemm import rows_are_stacked

from .fx import is_op, set_fake_val, val
from .fx import Mismatch
from .linears import LinearMatch, match_linear

aten = torch.ops.aten


@dataclass
class StackedLinears:
    x: fx.Node
    linears: list[LinearMatch]  # in row order of the shared buffer

    @property
    def fp8(self) -> bool:
        return self.linears[0].scale is not None

    @property
    def widths(self) -> list[int]:
        return [val(lin.weight).shape[0] for lin in self.linears]

    def describe(self) -> str:
        kind = "fp8" if self.fp8 else "bf16"
        return f"{len(self.linears)} {kind} GEMMs of {val(self.x).shape[0]} rows -> 1 (N = {' + '.join(map(str, self.widths))})"

    def replace(self, graph: fx.Graph, fake_mode=None) -> fx.Node:
        order = {n: i for i, n in enumerate(graph.nodes)}
        first = min((lin.out for lin in self.linears), key=order.__getitem__)
        out_dtype = val(first).dtype
        weights = [lin.weight for lin in self.linears]
        with graph.inserting_before(first):
            if self.fp8:
                xq, xs = first.args[0], first.args[1]
                node = graph.call_function(torch.ops.minimax.stacked_gemm.default,
                                           (xq, xs, weights, [lin.scale for lin in self.linears], out_dtype))
            else:
                node = graph.call_function(torch.ops.minimax.stacked_gemm.default,
                                           (first.args[0], None, weights, [], out_dtype))
        set_fake_val(node, fake_mode)
        start = 0
        anchor = node
        for lin, width in zip(self.linears, self.widths):
            with graph.inserting_after(anchor):
                piece = graph.call_function(aten.slice.Tensor, (node, -1, start, start + width))
            set_fake_val(piece, fake_mode)
            lin.out.replace_all_uses_with(piece)
            anchor, start = piece, start + width
        _erase_dead(graph, [n for lin in self.linears for n in lin.nodes])
        return node


def _erase_dead(graph: fx.Graph, nodes: list[fx.Node]) -> None:
    """Erase the old linears' nodes that nothing reads any more (users first)."""
    order = {n: i for i, n in enumerate(graph.nodes)}
    for n in sorted(set(nodes), key=order.__getitem__, reverse=True):
        if not n.users and n.op == "call_function":
            graph.erase_node(n)


@dataclass
class Unstacked:
    """A group of linears on one input left alone, and why."""

    x: fx.Node
    count: int
    reason: str


def _stacked_order(linears: list[LinearMatch]) -> list[LinearMatch] | None:
    try:
        ordered = sorted(linears, key=lambda lin: val(lin.weight).storage_offset())
    except (RuntimeError, AttributeError):
        return None
    if not rows_are_stacked([val(lin.weight) for lin in ordered]):
        return None
    if ordered[0].scale is not None:
        if any(val(lin.weight).shape[0] % WEIGHT_BLOCK for lin in ordered[:-1]):
            return None
        if not rows_are_stacked([val(lin.scale) for lin in ordered]):
            return None
    return ordered


def find_stacked_linears(graph: fx.Graph) -> tuple[list[StackedLinears], list[Unstacked]]:
    groups: dict[tuple, list[LinearMatch]] = defaultdict(list)
    for n in graph.nodes:
        if not is_op(n, "aten.mm", "minimax.fp8_block_gemm"):
            continue
        try:
            lin = match_linear(n)
        except Mismatch:
            continue
        groups[(lin.x, lin.scale is not None, lin.group)].append(lin)
    matches, left = [], []
    for (x, _, _), linears in groups.items():
        if len(linears) < 2:
            continue
        ordered = _stacked_order(linears)
        if ordered is None:
            left.append(Unstacked(x, len(linears), f"{len(linears)} linears read {x.name} but their weights are not "
                                                   "consecutive rows of one buffer"))
        else:
            matches.append(StackedLinears(x, ordered))
    return matches, left
