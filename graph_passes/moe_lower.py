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

import torch.fx

from ..kernels.moe_parallel import choose_dispatch
from ..patterns.fx import is_op
from ..patterns.moe_collectives import match_moe_collectives
from .base import CandidatePass, PassContext
from .manager import register_pass


@register_pass
class MoELowerPass(CandidatePass):
    name = "moe_lower"
    hash_modules = ("minimax_backend.patterns.moe_collectives", "minimax_backend.kernels.moe")
    no_candidates = "no minimax.moe in the graph (is moe_canonicalize on?)"
    what = "minimax.moe nodes"

    def candidates(self, gm: torch.fx.GraphModule, ctx: PassContext) -> list[torch.fx.Node]:
        return [n for n in gm.graph.nodes if is_op(n, "minimax.moe")]

    def match(self, moe: torch.fx.Node, ctx: PassContext):
        # One device: no collective anywhere in the graph (a process may run
        # torch.distributed and still compile an unsharded model).
        single = ctx.tp_size <= 1 or not ctx.group_names
        return match_moe_collectives(moe, single_device=single, choose_dispatch=choose_dispatch)
