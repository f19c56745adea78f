"""GEMM + reduce-scatter: find a matmul whose only consumer is a reduce-scatter.

Search side, walking up from each ``reduce_scatter_tensor`` (+ its
``wait_tensor``) of the functional ATen graph:

    gemm  ->  [view ...]  ->  [constant_pad_nd (rows, zeros)]  ->  reduce_scatter_tensor  ->  wait_tensor

where ``gemm`` is one of

    aten.mm(x, permute(w, [1, 0]))                 bf16 linear (F.linear's trace)
    aten.addmm(bias, x, permute(w, [1, 0]))        with a bias
    minimax.fp8_block_gemm(xq, xs, w, ws, dtype)   FP8; xq/xs from a
                                                   minimax.quantize_fp8 right
                                                   before ("fp8") or from
                                                   anywhere else ("fp8_prequantized")

and every node between the GEMM and the reduce-scatter has exactly one user
(the only-consumer rule: a GEMM output that is also read elsewhere must exist
in full on this rank, so it cannot be folded into its reduce-scatter). The
views must keep the GEMM's [M, N] shape; the pad must add zero rows at the end
(the sequence-parallel pass pads tokens to a multiple of the TP size).

Replace side: one ``minimax.gemm_rs`` node with the pad folded in
(``pad_rows``), the token threshold (``min_tokens``) and the group, then the
old chain is erased. ``GemmRsMatch.replace`` does both.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.fx as fx

from .fx import is_op, op_name, set_fake_val, val

from .collectives import is_collective, wait_of

aten = torch.ops.aten

KINDS = ("bf16", "fp8", "fp8_prequantized")
_VIEWS = ("aten.view", "aten._unsafe_view", "aten.reshape", "aten.alias")
_TRANSPOSES = ("aten.permute", "aten.t", "aten.transpose")


@dataclass
class GemmRsMatch:
    kind: str  # one of KINDS
    gemm: fx.Node
    between: list  # view / pad nodes from the GEMM to the reduce-scatter, in order
    rs: fx.Node
    wait: fx.Node
    x: fx.Node
    weight: fx.Node | None  # [N, K]; None: build permute(b) from the mm's second operand
    b: fx.Node | None  # the mm's [K, N] operand, when weight is None
    x_scale: fx.Node | None
    weight_scale: fx.Node | None
    bias: fx.Node | None
    out_dtype: torch.dtype | None
    pad_rows: int
    group_size: int
    group_name: str

    @property
    def tokens(self):
        return val(self.gemm).shape[0]

    def replace(self, graph: fx.Graph, min_tokens: int, fake_mode=None) -> fx.Node:
        """Insert the minimax.gemm_rs node, reroute the wait's users to it, erase the old chain."""
        with graph.inserting_before(self.gemm):
            weight = self.weight
            if weight is None:
                weight = graph.call_function(aten.permute.default, (self.b, [1, 0]))
                set_fake_val(weight, fake_mode)
            node = graph.call_function(
                torch.ops.minimax.gemm_rs.default,
                (self.x, weight, self.x_scale, self.weight_scale, self.bias,
                 self.pad_rows, min_tokens, self.group_size, self.group_name),
                {"out_dtype": self.out_dtype} if self.out_dtype is not None else {},
            )
        set_fake_val(node, fake_mode)
        for key in ("stack_trace", "nn_module_stack", "source_fn_stack"):
            if key in self.gemm.meta:
                node.meta[key] = self.gemm.meta[key]
        self.wait.replace_all_uses_with(node)
        dead = [self.wait, self.rs, *reversed(self.between), self.gemm]
        inputs = {a for n in dead for a in n.all_input_nodes} - set(dead)
        for n in dead:
            graph.erase_node(n)
        # The weight's permute (and anything else only the old chain read) goes too.
        for a in inputs:
            if a.op == "call_function" and not a.users and is_op(a, *_TRANSPOSES, *_VIEWS):
                graph.erase_node(a)
        return node


@dataclass
class Rejected:
    """A reduce-scatter left alone, and why (for the pass record)."""

    rs: fx.Node
    reason: str
    gemm_fed: bool  # a matmul feeds it, but a rule kept it from fusing


def _shape(node):
    v = val(node)
    return tuple(v.shape) if isinstance(v, torch.Tensor) else None


def is_gemm(node) -> bool:
    return is_op(node, "aten.mm", "aten.addmm", "minimax.fp8_block_gemm")


def _weight_of(b: fx.Node) -> fx.Node | None:
    """w when b is w.T of a 2-D w (permute [1, 0], t, transpose 0 1), else None."""
    if not isinstance(b, fx.Node) or _shape(b) is None or len(_shape(b)) != 2:
        return None
    if is_op(b, "aten.permute") and list(b.args[1]) in ([1, 0], [-1, -2], [1, -2], [-1, 0]):
        return b.args[0]
    if is_op(b, "aten.t"):
        return b.args[0]
    if is_op(b, "aten.transpose") and sorted(int(d) % 2 for d in b.args[1:3]) == [0, 1]:
        return b.args[0]
    return None


def _fp8_kind(xq: fx.Node, xs: fx.Node) -> str:
    """'fp8' when xq, xs are the two outputs of one minimax.quantize_fp8, else 'fp8_prequantized'."""
    import operator

    def source(n, index):
        if isinstance(n, fx.Node) and n.target is operator.getitem and n.args[1] == index:
            q = n.args[0]
            if is_op(q, "minimax.quantize_fp8"):
                return q
        return None

    q = source(xq, 0)
    return "fp8" if q is not None and source(xs, 1) is q else "fp8_prequantized"


def _describe(node) -> str:
    return f"{op_name(node) or node.op} ({node.name})" if isinstance(node, fx.Node) else repr(node)


def _hint(node: fx.Node) -> str:
    """What a non-matmul producer of a reduce-scatter probably is, for the record."""
    if is_op(node, "aten.add", "aten.sum", "minimax.moe", "minimax.mega_moe"):
        return ": a sum of partials (e.g. the MoE's routed experts + shared expert)"
    seen, todo = set(), [(node, 0)]
    while todo:
        n, depth = todo.pop()
        if n in seen or depth > 4:
            continue
        seen.add(n)
        if is_op(n, "aten.embedding"):
            return ": the embedding lookup"
        todo.extend((a, depth + 1) for a in n.all_input_nodes)
    return ""


def _pad_rows(pad: fx.Node) -> int | None:
    """Rows a constant_pad_nd appends at the end of dim 0 of a 2-D tensor with zeros, else None."""
    shape = _shape(pad.args[0])
    spec = list(pad.args[1])
    value = pad.args[2] if len(pad.args) > 2 else pad.kwargs.get("value", 0.0)
    if shape is None or len(shape) != 2 or value != 0:
        return None
    spec += [0] * (4 - len(spec))
    if len(spec) != 4 or spec[0] != 0 or spec[1] != 0 or spec[2] != 0 or not isinstance(spec[3], int) or spec[3] < 0:
        return None
    return spec[3]


def match_reduce_scatter(rs: fx.Node) -> GemmRsMatch | Rejected:
    """Match (or say why not) the chain feeding one reduce_scatter_tensor node."""
    wait = wait_of(rs)
    if wait is None or len(rs.users) != 1:
        return Rejected(rs, f"{rs.name} has no single wait_tensor", False)
    inp, reduce_op, group_size, group_name = rs.args[:4]
    if reduce_op != "sum":
        return Rejected(rs, f"{rs.name} reduces with {reduce_op!r}, not 'sum'", False)

    between: list[fx.Node] = []
    pad, pad_rows = None, 0
    node = inp
    while isinstance(node, fx.Node) and not is_gemm(node):
        if is_op(node, "aten.constant_pad_nd") and pad is None:
            rows = _pad_rows(node)
            if rows is None:
                return Rejected(rs, f"{rs.name} is fed by {_describe(node)}, which pads more than trailing zero rows",
                                False)
            pad, pad_rows = node, rows
        elif not is_op(node, *_VIEWS):
            return Rejected(rs, f"{rs.name} is fed by {_describe(node)}{_hint(node)}, not a single matmul", False)
        between.insert(0, node)
        node = node.args[0]
    if not isinstance(node, fx.Node):
        return Rejected(rs, f"{rs.name} is fed by a constant", False)
    gemm = node

    # Only-consumer rule, for the GEMM and every node up to the reduce-scatter.
    for a, b in zip([gemm, *between], [*between, rs]):
        if len(a.users) != 1:
            others = ", ".join(u.name for u in a.users if u is not b)
            what = "matmul output" if a is gemm else f"{_describe(a)} between the matmul and the reduce-scatter"
            return Rejected(rs, f"{gemm.name}: {what} is also used by {others}; it must exist in full, so it "
                                f"cannot be folded into {rs.name}", True)

    # Views may only restate the shape: [M, N] up to the pad, [M + pad, N] after it.
    gshape = _shape(gemm)
    if gshape is None or len(gshape) != 2:
        return Rejected(rs, f"{gemm.name} is not a 2-D [tokens, N] matmul", True)
    m, n = gshape
    cut = between.index(pad) if pad is not None else len(between)
    if any(_shape(v) != (m, n) for v in between[:cut]) or any(_shape(v) != (m + pad_rows, n) for v in between[cut:]):
        return Rejected(rs, f"{gemm.name} is reshaped on its way to {rs.name} ({gshape} -> {_shape(inp)})", True)

    common = dict(gemm=gemm, between=between, rs=rs, wait=wait, pad_rows=pad_rows,
                  group_size=int(group_size), group_name=group_name)
    if is_op(gemm, "minimax.fp8_block_gemm"):
        xq, xs, w, ws, out_dtype = gemm.args[:5]
        if _shape(xq) is None or len(_shape(xq)) != 2:
            return Rejected(rs, f"{gemm.name}: FP8 activation is not 2-D", True)
        return GemmRsMatch(kind=_fp8_kind(xq, xs), x=xq, weight=w, b=None, x_scale=xs, weight_scale=ws,
                           bias=None, out_dtype=out_dtype, **common)
    if is_op(gemm, "aten.addmm"):
        bias, x, b = gemm.args[:3]
        beta, alpha = gemm.kwargs.get("beta", 1), gemm.kwargs.get("alpha", 1)
        bias_shape = _shape(bias)
        if beta != 1 or alpha != 1:
            return Rejected(rs, f"{gemm.name}: addmm with beta={beta}, alpha={alpha}", True)
        if bias_shape is None or len(bias_shape) > 2 or (len(bias_shape) == 2 and bias_shape[0] != 1) \
                or bias_shape[-1] != gshape[1]:
            return Rejected(rs, f"{gemm.name}: bias of shape {bias_shape} is not one row of N", True)
    else:
        bias, (x, b) = None, gemm.args[:2]
    w = _weight_of(b)
    return GemmRsMatch(kind="bf16", x=x, weight=w, b=None if w is not None else b, x_scale=None,
                       weight_scale=None, bias=bias, out_dtype=None, **common)


def find_gemm_reduce_scatters(graph: fx.Graph) -> tuple[list[GemmRsMatch], list[Rejected], int]:
    """(matches, rejected, number of reduce-scatters) in graph order."""
    matches, rejected, total = [], [], 0
    for n in list(graph.nodes):
        if not is_collective(n, "reduce_scatter_tensor"):
            continue
        total += 1
        found = match_reduce_scatter(n)
        (matches if isinstance(found, GemmRsMatch) else rejected).append(found)
    return matches, rejected, total
