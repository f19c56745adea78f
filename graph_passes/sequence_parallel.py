"""Sequence parallelism: the residual stream stays split by token across TP ranks.

The rewrite is in patterns/sequence_parallel.py; this file decides when it
runs and what it reports. The auto rule is the source engine's (on for TP > 1
with expert parallelism, the fused MoE backend and a single pipeline stage),
plus a token floor measured on our GPUs (``sequence_parallel_min_tokens``: it
cost time at decode sizes). MTP blocks never reach this graph (the MTP module
has its own forward), and pipeline parallelism is not handled: the record
says both.
"""

from __future__ import annotations

import torch.fx

from ..patterns.sequence_parallel import NotRecognized, find_residual_stream
from .base import GraphPass, PassContext, PassResult
from .manager import register_pass

UNTOUCHED = "left untouched: MTP blocks (separate forward, not in this graph); pipeline parallelism (one stage only)"


@register_pass
class SequenceParallelPass(GraphPass):
    name = "sequence_parallel"
    config_fields = ("pp_size", "sequence_parallel_min_tokens")
    hash_modules = (
        "minimax_backend.patterns.sequence_parallel",
        "minimax_backend.patterns.token_wise",
        "minimax_backend.patterns.collectives",
    )
    changes_shapes = True

    def decide(self, gm: torch.fx.GraphModule, ctx: PassContext):
        if ctx.tp_size <= 1:
            return False, "TP is 1: nothing to shard"
        if ctx.pp_size > 1:
            return False, "pipeline parallelism is not supported by this pass"
        return super().decide(gm, ctx)

    def auto_rule(self, gm: torch.fx.GraphModule, ctx: PassContext) -> str | None:
        if ctx.ep_size <= 1:
            return "off without expert parallelism (set ep_size, or sequence_parallel='on')"
        if self.config.moe_lower == "off":
            return "off without the fused MoE backend (moe_lower is 'off')"
        floor = self.config.sequence_parallel_min_tokens
        if ctx.num_tokens is not None and ctx.num_tokens < floor:
            return f"off below sequence_parallel_min_tokens={floor} ({ctx.num_tokens} tokens: measured slower at decode sizes)"
        return None

    def apply(self, gm: torch.fx.GraphModule, ctx: PassContext) -> PassResult:
        try:
            stream = find_residual_stream(gm.graph)
        except NotRecognized as e:
            return self.result(matches=0, skipped=f"graph not recognized: {e}", details=[UNTOUCHED])
        record = stream.replace(gm.graph)
        breakdown = dict(sorted(record.replaced.items()))
        breakdown["gathers"] = record.stream_gathers
        breakdown["end gather"] = record.end_gathers
        return self.result(
            matches=record.matches,
            graph_changed=True,
            breakdown=breakdown,
            details=record.details() + [UNTOUCHED],
        )
