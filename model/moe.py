"""The MiniMax mixture-of-experts block (M3 and M2).

    router      logits = x @ gate.T in float32 (gate replicated, float32)
    scores      sigmoid(logits)
    select      top-k of scores + e_score_correction_bias (the bias only picks experts)
    weights     the selected UNBIASED scores, renormalized to sum 1, times routed_scaling_factor
    experts     this rank's local experts, each a gated MLP (w1 = gate, w3 = up, w2 = down),
                stored stacked (LocalExperts: one gate/up and one down weight for all of them)
    shared      the shared expert (M3), tensor-parallel like the dense MLP, added unscaled
    all_reduce  ONE all-reduce sums routed and shared partials of all ranks

Expert parallel layout (model/parallel.py): rank `ep_rank` owns experts
[ep_rank * E/ep, (ep_rank + 1) * E/ep) and holds slice `moe_tp_rank` of each
owned expert's intermediate dim; every rank runs its experts on all of its
tokens, so a token's full output appears only after the all-reduce.

This matches transformers' MiniMaxM2SparseMoeBlock (M2: no shared expert,
scaling 1.0) and the M3 block (shared expert, scaling 2.0). HF keeps the
router weight in the model dtype and applies the scaling after the expert
sum; here the router is float32 and the scaling is folded into the top-k
weights, which agree exactly in float32.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..kernels.fp8 import WEIGHT_BLOCK
from .layers import GatedMLP, gated_activation, shard
from .linear import ParallelLinear, Piece, ReplicatedLinear
from .parallel import ParallelState, all_reduce
from .weights import attach_plan

__all__ = ["LocalExperts", "MoE"]


def _tracing() -> bool:
    """True under torch.compile / export and under make_fx (proxy tracing): graph
    capture needs the static-shape expert loop, plain eager may gather tokens."""
    if torch.compiler.is_compiling():
        return True
    try:
        from torch.fx.experimental.proxy_tensor import get_proxy_mode
    except ImportError:  # pragma: no cover
        return False
    return get_proxy_mode() is not None


class MoE(nn.Module):
    def __init__(self, config, ps: ParallelState, prefix: str, *, dtype, device, fp8: bool):
        super().__init__()
        self.ps = ps
        self.top_k = config.num_experts_per_tok
        self.use_routing_bias = config.use_routing_bias
        self.norm_topk_prob = config.norm_topk_prob
        self.routed_scaling_factor = config.routed_scaling_factor
        num_experts = config.num_local_experts

        # Router: replicated and kept in float32 (small, and routing is precision sensitive);
        # forward uses its weight directly on float32 activations.
        self.gate = ReplicatedLinear(f"{prefix}.gate", config.hidden_size, num_experts,
                                     dtype=torch.float32, device=device)
        bias = torch.zeros(num_experts, dtype=torch.float32, device=device)
        self.register_buffer("e_score_correction_bias", bias)
        attach_plan(self.e_score_correction_bias, f"{prefix}.e_score_correction_bias")

        # Routed experts: this rank's slice of experts, each sharded over the MoE TP ranks.
        self.first_expert, n_local = shard(num_experts, ps.ep_rank, ps.ep_size, f"{prefix}: num_local_experts")
        self.experts = LocalExperts(config, ps, prefix, self.first_expert, n_local, dtype=dtype, device=device,
                                    fp8=fp8)

        # Shared expert: tensor-parallel over all ranks, no all-reduce of its own.
        self.shared_experts = None
        if config.shared_intermediate_size:
            names = tuple(f"{prefix}.shared_experts.{p}_proj" for p in ("gate", "up", "down"))
            self.shared_experts = GatedMLP(config, ps, names, config.shared_intermediate_size,
                                           ps.tp_rank, ps.tp_size, reduce_output=False,
                                           dtype=dtype, device=device, fp8=fp8)

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(expert ids, weights) [T, top_k]: router -> sigmoid -> top-k of the biased choice ->
        the unbiased scores gathered -> renormalized -> scaled."""
        logits = F.linear(x.float(), self.gate.weight)
        scores = torch.sigmoid(logits)
        choice = scores + self.e_score_correction_bias if self.use_routing_bias else scores
        topk_ids = torch.topk(choice, self.top_k, dim=-1, sorted=False).indices
        topk_weights = scores.gather(1, topk_ids)
        if self.norm_topk_prob:
            topk_weights = topk_weights / topk_weights.sum(dim=-1, keepdim=True)
        return topk_ids, topk_weights * self.routed_scaling_factor

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        topk_ids, topk_weights = self.route(x)

        # Local experts (partial sums, float32 accumulation).
        out = x.new_zeros(x.shape, dtype=torch.float32)
        if _tracing():
            out = self._experts_dense(x, topk_ids, topk_weights, out)
        else:
            out = self._experts_gathered(x, topk_ids, topk_weights, out)
        out = out.to(x.dtype)

        # Shared expert, then the one all-reduce of the block.
        if self.shared_experts is not None:
            out = out + self.shared_experts(x)
        return all_reduce(out, self.ps)

    def _experts_dense(self, x, topk_ids, topk_weights, out):
        """Static shapes for torch.compile: every local expert runs on all tokens,
        weighted by its top-k weight (zero for tokens not routed to it)."""
        for i in range(len(self.experts)):
            w_e = (topk_weights * (topk_ids == self.first_expert + i)).sum(dim=-1)  # [T]
            out = out + w_e[:, None] * self.experts(i, x)
        return out

    def _experts_gathered(self, x, topk_ids, topk_weights, out):
        """Eager fast path: each expert runs only on its routed tokens. Same sum in
        the same expert order as _experts_dense (which adds exact zeros for the rest)."""
        for i in range(len(self.experts)):
            token, slot = torch.nonzero(topk_ids == self.first_expert + i, as_tuple=True)
            if token.numel() == 0:
                continue
            w_e = topk_weights[token, slot]
            out.index_add_(0, token, w_e[:, None] * self.experts(i, x[token]))
        return out


class LocalExperts(nn.Module):
    """This rank's routed experts as two stacked linears: `gate_up_proj` [E * 2n, H] (expert i's
    gate then up rows at [2n * i, 2n * (i + 1))) and `down_proj` [E * H, n] (expert i's rows at
    [H * i, H * (i + 1))), n being this rank's slice of the expert intermediate size, each with
    its FP8 block scales. Every block loads from its own checkpoint tensors
    (`experts.{e}.w1 / w3 / w2`). One parameter per projection instead of one per expert: a
    compiled call then passes 4 tensors per MoE layer rather than 4 per expert (M3: 512), and
    the host time of a call grows with that count.

    `experts(i, x)` is expert i's gated MLP on x (partial sums under MoE tensor parallelism).
    """

    def __init__(self, config, ps: ParallelState, prefix: str, first: int, count: int, *, dtype, device, fp8: bool):
        super().__init__()
        full, hidden = config.intermediate_size, config.hidden_size
        i0, n = shard(full, ps.moe_tp_rank, ps.moe_tp_size, f"{prefix}.experts: intermediate size")
        self.count, self.width, self.hidden = count, n, hidden
        self.act = config.hidden_act
        self.alpha, self.limit, self.beta = config.swiglu_alpha, config.swiglu_limit, config.swiglu_beta
        names = [f"{prefix}.experts.{e}" for e in range(first, first + count)]
        self.gate_up_proj = ParallelLinear(
            [p for e in names for p in (Piece(f"{e}.w1", full, i0, n), Piece(f"{e}.w3", full, i0, n))], hidden,
            dtype=dtype, device=device, fp8=fp8, name=f"{prefix}.experts.{first}-{first + count - 1}.w1+w3")
        self.down_proj = ParallelLinear(
            [Piece(f"{e}.w2", hidden) for e in names], n, in_range=(i0, n, full),
            dtype=dtype, device=device, fp8=fp8, name=f"{prefix}.experts.{first}-{first + count - 1}.w2")

    def __len__(self) -> int:
        return self.count

    def per_expert(self) -> tuple[list, list, list, list]:
        """Views of each expert's gate/up and down weights and (FP8) their block scales:
        [w13_0, ...], [w2_0, ...], [s13_0, ...] or [], [s2_0, ...] or []."""
        gu, dn = self.gate_up_proj, self.down_proj
        w13 = list(gu.weight.split(2 * self.width))
        w2 = list(dn.weight.split(self.hidden))
        if not gu.fp8:
            return w13, w2, [], []
        s13 = list(gu.weight_scale_inv.split(2 * self.width // WEIGHT_BLOCK))
        s2 = list(dn.weight_scale_inv.split(self.hidden // WEIGHT_BLOCK))
        return w13, w2, s13, s2

    def forward(self, i: int, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj.forward_rows(x, 2 * self.width * i, 2 * self.width).chunk(2, dim=-1)
        h = gated_activation(self.act, gate, up, self.alpha, self.limit, self.beta)
        return self.down_proj.forward_rows(h, self.hidden * i, self.hidden)
