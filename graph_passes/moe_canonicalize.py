"""MoE canonicalization: the eager MoE region becomes ONE `minimax::moe` node.

The traced block (router, top-k, the static loop over local experts, the
shared expert; patterns/moe.py) is replaced by `minimax::moe`, which returns
this rank's PARTIAL sum: exactly the value the eager block hands to its
all-reduce. The all-reduce and its wait stay where they are, so the
sequence-parallel pass, which runs next, still sees an ordinary residual
all-reduce: it turns it into a reduce-scatter and gathers the MoE input,
like any other non-token-wise consumer. `moe_lower` then folds those
collectives into `minimax::mega_moe`.

Every `aten.topk` of the graph is a candidate. A candidate that does not
match in every detail (see patterns/moe.py) is left as it is and the record
says why; finding candidates but matching none is what the manager treats
as a miss (error in strict mode, loud warning otherwise), and a partial
match is logged as a warning too.
"""

from __future__ import annotations

import logging

import torch.fx

from ..patterns.moe import Mismatch, find_moe_topks, match_moe_block
from .base import CandidatePass, PassContext, PassResult
from .manager import register_pass

log = logging.getLogger("minimax")


@register_pass
class MoECanonicalizePass(CandidatePass):
    name = "moe_canonicalize"
    switch = "moe_canonicalize"
    hash_modules = ("minimax_backend.patterns.moe", "minimax_backend.kernels.moe")


    def apply(self, gm: torch.fx.GraphModule, ctx: PassContext) -> PassResult:
        graph = gm.graph
        topks = find_moe_topks(graph)
        self._candidates = len(topks)
        if not topks:
            return self.result(matches=0, skipped="no MoE block (no aten.topk) in the graph")
        details, misses, kinds = [], [], {}
        for i, topk in enumerate(topks):
            try:
                match = match_moe_block(topk)
            except Mismatch as e:
                misses.append(f"block {i} ({topk.name}) left alone: {e}")
                continue
            except Exception as e:  # a matcher bug must not corrupt the graph: leave the block alone
                misses.append(f"block {i} ({topk.name}) left alone: matcher error {type(e).__name__}: {e}")
                continue
            node = match.replace(graph, ctx.fake_mode)
            kind = "shared" if match.shared is not None else "routed only"
            kinds[kind] = kinds.get(kind, 0) + 1
            details.append(f"block {i} -> {node.name}: {match.describe()}")
        return self.finish(gm, kinds, details, misses, "MoE candidates")
