"""Linears, activations and gated MLPs in the functional ATen graph (search side).

    match_linear(y)        y = x @ W.T: mm(x, permute(W, [1, 0])), or FP8 quantize_fp8(x) -> fp8_block_gemm
    match_activation(h)    SwiGLU-OAI (M3: min(g, l) * sigmoid(alpha g) * (clamp(u, +-l) + beta)) or SiLU
                           (M2: silu(g) * u), either side of each product, with the dtype casts the
                           decompositions put around the clamps looked through
    match_gated_mlp(out)   down(act(split(gate_up(x), n, -1)))

Every constant is read from the graph and checked; what does not fit raises
Mismatch with the node and the reason. Used by the MoE block matcher
(patterns/moe_block.py) and by the stacked-linears fusion.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import torch.fx as fx

from .fx import (Mismatch, commutative_operands, dtype_of, expect, getitem_source, is_op, is_weight, op_arg,
                 scalar_of, shape_of, strip_casts)

__all__ = ["LinearMatch", "match_linear", "ActMatch", "match_activation", "GatedMLPMatch", "match_gated_mlp"]


@dataclass
class LinearMatch:
    x: fx.Node
    weight: fx.Node
    scale: fx.Node | None  # FP8 block scales, None for BF16
    group: int | None  # FP8 activation group size
    out: fx.Node
    nodes: set = field(default_factory=set)


def match_linear(n: Any) -> LinearMatch:
    """y = x @ W.T: mm(x, permute(W, [1, 0])) or FP8 quantize_fp8 -> fp8_block_gemm."""
    expect(isinstance(n, fx.Node), "a linear's output is not a graph value")
    if is_op(n, "aten.mm"):
        a, b = n.args
        expect(is_op(b, "aten.permute") and list(b.args[1]) == [1, 0] or is_op(b, "aten.t"),
                "mm whose weight is not a transposed [N, K] tensor", n)
        w = b.args[0]
        expect(is_weight(w), "linear weight is computed in the graph, not a parameter", n)
        return LinearMatch(a, w, None, None, n, {n, b})
    if is_op(n, "minimax.fp8_block_gemm"):
        xq, xs, w, ws = n.args[0], n.args[1], n.args[2], n.args[3]
        q = getitem_source(xq, 0)
        expect(q is not None and getitem_source(xs, 1) is q and is_op(q, "minimax.quantize_fp8"),
                "fp8_block_gemm whose activation is not one minimax.quantize_fp8", n)
        expect(is_weight(w) and is_weight(ws), "FP8 weight or scales are computed in the graph", n)
        x = q.args[0]
        expect(op_arg(n, "out_dtype") == dtype_of(x), "fp8_block_gemm output dtype differs from its input's", n)
        return LinearMatch(x, w, ws, int(op_arg(q, "group_size")), n, {n, xq, xs, q})
    raise Mismatch(f"expected a linear (aten.mm or minimax.fp8_block_gemm), found {n.format_node()}", n)


# --------------------------------------------------------------- activation
@dataclass
class ActMatch:
    gate: fx.Node
    up: fx.Node
    kind: str
    alpha: float = 1.0
    limit: float = math.inf
    beta: float = 0.0
    nodes: set = field(default_factory=set)


def _clamp_bounds(n: Any, seen: set) -> tuple[Any, float | None, float | None]:
    """(source, lo, hi) of a chain of clamp / clamp_min / clamp_max ops (casts looked through)."""
    lo = hi = None
    n = strip_casts(n, seen)
    while True:
        if is_op(n, "aten.clamp_max") and (v := scalar_of(n.args[1])) is not None:
            expect(hi is None, "two upper clamps", n)
            hi = v
        elif is_op(n, "aten.clamp_min") and (v := scalar_of(n.args[1])) is not None:
            expect(lo is None, "two lower clamps", n)
            lo = v
        elif is_op(n, "aten.clamp"):
            a_lo, a_hi = scalar_of(op_arg(n, "min")), scalar_of(op_arg(n, "max"))
            expect(lo is None and hi is None, "nested clamps", n)
            lo, hi = a_lo, a_hi
        else:
            return n, lo, hi
        seen.add(n)
        n = strip_casts(n.args[0], seen)


def _match_swiglu_oai(h: fx.Node) -> ActMatch:
    # (clamp(up, -l, l) + beta) * (g * sigmoid(g * alpha)),  g = min(gate, l)
    last = None
    for a, b in commutative_operands(h):
        seen: set = {h}
        try:
            add = strip_casts(a, seen)
            expect(is_op(add, "aten.add") and scalar_of(add.args[1]) is not None, "no '(up + beta)' factor", h)
            beta = scalar_of(add.args[1])
            expect(add.kwargs.get("alpha", 1) == 1, "add with alpha", add)
            seen.add(add)
            up, lo, hi = _clamp_bounds(add.args[0], seen)
            expect(lo is not None and hi is not None and lo == -hi and hi > 0,
                    f"up branch clamp [{lo}, {hi}] is not symmetric", add)
            prod = strip_casts(b, seen)
            expect(is_op(prod, "aten.mul"), "no 'g * sigmoid(alpha g)' factor", h)
            seen.add(prod)
            for g1, sg in commutative_operands(prod):
                sg_s = strip_casts(sg, set())
                if not is_op(sg_s, "aten.sigmoid"):
                    continue
                strip_casts(sg, seen)
                seen.add(sg_s)
                scaled = strip_casts(sg_s.args[0], seen)
                expect(is_op(scaled, "aten.mul"), "sigmoid argument is not alpha * g", sg_s)
                seen.add(scaled)
                pair = [(x, scalar_of(c)) for x, c in commutative_operands(scaled) if scalar_of(c) is not None]
                expect(len(pair) == 1, "sigmoid argument is not alpha * g", scaled)
                g2, alpha = pair[0]
                g_node = strip_casts(g1, seen)
                expect(strip_casts(g2, seen) is g_node, "the two g's of g * sigmoid(alpha g) differ", prod)
                gate, glo, ghi = _clamp_bounds(g_node, seen)
                expect(glo is None and ghi == hi, f"gate clamp (max {ghi}) differs from the up clamp ({hi})", prod)
                return ActMatch(gate, up, "swigluoai", alpha, hi, beta, seen)
            raise Mismatch("no sigmoid factor in 'g * sigmoid(alpha g)'", prod)
        except Mismatch as e:
            e.progress = len(seen)
            last = e if last is None or e.progress > last.progress else last
    raise last


def _match_silu(h: fx.Node) -> ActMatch:
    # silu(gate) * up, silu written as silu, g * sigmoid(g) or g / (1 + exp(-g))
    last = None
    for a, b in commutative_operands(h):
        seen: set = {h}
        try:
            s = strip_casts(a, seen)
            if is_op(s, "aten.silu"):
                gate = s.args[0]
                seen.add(s)
            elif is_op(s, "aten.div"):
                g, den = s.args
                den_s = strip_casts(den, seen)
                expect(is_op(den_s, "aten.add"), "silu denominator is not 1 + exp(-g)", s)
                ex = [x for x, c in commutative_operands(den_s) if scalar_of(c) == 1.0]
                expect(len(ex) == 1 and is_op(ex[0], "aten.exp") and is_op(ex[0].args[0], "aten.neg")
                        and ex[0].args[0].args[0] is g, "silu denominator is not 1 + exp(-g)", s)
                seen.update({s, den_s, ex[0], ex[0].args[0]})
                gate = g
            elif is_op(s, "aten.mul"):
                pair = [(g, sg) for g, sg in commutative_operands(s) if is_op(sg, "aten.sigmoid") and sg.args[0] is g]
                expect(len(pair) >= 1, "not silu(g) = g * sigmoid(g)", s)
                gate = pair[0][0]
                seen.update({s, pair[0][1]})
            else:
                raise Mismatch("not a SiLU-gated product", h)
            gate = strip_casts(gate, seen)
            up = strip_casts(b, seen)
            return ActMatch(gate, up, "silu", 1.0, math.inf, 0.0, seen)
        except Mismatch as e:
            e.progress = len(seen)
            last = e if last is None or e.progress > last.progress else last
    raise last


def match_activation(h: Any) -> ActMatch:
    expect(is_op(h, "aten.mul"), "the down projection's input is not a gated product", h if isinstance(h, fx.Node) else None)
    errors = []
    for fn in (_match_swiglu_oai, _match_silu):
        try:
            return fn(h)
        except Mismatch as e:
            errors.append(e)
    best = max(errors, key=lambda e: e.progress)
    if best.progress > 2:  # got well into one form: its reason is the one that matters
        raise best
    raise Mismatch(f"activation is neither SwiGLU-OAI nor SiLU ({'; '.join(e.reason for e in errors)})", h)


# --------------------------------------------------------------- gated MLP
@dataclass
class GatedMLPMatch:
    x: fx.Node
    w13: LinearMatch
    w2: LinearMatch
    act: ActMatch
    nodes: set = field(default_factory=set)

    @property
    def out(self) -> fx.Node:
        return self.w2.out

    @property
    def fp8(self) -> bool:
        return self.w13.scale is not None

    @property
    def group(self) -> int:
        return self.w13.group or self.w2.group or 128

    def consts(self) -> tuple:
        a = self.act
        return (a.kind, a.alpha, a.limit, a.beta)


def match_gated_mlp(out: Any) -> GatedMLPMatch:
    """down(act(gate, up)) with gate, up = split(gate_up(x), n, -1)."""
    down = match_linear(out)
    act = match_activation(down.x)
    sp_g, sp_u = getitem_source(act.gate, 0), getitem_source(act.up, 1)
    expect(sp_g is not None and sp_g is sp_u, "gate and up are not the two halves of one split", down.x)
    split = sp_g
    gu = split.args[0]
    expect(shape_of(gu) is not None, "gate/up projection without a shape", split)
    width = shape_of(gu)[-1]
    if is_op(split, "aten.split"):
        expect(width is not None and split.args[1] * 2 == width and len(split.users) == 2,
                "gate/up split is not into two equal halves", split)
        dim = split.args[2] if len(split.args) > 2 else split.kwargs.get("dim", 0)
    elif is_op(split, "aten.split_with_sizes"):
        sizes = list(split.args[1])
        expect(len(sizes) == 2 and sizes[0] == sizes[1] and width == 2 * sizes[0], "gate/up split sizes differ", split)
        dim = split.args[2] if len(split.args) > 2 else split.kwargs.get("dim", 0)
    else:
        raise Mismatch("gate and up do not come from a split", split)
    expect(dim % len(shape_of(gu)) == len(shape_of(gu)) - 1, "gate/up split is not along the last dim", split)
    gate_up = match_linear(gu)
    w13, w2 = shape_of(gate_up.weight), shape_of(down.weight)
    expect(w13 is not None and w2 is not None and w13[0] == 2 * w2[1] and w13[1] == w2[0],
            f"gate_up weight {w13} and down weight {w2} are not [2n, H] and [H, n]", out)
    expect((gate_up.scale is None) == (down.scale is None), "gate_up and down differ in FP8-ness", out)
    if gate_up.group and down.group:
        expect(gate_up.group == down.group, "gate_up and down quantize with different group sizes", out)
    nodes = gate_up.nodes | down.nodes | act.nodes | {split, act.gate, act.up}
    return GatedMLPMatch(gate_up.x, gate_up, down, act, nodes)
