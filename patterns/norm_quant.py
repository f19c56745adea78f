"""RMSNorm -> FP8 quantization in the functional ATen graph, and its fusion into
minimax::rms_norm_quant_fp8 (the fuse_norm_quant pass: graph_passes/fuse_norm_quant.py).

What the model's RMSNorm (model/layers.py) becomes after AOT tracing with
Inductor's decompositions, x of dtype D (bfloat16 in the served model):

    x32    = convert_element_type(x, f32)          (absent when D is f32)
    var    = mean.dim(pow.Tensor_Scalar(x32, 2), [-1], True)
    normed = mul(x32, rsqrt(add(var, eps)))
    Gemma: out = convert_element_type(mul(normed, add(convert(w, f32), 1.0)), D)
    plain: out = mul(convert_element_type(normed, D), w)

(each convert absent when it would be a no-op). The FP8 linear then calls
`minimax.quantize_fp8(out, G)`, possibly behind views that fold leading dims,
a clone, or a lossless cast to float32, and, under sequence parallelism,
behind an all-gather: out -> all_gather_into_tensor -> wait_tensor ->
slice(rows 0:T) -> quantize. ``find_quant_sites`` walks the norm output's
users and sorts them into quantizations reached locally, quantizations
reached through a gather, and everything else (consumers that need the
norm output itself, e.g. the MoE router or the residual stream).

``match_norm_quant(node, fp8_allgather)`` decides, per RMSNorm, what one fused
kernel can take over; ``NormQuantFusion.replace`` rewrites it (the pass's
docstring lists the cases).
"""

from __future__ import annotations

import operator
from dataclasses import dataclass, field

import torch
import torch.fx as fx

from .collectives import wait_of
from .fx import is_op, op_arg, set_fake_val, val

aten = torch.ops.aten
prims = torch.ops.prims
c10d = torch.ops._c10d_functional

QUANT = "minimax.quantize_fp8"
FUSED = "minimax.rms_norm_quant_fp8"
ALL_GATHER = "_c10d_functional.all_gather_into_tensor"
CONVERT = ("prims.convert_element_type", "aten._to_copy")
VIEWS = ("aten.view", "aten.reshape", "aten._unsafe_view")
COPIES = ("aten.clone", "aten.contiguous", "aten.alias")


def _tensor(node) -> torch.Tensor | None:
    v = val(node) if isinstance(node, fx.Node) else None
    return v if isinstance(v, torch.Tensor) else None


def _dtype(node) -> torch.dtype | None:
    v = _tensor(node)
    return v.dtype if v is not None else None


def _convert_to(node, dtype: torch.dtype | None = None) -> bool:
    """A plain dtype cast (to `dtype` when given)."""
    if not is_op(node, *CONVERT):
        return False
    if is_op(node, "aten._to_copy") and set(node.kwargs) - {"dtype"}:
        return False  # moves device / layout: not a plain cast
    return dtype is None or _dtype(node) == dtype


def _cast_source(node, dtype: torch.dtype) -> fx.Node | None:
    """If node is a cast to `dtype`, its input; if node already has `dtype`, node itself."""
    if _convert_to(node, dtype):
        return node.args[0] if isinstance(node.args[0], fx.Node) else None
    if isinstance(node, fx.Node) and _dtype(node) == dtype:
        return node
    return None


def _operands(node, name: str) -> tuple | None:
    """(a, b) of a binary aten op `name` (e.g. 'aten.mul'), else None."""
    if not is_op(node, name) or len(node.args) != 2 or node.kwargs:
        return None
    return node.args[0], node.args[1]


def _is_float_const(v, value: float | None = None) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and (value is None or float(v) == value)


def quant_group_size(q: fx.Node) -> int:
    g = op_arg(q, "group_size")
    return int(g) if g is not None else 128  # the op's schema default


# --------------------------------------------------------------- the norm
@dataclass
class RMSNormMatch:
    """One RMSNorm in the graph, matched from its output back to its input."""

    output: fx.Node  # the norm output, in x.dtype
    x: fx.Node  # the norm input (before the float32 cast)
    weight: fx.Node
    eps: float
    gemma: bool
    nodes: list[fx.Node] = field(default_factory=list)  # the norm's own nodes, output last
    residual: tuple[fx.Node, fx.Node] | None = None  # x = add(a, b) of two same-shape tensors

    @property
    def hidden(self) -> int:
        return _tensor(self.output).shape[-1]


def _match_normed(normed) -> tuple[fx.Node, float, list[fx.Node]] | None:
    """normed = x32 * rsqrt(mean(x32 ** 2, -1, keepdim) + eps) -> (x32, eps, nodes)."""
    ops = _operands(normed, "aten.mul")
    if ops is None:
        return None
    for x32, rs in (ops, ops[::-1]):
        if not (is_op(rs, "aten.rsqrt") and isinstance(x32, fx.Node)):
            continue
        add = rs.args[0]
        add_ops = _operands(add, "aten.add")
        if add_ops is None:
            continue
        mean, eps = add_ops if isinstance(add_ops[0], fx.Node) else add_ops[::-1]
        if not (is_op(mean, "aten.mean") and _is_float_const(eps)):
            continue
        sq = mean.args[0]
        dims = mean.args[1] if len(mean.args) > 1 else mean.kwargs.get("dim")
        keep = mean.args[2] if len(mean.args) > 2 else mean.kwargs.get("keepdim", False)
        v = _tensor(x32)
        if v is None or v.dtype != torch.float32 or not keep:
            return None
        if list(dims or []) not in ([-1], [v.dim() - 1]):
            return None
        squares = (
            (is_op(sq, "aten.pow") and sq.args[0] is x32 and _is_float_const(sq.args[1], 2.0))
            or (_operands(sq, "aten.mul") == (x32, x32))
        )
        if not squares:
            return None
        return x32, float(eps), [sq, mean, add, rs, normed]
    return None


def match_rms_norm(out: fx.Node) -> RMSNormMatch | None:
    """The RMSNorm whose output is `out` (Gemma or plain form), else None."""
    if not isinstance(out, fx.Node) or out.op != "call_function":
        return None
    out_v = _tensor(out)
    if out_v is None or out_v.dim() < 1 or not out_v.dtype.is_floating_point:
        return None
    dtype = out_v.dtype
    k = out_v.shape[-1]
    for gemma in (True, False):
        nodes: list[fx.Node] = []
        if gemma:
            # out = (normed * (1 + w.float())).to(D)
            prod = _cast_source(out, dtype)
            if prod is None or _dtype(prod) != torch.float32:
                continue
            ops = _operands(prod, "aten.mul")
            if ops is None:
                continue
            found = None
            for normed, wp in (ops, ops[::-1]):
                wp_ops = _operands(wp, "aten.add")
                if wp_ops is None:
                    continue
                w32, one = wp_ops if isinstance(wp_ops[0], fx.Node) else wp_ops[::-1]
                if not _is_float_const(one, 1.0) or not isinstance(w32, fx.Node):
                    continue
                w = w32.args[0] if _convert_to(w32, torch.float32) else w32
                m = _match_normed(normed)
                if m is not None:
                    found = (m, w, [n for n in (w32 if w32 is not w else None, wp) if n is not None])
                    break
            if found is None:
                continue
            (x32, eps, norm_nodes), weight, w_nodes = found
            nodes = norm_nodes + w_nodes + [prod] + ([out] if out is not prod else [])
        else:
            # out = normed.to(D) * w
            ops = _operands(out, "aten.mul")
            if ops is None:
                continue
            found = None
            for nc, w in (ops, ops[::-1]):
                normed = _cast_source(nc, torch.float32) if _dtype(nc) == torch.float32 else (
                    nc.args[0] if _convert_to(nc, dtype) else None)
                if normed is None:
                    continue
                m = _match_normed(normed)
                if m is not None and isinstance(w, fx.Node):
                    found = (m, w, nc)
                    break
            if found is None:
                continue
            (x32, eps, norm_nodes), weight, nc = found
            nodes = norm_nodes + ([nc] if nc is not norm_nodes[-1] else []) + [out]
        x = x32.args[0] if _convert_to(x32, torch.float32) else x32
        if x is not x32:
            nodes.insert(0, x32)
        xv, wv = _tensor(x), _tensor(weight)
        if xv is None or wv is None or xv.dtype != dtype or tuple(xv.shape) != tuple(out_v.shape):
            return None
        if wv.dim() != 1 or wv.shape[0] != k:
            return None
        match = RMSNormMatch(output=out, x=x, weight=weight, eps=eps, gemma=gemma, nodes=nodes)
        match.residual = residual_add(x)
        return match
    return None


def residual_add(x: fx.Node) -> tuple[fx.Node, fx.Node] | None:
    """x = add(a, b) of two tensors of x's shape and dtype: the residual add the fused op can take over."""
    ops = _operands(x, "aten.add")
    if ops is None:
        return None
    a, b = ops
    xv = _tensor(x)
    for t in (a, b):
        tv = _tensor(t)
        if tv is None or tv.dtype != xv.dtype or tuple(tv.shape) != tuple(xv.shape):
            return None
    return a, b


# --------------------------------------------------------------- its consumers
@dataclass
class QuantSite:
    """A quantize_fp8 fed by the norm output through `chain` (views / copies / f32 casts)."""

    quant: fx.Node
    chain: list[fx.Node]
    group_size: int


@dataclass
class GatherSite:
    """norm output -> (views) -> all_gather -> wait -> (row slice) -> consumers."""

    gather: fx.Node
    wait: fx.Node
    row_slice: fx.Node | None  # slice(rows 0:T) dropping the sequence-parallel padding
    pre_chain: list[fx.Node]  # views between the norm output and the gather
    quants: list[QuantSite] = field(default_factory=list)
    others: list[fx.Node] = field(default_factory=list)  # consumers after the gather that are not quantizations

    @property
    def group_name(self) -> str:
        return self.gather.args[-1]

    @property
    def world(self) -> int:
        return int(self.gather.args[1])


@dataclass
class NormUses:
    quants: list[QuantSite] = field(default_factory=list)  # reached without a gather
    gathers: list[GatherSite] = field(default_factory=list)
    others: list[fx.Node] = field(default_factory=list)  # need the norm output itself


def _transparent(node: fx.Node, src: fx.Node, k: int, allow_cast: bool) -> bool:
    """Does quantizing `node` equal quantizing `src` (reshaped)? Views that keep
    the last dim K, copies, and (when allowed) lossless casts to float32."""
    v, sv = _tensor(node), _tensor(src)
    if v is None or sv is None or v.dim() < 1 or v.shape[-1] != k or v.numel() != sv.numel():
        return False
    if is_op(node, *VIEWS, *COPIES):
        return node.args[0] is src and v.dtype == sv.dtype and not (
            is_op(node, *COPIES) and set(node.kwargs) - {"memory_format"})
    if allow_cast and _convert_to(node, torch.float32) and node.args[0] is src:
        return sv.dtype in (torch.bfloat16, torch.float16, torch.float32)
    return False


def _row_slice(node: fx.Node, gathered: fx.Node) -> bool:
    """slice(gathered, 0, 0, T): the sequence-parallel pass dropping its padding rows."""
    if not is_op(node, "aten.slice") or node.args[0] is not gathered:
        return False
    args = list(node.args) + [None] * (5 - len(node.args))
    dim, start, _, step = args[1] or 0, args[2] or 0, args[3], args[4] or 1
    return dim == 0 and start == 0 and step == 1


def _walk_quants(node: fx.Node, k: int, chain: list[fx.Node], quants: list[QuantSite], others: list[fx.Node],
                 allow_gather: bool, gathers: list[GatherSite] | None) -> None:
    for u in list(node.users):
        if is_op(u, QUANT) and u.args[0] is node and _quant_ok(u):
            quants.append(QuantSite(u, chain, quant_group_size(u)))
        elif _transparent(u, node, k, allow_cast=True):
            _walk_quants(u, k, chain + [u], quants, others, allow_gather and not _convert_to(u), gathers)
        elif allow_gather and gathers is not None and is_op(u, ALL_GATHER) and u.args[0] is node:
            w = wait_of(u)
            v = _tensor(node)
            if w is None or v is None or v.dim() != 2:
                others.append(u)
                continue
            site = GatherSite(gather=u, wait=w, row_slice=None, pre_chain=chain)
            after = w
            users = list(w.users)
            if len(users) == 1 and _row_slice(users[0], w):
                site.row_slice = after = users[0]
            _walk_quants(after, k, [], site.quants, site.others, allow_gather=False, gathers=None)
            gathers.append(site)
        else:
            others.append(u)


def find_quant_sites(norm_out: fx.Node) -> NormUses:
    """Sort the norm output's consumers: local quantizations, gathers, the rest."""
    uses = NormUses()
    k = _tensor(norm_out).shape[-1]
    _walk_quants(norm_out, k, [], uses.quants, uses.others, allow_gather=True, gathers=uses.gathers)
    return uses


def _quant_ok(q: fx.Node) -> bool:
    """Its outputs are read through getitem only (what AOT graphs always have)."""
    return all(u.target is operator.getitem and u.args[1] in (0, 1) for u in q.users)


def quant_source(q: fx.Node) -> fx.Node:
    """Walk up from a quantize_fp8's input through views, copies, casts and gathers."""
    n = q.args[0]
    while isinstance(n, fx.Node):
        if is_op(n, *VIEWS, *COPIES, *CONVERT, "aten.slice", ALL_GATHER, "_c10d_functional.wait_tensor"):
            n = n.args[0]
        else:
            break
    return n


def follows_a_norm(q: fx.Node, depth: int = 4) -> bool:
    """Loose test: does an rsqrt sit within `depth` producers of what q quantizes?

    A norm output is 3 ops below its rsqrt (cast <- mul <- mul <- rsqrt). Used to
    tell whether the graph quantizes norm outputs at all (an FP8 model), so that
    a pass that then matches none of them in strict form reports a miss."""
    seen, todo = set(), [(quant_source(q), 0)]
    while todo:
        n, d = todo.pop(0)  # breadth first: the nearest rsqrt is found at its depth
        if n in seen or d > depth or not isinstance(n, fx.Node):
            continue
        seen.add(n)
        if is_op(n, "aten.rsqrt"):
            return True
        todo.extend((a, d + 1) for a in n.all_input_nodes)
    return False


# ------------------------------------------------------------------ the fusion
@dataclass
class NormQuantFusion:
    """One RMSNorm and the quantizations one fused kernel takes over; `replace()` rewrites them.

    local        quantizations reached without a collective
    fp8_gathers  gathers (fp8_allgather) whose consumers are all quantizations: the kernel
                 runs on the shard and FP8 data + scales are gathered
    kept         gathers left in BF16 (quantized after the gather), with `kept_notes` saying why
    """

    norm: RMSNormMatch
    local: list[QuantSite]
    fp8_gathers: list[GatherSite]
    kept: list[GatherSite]
    kept_notes: list[str]
    group: int

    @property
    def fuses(self) -> bool:
        return bool(self.local or self.fp8_gathers)

    def replace(self, graph: fx.Graph, fake_mode=None) -> "FusionDone":
        return _Fuser(graph, fake_mode).fuse(self)


@dataclass(frozen=True)
class FusionDone:
    node: fx.Node  # the minimax.rms_norm_quant_fp8 node
    kind: str  # fused | fused_with_bf16_output (other readers keep the BF16 output) | fp8_allgather
    with_residual_add: bool
    description: str
    needs_toposort: bool  # an input of the kernel came after the place it was put


def match_norm_quant(node: fx.Node, fp8_allgather: bool) -> NormQuantFusion | None:
    """The fusion anchored at the RMSNorm whose output is `node`, or None (not a norm, or a
    norm that feeds no FP8 quantization: a BF16 linear, the QK norms, lm_head)."""
    match = match_rms_norm(node)
    if match is None:
        return None
    uses = find_quant_sites(match.output)
    groups = [s.group_size for s in uses.quants] + [s.group_size for gs in uses.gathers for s in gs.quants]
    if not groups:
        return None
    group = groups[0]
    local = [s for s in uses.quants if s.group_size == group]
    fp8_gathers, kept, notes = [], [], []
    for gs in uses.gathers:
        if not gs.quants:
            continue  # a gather of the BF16 output with no quantization behind it
        if fp8_allgather and not gs.others and all(s.group_size == group for s in gs.quants):
            fp8_gathers.append(gs)
        else:
            kept.append(gs)
            why = ("fp8_allgather is off" if not fp8_allgather else
                   "consumers after the gather also read BF16 (" +
                   ", ".join(o.name for o in gs.others[:3]) + ")" if gs.others else
                   "mixed group sizes after the gather")
            notes.append(f"{match.output.name}: kept BF16 in front of {gs.gather.name}, quantized after it ({why})")
    return NormQuantFusion(match, local, fp8_gathers, kept, notes, group)


class _Fuser:
    """The rewrite of one NormQuantFusion (new nodes get their fake values as they are made)."""

    def __init__(self, graph: fx.Graph, fake_mode):
        self.graph, self.fake_mode = graph, fake_mode

    def _call(self, target, args, kwargs=None) -> fx.Node:
        n = self.graph.call_function(target, tuple(args), kwargs or {})
        set_fake_val(n, self.fake_mode)
        return n

    def _reshaped(self, src: fx.Node, shape) -> fx.Node:
        if tuple(val(src).shape) == tuple(shape):
            return src
        return self._call(aten.view.default, (src, list(shape)))

    def _replace_quant(self, site: QuantSite, q: fx.Node, s: fx.Node) -> None:
        """Make the readers of site.quant's (data, scales) read q / s, reshaped like the site."""
        shape = tuple(val(site.quant.args[0]).shape)
        groups = shape[-1] // site.group_size
        outs = {}
        for g in list(site.quant.users):
            idx = g.args[1]
            if idx not in outs:
                outs[idx] = self._reshaped(q, shape) if idx == 0 else self._reshaped(s, (*shape[:-1], groups))
            g.replace_all_uses_with(outs[idx])

    def _erase_dead(self, nodes) -> None:
        """Erase the given nodes that nothing reads any more (repeat until stable)."""
        alive = [n for n in nodes if n is not None]
        changed = True
        while changed:
            changed = False
            for n in list(alive):
                if not n.users and not getattr(n, "_erased", False):
                    self.graph.erase_node(n)
                    alive.remove(n)
                    changed = True

    def fuse(self, f: NormQuantFusion) -> FusionDone:
        graph, match, group = self.graph, f.norm, f.group
        order = {n: i for i, n in enumerate(graph.nodes)}
        residual = match.residual
        if residual is not None:
            x, res = residual[1], residual[0]  # h = res + x: the residual stream plus the new output
            anchor = match.x
        else:
            x, res = match.x, None
            anchor = min(match.nodes, key=order.__getitem__)
        inputs = [a for a in (x, res, match.weight) if isinstance(a, fx.Node)]
        needs_toposort = any(order[a] >= order[anchor] for a in inputs)

        with graph.inserting_before(anchor):
            fused = self._call(torch.ops.minimax.rms_norm_quant_fp8.default,
                               (x, res, match.weight, match.eps, match.gemma, group, False))
            q = self._call(operator.getitem, (fused, 0))
            s = self._call(operator.getitem, (fused, 1))
            for site in f.local:
                self._replace_quant(site, q, s)
            for gs in f.fp8_gathers:
                self._gather_fp8(gs, q, s)

        dead: list[fx.Node] = []
        for site in f.local:
            dead += [site.quant, *reversed(site.chain)]
        for gs in f.fp8_gathers:
            for site in gs.quants:
                dead += [site.quant, *reversed(site.chain)]
            dead += [gs.row_slice, gs.wait, gs.gather, *reversed(gs.pre_chain)]
        self._erase_dead([u for site in f.local for u in site.quant.users] +
                         [u for gs in f.fp8_gathers for site in gs.quants for u in site.quant.users] + dead)

        want_y = len(match.output.users) > 0
        y = None
        if want_y:
            fused.update_arg(6, True)
            set_fake_val(fused, self.fake_mode)
            with graph.inserting_after(s):
                y = self._call(operator.getitem, (fused, 2))
            match.output.replace_all_uses_with(y)
        if residual is not None:
            with graph.inserting_after(s):
                r = self._call(operator.getitem, (fused, 3))
            match.x.replace_all_uses_with(r, delete_user_cb=lambda u: u is not fused)
        self._erase_dead(list(reversed(match.nodes)) + ([match.x] if residual is not None else []))

        n_q = len(f.local) + sum(len(gs.quants) for gs in f.fp8_gathers)
        extras = [f"{n_q} quantization(s), G={group}"]
        if want_y:
            extras.append("BF16 output kept for " + ", ".join(u.name for u in list(y.users)[:3]))
        if residual is not None:
            extras.append("residual add fused")
        if f.fp8_gathers:
            extras.append(f"FP8 data + scales gathered ({len(f.fp8_gathers)} gather(s))")
        kind = "fp8_allgather" if f.fp8_gathers else ("fused_with_bf16_output" if want_y else "fused")
        return FusionDone(fused, kind, residual is not None, f"{match.output.name} -> {fused.name}: " + "; ".join(extras),
                          needs_toposort)

    def _gather_fp8(self, gs: GatherSite, q: fx.Node, s: fx.Node) -> None:
        """Gather the shard's FP8 data (as bytes) and scales; slice the padding; feed the quant sites."""
        shard_shape = tuple(val(gs.gather.args[0]).shape)  # [T / tp, K]
        k = shard_shape[-1]
        groups = k // gs.quants[0].group_size
        q2 = self._reshaped(q, shard_shape)
        s2 = self._reshaped(s, (shard_shape[0], groups))
        q_bytes = self._call(aten.view.dtype, (q2, torch.uint8))
        ag_q = self._call(c10d.all_gather_into_tensor.default, (q_bytes, gs.world, gs.group_name))
        ag_s = self._call(c10d.all_gather_into_tensor.default, (s2, gs.world, gs.group_name))
        q_full = self._call(aten.view.dtype, (self._call(c10d.wait_tensor.default, (ag_q,)), torch.float8_e4m3fn))
        s_full = self._call(c10d.wait_tensor.default, (ag_s,))
        if gs.row_slice is not None:
            rest = tuple(gs.row_slice.args[1:])
            q_full = self._call(aten.slice.Tensor, (q_full, *rest))
            s_full = self._call(aten.slice.Tensor, (s_full, *rest))
        for site in gs.quants:
            self._replace_quant(site, q_full, s_full)
