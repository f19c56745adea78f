"""One rank's MoE block in plain torch: the numerical reference of `minimax::moe`.

    route(x, router_weight, correction_bias, top_k, norm_topk_prob, routed_scaling)
        -> (topk_ids int64 [T, k], topk_weights float32 [T, k])
    gated_mlp(x, w13, w2, ...)       one expert (or the shared expert): down(act(gate, up))
    MoEWeights(*op_args)             the op's weight and constant arguments, unpacked once
    local_experts_reference(x, ids, weights, w)
                                     sum over this rank's experts, float32 [T, H]
    moe_reference(x, *op_args, experts=..., weights_cls=...)
                                     the whole op: route, experts, shared expert

Everything here is model/moe.py's block op for op (same dtype steps), so on
CPU the ops equal the eager model. The GPU path (kernels/moe_triton.py) is the
same moe_reference with another `experts` function and a MoEWeights subclass;
the op definitions are in kernels/moe.py and the multi-rank reference in
kernels/moe_parallel.py.
"""

from __future__ import annotations

from typing import Callable, Optional

import torch
import torch.nn.functional as F

from .fp8 import quantize_fp8_reference

__all__ = [
    "ACTIVATIONS",
    "ExpertsFn",
    "MoEWeights",
    "route",
    "activation",
    "gated_mlp",
    "check_inputs",
    "local_experts_reference",
    "moe_reference",
]

ACTIVATIONS = ("swigluoai", "silu")


def router_scores(x: torch.Tensor, router_weight: torch.Tensor,
                  correction_bias: Optional[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """(scores, choice) float32 [T, E]: the sigmoid of the float32 logits, and the scores plus the
    correction bias that the top-k is taken of."""
    scores = torch.sigmoid(F.linear(x.float(), router_weight.float()))
    return scores, (scores + correction_bias.float() if correction_bias is not None else scores)


def route(x: torch.Tensor, router_weight: torch.Tensor, correction_bias: Optional[torch.Tensor], top_k: int,
          norm_topk_prob: bool, routed_scaling: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(topk_ids int64 [T, k], topk_weights float32 [T, k]), exactly as model/moe.py."""
    scores, choice = router_scores(x, router_weight, correction_bias)
    ids = torch.topk(choice, top_k, dim=-1, sorted=False).indices
    weights = scores.gather(1, ids)
    if norm_topk_prob:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return ids, weights * routed_scaling


def activation(gate: torch.Tensor, up: torch.Tensor, kind: str, alpha: float, limit: float,
               beta: float) -> torch.Tensor:
    """SwiGLU-OAI or SiLU-gated, op for op as model/layers.py (same dtype steps)."""
    if kind == "swigluoai":
        gate = gate.clamp(max=limit)
        up = up.clamp(min=-limit, max=limit)
        return (up + beta) * (gate * torch.sigmoid(gate * alpha))
    if kind == "silu":
        return F.silu(gate) * up
    raise ValueError(f"minimax moe: unknown activation {kind!r}; expected one of {ACTIVATIONS}")


def _linear(x: torch.Tensor, w: torch.Tensor, ws: Optional[torch.Tensor], group: int) -> torch.Tensor:
    if ws is None:
        return F.linear(x, w)
    xq, xs = quantize_fp8_reference(x, group)
    return torch.ops.minimax.fp8_block_gemm(xq, xs, w, ws, x.dtype)


def gated_mlp(x, w13, w2, w13_s, w2_s, kind, alpha, limit, beta, group) -> torch.Tensor:
    """down(act(gate(x), up(x))) for one expert (w13 = [gate; up] rows)."""
    gate, up = _linear(x, w13, w13_s, group).chunk(2, dim=-1)
    return _linear(activation(gate, up, kind, alpha, limit, beta), w2, w2_s, group)


class MoEWeights:
    """The op's weight and constant arguments, unpacked once."""

    def __init__(self, router_weight, correction_bias, w13, w2, w13_scale, w2_scale, shared_w13, shared_w2,
                 shared_w13_scale, shared_w2_scale, top_k, routed_scaling, norm_topk_prob, expert_offset,
                 activation, alpha, limit, beta, act_group_size):
        self.router_weight, self.correction_bias = router_weight, correction_bias
        self.w13, self.w2 = list(w13), list(w2)
        self.w13_scale = list(w13_scale) if w13_scale else None
        self.w2_scale = list(w2_scale) if w2_scale else None
        self.shared = shared_w13 is not None
        self.shared_w13, self.shared_w2 = shared_w13, shared_w2
        self.shared_w13_scale, self.shared_w2_scale = shared_w13_scale, shared_w2_scale
        self.top_k, self.routed_scaling, self.norm_topk_prob = top_k, routed_scaling, norm_topk_prob
        self.expert_offset = expert_offset
        self.activation, self.alpha, self.limit, self.beta = activation, alpha, limit, beta
        self.group = act_group_size

    @property
    def n_local(self) -> int:
        return len(self.w13)

    @property
    def num_experts(self) -> int:
        return self.router_weight.shape[0]

    @property
    def fp8(self) -> bool:
        return self.w13_scale is not None

    def route(self, x):
        return route(x, self.router_weight, self.correction_bias, self.top_k, self.norm_topk_prob,
                     self.routed_scaling)

    def expert(self, i: int, x: torch.Tensor) -> torch.Tensor:
        s13 = self.w13_scale[i] if self.w13_scale else None
        s2 = self.w2_scale[i] if self.w2_scale else None
        return gated_mlp(x, self.w13[i], self.w2[i], s13, s2, self.activation, self.alpha, self.limit, self.beta,
                         self.group)

    def block(self, x: torch.Tensor, experts: ExpertsFn) -> torch.Tensor:
        """The whole block on these rows: route, then this rank's partial sum (the GPU weights
        may fuse the two's launches)."""
        return self.partial(x, *self.route(x), experts)

    def partial(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, experts: ExpertsFn) -> torch.Tensor:
        """Routed experts (float32, cast once) + the shared expert, in x.dtype: the eager
        block's sum on this rank (the GPU weights run both in one set of launches)."""
        out = experts(x, ids, weights, self).to(x.dtype)
        if self.shared:
            out = out + self.shared_expert(x)
        return out

    def shared_expert(self, x: torch.Tensor) -> torch.Tensor:
        return gated_mlp(x, self.shared_w13, self.shared_w2, self.shared_w13_scale, self.shared_w2_scale,
                         self.activation, self.alpha, self.limit, self.beta, self.group)


def check_inputs(x: torch.Tensor, w: MoEWeights) -> None:
    """The errors the ops raise for inputs that do not make an MoE block."""
    if x.dim() != 2:
        raise ValueError(f"minimax moe: x must be 2-D [tokens, hidden], got shape {tuple(x.shape)}")
    if w.activation not in ACTIVATIONS:
        raise ValueError(f"minimax moe: unknown activation {w.activation!r}; expected one of {ACTIVATIONS}")
    if not w.w13 or len(w.w13) != len(w.w2):
        raise ValueError(f"minimax moe: need one w13 and one w2 per local expert, got {len(w.w13)} and {len(w.w2)}")
    if w.fp8 and (len(w.w13_scale) != w.n_local or not w.w2_scale or len(w.w2_scale) != w.n_local):
        raise ValueError("minimax moe: FP8 experts need one w13_scale and one w2_scale per local expert")
    e, h = w.router_weight.shape
    if h != x.shape[1]:
        raise ValueError(f"minimax moe: router weight {tuple(w.router_weight.shape)} does not match hidden {x.shape[1]}")
    if not 0 < w.top_k <= e:
        raise ValueError(f"minimax moe: top_k={w.top_k} must be in [1, {e}]")
    if e % w.n_local or w.expert_offset % w.n_local or not 0 <= w.expert_offset <= e - w.n_local:
        raise ValueError(
            f"minimax moe: {w.n_local} local experts at offset {w.expert_offset} do not tile {e} experts"
        )
    for i, (a, b) in enumerate(zip(w.w13, w.w2)):
        if a.dim() != 2 or b.dim() != 2 or a.shape[1] != h or b.shape[0] != h or a.shape[0] != 2 * b.shape[1]:
            raise ValueError(
                f"minimax moe: local expert {i}: w13 {tuple(a.shape)} / w2 {tuple(b.shape)} are not [2n, {h}] / [{h}, n]"
            )


def local_experts_reference(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, w: MoEWeights) -> torch.Tensor:
    """sum over this rank's experts of weight * expert(x), float32 [T, H].

    Each expert runs on its routed rows only; experts are added in id order,
    as model/moe.py does (its traced form adds exact zeros for the rest).
    Ids outside the local range (other ranks' experts, or the padding id -1)
    contribute nothing."""
    out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    for i in range(w.n_local):
        token, slot = torch.nonzero(ids == w.expert_offset + i, as_tuple=True)
        if token.numel() == 0:
            continue
        out.index_add_(0, token, weights[token, slot][:, None] * w.expert(i, x[token]))
    return out


ExpertsFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, MoEWeights], torch.Tensor]


def moe_reference(x: torch.Tensor, *args, experts: ExpertsFn = local_experts_reference,
                  weights_cls: type = MoEWeights) -> torch.Tensor:
    w = weights_cls(*args)
    check_inputs(x, w)
    return w.block(x, experts)
