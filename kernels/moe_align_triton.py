"""Expert alignment of the MoE's (token, slot) pairs in one Triton program, for decode sizes.

kernels/moe_triton.py:align_by_expert builds the sorted layout the grouped
GEMMs read (pairs sorted by local expert, each expert's run padded to a
multiple of BLOCK_M, the expert of every block, each pair's row) from about
40 small torch kernels (sort, scans, scatters, fills). At decode sizes those
launches cost more than the work (about half of the MoE layer's time at 1
token, measured: docs/kernel-notes.md#moe-alignment). This file computes the same
three tensors, equal element for element, in one launch:

    fill     sorted_pair = -1
    count    tokens per local expert (one-hot sums over chunks of pairs)
    scan     padded run starts, cumulative block counts
    place    each pair's row = its expert's start + the number of earlier
             pairs with the same expert (the stable order of the torch path)
    blocks   the expert of each block = how many experts end at or before it

With a shared expert run in the same launches, its id (shared_id, past every
routed id) is one more local expert after the routed ones.

One program does it all (a counting sort is sequential across chunks), so it
is for small pair counts only: `align_fits(pairs)`; larger counts use the
torch path, whose kernels are then cheap next to the GEMMs. The pair count
and the expert count are compile-time constants (one compile per token-count
bucket; the loop bounds must be Python ints under triton 3.6's interpreter).
"""

from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl

    HAVE_TRITON = True
except ImportError:  # pragma: no cover
    triton = tl = None
    HAVE_TRITON = False

# (token, slot) pairs up to which one program is used (64 tokens x top-4 + the shared slot =
# 320 pairs at decode; faster than the torch path at 1 and 64 tokens, measured:
# docs/kernel-notes.md#moe-alignment; the limit itself is a guess).
MAX_PAIRS = 1024
_CHUNK = 64  # pairs per step: a CHUNK x CHUNK comparison and a CHUNK x NB one-hot in registers


def align_fits(pairs: int) -> bool:
    return HAVE_TRITON and 0 < pairs <= MAX_PAIRS


if HAVE_TRITON:

    @triton.jit
    def _chunk(ids_ptr, c0, lane, bins, expert_offset, shared_id, PAIRS: tl.constexpr, N_LOCAL: tl.constexpr,
               ROUTED: tl.constexpr):
        """Pairs c0 .. c0 + CHUNK: index, in range, local expert (N_LOCAL = not ours), one-hot [CHUNK, NB].
        Local experts 0 .. ROUTED - 1 are routed ids from expert_offset on; with a shared
        expert (ROUTED = N_LOCAL - 1) the id shared_id is local expert ROUTED."""
        idx = c0 + lane
        ok = idx < PAIRS
        raw = tl.load(ids_ptr + idx, mask=ok, other=-1).to(tl.int64)
        e = raw - expert_offset
        e = tl.where((e >= 0) & (e < ROUTED) & ok, e, N_LOCAL)
        e = tl.where((raw == shared_id) & ok, ROUTED, e).to(tl.int32)
        hit = ((e[:, None] == bins[None, :]) & ok[:, None]).to(tl.int32)
        return idx, ok, e, hit

    @triton.jit
    def _align_kernel(
        ids_ptr, sorted_pair_ptr, block_expert_ptr, pair_row_ptr, expert_offset, shared_id,
        PAIRS: tl.constexpr, N_LOCAL: tl.constexpr, ROUTED: tl.constexpr, NB: tl.constexpr, BM: tl.constexpr,
        MAX_ROWS: tl.constexpr, MAX_BLOCKS: tl.constexpr, CHUNK: tl.constexpr, FILL: tl.constexpr,
    ):
        bins = tl.arange(0, NB)  # local experts 0..N_LOCAL-1; bin N_LOCAL = "not ours"
        lane = tl.arange(0, CHUNK)
        # fill: every row starts as padding
        for r0 in range(0, MAX_ROWS, FILL):
            rows = r0 + tl.arange(0, FILL)
            tl.store(sorted_pair_ptr + rows, tl.full((FILL,), -1, tl.int32), mask=rows < MAX_ROWS)
        # count
        counts = tl.zeros((NB,), dtype=tl.int32)
        for c0 in range(0, PAIRS, CHUNK):
            idx, ok, e, hit = _chunk(ids_ptr, c0, lane, bins, expert_offset, shared_id, PAIRS, N_LOCAL, ROUTED)
            counts += tl.sum(hit, axis=0)
        # scan
        mine = bins < N_LOCAL
        padded = tl.where(mine, (counts + BM - 1) // BM * BM, 0)
        start = tl.cumsum(padded, axis=0) - padded
        cum_blocks = tl.cumsum(padded // BM, axis=0)
        tl.debug_barrier()  # the fill's stores land before any thread places a pair
        # place
        seen = tl.zeros((NB,), dtype=tl.int32)  # pairs of each expert in earlier chunks
        for c0 in range(0, PAIRS, CHUNK):
            idx, ok, e, hit = _chunk(ids_ptr, c0, lane, bins, expert_offset, shared_id, PAIRS, N_LOCAL, ROUTED)
            base = tl.sum(hit * (start + seen)[None, :], axis=1)
            earlier = (e[:, None] == e[None, :]) & (lane[None, :] < lane[:, None]) & ok[None, :]
            row = base + tl.sum(earlier.to(tl.int32), axis=1)
            local = ok & (e < N_LOCAL)
            tl.store(sorted_pair_ptr + row, idx.to(tl.int32), mask=local)
            tl.store(pair_row_ptr + idx, tl.where(local, row, -1), mask=ok)
            seen += tl.sum(hit, axis=0)
        # blocks: searchsorted(cum_blocks, b, right=True) over the local experts
        for b0 in range(0, MAX_BLOCKS, CHUNK):
            b = b0 + lane
            ends = (cum_blocks[None, :] <= b[:, None]) & mine[None, :]
            tl.store(block_expert_ptr + b, tl.sum(ends.to(tl.int32), axis=1), mask=b < MAX_BLOCKS)


def align_by_expert_triton(ids: torch.Tensor, expert_offset: int, n_local: int, block_m: int,
                           shared_id: int = -2):
    """(sorted_pair, block_expert, pair_row) as kernels/moe_triton.align_by_expert returns them
    (shared_id >= 0: that id is one more local expert, n_local)."""
    pairs = ids.numel()
    routed = n_local
    if shared_id >= 0:
        n_local += 1
    if not align_fits(pairs):
        raise ValueError(f"align_by_expert_triton: {pairs} pairs; one program handles 1..{MAX_PAIRS}")
    max_rows = -(-(pairs + n_local * (block_m - 1)) // block_m) * block_m
    max_blocks = max_rows // block_m
    dev = ids.device
    sorted_pair = torch.empty(max_rows, dtype=torch.int32, device=dev)
    block_expert = torch.empty(max_blocks, dtype=torch.int32, device=dev)
    pair_row = torch.empty(pairs, dtype=torch.int32, device=dev)
    _align_kernel[(1,)](
        ids.reshape(-1).contiguous(), sorted_pair, block_expert, pair_row, int(expert_offset), int(shared_id),
        PAIRS=pairs, N_LOCAL=n_local, ROUTED=routed, NB=triton.next_power_of_2(n_local + 1), BM=block_m,
        MAX_ROWS=max_rows, MAX_BLOCKS=max_blocks, CHUNK=_CHUNK, FILL=1024, num_warps=4,
    )
    return sorted_pair, block_expert, pair_row
