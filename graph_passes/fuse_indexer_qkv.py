"""The sparse layers' indexer projections and QKV as one GEMM.

An MSA layer runs three linears on the same normed hidden state: QKV, the
indexer's query projection and its key projection. The model keeps their
weights as consecutive rows of one buffer (model/linear.py place_adjacent),
so this pass turns the three GEMMs into one ``minimax::stacked_gemm`` over
a view spanning the rows, and slices its output (patterns/stacked_linears.py).
In FP8 the activation is then quantized once instead of three times, and the
norm + quant fusion finds a single quantization after the norm. Under
sequence parallelism the three already read one all-gather; after this
pass they read it through one GEMM.

Expected: one match per sparse layer (each ``minimax.msa_select`` in the
graph). Linears on one input whose weights are not stacked are left alone
and listed in the record.
"""

from __future__ import annotations

from collections import Counter

import torch.fx

from ..patterns.fx import is_op
from ..patterns.stacked_linears import find_stacked_linears
from .base import GraphPass, PassContext, PassResult
from .manager import register_pass


@register_pass
class FuseIndexerQKVPass(GraphPass):
    name = "fuse_indexer_qkv"
    hash_modules = ("minimax_backend.patterns.stacked_linears", "minimax_backend.kernels.stacked_gemm")

    def apply(self, gm: torch.fx.GraphModule, ctx: PassContext) -> PassResult:
        sparse_layers = sum(1 for n in gm.graph.nodes if is_op(n, "minimax.msa_select"))
        matches, left = find_stacked_linears(gm.graph)
        kinds = Counter()
        details = []
        for m in matches:
            node = m.replace(gm.graph, ctx.fake_mode)
            kinds["fp8" if m.fp8 else "bf16"] += 1
            details.append(f"{node.name}: {m.describe()}")
        details += [f"left alone: {u.reason}" for u in left]
        skipped = None
        if not sparse_layers:
            skipped = "no sparse attention layer (minimax.msa_select) in the graph"
        elif len(matches) < sparse_layers:
            skipped = (f"{len(matches)} fused for {sparse_layers} sparse layers"
                       + (f"; {left[0].reason}" if left else ""))
        return self.result(matches=len(matches), graph_changed=bool(matches), skipped=skipped,
                           expected=self.mode() == "on" or sparse_layers > 0, candidates=sparse_layers,
                           breakdown={"sparse layers": sparse_layers, **dict(sorted(kinds.items()))},
                           details=details)
