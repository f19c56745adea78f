"""The MoE custom ops: `minimax::moe` (canonical) and `minimax::mega_moe` (lowered).

    torch.ops.minimax.moe(x, router_weight, correction_bias, w13, w2, w13_scale, w2_scale,
                          shared_w13, shared_w2, shared_w13_scale, shared_w2_scale,
                          top_k, routed_scaling, norm_topk_prob, expert_offset,
                          activation, alpha, limit, beta, act_group_size) -> partial [T, H]

        What model/moe.py's block computes on one rank BEFORE its all-reduce:
        fp32 router -> sigmoid -> top-k of (score + correction bias) -> the
        unbiased scores of the chosen experts, renormalized, times
        routed_scaling -> the sum over this rank's local experts (global ids
        expert_offset ... expert_offset + len(w13) - 1, in that order, fp32
        accumulation) -> cast to x.dtype -> + the shared expert's partial.
        w13[i] is local expert i's fused gate/up weight [2n, H] (gate rows
        first), w2[i] its down weight [H, n]; FP8 experts pass float8_e4m3fn
        weights and their 128 x 128 block scales in w13_scale / w2_scale
        (empty lists for BF16). The shared expert is optional (None: M2).
        activation: "swigluoai" (M3: min(g, limit) * sigmoid(alpha g) *
        (clamp(u, +-limit) + beta)) or "silu" (M2: silu(g) * u).

    torch.ops.minimax.mega_moe(<the same arguments>, group_name, group_size,
                               input_sharded, output_sharded, num_tokens, dispatch) -> Tensor

        The whole block across the TP / EP group in one op: route, dispatch
        tokens to the ranks that own their experts, expert GEMMs, combine with
        the routing weights and the shared expert, and the collective that the
        eager block ended with. Token rows are split over the group as the
        sequence-parallel pass splits them: the stream is padded to
        T_pad = ceil(T / tp) * tp rows and rank r holds rows [r t, (r+1) t),
        t = T_pad / tp; rows >= num_tokens are padding (routed nowhere, output 0).
          input_sharded   x is this rank's shard [t, H] (under sequence
                          parallelism), else the replicated [T, H] input.
          output_sharded  return this rank's shard of the summed output [t, H]
                          (sequence parallelism: what the reduce-scatter gave),
                          else the full output [T, H] on every rank (what the
                          all-reduce gave).
          dispatch        "allgather": gather the tokens, every rank runs its
                          experts (and its shared-expert slice) on the tokens
                          routed to them, reduce-scatter the partial sums.
                          "alltoall": send each token only to the ranks that
                          own one of its experts and send the results back.
                          See choose_dispatch() for which is cheaper.
        group_name "" (group_size 1) is one device: no collective at all.

The ops' default implementations are the plain-torch references
(kernels/moe_reference.py for one rank, kernels/moe_parallel.py across ranks):
CPU, and any device without a kernel. The CUDA kernel of both ops is the same
code with the local experts (and the shared expert) run by the expert-sorted
Triton grouped GEMMs; kernels/moe_triton.py registers it (this module never
imports it), and it falls back to the reference without Triton or with the
kernel switch moe_kernel=reference (kernels/options.py).

"""

from __future__ import annotations

import torch

from .moe_parallel import mega_moe_out_rows, mega_moe_reference
from .moe_probe import notify as _notify_router_inputs
from .moe_probe import watching as _watching_router_inputs
from .moe_reference import moe_reference

__all__ = ["moe", "mega_moe", "MOE_ARGS", "MEGA_MOE_ARGS", "block_op_args", "flops"]


# ---------------------------------------------------------------- the ops
# One schema for both: mega_moe takes moe's arguments and six more. Tensor[] for
# the per-expert weights (empty scale lists = BF16).
MOE_ARGS = (
    "Tensor x, Tensor router_weight, Tensor? correction_bias, Tensor[] w13, Tensor[] w2, "
    "Tensor[] w13_scale, Tensor[] w2_scale, Tensor? shared_w13, Tensor? shared_w2, "
    "Tensor? shared_w13_scale, Tensor? shared_w2_scale, int top_k, float routed_scaling, "
    "bool norm_topk_prob, int expert_offset, str activation, float alpha, float limit, float beta, "
    "int act_group_size"
)
MEGA_MOE_ARGS = (MOE_ARGS + ", str group_name, int group_size, bool input_sharded, bool output_sharded, "
                 "int num_tokens, str dispatch")


@torch.library.custom_op("minimax::moe", mutates_args=(), schema=f"({MOE_ARGS}) -> Tensor")
def moe(*args) -> torch.Tensor:
    if _watching_router_inputs():
        _notify_router_inputs(args[0], args[1], args[2], args[11])
    return moe_reference(*args)


@moe.register_fake
def _moe_fake(x, *rest):
    return torch.empty_like(x)


@torch.library.custom_op("minimax::mega_moe", mutates_args=(), schema=f"({MEGA_MOE_ARGS}) -> Tensor")
def mega_moe(*args) -> torch.Tensor:
    if _watching_router_inputs():
        _notify_router_inputs(args[0], args[1], args[2], args[11])
    return mega_moe_reference(*args)


@mega_moe.register_fake
def _mega_moe_fake(x, *args):
    group_size, input_sharded, output_sharded, num_tokens = args[-5:-1]
    rows = mega_moe_out_rows(x.shape[0], group_size, input_sharded, output_sharded, num_tokens)
    return x.new_empty((rows, x.shape[1]))


def flops(tokens: int, hidden: int, intermediate: int, top_k: int, shared_intermediate: int = 0) -> float:
    """Matrix FLOPs of one MoE layer (router excluded): 2 * 3 * H * I per token and expert."""
    return 2.0 * tokens * hidden * (3 * intermediate * top_k + 3 * shared_intermediate)


def block_op_args(block) -> tuple:
    """The weight and constant arguments of minimax::moe for an eager MoE block
    (model/moe.py's MoE, read duck-typed): what the canonicalize pass finds in
    the graph, for tests and benchmarks that call the ops directly."""
    experts = block.experts  # stacked: model/moe.py's LocalExperts
    w13, w2, s13, s2 = experts.per_expert()
    shared = block.shared_experts
    return (
        block.gate.weight,
        block.e_score_correction_bias if block.use_routing_bias else None,
        w13, w2, s13, s2,
        shared.gate_up_proj.weight if shared is not None else None,
        shared.down_proj.weight if shared is not None else None,
        shared.gate_up_proj.weight_scale_inv if shared is not None and shared.gate_up_proj.fp8 else None,
        shared.down_proj.weight_scale_inv if shared is not None and shared.down_proj.fp8 else None,
        block.top_k,
        float(block.routed_scaling_factor),
        bool(block.norm_topk_prob),
        block.first_expert,
        experts.act,
        float(experts.alpha),
        float(experts.limit),
        float(experts.beta),
        experts.gate_up_proj.act_group_size,
    )
