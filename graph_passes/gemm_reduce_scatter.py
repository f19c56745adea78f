"""GEMM + reduce-scatter: a matmul whose only consumer is a reduce-scatter
becomes one ``minimax::gemm_rs`` op (kernels/gemm_rs.py) that overlaps the two.

The reduce-scatters come from the sequence-parallel pass (after each o_proj
and each dense down_proj, with a row pad in front when the token count does
not divide by TP); the pattern is in patterns/gemm_rs.py. The op decides at
run time: the overlapped kernel at or above ``gemm_rs_min_tokens`` tokens,
matmul + reduce-scatter below (the graph is the same for every token count).

Not fused, by design, and said so in the record:
- the embedding's reduce-scatter (fed by the masked embedding lookup);
- the MoE's reduce-scatter: it is fed by the sum of the routed experts and
  the shared expert, not by a single matmul;
- any matmul whose output is also read elsewhere (only-consumer rule).

With no reduce-scatter in the graph (sequence parallelism off, TP 1) the
pass skips with that reason; finding nothing is then not a failure. It is
one when a matmul feeds a reduce-scatter and still nothing was fused.
"""

from __future__ import annotations

from collections import Counter

import torch.fx

from ..patterns.gemm_rs import KINDS, find_gemm_reduce_scatters
from .base import GraphPass, PassContext, PassResult
from .manager import register_pass


@register_pass
class GemmReduceScatterPass(GraphPass):
    name = "gemm_reduce_scatter"
    config_fields = ("gemm_rs_min_tokens",)
    hash_modules = ("minimax_backend.patterns.gemm_rs", "minimax_backend.kernels.gemm_rs")

    def decide(self, gm: torch.fx.GraphModule, ctx: PassContext):
        if ctx.tp_size <= 1:
            return False, "TP is 1: no reduce-scatter to fuse"
        return super().decide(gm, ctx)

    def apply(self, gm: torch.fx.GraphModule, ctx: PassContext) -> PassResult:
        matches, rejected, total = find_gemm_reduce_scatters(gm.graph)
        # A matmul feeds a reduce-scatter: fusing nothing then means something went wrong.
        gemm_fed = len(matches) + sum(r.gemm_fed for r in rejected)
        min_tokens = self.config.gemm_rs_min_tokens
        details = [f"left alone: {r.reason}" for r in rejected]
        if total == 0:
            return self.result(matches=0, skipped="no reduce-scatter in the graph (sequence parallelism is off?)",
                               breakdown={k: 0 for k in KINDS}, expected=False)
        kinds = Counter()
        for m in matches:
            tokens, gemm_name = m.tokens, m.gemm.name
            node = m.replace(gm.graph, min_tokens, ctx.fake_mode)
            kinds[m.kind] += 1
            fused = isinstance(tokens, int) and tokens >= min_tokens
            path = "overlapped kernel on CUDA" if fused else "matmul + reduce-scatter"
            details.append(f"{node.name}: {m.kind} from {gemm_name}, {tokens} tokens, pad {m.pad_rows}, "
                           f"group {m.group_name} x{m.group_size}, min_tokens {min_tokens} -> {path} at this size")
        skipped = None
        if not matches:
            first = next((r.reason for r in rejected if r.gemm_fed), None)
            skipped = (f"none of the {total} reduce-scatter(s) is fed by a matmul that only feeds it ({first})"
                       if first else f"none of the {total} reduce-scatter(s) is fed by a matmul")
        return self.result(matches=len(matches), graph_changed=bool(matches), skipped=skipped, expected=gemm_fed > 0,
                           breakdown={k: kinds[k] for k in KINDS}, details=details)
