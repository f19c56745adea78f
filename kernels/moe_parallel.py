"""The MoE block across a TP / EP group in plain torch: the reference of `minimax::mega_moe`.

    mega_moe_reference(x, *op_args, group_name, group_size, input_sharded, output_sharded,
                       num_tokens, dispatch, experts=..., weights_cls=...)

routes the tokens, moves them to the ranks that own their experts (all-gather
or all-to-all: choose_dispatch), runs one rank's block (kernels/moe_reference.py)
and ends with the collective the eager block ended with (see kernels/moe.py for
the op's contract). Collectives are the functional `_c10d_functional` ops, so
this runs on gloo (CPU tests) as on NCCL; the GPU path (kernels/moe_triton.py)
is this same function with the grouped-GEMM `experts` / `weights_cls`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .moe_reference import ExpertsFn, MoEWeights, check_inputs, local_experts_reference

__all__ = ["DISPATCH_MODES", "shard_rows", "choose_dispatch", "mega_moe_reference", "mega_moe_out_rows"]

DISPATCH_MODES = ("allgather", "alltoall")

c10d = torch.ops._c10d_functional


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
    check_inputs(x, w)
    if dispatch not in DISPATCH_MODES:
        raise ValueError(f"minimax mega_moe: dispatch {dispatch!r} must be one of {DISPATCH_MODES}")
    tp = group_size
    if tp == 1:  # one device: the block itself, on the real rows
        if x.shape[0] < num_tokens:
            raise ValueError(f"minimax mega_moe: {x.shape[0]} rows cannot hold {num_tokens} tokens")
        out = w.block(x[:num_tokens], experts)
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


def mega_moe_out_rows(rows_in: int, group_size: int, input_sharded: bool, output_sharded: bool,
                      num_tokens: int) -> int:
    """Rows of mega_moe's output for an input of rows_in rows."""
    t = rows_in if input_sharded else shard_rows(rows_in, group_size)
    return t if output_sharded else num_tokens
