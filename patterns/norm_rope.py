"""NeoX RoPE of a per-head RMSNorm's output in the functional ATen graph, and its rewrite into
minimax::rms_norm_rope (the fuse_norm_rope pass: graph_passes/fuse_norm_rope.py).

What `apply_rope(RMSNorm(x), cos, sin)` (model/layers.py) becomes after AOT tracing, n the norm
output [T, heads, D] of dtype X, h = rotary_dim / 2:

    x1  = convert(slice(n, -1, 0, h), f32)       x2 = convert(slice(n, -1, h, 2h), f32)
    c   = unsqueeze(cos, 1)                      s  = unsqueeze(sin, 1)
    rot = convert(cat([sub(mul(x1, c), mul(x2, s)), add(mul(x2, c), mul(x1, s))], -1), X)
    out = cat([rot, slice(n, -1, 2h, end)], -1)  (just rot when rotary_dim = D)

(the converts absent in a float32 graph). The candidates are the rotations (the inner cat) of an
RMSNorm's output (patterns/norm_quant.py:match_rms_norm); `normed_rotations` also returns the
other rotations, so that a model with another QK norm (M2's per-layer one) or none shows up in
the pass's record. A candidate that is not exactly the form above is a Mismatch saying where.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.fx as fx

from .fx import Mismatch, commutative_operands, erase_unused, expect, is_cast, is_op, set_fake_val, tensor_val
from .norm_quant import RMSNormMatch, match_rms_norm

__all__ = ["NormRopeMatch", "rotation_candidates", "normed_rotations", "match_norm_rope"]


def _dim(node: fx.Node, d) -> int:
    rank = tensor_val(node).dim()
    return d % rank if isinstance(d, int) else -1


def _cat_parts(node) -> list | None:
    """The parts of a cat along the last dim, else None."""
    if not is_op(node, "aten.cat") or not isinstance(node.args[0], (list, tuple)):
        return None
    dim = node.args[1] if len(node.args) > 1 else node.kwargs.get("dim", 0)
    v = tensor_val(node)
    if v is None or v.dim() == 0 or _dim(node, dim) != v.dim() - 1:
        return None
    return list(node.args[0])


def _slice_of(node, src: fx.Node | None = None) -> tuple[fx.Node, int, int] | None:
    """slice(src, last dim, start, end) -> (src, start, end clipped to the size), else None."""
    if not is_op(node, "aten.slice") or len(node.args) < 2:
        return None
    base = node.args[0]
    if not isinstance(base, fx.Node) or (src is not None and base is not src):
        return None
    bv = tensor_val(base)
    step = node.args[4] if len(node.args) > 4 else node.kwargs.get("step", 1)
    if bv is None or _dim(base, node.args[1]) != bv.dim() - 1 or step != 1:
        return None
    size = bv.shape[-1]
    start = node.args[2] if len(node.args) > 2 else 0
    end = node.args[3] if len(node.args) > 3 else size
    start, end = (0 if start is None else start), (size if end is None else min(end, size))
    return base, start, end


def _f32_of(node):
    """The tensor a float32 value was cast from (itself if it is not a cast)."""
    return node.args[0] if is_cast(node) else node


def rotation_candidates(graph: fx.Graph) -> list[fx.Node]:
    """Every cat of two float32 halves, each a sub or add of two products: a NeoX rotation."""
    found = []
    for n in graph.nodes:
        parts = _cat_parts(n)
        if parts is None or len(parts) != 2:
            continue
        if is_op(parts[0], "aten.sub") and is_op(parts[1], "aten.add") and all(
                is_op(a, "aten.mul") for p in parts for a in p.args[:2]):
            found.append(n)
    return found


def _rotated_tensor(rotation: fx.Node) -> fx.Node | None:
    """The tensor whose first dims a rotation reads (the slice source of its x1), else None."""
    for a in rotation.args[0][0].args[0].args[:2]:
        if isinstance(a, fx.Node) and not is_op(a, "aten.unsqueeze"):
            sl = _slice_of(_f32_of(a))
            return sl[0] if sl is not None else None
    return None


def normed_rotations(graph: fx.Graph) -> tuple[list[fx.Node], list[fx.Node]]:
    """(rotations of an RMSNorm's output, the other rotations): the first are what the pass must fuse."""
    normed, other = [], []
    for r in rotation_candidates(graph):
        x = _rotated_tensor(r)
        (normed if x is not None and match_rms_norm(x) is not None else other).append(r)
    return normed, other


@dataclass
class NormRopeMatch:
    """One rotation and the RMSNorm feeding it, matched from the rotation (the inner cat)."""

    output: fx.Node  # what the graph reads afterwards: the outer cat (or the rotation's cast)
    norm: RMSNormMatch
    cos: fx.Node
    sin: fx.Node
    nodes: list[fx.Node]  # the rope's own nodes
    kind: str = "fused"

    def describe(self) -> str:
        v = tensor_val(self.output)
        heads, d = v.shape[-2], v.shape[-1]
        half = tensor_val(self.cos).shape[-1]
        form = "Gemma" if self.norm.gemma else "plain"
        return (f"RMSNorm ({form}, eps {self.norm.eps:g}) of {self.norm.x.name} [{heads} heads x {d}] + RoPE on "
                f"{2 * half} dims -> minimax.rms_norm_rope")

    def replace(self, graph: fx.Graph, fake_mode=None) -> fx.Node:
        n = self.norm
        with graph.inserting_before(self.output):
            new = graph.call_function(torch.ops.minimax.rms_norm_rope.default, (n.x, n.weight, self.cos, self.sin, float(n.eps), bool(n.gemma)))
        set_fake_val(new, fake_mode)
        new.meta["stack_trace"] = self.output.meta.get("stack_trace")
        self.output.replace_all_uses_with(new)
        erase_unused(graph, [*self.nodes, *n.nodes])
        return new


def _products(node, first: str) -> tuple:
    """sub / add(mul(a, b), mul(c, d)) -> ((a, b), (c, d)) in the written order."""
    expect(is_op(node, first) and len(node.args) == 2, f"not an aten.{first.split('.')[-1]} of two products", node)
    pa, pb = node.args
    expect(is_op(pa, "aten.mul") and is_op(pb, "aten.mul"), "the rotation's terms are not products", node)
    return pa, pb


def _factor_pair(mul: fx.Node, x: fx.Node, t: fx.Node) -> bool:
    return any(a is x and b is t for a, b in commutative_operands(mul))


def match_norm_rope(rotation: fx.Node) -> NormRopeMatch:
    """The RMSNorm + RoPE around `rotation` (a rotation_candidates node), or Mismatch saying why not."""
    sub, add = rotation.args[0]
    m1, m2 = _products(sub, "aten.sub")  # x1 * c - x2 * s
    m3, m4 = _products(add, "aten.add")  # x2 * c + x1 * s
    # x1 and c from the first product: whichever factor is an unsqueeze of a [T, h] float32 table
    for x1, c in commutative_operands(m1):
        if is_op(c, "aten.unsqueeze"):
            break
    else:
        raise Mismatch("no cos table (an unsqueeze) in the rotation's first product", m1)
    for x2, s in commutative_operands(m2):
        if is_op(s, "aten.unsqueeze"):
            break
    else:
        raise Mismatch("no sin table (an unsqueeze) in the rotation's second product", m2)
    expect(_factor_pair(m3, x2, c) and _factor_pair(m4, x1, s),
           "the rotation's second half is not x2 * cos + x1 * sin", add)
    cos, sin = c.args[0], s.args[0]
    expect(c.args[1] in (1, -2) and s.args[1] in (1, -2), "cos / sin are not unsqueezed at the head dim", c)
    cv, sv = tensor_val(cos), tensor_val(sin)
    expect(cv is not None and sv is not None and cv.dim() == 2 and cv.shape == sv.shape
           and cv.dtype == torch.float32 == sv.dtype, "cos / sin are not float32 [tokens, rotary_dim / 2]", cos)
    h = cv.shape[-1]
    s1, s2 = _slice_of(_f32_of(x1)), _slice_of(_f32_of(x2))
    expect(s1 is not None and s2 is not None and s1[0] is s2[0], "x1 and x2 are not slices of one tensor", x1)
    normed = s1[0]
    expect(s1[1:] == (0, h) and s2[1:] == (h, 2 * h), f"x1, x2 are not the dims [0, {h}) and [{h}, {2 * h})", x1)
    nv = tensor_val(normed)
    expect(nv is not None and nv.dim() == 3 and tuple(cv.shape) == (nv.shape[0], h),
           "the rotated tensor is not [tokens, heads, head_dim] with one cos row per token", normed)
    nodes = [x1, x2, m1, m2, m3, m4, sub, add, c, s, rotation]
    nodes += [v for v in (x1.args[0] if is_cast(x1) else None, x2.args[0] if is_cast(x2) else None) if v is not None]
    output = rotation
    users = list(rotation.users)
    if len(users) == 1 and is_cast(users[0]):
        output = users[0]
        nodes.append(output)
    expect(tensor_val(output).dtype == nv.dtype, "the rotation is not cast back to the norm output's dtype", output)
    d = nv.shape[-1]
    if 2 * h < d:
        users = list(output.users)
        expect(len(users) == 1, "the rotated dims are read other than by one cat with the pass-through dims", output)
        outer = users[0]
        parts = _cat_parts(outer)
        rest = _slice_of(parts[1], normed) if parts is not None and len(parts) == 2 else None
        expect(parts is not None and parts[0] is output and rest is not None and rest[1:] == (2 * h, d),
               f"the rotation is not followed by the pass-through dims [{2 * h}, {d})", outer)
        nodes += [parts[1], outer]
        output = outer
    norm = match_rms_norm(normed)
    expect(norm is not None, "the rotated tensor is not an RMSNorm output (another QK norm, or none)", normed)
    expect(norm.residual is None, "the norm's input is a residual add (not a QK norm)", normed)
    return NormRopeMatch(output=output, norm=norm, cos=cos, sin=sin, nodes=nodes)

