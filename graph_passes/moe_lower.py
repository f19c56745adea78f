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
import warnings

import torch.fx

from ..patterns import is_op
from ..patterns.moe import Mismatch, match_moe_collectives
from .base import GraphPass, PassContext, PassResult, PassWarning
from .manager import register_pass

log = logging.getLogger("minimax")


@register_pass
class MoELowerPass(GraphPass):
    name = "moe_lower"
    switch = "moe_lower"
    hash_modules = ("minimax_backend.patterns.moe", "minimax_backend.kernels.moe")

    def __init__(self, config):
        super().__init__(config)
        self._candidates = 0

    def expects_matches(self, ctx: PassContext) -> bool:
        if self.mode() == "on":
            return True
        return self.is_enabled(ctx) and self._candidates > 0

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
        matches = sum(forms.values())
        if matches:
            graph.lint()
            gm.recompile()
        if misses and matches:
            msg = f"moe_lower lowered {matches} of {len(moes)} minimax.moe nodes; " + "; ".join(misses)
            log.warning("minimax: WARNING %s", msg)
            warnings.warn(msg, PassWarning, stacklevel=2)
        return self.result(
            matches=matches,
            graph_changed=matches > 0,
            breakdown=forms,
            details=details + misses,
            skipped="; ".join(misses) if misses else None,
        )
