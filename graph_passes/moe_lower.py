"""MoE lowering: `minimax::moe` and the collectives around it become `minimax::mega_moe`.

After moe_canonicalize and the sequence-parallel pass, each MoE block is one
of (patterns/moe.py, match_moe_collectives):

    sequence parallel   shard -> all_gather + wait [-> rows :T] -> moe
                        -> [pad rows] -> reduce_scatter + wait
                        => mega_moe(shard, input_sharded, output_sharded):
                           takes the token shard as is and gives the shard's
                           output: no gathered input in the graph, no
                           zero-filled full-size buffer, no all-reduce
    tensor parallel     moe -> all_reduce + wait
                        => mega_moe(x, replicated in, replicated out): works
                           on this rank's token shard, gathers the output
    one device          moe => mega_moe(x, group "")

Inside, mega_moe routes, dispatches the tokens to the ranks owning their
experts (all-gather + reduce-scatter, or all-to-all: kernels/moe.py,
choose_dispatch), runs the expert GEMMs and combines; the graph keeps no
collective of the block. A moe node that fits none of the forms is left as
it is (it still computes the right thing, unfused) and the record says why.
"""

from __future__ import annotations

import logging

import torch.fx

from ..patterns import is_op
from ..patterns.moe import Mismatch, match_moe_collectives
from .base import CandidatePass, PassContext, PassResult
from .manager import register_pass

log = logging.getLogger("minimax")


@register_pass
class MoELowerPass(CandidatePass):
    name = "moe_lower"
    switch = "moe_lower"
    hash_modules = ("minimax_backend.patterns.moe", "minimax_backend.kernels.moe")


    def apply(self, gm: torch.fx.GraphModule, ctx: PassContext) -> PassResult:
        graph = gm.graph
        moes = [n for n in graph.nodes if is_op(n, "minimax.moe")]
        self._candidates = len(moes)
        if not moes:
            return self.result(matches=0, skipped="no minimax.moe in the graph (is moe_canonicalize on?)")
        # One device: no collective anywhere in the graph (a process may run
        # torch.distributed and still compile an unsharded model).
        single = ctx.tp_size <= 1 or not ctx.group_names
        details, misses, forms = [], [], {}
        for i, moe in enumerate(moes):
            try:
                lowering = match_moe_collectives(moe, single_device=single)
                node = lowering.replace(graph, ctx.fake_mode)
            except Mismatch as e:
                misses.append(f"{moe.name} left unfused: {e}")
                continue
            forms[lowering.form] = forms.get(lowering.form, 0) + 1
            details.append(
                f"{moe.name} -> {node.name}: {lowering.form}, group {lowering.group_name or '-'} "
                f"x{lowering.group_size}, {lowering.num_tokens} tokens, dispatch {lowering.dispatch}"
            )
        return self.finish(gm, forms, details, misses, "minimax.moe nodes")
