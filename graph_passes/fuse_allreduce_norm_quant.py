"""All-reduce + residual add + RMSNorm + FP8 quantization -> one op, at small token counts.

Below ``sequence_parallel_min_tokens`` (decode, short prefills) sequence
parallelism is off and every attention / dense-MLP block ends in an all-reduce
whose result the next RMSNorm reads; fuse_norm_quant has already folded that
norm, its residual add and its quantization into ``minimax.rms_norm_quant_fp8``.
This pass folds the all-reduce in too (patterns/allreduce_norm.py), and does
the same for a plain residual add + RMSNorm whose output stays BF16 (the norm
in front of the MoE, which quantizes inside its own op), up to
``allreduce_fusion_max_tokens`` tokens, the size where serving engines use a
one-shot all-reduce with the norm in its epilogue.

The op runs the unfused sequence by default (kernels/allreduce_norm.py); its
one-kernel CUDA path over symmetric memory (kernels/allreduce_norm_cuda.py,
kernel option allreduce_norm=symm_mem) has been checked in the CPU interpreter
only, not yet run or timed on several GPUs. So the auto rule keeps the pass
off; ``fuse_allreduce_norm_quant='on'`` runs it (tests, and those GPU runs).
"""

from __future__ import annotations

import torch.fx

from ..patterns.allreduce_norm import find_norms_after_all_reduce, match_norm_after_all_reduce
from .base import CandidatePass, PassContext
from .manager import register_pass


@register_pass
class FuseAllReduceNormQuantPass(CandidatePass):
    name = "fuse_allreduce_norm_quant"
    config_fields = ("allreduce_fusion_max_tokens",)
    hash_modules = ("minimax_backend.patterns.allreduce_norm", "minimax_backend.kernels.allreduce_norm")
    no_candidates = "no fused RMSNorm + FP8 quantization reads an all-reduce (SP on, or a BF16 model)"
    what = "norms after an all-reduce"

    def decide(self, gm: torch.fx.GraphModule, ctx: PassContext):
        if ctx.tp_size <= 1:
            return False, "TP is 1: no all-reduce to fuse"
        return super().decide(gm, ctx)

    def auto_rule(self, gm: torch.fx.GraphModule, ctx: PassContext) -> str | None:
        return ("off until its single-kernel CUDA path (MINIMAX_ALLREDUCE_NORM=symm_mem) has run and been timed on "
                "several GPUs (set 'on' to rewrite the graph)")

    def candidates(self, gm: torch.fx.GraphModule, ctx: PassContext) -> list[torch.fx.Node]:
        return find_norms_after_all_reduce(gm.graph)

    def match(self, norm: torch.fx.Node, ctx: PassContext):
        return match_norm_after_all_reduce(norm, self.config.allreduce_fusion_max_tokens)
