"""The eager MoE block in the functional ATen graph, and the minimax::moe that replaces it.

``match_moe_block(topk)``: the block of model/moe.py as AOT traces it
(``_experts_dense``: a static loop over the local experts), anchored at its
``aten.topk``::

    xr = x [-> convert_element_type(float32)]           router input (fp32)
    scores = sigmoid(mm(xr, permute(router_w, [1, 0])))
    choice = scores [+ correction_bias]
    ids = topk(choice, k, -1, largest=True)[1]
    w = gather(scores, 1, ids) [/ sum(., [-1], keepdim)] [* routed_scaling]
    acc = full([T, H], 0, float32)
    for e in offset, offset + 1, ...:                  this rank's experts, in order
        acc = acc + unsqueeze(sum(w * (ids == e), [-1]), 1) * gated_mlp_e(x)
    partial = acc [-> convert_element_type(x.dtype)] [+ gated_mlp_shared(x)]

with the gated MLPs of patterns/linears.py. Every node of the block must be
used only inside it. What does not fit raises ``Mismatch`` naming the node
and the reason: the pass leaves that block alone and reports why. The
replace side (``MoEBlockMatch.replace``) builds the ``minimax::moe`` node and
erases the block.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx as fx

from .fx import (Mismatch, commutative_operands, dtype_of, erase_unused, expect, getitem_source, is_cast, is_op,
                 is_weight, op_arg, op_name, scalar_of, set_fake_val, shape_of)
from .linears import GatedMLPMatch, match_gated_mlp, match_linear

__all__ = ["MoEBlockMatch", "match_moe_block", "find_moe_topks"]


def _dims_last(dims: Any, ndim: int) -> bool:
    if isinstance(dims, int):
        dims = [dims]
    return isinstance(dims, (list, tuple)) and len(dims) == 1 and dims[0] % ndim == ndim - 1


# --------------------------------------------------------------- the block
@dataclass
class MoEBlockMatch:
    """One eager MoE block, matched; `replace()` puts one minimax::moe in its place."""

    x: fx.Node
    output: fx.Node  # the partial sum the block hands to its all-reduce (or to the residual add at TP 1)
    topk: fx.Node
    router_weight: fx.Node
    correction_bias: fx.Node | None
    top_k: int
    routed_scaling: float
    norm_topk_prob: bool
    expert_offset: int
    experts: list[GatedMLPMatch]
    shared: GatedMLPMatch | None
    nodes: set = field(default_factory=set)

    @property
    def num_experts(self) -> int:
        return shape_of(self.router_weight)[0]

    def op_args(self) -> tuple:
        e0, sh = self.experts[0], self.shared
        kind, alpha, limit, beta = e0.consts()
        fp8 = e0.fp8
        group = next((m.group for m in (e0, sh) if m is not None and m.fp8), 128)
        return (
            self.x, self.router_weight, self.correction_bias,
            [e.w13.weight for e in self.experts], [e.w2.weight for e in self.experts],
            [e.w13.scale for e in self.experts] if fp8 else [], [e.w2.scale for e in self.experts] if fp8 else [],
            sh.w13.weight if sh else None, sh.w2.weight if sh else None,
            sh.w13.scale if sh else None, sh.w2.scale if sh else None,
            self.top_k, self.routed_scaling, self.norm_topk_prob, self.expert_offset,
            kind, alpha, limit if math.isfinite(limit) else 0.0, beta, group,
        )

    @property
    def kind(self) -> str:
        return "shared" if self.shared is not None else "routed only"

    def describe(self) -> str:
        e0 = self.experts[0]
        kind, alpha, limit, beta = e0.consts()
        act = f"swigluoai(alpha {alpha}, limit {limit}, beta {beta})" if kind == "swigluoai" else "silu"
        n = len(self.experts)
        return (
            f"experts {self.expert_offset}..{self.expert_offset + n - 1} of {self.num_experts}, top-{self.top_k}, "
            f"{act}, scaling {self.routed_scaling}, {'renormalized' if self.norm_topk_prob else 'not renormalized'}, "
            f"{'biased choice' if self.correction_bias is not None else 'unbiased choice'}, "
            f"{'shared expert' if self.shared else 'no shared expert'}, {'fp8' if e0.fp8 else str(dtype_of(self.x)).replace('torch.', '')}"
        )

    def replace(self, graph: fx.Graph, fake_mode=None) -> fx.Node:
        with graph.inserting_before(self.output):
            node = graph.call_function(torch.ops.minimax.moe.default, self.op_args())
        set_fake_val(node, fake_mode)
        node.meta["minimax_moe"] = self.describe()
        self.output.replace_all_uses_with(node)
        erase_unused(graph, self.nodes)
        return node


def _match_router(topk: fx.Node, seen: set) -> tuple[fx.Node, fx.Node, fx.Node, fx.Node | None, fx.Node]:
    """(xr, scores, router_weight, bias, ids) from the topk node."""
    dim, largest = op_arg(topk, "dim"), op_arg(topk, "largest")
    choice = topk.args[0]
    expect(shape_of(choice) is not None and len(shape_of(choice)) == 2, "top-k input is not [tokens, experts]", topk)
    expect(dim % 2 == 1 and largest, f"top-k over dim {dim} largest={largest}, not the largest over experts", topk)
    ids = [u for u in topk.users if getitem_source(u, 1) is topk]
    values = [u for u in topk.users if getitem_source(u, 0) is topk]
    expect(len(ids) == 1 and not values, "top-k values are used, or the ids are not", topk)
    seen.update({topk, ids[0]})
    bias = None
    if is_op(choice, "aten.sigmoid"):
        scores = choice
    else:
        expect(is_op(choice, "aten.add") and choice.kwargs.get("alpha", 1) == 1,
                "top-k input is neither sigmoid scores nor scores + correction bias", choice)
        pair = [(s, b) for s, b in commutative_operands(choice) if is_op(s, "aten.sigmoid")]
        expect(len(pair) == 1, "top-k input is not sigmoid(logits) + bias", choice)
        scores, bias = pair[0]
        expect(is_weight(bias) and dtype_of(bias) == torch.float32 and shape_of(bias) == (shape_of(choice)[1],),
                "the correction bias is not a float32 [experts] parameter", choice)
        seen.add(choice)
    seen.add(scores)
    lin = match_linear(scores.args[0])
    expect(lin.scale is None, "router is FP8", scores)
    expect(dtype_of(lin.weight) == torch.float32 and dtype_of(lin.x) == torch.float32,
            "router is not computed in float32", scores)
    seen.update(lin.nodes)
    return lin.x, scores, lin.weight, bias, ids[0]


def _match_weights(ids: fx.Node, scores: fx.Node, seen: set) -> tuple[fx.Node, bool, float]:
    """(topk_weights node, renormalized, routed_scaling) from gather(scores, ids)."""
    gathers = [u for u in ids.users if is_op(u, "aten.gather")]
    expect(len(gathers) == 1, f"expected one gather of the top-k ids, found {len(gathers)}", ids)
    g = gathers[0]
    expect(g.args[0] is scores and g.args[2] is ids and g.args[1] % 2 == 1,
            "routing weights are not gathered from the unbiased sigmoid scores", g)
    seen.add(g)
    w, norm, scale = g, False, 1.0
    divs = [u for u in g.users if is_op(u, "aten.div")]
    if divs:
        d = divs[0]
        s = d.args[1]
        expect(d.args[0] is g and is_op(s, "aten.sum") and s.args[0] is g and _dims_last(s.args[1], 2)
                and (s.args[2] if len(s.args) > 2 else s.kwargs.get("keepdim", False)),
                "renormalization is not w / w.sum(-1, keepdim=True)", d)
        expect(set(g.users) == {d, s}, "the gathered scores are used outside the renormalization", g)
        seen.update({d, s})
        w, norm = d, True
    muls = [u for u in w.users if is_op(u, "aten.mul") and scalar_of(u.args[1]) is not None and u.args[0] is w]
    if muls and len(w.users) == 1:
        scale = scalar_of(muls[0].args[1])
        seen.add(muls[0])
        w = muls[0]
    return w, norm, scale


def _expert_term(term: fx.Node, ids: fx.Node, w: fx.Node, seen: set) -> tuple[int, fx.Node]:
    """(expert id, expert output) of unsqueeze(sum(w * (ids == e), -1), 1) * expert(x)."""
    expect(is_op(term, "aten.mul"), "expert term is not weight * expert(x)", term)
    for wt, eo in commutative_operands(term):
        if not (is_op(wt, "aten.unsqueeze") and wt.args[1] in (1, -1)):
            continue
        s = wt.args[0]
        expect(is_op(s, "aten.sum") and _dims_last(s.args[1], 2)
                and not (s.args[2] if len(s.args) > 2 else s.kwargs.get("keepdim", False)),
                "per-expert weight is not a sum over the top-k slots", s)
        m = s.args[0]
        expect(is_op(m, "aten.mul"), "per-expert weight is not w * (ids == e)", m)
        eqs = [(ww, q) for ww, q in commutative_operands(m) if ww is w and is_op(q, "aten.eq") and q.args[0] is ids]
        expect(len(eqs) == 1, "per-expert mask is not (topk_ids == e) times the routing weights", m)
        q = eqs[0][1]
        e = q.args[1]
        expect(isinstance(e, int) and not isinstance(e, bool), "expert id of the mask is not a constant", q)
        for n in (wt, s, m, q):
            expect(len(n.users) == 1, "a per-expert mask value is used twice", n)
        seen.update({term, wt, s, m, q})
        return e, eo
    raise Mismatch("expert term has no per-expert routing weight", term)


def match_moe_block(topk: fx.Node) -> MoEBlockMatch:
    """Match the eager MoE block around `topk`; raises Mismatch with the reason."""
    seen: set = set()
    xr, scores, router_w, bias, ids = _match_router(topk, seen)
    w, norm, scale = _match_weights(ids, scores, seen)

    # The accumulation chain, from its zero-filled start to its end: each
    # mask product w * (ids == e) -> sum -> unsqueeze -> * expert(x) -> add.
    muls = list(w.users)
    expect(bool(muls) and all(is_op(u, "aten.mul") for u in muls),
            "routing weights feed something besides expert masks", w)

    def only_user(n):
        if n is None or not n.users:
            return None
        if len(n.users) > 1:
            others = ", ".join(u.name for u in n.users)
            raise Mismatch(f"{n.name} is used outside the MoE block (users: {others})", n)
        return next(iter(n.users))

    zero = first_add = None
    for m in muls:
        chain = [m]
        for _ in range(4):  # mask -> sum over top-k -> unsqueeze -> times the expert output -> add
            chain.append(only_user(chain[-1]))
        add = chain[-1]
        path = " -> ".join(op_name(n) or n.op if n is not None else "(no user)" for n in chain)
        expect(is_op(add, "aten.add"), f"an expert mask does not feed an accumulating add (path {path})", m)
        for a in add.args:
            if is_op(a, "aten.full", "aten.zeros", "aten.zeros_like"):
                zero, first_add = a, add
    expect(zero is not None, "no accumulator starting from zeros", topk)
    expect(dtype_of(zero) == torch.float32 and (not is_op(zero, "aten.full") or scalar_of(zero.args[1]) == 0.0)
            and len(zero.users) == 1, "the accumulator does not start as float32 zeros", zero)
    seen.add(zero)
    terms: list[tuple[int, GatedMLPMatch]] = []
    acc, add = zero, first_add
    while is_op(add, "aten.add") and acc in add.args and add.kwargs.get("alpha", 1) == 1:
        other = add.args[1] if add.args[0] is acc else add.args[0]
        if not (is_op(other, "aten.mul") and any(is_op(a, "aten.unsqueeze") for a in other.args)):
            break
        e, eo = _expert_term(other, ids, w, seen)
        terms.append((e, match_gated_mlp(eo)))
        seen.add(add)
        acc = add
        if len(add.users) != 1:
            break
        add = next(iter(add.users))
    expect(len(terms) == len(muls), f"{len(muls)} expert masks but {len(terms)} terms in the accumulation chain", topk)
    eq_users = [u for u in ids.users if is_op(u, "aten.eq")]
    expect(len(eq_users) == len(terms), "top-k ids are compared with more experts than are summed", ids)

    # Experts: consecutive ids in chain order, one input, one activation, one shape.
    expert_ids = [e for e, _ in terms]
    offset = expert_ids[0]
    expect(expert_ids == list(range(offset, offset + len(terms))),
            f"local experts {expert_ids} are not consecutive ids in order", topk)
    experts = [m for _, m in terms]
    x = experts[0].x
    for i, m in enumerate(experts):
        expect(m.x is x, f"expert {offset + i} reads another input than expert {offset}", m.w13.weight)
        expect(m.consts() == experts[0].consts(), f"expert {offset + i} has another activation than expert {offset}",
                m.w13.weight)
        expect(shape_of(m.w13.weight) == shape_of(experts[0].w13.weight) and m.fp8 == experts[0].fp8
                and m.group == experts[0].group,
                f"expert {offset + i} differs in weight shape or format from expert {offset}", m.w13.weight)
        expect(dtype_of(m.out) == dtype_of(x),
                f"expert {offset + i} output dtype differs from the input's", m.w2.weight)
        seen.update(m.nodes)
    if xr is not x:  # x.float(): exactly one cast of the experts' input to float32
        expect(is_cast(xr) and xr.args[0] is x and dtype_of(x) != torch.float32,
                "the router reads another input than the experts", scores)
        seen.add(xr)
    e_total = shape_of(router_w)[0]
    expect(shape_of(router_w) == (e_total, shape_of(x)[1]), "router weight is not [experts, hidden]", router_w)
    n = len(experts)
    expect(e_total % n == 0 and offset % n == 0 and offset + n <= e_total,
            f"{n} local experts from {offset} do not tile {e_total} experts", topk)
    k = topk.args[1]
    expect(isinstance(k, int) and 0 < k <= e_total, f"top-k {k} is not a constant in [1, {e_total}]", topk)
    expect(shape_of(zero) == shape_of(x), "accumulator shape differs from the input's", zero)

    # End of the block: cast back to the input dtype, then the shared expert.
    out = acc
    if dtype_of(x) != torch.float32:
        users = list(acc.users)
        expect(len(users) == 1 and is_cast(users[0]) and dtype_of(users[0]) == dtype_of(x),
                "the expert sum is not cast back to the input dtype", acc)
        out = users[0]
        seen.add(out)
    shared = None
    if len(out.users) == 1:
        u = next(iter(out.users))
        if is_op(u, "aten.add") and u.kwargs.get("alpha", 1) == 1:
            other = u.args[1] if u.args[0] is out else u.args[0]
            try:
                cand = match_gated_mlp(other)
            except Mismatch:
                cand = None  # not an MLP: the residual add of a block without a shared expert
            if cand is not None:
                expect(cand.x is x, "the shared expert reads another input than the experts", other)
                expect(cand.consts() == experts[0].consts(), "the shared expert has another activation", other)
                expect(not cand.fp8 or not experts[0].fp8 or cand.group == experts[0].group,
                        "the shared expert quantizes with another group size", other)
                shared = cand
                seen.update(cand.nodes)
                seen.add(u)
                out = u
    # Nothing computed inside the block may be used outside it.
    seen.discard(x)
    for node in seen:
        if node is out:
            continue
        outside = [u for u in node.users if u not in seen]
        if outside:
            raise Mismatch(f"{node.name} is used outside the MoE block (by {outside[0].name})", node)
    return MoEBlockMatch(x, out, topk, router_w, bias, k, scale, norm, offset, experts, shared, seen)


def find_moe_topks(graph: fx.Graph) -> list[fx.Node]:
    """The top-k nodes that look like a router's (of sigmoid scores, biased or not): the
    candidates. Any other top-k (sampling, a sparse-attention indexer) is not a MoE."""
    def router_like(n):
        if not is_op(n, "aten.topk"):
            return False
        choice = n.args[0]
        return is_op(choice, "aten.sigmoid") or (is_op(choice, "aten.add") and any(is_op(a, "aten.sigmoid") for a in choice.args))

    return [n for n in graph.nodes if router_like(n)]
