"""minimax::moe and the collectives around it, which minimax::mega_moe replaces.

``match_moe_collectives(moe, single_device, dispatch)``: what the
sequence-parallel pass (or the eager block) put around a ``minimax::moe`` node::

    SP:      shard -> all_gather + wait [-> slice rows :T] -> moe
             -> [constant_pad_nd rows] -> reduce_scatter + wait
    no SP:   moe -> all_reduce + wait
    TP 1:    moe (no collective)

The replace side (``MoELowering.replace``) builds ``minimax::mega_moe`` with
the dispatch the pass chose (graph_passes/moe_lower.py) and erases the
collectives.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.fx as fx

from .collectives import collective_of, group_size, is_collective, wait_of
from .fx import Mismatch, dtype_of, erase_unused, expect, is_op, scalar_of, set_fake_val, shape_of

__all__ = ["MoELowering", "match_moe_collectives"]


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

    @property
    def kind(self) -> str:
        return self.form

    def describe(self) -> str:
        return (f"{self.form}, group {self.group_name or '-'} x{self.group_size}, {self.num_tokens} tokens, "
                f"dispatch {self.dispatch}")

    def replace(self, graph: fx.Graph, fake_mode=None) -> fx.Node:
        args = (self.x, *self.moe.args[1:], self.group_name, self.group_size, self.input_sharded,
                self.output_sharded, self.num_tokens, self.dispatch)
        with graph.inserting_before(self.end):
            node = graph.call_function(torch.ops.minimax.mega_moe.default, args)
        set_fake_val(node, fake_mode)
        if shape_of(node) != shape_of(self.end) or dtype_of(node) != dtype_of(self.end):
            graph.erase_node(node)
            raise Mismatch(f"mega_moe would give {shape_of(node)} where the graph has {shape_of(self.end)}", self.end)
        node.meta["minimax_moe"] = f"{self.moe.meta.get('minimax_moe', '')}; {self.form}, dispatch {self.dispatch}"
        self.end.replace_all_uses_with(node)
        erase_unused(graph, {self.moe, self.end, *self.nodes})
        return node


def _gathered_shard(x: fx.Node) -> tuple[fx.Node, list, int, str, int] | None:
    """If x = [slice rows :T of] wait(all_gather(shard)): (shard, nodes, size, group, rows)."""
    nodes = []
    src = x
    rows = shape_of(x)[0]
    if is_op(src, "aten.slice") and src.args[1] == 0 and (len(src.args) < 3 or src.args[2] in (0, None)) \
            and (len(src.args) < 5 or src.args[4] == 1):
        nodes.append(src)
        src = src.args[0]
    ag = collective_of(src, "all_gather_into_tensor")
    if ag is None:
        return None
    nodes += [src, ag]
    return ag.args[0], nodes, ag.args[1], ag.args[2], rows


def match_moe_collectives(moe: fx.Node, single_device: bool, choose_dispatch) -> MoELowering:
    """`choose_dispatch(has_shared, group_size, ep_size)` picks how mega_moe exchanges tokens."""
    x = moe.args[0]
    rows = shape_of(x)[0]
    expect(isinstance(rows, int), "symbolic token count; lowering needs static shapes", moe)
    w13 = moe.args[3]
    has_shared = moe.args[7] is not None
    ep = shape_of(moe.args[1])[0] // len(w13)

    # Output side.
    users = list(moe.users)
    nodes: list = []
    end, group, size, out_sharded, padded = moe, None, 1, False, rows
    if len(users) == 1:
        u = users[0]
        rs_in = u
        if is_op(u, "aten.constant_pad_nd"):
            pad = list(u.args[1])
            expect(len(pad) == 4 and pad[:3] == [0, 0, 0] and scalar_of(u.args[2] if len(u.args) > 2 else 0.0) == 0.0
                    and len(u.users) == 1, "the MoE output is padded other than with zero rows", u)
            nodes.append(u)
            padded = rows + pad[3]
            rs_in = next(iter(u.users))
        if is_collective(rs_in, "reduce_scatter_tensor"):
            expect(rs_in.args[1] == "sum", "reduce-scatter is not a sum", rs_in)
            wait = wait_of(rs_in)
            expect(wait is not None and len(rs_in.users) == 1, "reduce-scatter without its one wait", rs_in)
            size, group = rs_in.args[2], rs_in.args[3]
            nodes += [rs_in]
            end, out_sharded = wait, True
        elif is_collective(u, "all_reduce") and not nodes:
            expect(u.args[1] == "sum", "all-reduce is not a sum", u)
            wait = wait_of(u)
            expect(wait is not None and len(u.users) == 1, "all-reduce without its one wait", u)
            group = u.args[2]
            size = group_size(group)
            nodes.append(u)
            end = wait
        else:
            expect(not nodes, "the padded MoE output does not go to a reduce-scatter", u)
    if group is None and not single_device:
        raise Mismatch("the MoE output does not go to an all-reduce or reduce-scatter (and TP > 1)", moe)

    # Input side.
    gathered = _gathered_shard(x)
    in_sharded = False
    if gathered is not None:
        shard, g_nodes, g_size, g_group, _ = gathered
        if group is None:
            group, size = g_group, g_size
        expect((g_group, g_size) == (group, size), "the gather and the reduction use different groups", x)
        t = shape_of(shard)[0]
        expect(t * size >= rows and t * size - rows < size, f"shards of {t} rows do not cover {rows} tokens", x)
        in_sharded = True
        x_in = shard
        nodes += g_nodes  # erased only if nothing else reads the gathered tokens
    else:
        x_in = x
    if out_sharded:
        expect(padded == -(-rows // size) * size, f"{rows} tokens padded to {padded}, not to a multiple of {size}", end)
    form = ("sp" if in_sharded and out_sharded else
            "replicated" if not in_sharded and not out_sharded else
            f"{'sharded' if in_sharded else 'replicated'} in, {'sharded' if out_sharded else 'replicated'} out")
    if size == 1:
        form = "single device"
    return MoELowering(moe, x_in, end, group or "", size, in_sharded, out_sharded, rows,
                       choose_dispatch(has_shared, size, ep), nodes, form)
