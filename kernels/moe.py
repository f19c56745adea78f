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

The implementations here are plain torch: the numerical reference (CPU, and
any device without a kernel). The CUDA kernel of both ops is the same code
with the local experts (and the shared expert) run by the expert-sorted
Triton grouped GEMMs of kernels/moe_triton.py, imported lazily; it falls back
to the reference without Triton or with MINIMAX_MOE_KERNEL=reference.
"""

from __future__ import annotations

from typing import Callable, Optional, Sequence

import torch
import torch.nn.functional as F

from .env import env_choice
from .fp8 import quantize_fp8_reference

__all__ = [
    "ACTIVATIONS",
    "DISPATCH_MODES",
    "MoEWeights",
    "route",
    "activation",
    "gated_mlp",
    "local_experts_reference",
    "moe_reference",
    "mega_moe_reference",
    "choose_dispatch",
    "shard_rows",
    "block_op_args",
    "flops",
]

ACTIVATIONS = ("swigluoai", "silu")
DISPATCH_MODES = ("allgather", "alltoall")

c10d = torch.ops._c10d_functional


# --------------------------------------------------------------------- pieces
def route(x: torch.Tensor, router_weight: torch.Tensor, correction_bias: Optional[torch.Tensor], top_k: int,
          norm_topk_prob: bool, routed_scaling: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(topk_ids int64 [T, k], topk_weights float32 [T, k]), exactly as model/moe.py."""
    scores = torch.sigmoid(F.linear(x.float(), router_weight.float()))
    choice = scores + correction_bias.float() if correction_bias is not None else scores
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


def _check(x: torch.Tensor, w: MoEWeights) -> None:
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
    _check(x, w)
    ids, weights = w.route(x)
    return w.partial(x, ids, weights, experts)


# ------------------------------------------------------------- distribution
def shard_rows(num_tokens: int, group_size: int) -> int:
    """Rows per rank of a stream of num_tokens padded to a multiple of the group size."""
    return -(-num_tokens // group_size)


def choose_dispatch(has_shared: bool, group_size: int, ep_size: int) -> str:
    """Which exchange moves fewer bytes (per rank, T tokens, hidden H, tp ranks):

    allgather: all-gather the tokens, reduce-scatter the partials:
               2 * (tp - 1) / tp * T * H, fixed shapes (CUDA-graph friendly).
    alltoall:  each token goes only to the ranks owning one of its k experts
               (~min(k, ep) * moe_tp of tp ranks) and comes back:
               about 2 * k' / tp * T * H, but data-dependent sizes.

    A tensor-parallel shared expert (M3) needs every token on every rank and
    a reduce-scatter anyway, so the routed experts ride on those two
    collectives for no extra bytes: allgather. With ep == 1 every rank holds a
    slice of every expert, so all-to-all degenerates to an all-gather:
    allgather. Only without a shared expert and with experts spread over
    ranks (M2 with EP) does all-to-all move fewer bytes."""
    if group_size == 1 or has_shared or ep_size == 1:
        return "allgather"
    return "alltoall"


def _resolve(group_name: str):
    from torch.distributed.distributed_c10d import _resolve_process_group

    return _resolve_process_group(group_name)


def _all_gather(x: torch.Tensor, group_size: int, group_name: str) -> torch.Tensor:
    return c10d.wait_tensor(c10d.all_gather_into_tensor(x.contiguous(), group_size, group_name))


def _reduce_scatter(x: torch.Tensor, group_size: int, group_name: str) -> torch.Tensor:
    return c10d.wait_tensor(c10d.reduce_scatter_tensor(x.contiguous(), "sum", group_size, group_name))


def _all_to_all(x: torch.Tensor, out_splits: list[int], in_splits: list[int], group_name: str) -> torch.Tensor:
    return c10d.wait_tensor(c10d.all_to_all_single(x.contiguous(), out_splits, in_splits, group_name))


def _gather_routed(x, ids, weights, group_size, group_name):
    """All-gather the tokens with their routing in ONE collective: ids (exact in
    float32 below 2**24) and weights ride as float32 bits next to the token row."""
    k = ids.shape[1]
    meta = torch.cat([ids.to(torch.float32), weights.to(torch.float32)], dim=1)
    if x.element_size() in (2, 4):
        packed = torch.cat([x, meta.view(x.dtype)], dim=1)  # a bit view, no conversion
        full = _all_gather(packed, group_size, group_name)
        h = x.shape[1]
        x_all = full[:, :h]
        meta_all = full[:, h:].contiguous().view(torch.float32)
    else:  # pragma: no cover - one-byte activations: two collectives
        x_all = _all_gather(x, group_size, group_name)
        meta_all = _all_gather(meta, group_size, group_name)
    return x_all, meta_all[:, :k].to(torch.int64), meta_all[:, k:]


def _pad_rows(x: torch.Tensor, rows: int, value=0) -> torch.Tensor:
    if x.shape[0] == rows:
        return x
    return F.pad(x, [0, 0, 0, rows - x.shape[0]], value=value)


def _layout(w: MoEWeights, group_size: int, rank: int) -> tuple[int, int]:
    """(ep_size, moe_tp_size) from the weights; checks this rank owns expert_offset."""
    ep = w.num_experts // w.n_local
    if group_size % ep:
        raise ValueError(f"minimax mega_moe: {ep} expert groups do not divide the group of {group_size} ranks")
    moe_tp = group_size // ep
    want = (rank // moe_tp) * w.n_local
    if w.expert_offset != want:
        raise ValueError(
            f"minimax mega_moe: rank {rank} of {group_size} (ep {ep}) owns experts from {want}, "
            f"but the weights are for experts from {w.expert_offset}"
        )
    return ep, moe_tp


def _alltoall_routed(xs, ids, weights, w: MoEWeights, experts: ExpertsFn, group_size, group_name, moe_tp):
    """Routed experts by all-to-all: float32 [rows, H] summed over every owner's partial."""
    rows, hidden = xs.shape
    owner = torch.div(ids, w.n_local, rounding_mode="floor")  # expert group of each choice [rows, k]
    ep = group_size // moe_tp
    groups = torch.zeros(rows, ep, dtype=torch.bool, device=xs.device)
    if rows:
        groups.scatter_(1, owner, True)
    dest = groups.repeat_interleave(moe_tp, dim=1)  # [rows, tp]: ranks holding a slice of an owned expert
    order = [torch.nonzero(dest[:, d], as_tuple=True)[0] for d in range(group_size)]
    send_idx = torch.cat(order)
    send_counts = [int(o.numel()) for o in order]
    counts = torch.tensor(send_counts, dtype=torch.int64, device=xs.device)
    recv_counts = _all_to_all(counts, [1] * group_size, [1] * group_size, group_name).tolist()
    # Token rows, and ids + weights packed in float32 (ids < 2**24 are exact).
    meta = torch.cat([ids.to(torch.float32), weights], dim=1)[send_idx]
    recv_x = _all_to_all(xs[send_idx], recv_counts, send_counts, group_name)
    recv_meta = _all_to_all(meta, recv_counts, send_counts, group_name)
    k = ids.shape[1]
    recv_ids = recv_meta[:, :k].to(torch.int64)
    y = experts(recv_x, recv_ids, recv_meta[:, k:], w)  # float32 [received, H]
    back = _all_to_all(y, send_counts, recv_counts, group_name)
    out = torch.zeros(rows, hidden, dtype=torch.float32, device=xs.device)
    return out.index_add_(0, send_idx, back)


def mega_moe_reference(x: torch.Tensor, *args, experts: ExpertsFn = local_experts_reference,
                       weights_cls: type = MoEWeights) -> torch.Tensor:
    """The CPU reference of minimax::mega_moe (see the module docstring). The GPU
    path is this same function with the grouped-GEMM `experts` / `weights_cls`."""
    *weight_args, group_name, group_size, input_sharded, output_sharded, num_tokens, dispatch = args
    w = weights_cls(*weight_args)
    _check(x, w)
    if dispatch not in DISPATCH_MODES:
        raise ValueError(f"minimax mega_moe: dispatch {dispatch!r} must be one of {DISPATCH_MODES}")
    tp = group_size
    if tp == 1:  # one device: the block itself, on the real rows
        if x.shape[0] < num_tokens:
            raise ValueError(f"minimax mega_moe: {x.shape[0]} rows cannot hold {num_tokens} tokens")
        out = w.partial(x[:num_tokens], *w.route(x[:num_tokens]), experts)
        return _pad_rows(out, x.shape[0]) if output_sharded else out
    rank = _resolve(group_name).rank()
    _, moe_tp = _layout(w, tp, rank)
    t = x.shape[0] if input_sharded else shard_rows(x.shape[0], tp)
    total = num_tokens
    if input_sharded and t * tp < total:
        raise ValueError(f"minimax mega_moe: shards of {t} rows on {tp} ranks cannot hold {total} tokens")
    if not input_sharded and x.shape[0] != total:
        raise ValueError(f"minimax mega_moe: replicated input has {x.shape[0]} rows, num_tokens is {total}")
    valid = max(0, min(t, total - rank * t))  # real (non-padding) rows of this rank's shard

    if dispatch == "allgather":
        if input_sharded:
            ids, weights = w.route(x[:valid])
            ids = _pad_rows(ids, t, value=-1)  # padding rows choose no expert
            weights = _pad_rows(weights, t)
            x_all, ids_all, w_all = _gather_routed(x, ids, weights, tp, group_name)
            x_all, ids_all, w_all = x_all[:total], ids_all[:total], w_all[:total]
        else:
            # Replicated input: every rank has every token; routing them all
            # here is cheaper than a collective.
            x_all = x
            ids_all, w_all = w.route(x)
        # Exactly the eager block's partial sum on this rank ...
        partial = w.partial(x_all, ids_all, w_all, experts)
        # ... and the reduce-scatter the sequence-parallel graph ended with.
        out_shard = _reduce_scatter(_pad_rows(partial, t * tp), tp, group_name)
    else:
        xs = x if input_sharded else _pad_rows(x, t * tp)[rank * t:(rank + 1) * t]
        ids, weights = w.route(xs[:valid])
        routed = _alltoall_routed(xs[:valid], ids, weights, w, experts, tp, group_name, moe_tp)
        out_shard = _pad_rows(routed.to(x.dtype), t)
        if w.shared:
            x_all = _all_gather(xs, tp, group_name)[:total] if input_sharded else x
            shared = _pad_rows(w.shared_expert(x_all), t * tp)
            out_shard = out_shard + _reduce_scatter(shared, tp, group_name)
    if output_sharded:
        return out_shard
    return _all_gather(out_shard, tp, group_name)[:total]


# ---------------------------------------------------------------- the ops
# Schemas: Tensor[] for the per-expert weights (empty scale lists = BF16).
@torch.library.custom_op("minimax::moe", mutates_args=())
def moe(
    x: torch.Tensor, router_weight: torch.Tensor, correction_bias: Optional[torch.Tensor],
    w13: Sequence[torch.Tensor], w2: Sequence[torch.Tensor],
    w13_scale: Sequence[torch.Tensor], w2_scale: Sequence[torch.Tensor],
    shared_w13: Optional[torch.Tensor], shared_w2: Optional[torch.Tensor],
    shared_w13_scale: Optional[torch.Tensor], shared_w2_scale: Optional[torch.Tensor],
    top_k: int, routed_scaling: float, norm_topk_prob: bool, expert_offset: int,
    activation: str, alpha: float, limit: float, beta: float, act_group_size: int,
) -> torch.Tensor:
    return moe_reference(x, router_weight, correction_bias, w13, w2, w13_scale, w2_scale, shared_w13, shared_w2,
                         shared_w13_scale, shared_w2_scale, top_k, routed_scaling, norm_topk_prob, expert_offset,
                         activation, alpha, limit, beta, act_group_size)


@moe.register_fake
def _moe_fake(x, router_weight, correction_bias, w13, w2, w13_scale, w2_scale, shared_w13, shared_w2,
              shared_w13_scale, shared_w2_scale, top_k, routed_scaling, norm_topk_prob, expert_offset,
              activation, alpha, limit, beta, act_group_size):
    return torch.empty_like(x)


@torch.library.custom_op("minimax::mega_moe", mutates_args=())
def mega_moe(
    x: torch.Tensor, router_weight: torch.Tensor, correction_bias: Optional[torch.Tensor],
    w13: Sequence[torch.Tensor], w2: Sequence[torch.Tensor],
    w13_scale: Sequence[torch.Tensor], w2_scale: Sequence[torch.Tensor],
    shared_w13: Optional[torch.Tensor], shared_w2: Optional[torch.Tensor],
    shared_w13_scale: Optional[torch.Tensor], shared_w2_scale: Optional[torch.Tensor],
    top_k: int, routed_scaling: float, norm_topk_prob: bool, expert_offset: int,
    activation: str, alpha: float, limit: float, beta: float, act_group_size: int,
    group_name: str, group_size: int, input_sharded: bool, output_sharded: bool, num_tokens: int, dispatch: str,
) -> torch.Tensor:
    return mega_moe_reference(x, router_weight, correction_bias, w13, w2, w13_scale, w2_scale, shared_w13,
                              shared_w2, shared_w13_scale, shared_w2_scale, top_k, routed_scaling, norm_topk_prob,
                              expert_offset, activation, alpha, limit, beta, act_group_size, group_name, group_size,
                              input_sharded, output_sharded, num_tokens, dispatch)


def _gpu_path(reference):
    """The CUDA kernel of an op: the same code with the Triton grouped GEMMs
    (kernels/moe_triton.py) for the experts. MINIMAX_MOE_KERNEL=reference keeps
    the plain-torch experts (e.g. to compare on the GPU)."""

    def impl(x, *args):
        if env_choice("MINIMAX_MOE_KERNEL", "triton", ("triton", "reference")) == "reference":
            return reference(x, *args)
        try:
            from . import moe_triton
        except ImportError:  # pragma: no cover - triton missing: the reference runs on CUDA too
            return reference(x, *args)
        if not moe_triton.HAVE_TRITON:
            return reference(x, *args)
        return reference(x, *args, experts=moe_triton.triton_experts, weights_cls=moe_triton.TritonMoEWeights)

    return impl


moe.register_kernel("cuda")(_gpu_path(moe_reference))
mega_moe.register_kernel("cuda")(_gpu_path(mega_moe_reference))


def mega_moe_out_rows(rows_in: int, group_size: int, input_sharded: bool, output_sharded: bool,
                      num_tokens: int) -> int:
    """Rows of mega_moe's output for an input of rows_in rows."""
    t = rows_in if input_sharded else shard_rows(rows_in, group_size)
    return t if output_sharded else num_tokens


@mega_moe.register_fake
def _mega_moe_fake(x, router_weight, correction_bias, w13, w2, w13_scale, w2_scale, shared_w13, shared_w2,
                   shared_w13_scale, shared_w2_scale, top_k, routed_scaling, norm_topk_prob, expert_offset,
                   activation, alpha, limit, beta, act_group_size, group_name, group_size, input_sharded,
                   output_sharded, num_tokens, dispatch):
    rows = mega_moe_out_rows(x.shape[0], group_size, input_sharded, output_sharded, num_tokens)
    return x.new_empty((rows, x.shape[1]))


def flops(tokens: int, hidden: int, intermediate: int, top_k: int, shared_intermediate: int = 0) -> float:
    """Matrix FLOPs of one MoE layer (router excluded): 2 * 3 * H * I per token and expert."""
    return 2.0 * tokens * hidden * (3 * intermediate * top_k + 3 * shared_intermediate)


def block_op_args(block) -> tuple:
    """The weight and constant arguments of minimax::moe for an eager MoE block
    (model/moe.py's MoE, read duck-typed): what the canonicalize pass finds in
    the graph, for tests and benchmarks that call the ops directly."""
    experts = list(block.experts)
    mlp = experts[0] if experts else block.shared_experts

    def scales(linears):
        return [lin.weight_scale_inv for lin in linears] if linears and linears[0].fp8 else []

    shared = block.shared_experts
    return (
        block.gate.weight,
        block.e_score_correction_bias if block.use_routing_bias else None,
        [e.gate_up_proj.weight for e in experts],
        [e.down_proj.weight for e in experts],
        scales([e.gate_up_proj for e in experts]),
        scales([e.down_proj for e in experts]),
        shared.gate_up_proj.weight if shared is not None else None,
        shared.down_proj.weight if shared is not None else None,
        shared.gate_up_proj.weight_scale_inv if shared is not None and shared.gate_up_proj.fp8 else None,
        shared.down_proj.weight_scale_inv if shared is not None and shared.down_proj.fp8 else None,
        block.top_k,
        float(block.routed_scaling_factor),
        bool(block.norm_topk_prob),
        block.first_expert,
        mlp.act,
        float(mlp.alpha),
        float(mlp.limit),
        float(mlp.beta),
        mlp.gate_up_proj.act_group_size,
    )
