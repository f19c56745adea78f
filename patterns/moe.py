"""The MoE block in the functional ATen graph, and the collectives around `minimax::moe`.

Search side of two passes:

* ``match_moe_block(topk)``: the eager block of model/moe.py as AOT traces it
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

  a gated MLP being ``down(act(split(gate_up(x), n, -1)))`` with BF16 linears
  (``mm(a, permute(w, [1, 0]))``) or FP8 ones (``minimax.quantize_fp8`` ->
  ``minimax.fp8_block_gemm``), and ``act`` SwiGLU-OAI or SiLU (either side of
  each product; dtype casts that the decompositions put around the clamps are
  looked through). Every constant is read from the graph and checked; every
  node of the block must be used only inside it. What does not fit raises
  ``Mismatch`` naming the node and the reason: the pass leaves that block
  alone and reports why.

* ``match_moe_collectives(moe)``: what the sequence-parallel pass (or the
  eager block) put around a ``minimax::moe`` node::

      SP:      shard -> all_gather + wait [-> slice rows :T] -> moe
               -> [constant_pad_nd rows] -> reduce_scatter + wait
      no SP:   moe -> all_reduce + wait
      TP 1:    moe (no collective)

The replace side (building ``minimax::moe`` / ``minimax::mega_moe`` and erasing
the old nodes) is on the match dataclasses, in the style of
``torch/_inductor/fx_passes/micro_pipeline_tp.py``.
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx as fx

from minimax_backend.patterns import collective_of, is_collective, is_op, op_name, set_fake_val, wait_of

aten = torch.ops.aten

_CASTS = ("prims.convert_element_type", "aten._to_copy")


class Mismatch(Exception):
    """The subgraph is not (provably) the eager MoE block; the message says why."""

    def __init__(self, reason: str, node: fx.Node | None = None):
        self.reason, self.node = reason, node
        self.progress = 0  # how far a match attempt got: the furthest one explains the miss best
        super().__init__(f"{reason} (at {node.name})" if node is not None else reason)


# ------------------------------------------------------------------ helpers
def _val(n: Any):
    v = n.meta.get("val") if isinstance(n, fx.Node) else None
    return v if isinstance(v, torch.Tensor) else None


def _shape(n) -> tuple | None:
    v = _val(n)
    return tuple(v.shape) if v is not None else None


def _dtype(n):
    v = _val(n)
    return v.dtype if v is not None else None


def _expect(cond: bool, reason: str, node: fx.Node | None = None) -> None:
    if not cond:
        raise Mismatch(reason, node)


def _op(n: Any, *names: str) -> bool:
    return is_op(n, *names)


def _arg(n: fx.Node, name: str) -> Any:
    """Argument by schema name, falling back to the schema default."""
    if name in n.kwargs:
        return n.kwargs[name]
    for i, a in enumerate(n.target._schema.arguments):
        if a.name == name:
            if i < len(n.args):
                return n.args[i]
            return a.default_value if a.has_default_value() else None
    raise KeyError(name)


def _scalar(v: Any) -> float | None:
    return float(v) if isinstance(v, numbers.Real) and not isinstance(v, bool) else None


def _is_cast(n: Any) -> bool:
    if not _op(n, *_CASTS):
        return False
    if _op(n, "aten._to_copy"):
        return set(n.kwargs) <= {"dtype"}
    return True


def strip_casts(n: Any, seen: set | None = None) -> Any:
    """Follow dtype casts back to their source (recording them in `seen`)."""
    while _is_cast(n):
        if seen is not None:
            seen.add(n)
        n = n.args[0]
    return n


def _getitem(n: Any, index: int) -> fx.Node | None:
    """If n is operator.getitem(src, index), src; else None."""
    import operator

    if isinstance(n, fx.Node) and n.op == "call_function" and n.target is operator.getitem and n.args[1] == index:
        return n.args[0]
    return None


def _is_weight(n: Any) -> bool:
    return isinstance(n, fx.Node) and n.op in ("placeholder", "get_attr")


def _operands(n: fx.Node) -> list[tuple[Any, Any]]:
    """Both orders of a binary commutative op's operands."""
    a, b = n.args[0], n.args[1]
    return [(a, b), (b, a)]


def _dims_last(dims: Any, ndim: int) -> bool:
    if isinstance(dims, int):
        dims = [dims]
    return isinstance(dims, (list, tuple)) and len(dims) == 1 and dims[0] % ndim == ndim - 1


# ------------------------------------------------------------------ linears
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
    _expect(isinstance(n, fx.Node), "a linear's output is not a graph value")
    if _op(n, "aten.mm"):
        a, b = n.args
        _expect(_op(b, "aten.permute") and list(b.args[1]) == [1, 0] or _op(b, "aten.t"),
                "mm whose weight is not a transposed [N, K] tensor", n)
        w = b.args[0]
        _expect(_is_weight(w), "linear weight is computed in the graph, not a parameter", n)
        return LinearMatch(a, w, None, None, n, {n, b})
    if _op(n, "minimax.fp8_block_gemm"):
        xq, xs, w, ws = n.args[0], n.args[1], n.args[2], n.args[3]
        q = _getitem(xq, 0)
        _expect(q is not None and _getitem(xs, 1) is q and _op(q, "minimax.quantize_fp8"),
                "fp8_block_gemm whose activation is not one minimax.quantize_fp8", n)
        _expect(_is_weight(w) and _is_weight(ws), "FP8 weight or scales are computed in the graph", n)
        x = q.args[0]
        _expect(_arg(n, "out_dtype") == _dtype(x), "fp8_block_gemm output dtype differs from its input's", n)
        return LinearMatch(x, w, ws, int(_arg(q, "group_size")), n, {n, xq, xs, q})
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
        if _op(n, "aten.clamp_max") and (v := _scalar(n.args[1])) is not None:
            _expect(hi is None, "two upper clamps", n)
            hi = v
        elif _op(n, "aten.clamp_min") and (v := _scalar(n.args[1])) is not None:
            _expect(lo is None, "two lower clamps", n)
            lo = v
        elif _op(n, "aten.clamp"):
            a_lo, a_hi = _scalar(_arg(n, "min")), _scalar(_arg(n, "max"))
            _expect(lo is None and hi is None, "nested clamps", n)
            lo, hi = a_lo, a_hi
        else:
            return n, lo, hi
        seen.add(n)
        n = strip_casts(n.args[0], seen)


def _match_swiglu_oai(h: fx.Node) -> ActMatch:
    # (clamp(up, -l, l) + beta) * (g * sigmoid(g * alpha)),  g = min(gate, l)
    last = None
    for a, b in _operands(h):
        seen: set = {h}
        try:
            add = strip_casts(a, seen)
            _expect(_op(add, "aten.add") and _scalar(add.args[1]) is not None, "no '(up + beta)' factor", h)
            beta = _scalar(add.args[1])
            _expect(add.kwargs.get("alpha", 1) == 1, "add with alpha", add)
            seen.add(add)
            up, lo, hi = _clamp_bounds(add.args[0], seen)
            _expect(lo is not None and hi is not None and lo == -hi and hi > 0,
                    f"up branch clamp [{lo}, {hi}] is not symmetric", add)
            prod = strip_casts(b, seen)
            _expect(_op(prod, "aten.mul"), "no 'g * sigmoid(alpha g)' factor", h)
            seen.add(prod)
            for g1, sg in _operands(prod):
                sg_s = strip_casts(sg, set())
                if not _op(sg_s, "aten.sigmoid"):
                    continue
                strip_casts(sg, seen)
                seen.add(sg_s)
                scaled = strip_casts(sg_s.args[0], seen)
                _expect(_op(scaled, "aten.mul"), "sigmoid argument is not alpha * g", sg_s)
                seen.add(scaled)
                pair = [(x, _scalar(c)) for x, c in _operands(scaled) if _scalar(c) is not None]
                _expect(len(pair) == 1, "sigmoid argument is not alpha * g", scaled)
                g2, alpha = pair[0]
                g_node = strip_casts(g1, seen)
                _expect(strip_casts(g2, seen) is g_node, "the two g's of g * sigmoid(alpha g) differ", prod)
                gate, glo, ghi = _clamp_bounds(g_node, seen)
                _expect(glo is None and ghi == hi, f"gate clamp (max {ghi}) differs from the up clamp ({hi})", prod)
                return ActMatch(gate, up, "swigluoai", alpha, hi, beta, seen)
            raise Mismatch("no sigmoid factor in 'g * sigmoid(alpha g)'", prod)
        except Mismatch as e:
            e.progress = len(seen)
            last = e if last is None or e.progress > last.progress else last
    raise last


def _match_silu(h: fx.Node) -> ActMatch:
    # silu(gate) * up, silu written as silu, g * sigmoid(g) or g / (1 + exp(-g))
    last = None
    for a, b in _operands(h):
        seen: set = {h}
        try:
            s = strip_casts(a, seen)
            if _op(s, "aten.silu"):
                gate = s.args[0]
                seen.add(s)
            elif _op(s, "aten.div"):
                g, den = s.args
                den_s = strip_casts(den, seen)
                _expect(_op(den_s, "aten.add"), "silu denominator is not 1 + exp(-g)", s)
                ex = [x for x, c in _operands(den_s) if _scalar(c) == 1.0]
                _expect(len(ex) == 1 and _op(ex[0], "aten.exp") and _op(ex[0].args[0], "aten.neg")
                        and ex[0].args[0].args[0] is g, "silu denominator is not 1 + exp(-g)", s)
                seen.update({s, den_s, ex[0], ex[0].args[0]})
                gate = g
            elif _op(s, "aten.mul"):
                pair = [(g, sg) for g, sg in _operands(s) if _op(sg, "aten.sigmoid") and sg.args[0] is g]
                _expect(len(pair) >= 1, "not silu(g) = g * sigmoid(g)", s)
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
    _expect(_op(h, "aten.mul"), "the down projection's input is not a gated product", h if isinstance(h, fx.Node) else None)
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
    sp_g, sp_u = _getitem(act.gate, 0), _getitem(act.up, 1)
    _expect(sp_g is not None and sp_g is sp_u, "gate and up are not the two halves of one split", down.x)
    split = sp_g
    gu = split.args[0]
    _expect(_shape(gu) is not None, "gate/up projection without a shape", split)
    width = _shape(gu)[-1]
    if _op(split, "aten.split"):
        _expect(width is not None and split.args[1] * 2 == width and len(split.users) == 2,
                "gate/up split is not into two equal halves", split)
        dim = split.args[2] if len(split.args) > 2 else split.kwargs.get("dim", 0)
    elif _op(split, "aten.split_with_sizes"):
        sizes = list(split.args[1])
        _expect(len(sizes) == 2 and sizes[0] == sizes[1] and width == 2 * sizes[0], "gate/up split sizes differ", split)
        dim = split.args[2] if len(split.args) > 2 else split.kwargs.get("dim", 0)
    else:
        raise Mismatch("gate and up do not come from a split", split)
    _expect(dim % len(_shape(gu)) == len(_shape(gu)) - 1, "gate/up split is not along the last dim", split)
    gate_up = match_linear(gu)
    w13, w2 = _shape(gate_up.weight), _shape(down.weight)
    _expect(w13 is not None and w2 is not None and w13[0] == 2 * w2[1] and w13[1] == w2[0],
            f"gate_up weight {w13} and down weight {w2} are not [2n, H] and [H, n]", out)
    _expect((gate_up.scale is None) == (down.scale is None), "gate_up and down differ in FP8-ness", out)
    if gate_up.group and down.group:
        _expect(gate_up.group == down.group, "gate_up and down quantize with different group sizes", out)
    nodes = gate_up.nodes | down.nodes | act.nodes | {split, act.gate, act.up}
    return GatedMLPMatch(gate_up.x, gate_up, down, act, nodes)


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
        return _shape(self.router_weight)[0]

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

    def describe(self) -> str:
        e0 = self.experts[0]
        kind, alpha, limit, beta = e0.consts()
        act = f"swigluoai(alpha {alpha}, limit {limit}, beta {beta})" if kind == "swigluoai" else "silu"
        n = len(self.experts)
        return (
            f"experts {self.expert_offset}..{self.expert_offset + n - 1} of {self.num_experts}, top-{self.top_k}, "
            f"{act}, scaling {self.routed_scaling}, {'renormalized' if self.norm_topk_prob else 'not renormalized'}, "
            f"{'biased choice' if self.correction_bias is not None else 'unbiased choice'}, "
            f"{'shared expert' if self.shared else 'no shared expert'}, {'fp8' if e0.fp8 else str(_dtype(self.x)).replace('torch.', '')}"
        )

    def replace(self, graph: fx.Graph, fake_mode=None) -> fx.Node:
        with graph.inserting_before(self.output):
            node = graph.call_function(torch.ops.minimax.moe.default, self.op_args())
        set_fake_val(node, fake_mode)
        node.meta["minimax_moe"] = self.describe()
        self.output.replace_all_uses_with(node)
        erase_region(graph, self.nodes)
        return node


def erase_region(graph: fx.Graph, nodes: set) -> None:
    order = {n: i for i, n in enumerate(graph.nodes)}
    for n in sorted(nodes, key=order.__getitem__, reverse=True):
        if not n.users:
            graph.erase_node(n)


def _match_router(topk: fx.Node, seen: set) -> tuple[fx.Node, fx.Node, fx.Node, fx.Node | None, fx.Node]:
    """(xr, scores, router_weight, bias, ids) from the topk node."""
    k, dim, largest = topk.args[1], _arg(topk, "dim"), _arg(topk, "largest")
    choice = topk.args[0]
    _expect(_shape(choice) is not None and len(_shape(choice)) == 2, "top-k input is not [tokens, experts]", topk)
    _expect(dim % 2 == 1 and largest, f"top-k over dim {dim} largest={largest}, not the largest over experts", topk)
    ids = [u for u in topk.users if _getitem(u, 1) is topk]
    values = [u for u in topk.users if _getitem(u, 0) is topk]
    _expect(len(ids) == 1 and not values, "top-k values are used, or the ids are not", topk)
    seen.update({topk, ids[0]})
    bias = None
    if _op(choice, "aten.sigmoid"):
        scores = choice
    else:
        _expect(_op(choice, "aten.add") and choice.kwargs.get("alpha", 1) == 1,
                "top-k input is neither sigmoid scores nor scores + correction bias", choice)
        pair = [(s, b) for s, b in _operands(choice) if _op(s, "aten.sigmoid")]
        _expect(len(pair) == 1, "top-k input is not sigmoid(logits) + bias", choice)
        scores, bias = pair[0]
        _expect(_is_weight(bias) and _dtype(bias) == torch.float32 and _shape(bias) == (_shape(choice)[1],),
                "the correction bias is not a float32 [experts] parameter", choice)
        seen.add(choice)
    seen.add(scores)
    lin = match_linear(scores.args[0])
    _expect(lin.scale is None, "router is FP8", scores)
    _expect(_dtype(lin.weight) == torch.float32 and _dtype(lin.x) == torch.float32,
            "router is not computed in float32", scores)
    seen.update(lin.nodes)
    return lin.x, scores, lin.weight, bias, ids[0]


def _match_weights(ids: fx.Node, scores: fx.Node, seen: set) -> tuple[fx.Node, bool, float]:
    """(topk_weights node, renormalized, routed_scaling) from gather(scores, ids)."""
    gathers = [u for u in ids.users if _op(u, "aten.gather")]
    _expect(len(gathers) == 1, f"expected one gather of the top-k ids, found {len(gathers)}", ids)
    g = gathers[0]
    _expect(g.args[0] is scores and g.args[2] is ids and g.args[1] % 2 == 1,
            "routing weights are not gathered from the unbiased sigmoid scores", g)
    seen.add(g)
    w, norm, scale = g, False, 1.0
    divs = [u for u in g.users if _op(u, "aten.div")]
    if divs:
        d = divs[0]
        s = d.args[1]
        _expect(d.args[0] is g and _op(s, "aten.sum") and s.args[0] is g and _dims_last(s.args[1], 2)
                and (s.args[2] if len(s.args) > 2 else s.kwargs.get("keepdim", False)),
                "renormalization is not w / w.sum(-1, keepdim=True)", d)
        _expect(set(g.users) == {d, s}, "the gathered scores are used outside the renormalization", g)
        seen.update({d, s})
        w, norm = d, True
    muls = [u for u in w.users if _op(u, "aten.mul") and _scalar(u.args[1]) is not None and u.args[0] is w]
    if muls and len(w.users) == 1:
        scale = _scalar(muls[0].args[1])
        seen.add(muls[0])
        w = muls[0]
    return w, norm, scale


def _expert_term(term: fx.Node, ids: fx.Node, w: fx.Node, seen: set) -> tuple[int, fx.Node]:
    """(expert id, expert output) of unsqueeze(sum(w * (ids == e), -1), 1) * expert(x)."""
    _expect(_op(term, "aten.mul"), "expert term is not weight * expert(x)", term)
    for wt, eo in _operands(term):
        if not (_op(wt, "aten.unsqueeze") and wt.args[1] in (1, -1)):
            continue
        s = wt.args[0]
        _expect(_op(s, "aten.sum") and _dims_last(s.args[1], 2)
                and not (s.args[2] if len(s.args) > 2 else s.kwargs.get("keepdim", False)),
                "per-expert weight is not a sum over the top-k slots", s)
        m = s.args[0]
        _expect(_op(m, "aten.mul"), "per-expert weight is not w * (ids == e)", m)
        eqs = [(ww, q) for ww, q in _operands(m) if ww is w and _op(q, "aten.eq") and q.args[0] is ids]
        _expect(len(eqs) == 1, "per-expert mask is not (topk_ids == e) times the routing weights", m)
        q = eqs[0][1]
        e = q.args[1]
        _expect(isinstance(e, int) and not isinstance(e, bool), "expert id of the mask is not a constant", q)
        for n in (wt, s, m, q):
            _expect(len(n.users) == 1, "a per-expert mask value is used twice", n)
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
    _expect(bool(muls) and all(_op(u, "aten.mul") for u in muls),
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
        _expect(_op(add, "aten.add"), f"an expert mask does not feed an accumulating add (path {path})", m)
        for a in add.args:
            if _op(a, "aten.full", "aten.zeros", "aten.zeros_like"):
                zero, first_add = a, add
    _expect(zero is not None, "no accumulator starting from zeros", topk)
    _expect(_dtype(zero) == torch.float32 and (not _op(zero, "aten.full") or _scalar(zero.args[1]) == 0.0)
            and len(zero.users) == 1, "the accumulator does not start as float32 zeros", zero)
    seen.add(zero)
    terms: list[tuple[int, GatedMLPMatch]] = []
    acc, add = zero, first_add
    while _op(add, "aten.add") and acc in add.args and add.kwargs.get("alpha", 1) == 1:
        other = add.args[1] if add.args[0] is acc else add.args[0]
        if not (_op(other, "aten.mul") and any(_op(a, "aten.unsqueeze") for a in other.args)):
            break
        e, eo = _expert_term(other, ids, w, seen)
        terms.append((e, match_gated_mlp(eo)))
        seen.add(add)
        acc = add
        if len(add.users) != 1:
            break
        add = next(iter(add.users))
    _expect(len(terms) == len(muls), f"{len(muls)} expert masks but {len(terms)} terms in the accumulation chain", topk)
    eq_users = [u for u in ids.users if _op(u, "aten.eq")]
    _expect(len(eq_users) == len(terms), "top-k ids are compared with more experts than are summed", ids)

    # Experts: consecutive ids in chain order, one input, one activation, one shape.
    expert_ids = [e for e, _ in terms]
    offset = expert_ids[0]
    _expect(expert_ids == list(range(offset, offset + len(terms))),
            f"local experts {expert_ids} are not consecutive ids in order", topk)
    experts = [m for _, m in terms]
    x = experts[0].x
    for i, m in enumerate(experts):
        _expect(m.x is x, f"expert {offset + i} reads another input than expert {offset}", m.w13.weight)
        _expect(m.consts() == experts[0].consts(), f"expert {offset + i} has another activation than expert {offset}",
                m.w13.weight)
        _expect(_shape(m.w13.weight) == _shape(experts[0].w13.weight) and m.fp8 == experts[0].fp8
                and m.group == experts[0].group,
                f"expert {offset + i} differs in weight shape or format from expert {offset}", m.w13.weight)
        _expect(_dtype(m.out) == _dtype(x),
                f"expert {offset + i} output dtype differs from the input's", m.w2.weight)
        seen.update(m.nodes)
    if xr is not x:  # x.float(): exactly one cast of the experts' input to float32
        _expect(_is_cast(xr) and xr.args[0] is x and _dtype(x) != torch.float32,
                "the router reads another input than the experts", scores)
        seen.add(xr)
    e_total = _shape(router_w)[0]
    _expect(_shape(router_w) == (e_total, _shape(x)[1]), "router weight is not [experts, hidden]", router_w)
    n = len(experts)
    _expect(e_total % n == 0 and offset % n == 0 and offset + n <= e_total,
            f"{n} local experts from {offset} do not tile {e_total} experts", topk)
    k = topk.args[1]
    _expect(isinstance(k, int) and 0 < k <= e_total, f"top-k {k} is not a constant in [1, {e_total}]", topk)
    _expect(_shape(zero) == _shape(x), "accumulator shape differs from the input's", zero)

    # End of the block: cast back to the input dtype, then the shared expert.
    out = acc
    if _dtype(x) != torch.float32:
        users = list(acc.users)
        _expect(len(users) == 1 and _is_cast(users[0]) and _dtype(users[0]) == _dtype(x),
                "the expert sum is not cast back to the input dtype", acc)
        out = users[0]
        seen.add(out)
    shared = None
    if len(out.users) == 1:
        u = next(iter(out.users))
        if _op(u, "aten.add") and u.kwargs.get("alpha", 1) == 1:
            other = u.args[1] if u.args[0] is out else u.args[0]
            try:
                cand = match_gated_mlp(other)
            except Mismatch:
                cand = None  # not an MLP: the residual add of a block without a shared expert
            if cand is not None:
                _expect(cand.x is x, "the shared expert reads another input than the experts", other)
                _expect(cand.consts() == experts[0].consts(), "the shared expert has another activation", other)
                _expect(not cand.fp8 or not experts[0].fp8 or cand.group == experts[0].group,
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
        if not _op(n, "aten.topk"):
            return False
        choice = n.args[0]
        return _op(choice, "aten.sigmoid") or (_op(choice, "aten.add") and any(_op(a, "aten.sigmoid") for a in choice.args))

    return [n for n in graph.nodes if router_like(n)]


# ------------------------------------------------------ lowering pattern
@dataclass
class MoELowering:
    """A minimax::moe node and the collectives around it; `replace()` makes one mega_moe."""

    moe: fx.Node
    x: fx.Node  # what mega_moe reads: the token shard, or the replicated input
    end: fx.Node  # the node whose value mega_moe gives (wait of the RS / AR, or the moe itself)
    group_name: str
    group_size: int
    input_sharded: bool
    output_sharded: bool
    num_tokens: int
    dispatch: str
    nodes: list = field(default_factory=list)  # collectives, waits, pad and slice to drop
    form: str = ""

    def replace(self, graph: fx.Graph, fake_mode=None) -> fx.Node:
        args = (self.x, *self.moe.args[1:], self.group_name, self.group_size, self.input_sharded,
                self.output_sharded, self.num_tokens, self.dispatch)
        with graph.inserting_before(self.end):
            node = graph.call_function(torch.ops.minimax.mega_moe.default, args)
        set_fake_val(node, fake_mode)
        if _shape(node) != _shape(self.end) or _dtype(node) != _dtype(self.end):
            graph.erase_node(node)
            raise Mismatch(f"mega_moe would give {_shape(node)} where the graph has {_shape(self.end)}", self.end)
        node.meta["minimax_moe"] = f"{self.moe.meta.get('minimax_moe', '')}; {self.form}, dispatch {self.dispatch}"
        self.end.replace_all_uses_with(node)
        erase_region(graph, {self.moe, self.end, *self.nodes})
        return node


def _gathered_shard(x: fx.Node) -> tuple[fx.Node, list, int, str, int] | None:
    """If x = [slice rows :T of] wait(all_gather(shard)): (shard, nodes, size, group, rows)."""
    nodes = []
    src = x
    rows = _shape(x)[0]
    if _op(src, "aten.slice") and src.args[1] == 0 and (len(src.args) < 3 or src.args[2] in (0, None)) \
            and (len(src.args) < 5 or src.args[4] == 1):
        nodes.append(src)
        src = src.args[0]
    ag = collective_of(src, "all_gather_into_tensor")
    if ag is None:
        return None
    nodes += [src, ag]
    return ag.args[0], nodes, ag.args[1], ag.args[2], rows


def match_moe_collectives(moe: fx.Node, single_device: bool) -> MoELowering:
    from minimax_backend.kernels.moe import choose_dispatch

    x = moe.args[0]
    rows = _shape(x)[0]
    _expect(isinstance(rows, int), "symbolic token count; lowering needs static shapes", moe)
    w13 = moe.args[3]
    has_shared = moe.args[7] is not None
    ep = _shape(moe.args[1])[0] // len(w13)

    # Output side.
    users = list(moe.users)
    nodes: list = []
    end, group, size, out_sharded, padded = moe, None, 1, False, rows
    if len(users) == 1:
        u = users[0]
        rs_in = u
        if _op(u, "aten.constant_pad_nd"):
            pad = list(u.args[1])
            _expect(len(pad) == 4 and pad[:3] == [0, 0, 0] and _scalar(u.args[2] if len(u.args) > 2 else 0.0) == 0.0
                    and len(u.users) == 1, "the MoE output is padded other than with zero rows", u)
            nodes.append(u)
            padded = rows + pad[3]
            rs_in = next(iter(u.users))
        if is_collective(rs_in, "reduce_scatter_tensor"):
            _expect(rs_in.args[1] == "sum", "reduce-scatter is not a sum", rs_in)
            wait = wait_of(rs_in)
            _expect(wait is not None and len(rs_in.users) == 1, "reduce-scatter without its one wait", rs_in)
            size, group = rs_in.args[2], rs_in.args[3]
            nodes += [rs_in]
            end, out_sharded = wait, True
        elif is_collective(u, "all_reduce") and not nodes:
            _expect(u.args[1] == "sum", "all-reduce is not a sum", u)
            wait = wait_of(u)
            _expect(wait is not None and len(u.users) == 1, "all-reduce without its one wait", u)
            group = u.args[2]
            from minimax_backend.patterns.collectives import group_size

            size = group_size(group)
            nodes.append(u)
            end = wait
        else:
            _expect(not nodes, "the padded MoE output does not go to a reduce-scatter", u)
    if group is None and not single_device:
        raise Mismatch("the MoE output does not go to an all-reduce or reduce-scatter (and TP > 1)", moe)

    # Input side.
    gathered = _gathered_shard(x)
    in_sharded = False
    if gathered is not None:
        shard, g_nodes, g_size, g_group, _ = gathered
        if group is None:
            group, size = g_group, g_size
        _expect((g_group, g_size) == (group, size), "the gather and the reduction use different groups", x)
        t = _shape(shard)[0]
        _expect(t * size >= rows and t * size - rows < size, f"shards of {t} rows do not cover {rows} tokens", x)
        in_sharded = True
        x_in = shard
        nodes += g_nodes  # erased only if nothing else reads the gathered tokens
    else:
        x_in = x
    if out_sharded:
        _expect(padded == -(-rows // size) * size, f"{rows} tokens padded to {padded}, not to a multiple of {size}", end)
    form = ("sp" if in_sharded and out_sharded else
            "replicated" if not in_sharded and not out_sharded else
            f"{'sharded' if in_sharded else 'replicated'} in, {'sharded' if out_sharded else 'replicated'} out")
    if size == 1:
        form = "single device"
    return MoELowering(moe, x_in, end, group or "", size, in_sharded, out_sharded, rows,
                       choose_dispatch(has_shared, size, ep), nodes, form)
