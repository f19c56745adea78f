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

import torch.fx

from ..patterns.moe_block import find_moe_topks, match_moe_block
from .base import CandidatePass, PassContext
from .manager import register_pass


@register_pass
class MoECanonicalizePass(CandidatePass):
    name = "moe_canonicalize"
    hash_modules = ("minimax_backend.patterns.moe_block", "minimax_backend.patterns.linears",
                    "minimax_backend.kernels.moe")
    no_candidates = "no MoE block (no aten.topk) in the graph"
    what = "MoE candidates"

    def candidates(self, gm: torch.fx.GraphModule, ctx: PassContext) -> list[torch.fx.Node]:
        return find_moe_topks(gm.graph)

    def match(self, topk: torch.fx.Node, ctx: PassContext):
        return match_moe_block(topk)
