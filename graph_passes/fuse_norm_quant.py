"""Norm + quant fusion: RMSNorm followed by FP8 quantization becomes one kernel.

    (residual add) -> RMSNorm -> minimax.quantize_fp8      =>   minimax.rms_norm_quant_fp8

The search side is patterns/norm_quant.py. Per RMSNorm whose output is
quantized (the FP8 linears call `quantize_fp8` then `fp8_block_gemm`):

* local quantizations (no collective in between) are replaced by the fused
  op's FP8 data and scales; every quantization of the same output (the MoE
  runs one per expert) reads the one fused result;
* when the norm output has other consumers (the MoE router reads BF16, the
  experts FP8; a KV-cache write; another group size) the fused op also
  writes the BF16 output and those consumers read it ("fused_with_bf16_output");
* when the norm's input is a residual add, the add moves into the kernel too
  and its other readers (the next residual add) read the kernel's copy;
* where the norm output reaches an all-gather BEFORE the quantization
  (sequence parallelism ran: norm on the token shard -> all_gather -> wait
  -> slice -> quantize_fp8), the pass does NOT fuse across the gather: BF16
  is gathered and quantized after it ("kept_bf16_before_gather"). Fusing
  there is the bug that crashed the source engine at start-up.
* with `fp8_allgather=True`, such a gather whose consumers are all FP8
  quantizations instead gets the fused op on the shard, and gathers the FP8
  data (as bytes: gloo has no float8) and the row-major float32 scales: about
  half the bytes of BF16. Quantization groups lie inside one token's row, so
  this equals gather-then-quantize bit for bit; the padding rows of the
  sequence-parallel pass are sliced off both after the gathers. The GEMM's
  own layout of the scales (column-major for cuBLAS) is made by its kernel
  after the gather (kernels/fp8_gemm_cuda.py). A gather whose consumers also
  read BF16 (the MoE router) stays BF16: gathering both would cost more.

Two gathers rather than one gather of a packed [T, K + 4K/G] byte buffer: the
packed form needs a copy after the gather to unpack the data for the GEMM
(the fused kernel could write the packed layout, but not unpack it), which
costs more HBM time than the second collective's launch at large token
counts; tools/bench_norm_quant.py measures both.

Auto rule: on when the graph has `minimax.quantize_fp8` nodes (an FP8 model).
A BF16 graph has nothing to fuse, and that is no failure.
"""

from __future__ import annotations

from collections import Counter

import torch.fx

from ..patterns.fx import is_op, stable_toposort
from ..patterns.norm_quant import QUANT, follows_a_norm, match_norm_quant
from .base import GraphPass, PassContext, PassResult
from .manager import register_pass

NO_FP8 = "no minimax.quantize_fp8 in the graph (a BF16 model): nothing to fuse"
NO_NORM_QUANT = "no minimax.quantize_fp8 follows an RMSNorm: nothing to fuse"
CATEGORIES = ("fused", "fused_with_bf16_output", "kept_bf16_before_gather")


@register_pass
class FuseNormQuantPass(GraphPass):
    name = "fuse_norm_quant"
    config_fields = ("fp8_allgather",)
    hash_modules = (
        "minimax_backend.patterns.norm_quant",
        "minimax_backend.patterns.collectives",
        "minimax_backend.kernels.norm_quant",
    )

    def auto_rule(self, gm: torch.fx.GraphModule, ctx: PassContext) -> str | None:
        if not any(is_op(n, QUANT) for n in gm.graph.nodes):
            return NO_FP8
        return None

    def apply(self, gm: torch.fx.GraphModule, ctx: PassContext) -> PassResult:
        graph = gm.graph
        quants = [n for n in graph.nodes if is_op(n, QUANT)]
        if not quants:
            return self.result(matches=0, skipped=NO_FP8, expected=False)
        if not any(follows_a_norm(q) for q in quants):
            return self.result(matches=0, skipped=NO_NORM_QUANT, expected=False)

        counts, details, resort = Counter(), [], False
        for node in list(graph.nodes):
            if node.graph is not graph or getattr(node, "_erased", False):
                continue
            fusion = match_norm_quant(node, self.config.fp8_allgather)
            if fusion is None:
                continue
            counts["kept_bf16_before_gather"] += len(fusion.kept)
            details += fusion.kept_notes
            if not fusion.fuses:
                continue
            done = fusion.replace(graph, ctx.fake_mode)
            counts[done.kind] += 1
            counts["with_residual_add"] += done.with_residual_add
            details.append(done.description)
            resort |= done.needs_toposort
        if resort:
            stable_toposort(graph)

        breakdown = {k: counts.get(k, 0) for k in CATEGORIES}
        if self.config.fp8_allgather or counts.get("fp8_allgather"):
            breakdown["fp8_allgather"] = counts.get("fp8_allgather", 0)
        breakdown["with_residual_add"] = counts.get("with_residual_add", 0)
        matches = sum(counts.get(k, 0) for k in (*CATEGORIES, "fp8_allgather"))
        fused = matches - counts.get("kept_bf16_before_gather", 0)
        skipped = None
        if matches == 0:
            skipped = "quantize_fp8 follows a norm, but no norm -> quantize pair was recognized"
        return self.result(matches=matches, graph_changed=fused > 0, breakdown=breakdown, details=details,
                           skipped=skipped)
