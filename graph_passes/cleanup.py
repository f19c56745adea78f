"""Cleanup: dead code and no-op views/clones. Runs first (so the passes see
a tidy graph) and last (to sweep what the rewrites left). Its match count is
the number of nodes removed; finding nothing is never a failure."""

from __future__ import annotations

import torch
import torch.fx
from torch.fx.experimental.symbolic_shapes import statically_known_true

from ..patterns.fx import is_op, val
from .base import GraphPass, PassContext, PassResult
from .manager import register_pass

# Ops that are the identity when the output has the input's shape and strides.
_NOOP_IF_SAME_LAYOUT = (
    "aten.view",
    "aten.reshape",
    "aten._unsafe_view",
    "aten.alias",
    "aten.clone",
    "aten.contiguous",
    "aten.expand",
    "aten.slice",  # x[:, None] traces as a full slice + unsqueeze on CUDA (seen on the H200)
)


def _same_layout(a, b) -> bool:
    if not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)):
        return False
    if a.dtype != b.dtype or a.device != b.device or a.dim() != b.dim():
        return False
    if not statically_known_true(a.storage_offset() == b.storage_offset()):
        return False
    pairs = list(zip(a.shape, b.shape)) + list(zip(a.stride(), b.stride()))
    return all(statically_known_true(x == y) for x, y in pairs)


def _is_side_effect(node: torch.fx.Node) -> bool:
    if node.is_impure():
        return True
    schema = getattr(node.target, "_schema", None)  # in-place / out= ops (KV-cache copy_)
    return schema is not None and schema.is_mutable


@register_pass
class CleanupPass(GraphPass):
    name = "cleanup"

    def apply(self, gm: torch.fx.GraphModule, ctx: PassContext) -> PassResult:
        g = gm.graph
        noop = 0
        for n in list(g.nodes):
            if not is_op(n, *_NOOP_IF_SAME_LAYOUT):
                continue
            src = n.args[0]
            # Keep the node when it feeds an output: dropping it would make an
            # output alias an input, which AOT's runtime wrapper did not plan for.
            if any(u.op == "output" for u in n.users):
                continue
            if isinstance(src, torch.fx.Node) and _same_layout(val(n), val(src)):
                n.replace_all_uses_with(src)
                g.erase_node(n)
                noop += 1
        dead = 0
        for n in reversed(list(g.nodes)):
            if n.op in ("placeholder", "output") or n.users or _is_side_effect(n):
                continue
            g.erase_node(n)
            dead += 1
        total = noop + dead
        breakdown = {k: v for k, v in (("no-op view", noop), ("dead", dead)) if v}
        return self.result(matches=total, graph_changed=total > 0, breakdown=breakdown, expected=False)
