"""Which tokens took another expert than eager: routing flips between two runs of one model.

    eager = eager_router_calls(model, ids, positions)          # forward pre-hooks on the MoE blocks
    with watch_router_inputs() as compiled:                     # kernels/moe_probe.py
        out = compiled_model(ids, positions)                    # a call that runs the ops (not a replay)
    report = routing_flips(eager, compiled)
    report.tokens, report.layers, report.min_margin

In BF16 or FP8 two correct implementations round differently, and a token whose k-th and
(k+1)-th expert choices are nearly tied (the router's sigmoid scores 2.5e-4 apart, say) picks
another expert in one of them: that token's output moves by a tenth of the largest logit or more
while every other token agrees to rounding (docs/measurements/2026-12-05.md). A logits comparison
that excludes these tokens (`errors_without`) measures the code; the flips themselves, with
eager's margin at each, say how close to a tie the token was. One process, one rank (the MoE
inputs are the whole token stream, in the order of the logits' rows).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from minimax_backend.kernels.moe_probe import RouterCall
from minimax_backend.kernels.moe_reference import router_scores

__all__ = ["RoutingFlips", "eager_router_calls", "routing_flips", "top_k_and_margin", "logit_rows",
           "errors_without"]


def top_k_and_margin(call: RouterCall) -> tuple[torch.Tensor, torch.Tensor]:
    """(the chosen experts per token, ascending [T, k]; the gap between the k-th and (k+1)-th
    choice [T]) with the model's router math (kernels/moe_reference.py:router_scores)."""
    _, choice = router_scores(call.x, call.router_weight, call.correction_bias)
    k = call.top_k
    if k >= choice.shape[-1]:  # every expert taken: nothing can flip
        ids = torch.arange(choice.shape[-1], device=choice.device).expand(choice.shape[0], -1)
        return ids, torch.full((choice.shape[0],), float("inf"), device=choice.device)
    top = torch.topk(choice, k + 1, dim=-1)
    ids = top.indices[:, :k].sort(dim=-1).values
    return ids, top.values[:, k - 1] - top.values[:, k]


def eager_router_calls(model: torch.nn.Module, *args, **kwargs) -> tuple[list[RouterCall], object]:
    """Run the eager model once and record each MoE block's input: (calls, the model's output)."""
    from minimax_backend.model.moe import MoE

    calls: list[RouterCall] = []

    def hook(block, inputs):
        bias = block.e_score_correction_bias if block.use_routing_bias else None
        calls.append(RouterCall(inputs[0].detach().clone(), block.gate.weight, bias, block.top_k))

    handles = [m.register_forward_pre_hook(hook) for m in model.modules() if isinstance(m, MoE)]
    try:
        with torch.no_grad():
            out = model(*args, **kwargs)
    finally:
        for h in handles:
            h.remove()
    return calls, out


@dataclass
class RoutingFlips:
    tokens: list[int]  # every token (row) whose experts differ from eager's in some MoE layer
    layers: list[dict] = field(default_factory=list)  # per layer: flipped rows and eager's margins there
    min_margin: float = float("inf")  # eager's smallest gap between the k-th and (k+1)-th choice

    def as_dict(self) -> dict:
        return {"tokens": self.tokens, "layers": self.layers, "min_margin": self.min_margin}


def routing_flips(eager: list[RouterCall], other: list[RouterCall]) -> RoutingFlips:
    """Compare the first len(eager) calls of `other` (one forward) with eager's, layer by layer."""
    if len(other) < len(eager):
        raise ValueError(f"routing_flips: eager ran {len(eager)} MoE layers, the other run {len(other)} MoE op "
                         "calls: was it a CUDA graph replay (no op runs), or is the MoE not the minimax op?")
    flipped: set[int] = set()
    layers = []
    min_margin = float("inf")
    for i, (e, o) in enumerate(zip(eager, other)):
        if e.x.shape != o.x.shape:
            raise ValueError(f"routing_flips: layer {i}: eager's MoE input is {tuple(e.x.shape)}, the other "
                             f"run's {tuple(o.x.shape)}: the same token rows are needed (one rank, no padding)")
        e_ids, margin = top_k_and_margin(e)
        o_ids, _ = top_k_and_margin(o)
        rows = (e_ids != o_ids.to(e_ids.device)).any(dim=-1).nonzero().flatten().tolist()
        flipped.update(rows)
        min_margin = min(min_margin, float(margin.min()))
        layers.append({"layer": i, "tokens": rows, "eager_margins": [float(margin[r]) for r in rows]})
    return RoutingFlips(sorted(flipped), layers, min_margin)


def logit_rows(tokens: list[int], num_tokens: int, num_rows: int, sequences: int) -> list[int]:
    """The rows of a [rows, vocab] logits tensor that belong to `tokens` (indices into the
    num_tokens rows the MoE saw): every row when the model kept every position, else the last
    position of each of the `sequences` sequences (a prefill that keeps only the last logits)."""
    if num_rows == num_tokens:
        return list(tokens)
    if num_rows != sequences or num_tokens % sequences:
        raise ValueError(f"logit_rows: {num_rows} logits rows for {num_tokens} tokens in {sequences} sequence(s)")
    per_seq = num_tokens // sequences
    return [t // per_seq for t in tokens if t % per_seq == per_seq - 1]


def errors_without(reference: torch.Tensor, other: torch.Tensor, tokens: list[int]) -> dict[str, float]:
    """The largest and median per-token error over the largest reference logit, without `tokens`
    (rows of the flattened [tokens, vocab] logits)."""
    ref = reference.float().reshape(-1, reference.shape[-1])
    per_token = (ref - other.float().reshape(ref.shape)).abs().amax(-1) / ref.abs().max().clamp_min(1e-12)
    keep = torch.ones(per_token.shape[0], dtype=torch.bool, device=per_token.device)
    keep[tokens] = False
    if not bool(keep.any()):
        return {"max_rel_err": float("nan"), "median_token_rel_err": float("nan")}
    rest = per_token[keep]
    return {"max_rel_err": float(rest.max()), "median_token_rel_err": float(rest.median())}
