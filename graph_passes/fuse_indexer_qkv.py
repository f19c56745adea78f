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

import logging
import warnings
from collections import Counter

import torch.fx

from ..patterns import is_op
from ..patterns.stacked_linears import find_stacked_linears
from .base import GraphPass, PassContext, PassError, PassResult, PassWarning
from .manager import register_pass


@register_pass
class FuseIndexerQKVPass(GraphPass):
    name = "fuse_indexer_qkv"
    switch = "fuse_indexer_qkv"
    hash_modules = ("minimax_backend.patterns.stacked_linears", "minimax_backend.kernels.stacked_gemm")

    def __init__(self, config):
        super().__init__(config)
        self._sparse_layers = 0

    def expects_matches(self, ctx: PassContext) -> bool:
        return self.mode() == "on" or (self.is_enabled(ctx) and self._sparse_layers > 0)

    def apply(self, gm: torch.fx.GraphModule, ctx: PassContext) -> PassResult:
        self._sparse_layers = sum(1 for n in gm.graph.nodes if is_op(n, "minimax.msa_select"))
        matches, left = find_stacked_linears(gm.graph)
        kinds = Counter()
        details = []
        for m in matches:
            node = m.replace(gm.graph, ctx.fake_mode)
            kinds["fp8" if m.fp8 else "bf16"] += 1
            details.append(f"{node.name}: {m.describe()}")
        details += [f"left alone: {u.reason}" for u in left]
        skipped = None
        if not self._sparse_layers:
            skipped = "no sparse attention layer (minimax.msa_select) in the graph"
        elif len(matches) < self._sparse_layers:
            skipped = (f"{len(matches)} fused for {self._sparse_layers} sparse layers"
                       + (f"; {left[0].reason}" if left else ""))
            if matches:  # a partial match is never silent (none at all: the manager's miss rule)
                if self.config.strict:
                    raise PassError(f"{self.name}: {skipped}")
                logging.getLogger("minimax").warning("minimax: WARNING %s: %s", self.name, skipped)
                warnings.warn(f"{self.name}: {skipped}", PassWarning, stacklevel=2)
        return self.result(matches=len(matches), graph_changed=bool(matches), skipped=skipped,
                           breakdown={"sparse layers": self._sparse_layers, **dict(sorted(kinds.items()))},
                           details=details)
