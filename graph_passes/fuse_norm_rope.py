"""QK norm + RoPE fusion: the per-head RMSNorm of q (and of k) and the rotation after it become one
kernel.

    RMSNorm over head_dim -> apply_rope      =>   minimax.rms_norm_rope

The search side is patterns/norm_rope.py. Stock Inductor runs each as a reduction kernel over q
followed by a pointwise one, each reading the whole of q; the fused op reads each head once and
writes it once (kernels/norm_rope_triton.py; tools/bench_norm_rope.py times both). The indexer of
the sparse layers (MSA) normalizes and rotates its own query and key the same way, so those match
too.

The candidates are the rotations (a cat of x1 * cos - x2 * sin and x2 * cos + x1 * sin) of an
RMSNorm's output; auto rule: on when the graph has one, and each must then fuse (a rotation of a
norm left alone is a partial match, none fused a miss). Rotations of anything else (a model
without QK norm, or M2's norm over the whole projection) are not candidates; the record lists them.
"""

from __future__ import annotations

import dataclasses

import torch.fx

from ..patterns.norm_rope import match_norm_rope, normed_rotations
from .base import CandidatePass, PassContext, PassResult
from .manager import register_pass


@register_pass
class FuseNormRopePass(CandidatePass):
    name = "fuse_norm_rope"
    hash_modules = ("minimax_backend.patterns.norm_rope", "minimax_backend.patterns.norm_quant",
                    "minimax_backend.kernels.norm_rope")
    no_candidates = "no RoPE rotation of an RMSNorm output in the graph: nothing to fuse"
    what = "rotations of a norm"

    def auto_rule(self, gm: torch.fx.GraphModule, ctx: PassContext) -> str | None:
        return None if normed_rotations(gm.graph)[0] else self.no_candidates

    def candidates(self, gm: torch.fx.GraphModule, ctx: PassContext) -> list[torch.fx.Node]:
        return normed_rotations(gm.graph)[0]

    def match(self, node: torch.fx.Node, ctx: PassContext):
        return match_norm_rope(node)

    def apply(self, gm: torch.fx.GraphModule, ctx: PassContext) -> PassResult:
        others = normed_rotations(gm.graph)[1]
        res = super().apply(gm, ctx)
        if not others:
            return res
        note = f"{len(others)} rotation(s) of a tensor that is not an RMSNorm output left alone: " + ", ".join(
            n.name for n in others[:4]) + (" ..." if len(others) > 4 else "")
        return dataclasses.replace(res, details=(*res.details, note))
