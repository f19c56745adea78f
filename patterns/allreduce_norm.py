"""An all-reduce whose result only the next RMSNorm (and its residual add) reads.

Search side, two forms:

    FP8: y -> all_reduce(sum) -> wait -> rms_norm_quant_fp8(x, residual, w, ...)
         (what fuse_norm_quant made of the residual add, the norm and its quantization)
    BF16 consumer: y -> all_reduce(sum) -> wait -> h = residual + . -> RMSNorm(h)
         (the norm in front of the MoE, which quantizes inside its own op)

the all-reduce read by nothing else (a norm without a residual add whose input
is also read elsewhere, e.g. the embedding's, stays as it is).

Replace side: one ``minimax.allreduce_rms_norm_quant`` reading ``y``; the FP8
form keeps the readers' getitems (the same four outputs), the BF16 form hands
the norm's readers output 2 and the residual sum's readers output 3.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.fx as fx

import operator

from .collectives import collective_of, group_size
from .fx import Mismatch, erase_unused, expect, is_op, set_fake_val, shape_of
from .norm_quant import RMSNormMatch, match_rms_norm

FUSED_NORM = "minimax.rms_norm_quant_fp8"


@dataclass
class AllReduceNorm:
    norm: fx.Node
    wait: fx.Node
    all_reduce: fx.Node
    kind: str = "allreduce + norm + quant"

    @property
    def tokens(self) -> int:
        return shape_of(self.wait)[0]

    def describe(self) -> str:
        residual = "with residual add" if self.norm.args[1] is not None else "no residual"
        return f"{self.tokens} tokens, group {self.all_reduce.args[2]}, {residual}"

    def replace(self, graph: fx.Graph, fake_mode=None) -> fx.Node:
        x, residual, weight, eps, gemma, group, want_y = self.norm.args
        name = self.all_reduce.args[2]
        with graph.inserting_before(self.norm):
            node = graph.call_function(torch.ops.minimax.allreduce_rms_norm_quant.default,
                                       (self.all_reduce.args[0], residual, weight, eps, gemma, group, want_y,
                                        group_size(name), name))
        set_fake_val(node, fake_mode)
        self.norm.replace_all_uses_with(node)
        for n in (self.norm, self.wait, self.all_reduce):
            graph.erase_node(n)
        return node


def find_fused_norms(graph: fx.Graph) -> list[fx.Node]:
    return [n for n in graph.nodes if is_op(n, FUSED_NORM)]


def match_allreduce_norm(norm: fx.Node, max_tokens: int) -> AllReduceNorm:
    wait = norm.args[0]
    ar = collective_of(wait, "all_reduce")
    expect(ar is not None, "the norm's input is not an all-reduce", norm)
    expect(ar.args[1] == "sum", "the all-reduce is not a sum", ar)
    expect(len(wait.users) == 1 and len(ar.users) == 1, "the all-reduce's result is read by more than the norm", wait)
    tokens = shape_of(wait)[0] if shape_of(wait) else None
    expect(isinstance(tokens, int), "symbolic token count", wait)
    if tokens > max_tokens:
        raise Mismatch(f"{tokens} tokens is above allreduce_fusion_max_tokens={max_tokens}", norm)
    return AllReduceNorm(norm, wait, ar)


@dataclass
class AllReducePlainNorm:
    norm: RMSNormMatch
    residual: fx.Node  # the other operand of the residual add
    wait: fx.Node
    all_reduce: fx.Node
    kind: str = "allreduce + norm (BF16 out)"

    @property
    def tokens(self) -> int:
        return shape_of(self.wait)[0]

    def describe(self) -> str:
        return f"{self.tokens} tokens, group {self.all_reduce.args[2]}, with residual add, no quantization"

    def replace(self, graph: fx.Graph, fake_mode=None) -> fx.Node:
        m, name = self.norm, self.all_reduce.args[2]
        with graph.inserting_before(m.nodes[0] if m.nodes else m.output):
            node = graph.call_function(torch.ops.minimax.allreduce_rms_norm_quant.default,
                                       (self.all_reduce.args[0], self.residual, m.weight, m.eps, m.gemma, 0, True,
                                        group_size(name), name))
            set_fake_val(node, fake_mode)
            normed = graph.call_function(operator.getitem, (node, 2))
            set_fake_val(normed, fake_mode)
            h = graph.call_function(operator.getitem, (node, 3))
            set_fake_val(h, fake_mode)
        m.output.replace_all_uses_with(normed)
        norm_nodes = set(m.nodes)
        m.x.replace_all_uses_with(h, delete_user_cb=lambda u: u not in norm_nodes)
        erase_unused(graph, [*m.nodes, m.output, m.x, self.wait, self.all_reduce])
        return node


def _reduced_operand(add_operands) -> tuple[fx.Node, fx.Node, fx.Node] | None:
    """(residual, wait, all_reduce) when one operand of the residual add is an all-reduce only it reads."""
    a, b = add_operands
    for other, wait in ((a, b), (b, a)):
        ar = collective_of(wait, "all_reduce")
        if ar is not None and len(wait.users) == 1 and len(ar.users) == 1 and ar.args[1] == "sum":
            return other, wait, ar
    return None


def find_norms_after_all_reduce(graph: fx.Graph) -> list[fx.Node]:
    """The fused norms reading an all-reduce nothing else reads, and the outputs of plain RMSNorms
    whose residual add reads one: the candidates, in graph order."""
    out = []
    for n in graph.nodes:
        if is_op(n, FUSED_NORM):
            if collective_of(n.args[0], "all_reduce") is not None and len(n.args[0].users) == 1:
                out.append(n)
            continue
        m = match_rms_norm(n) if n.op == "call_function" else None
        if m is not None and m.residual is not None and _reduced_operand(m.residual) is not None:
            out.append(n)
    return out


def match_norm_after_all_reduce(node: fx.Node, max_tokens: int):
    if is_op(node, FUSED_NORM):
        return match_allreduce_norm(node, max_tokens)
    m = match_rms_norm(node)
    expect(m is not None and m.residual is not None, "not an RMSNorm after a residual add", node)
    found = _reduced_operand(m.residual)
    expect(found is not None, "no operand of the residual add is an all-reduce only it reads", node)
    residual, wait, ar = found
    tokens = shape_of(wait)[0] if shape_of(wait) else None
    expect(isinstance(tokens, int), "symbolic token count", wait)
    if tokens > max_tokens:
        raise Mismatch(f"{tokens} tokens is above allreduce_fusion_max_tokens={max_tokens}", node)
    return AllReducePlainNorm(m, residual, wait, ar)
