"""The router's selection, the shared expert's slot and the experts' alignment in one launch.

At decode sizes the MoE layer's small kernels between the router logits and the
expert GEMMs were four: the selection (`moe_route_triton._select_kernel`), two
`torch.cat`s that append the shared expert's slot to the ids and weights, and the
alignment's one program (`moe_align_triton._align_kernel`). Each is a few
microseconds of work and a launch gap on a call that should take as long as
reading the experts' weights (docs/kernel-notes.md#moe-selection-and-alignment-in-one-launch).
Here one program does all of it:

    select    every token's top-k over its logits (the same helper as the
              selection kernel), into slots 0 .. k-1 of [T, k + 1] rows
    shared    slot k of every row: the shared expert's id, weight 1
    align     the one-program alignment of those pairs (the same helper as
              the alignment kernel), after a barrier: the pairs it reads were
              stored by other threads of this program

The result is what the separate launches give: the same ids and alignment, the
same weights (each row's sum over its slots may be reduced in another order,
so the last bit of a normalized weight may differ). It is for one program's
worth of pairs (`select_align_fits`); the kernel option moe_select=separate
keeps the separate launches.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from .launch_overlap import pdl_launch
from .moe_align_triton import MAX_PAIRS, ONE_PROGRAM_PAIRS, one_program_outputs
from .moe_route_triton import MAX_EXPERTS

try:
    import triton
    import triton.language as tl

    from .launch_overlap import wait_then_release
    from .moe_align_triton import _align_pairs
    from .moe_route_triton import _select_rows

    HAVE_TRITON = True
except ImportError:  # pragma: no cover
    triton = tl = None
    HAVE_TRITON = False


@dataclass
class Selection:
    """The router's selection left to the alignment's launch: its logits and parameters in
    place of ids and weights (kernels/moe_triton.py:grouped_gated_mlp's `selection`)."""
    logits: torch.Tensor  # float32 [T, E]
    correction_bias: Optional[torch.Tensor]
    top_k: int
    norm_topk_prob: bool
    routed_scaling: float


# The selection holds a [tokens, experts] tile in one program's registers: up to 64 x 128 at M3.
MAX_TILE = 8192


def select_align_fits(tokens: int, top_k: int, num_experts: int, shared: bool) -> bool:
    """Whether one program takes the selection and the alignment of `tokens` rows."""
    pairs = tokens * (top_k + shared)
    return (HAVE_TRITON and tokens > 0 and 0 < top_k <= num_experts <= MAX_EXPERTS
            and pairs <= min(ONE_PROGRAM_PAIRS, MAX_PAIRS)
            and triton.next_power_of_2(tokens) * triton.next_power_of_2(num_experts) <= MAX_TILE)


if HAVE_TRITON:

    @triton.jit
    def _select_align_kernel(
        logits_ptr, bias_ptr, ids_ptr, w_ptr, sorted_pair_ptr, block_expert_ptr, pair_row_ptr,
        E, stride_l, scaling, expert_offset, shared_id,
        T: tl.constexpr, BT: tl.constexpr, BE: tl.constexpr, HAS_BIAS: tl.constexpr, NORM: tl.constexpr,
        TOP_K: tl.constexpr, SHARED: tl.constexpr,
        PAIRS: tl.constexpr, P2: tl.constexpr, N_LOCAL: tl.constexpr, ROUTED: tl.constexpr, NB: tl.constexpr,
        BM: tl.constexpr, MAX_ROWS: tl.constexpr, MAX_BLOCKS: tl.constexpr, B2: tl.constexpr, FILL: tl.constexpr,
        PDL: tl.constexpr = False,
    ):
        wait_then_release(PDL)  # kernels/launch_overlap.py
        slots: tl.constexpr = TOP_K + SHARED
        _select_rows(logits_ptr, bias_ptr, ids_ptr, w_ptr, 0, T, E, stride_l, slots, scaling,
                     HAS_BIAS, NORM, TOP_K, BT, BE)
        if SHARED:
            rt = tl.arange(0, BT)
            tl.store(ids_ptr + rt * slots + TOP_K, tl.zeros((BT,), tl.int64) + shared_id, mask=rt < T)
            tl.store(w_ptr + rt * slots + TOP_K, tl.full((BT,), 1.0, tl.float32), mask=rt < T)
        tl.debug_barrier()  # the alignment's threads read pairs other threads stored
        _align_pairs(ids_ptr, sorted_pair_ptr, block_expert_ptr, pair_row_ptr, expert_offset, shared_id,
                     PAIRS, P2, N_LOCAL, ROUTED, NB, BM, MAX_ROWS, MAX_BLOCKS, B2, FILL)


def select_and_align(logits: torch.Tensor, correction_bias: Optional[torch.Tensor], top_k: int,
                     norm_topk_prob: bool, routed_scaling: float, expert_offset: int, n_local: int,
                     block_m: int, shared_id: int = -2, overlap: bool = False):
    """(ids int64 [T, k'], weights float32 [T, k'], sorted_pair, block_expert, pair_row) from the
    router's float32 logits [T, E]: k' = top_k, or top_k + 1 with the shared expert's slot
    (shared_id >= 0: its id, weight 1) last; the alignment as kernels/moe_align_triton gives it.
    overlap: a programmatic dependent launch (kernels/launch_overlap.py)."""
    t, e = logits.shape
    shared = shared_id >= 0
    if not select_align_fits(t, top_k, e, shared):
        raise ValueError(f"select_and_align: {t} tokens x top-{top_k} of {e} experts (shared slot: {shared}) "
                         "is more than one program takes")
    if logits.dtype != torch.float32 or logits.stride(1) != 1:
        raise ValueError("select_and_align: the logits must be float32 with contiguous rows")
    slots = top_k + shared
    dev = logits.device
    ids = torch.empty(t, slots, dtype=torch.int64, device=dev)
    weights = torch.empty(t, slots, dtype=torch.float32, device=dev)
    outputs, constants, warps = one_program_outputs(t * slots, n_local, block_m, shared_id, dev)
    bias = correction_bias.float().contiguous() if correction_bias is not None else logits
    _select_align_kernel[(1,)](
        logits, bias, ids, weights, *outputs, e, logits.stride(0), float(routed_scaling), int(expert_offset),
        int(shared_id), T=t, BT=triton.next_power_of_2(t), BE=triton.next_power_of_2(e),
        HAS_BIAS=correction_bias is not None, NORM=bool(norm_topk_prob), TOP_K=top_k, SHARED=shared,
        **constants, num_warps=warps, **pdl_launch(overlap),
    )
    return (ids, weights, *outputs)
