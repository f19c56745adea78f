"""Expert alignment of the MoE's (token, slot) pairs in Triton: one program at decode sizes, chunks past them.

kernels/moe_triton.py:align_by_expert builds the sorted layout the grouped
GEMMs read (pairs sorted by local expert, each expert's run padded to a
multiple of BLOCK_M, the expert of every block, each pair's row) from about
40 small torch kernels (sort, scans, scatters, fills). At decode sizes those
launches cost more than the work (about half of the MoE layer's time at 1
token, measured: docs/kernel-notes.md#moe-alignment). This file computes the same
three tensors, equal element for element, in one launch, every pair in one
tile (no loop over chunks of pairs):

    fill     sorted_pair = -1
    count    pairs per local expert: a histogram
    scan     padded run starts, each expert's first place among the sorted pairs,
             cumulative block counts
    place    one sort of (expert, pair) keys: a pair's row = its expert's start +
             its rank - the expert's first place (the stable order of the torch path)
    blocks   the expert of block b = how many experts end at or before it: a
             histogram of the experts' block ends, summed up

With a shared expert run in the same launches, its id (shared_id, past every
routed id) is one more local expert after the routed ones.

One program holds every pair, so it is for small pair counts only
(`align_fits(pairs)`). `align_by_expert_chunked` does the same steps over
chunks of pairs in two launches: the counts of every chunk first, then each
chunk's places after the runs and the earlier chunks' pairs. `align_with_triton`
picks between them: the one program up to ONE_PROGRAM_PAIRS, chunks past it
(measured: docs/kernel-notes.md#moe-alignment). The sort replaced a
counting loop over chunks of 64 pairs with one-hot sums, 2-13x faster at
5-1000 pairs. The pair count and the expert count are compile-time constants
(one compile per token-count bucket).
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

# The one program's limit: it holds a sort of every pair (64 tokens x top-4 + the shared slot =
# 320 pairs at decode).
MAX_PAIRS = 4096
# Up to here the one program, past it the chunks. One H100 (2026-12-05): the one program 5.0 / 7.7 /
# 8.2 us at 320 / 640 / 1020 pairs, chunks of 256 pairs 6.1-6.2 at each; one H200: the one program
# 4.6 / 7.4 / 7.7 us at 320 / 640 / 1000 and 48-50 at 2560-4095, chunks 5.9-6.2 at 2560-4095.
ONE_PROGRAM_PAIRS = 512


def align_fits(pairs: int) -> bool:
    return HAVE_TRITON and 0 < pairs <= MAX_PAIRS


def chunk_pairs(pairs: int) -> int:
    """Pairs per program of the chunked alignment: 256 up to 16384 pairs, 1024 past them (each
    program reads every chunk's counts, so many small chunks lose there; measured best at 2560-81920
    pairs among 256 / 512 / 1024 / 2048)."""
    return 256 if pairs <= 16384 else 1024


if HAVE_TRITON:

    @triton.jit
    def _local_expert(ids_ptr, pair, ok, expert_offset, shared_id, N_LOCAL: tl.constexpr, ROUTED: tl.constexpr):
        """Each pair's local expert: its id - expert_offset for this rank's routed experts, ROUTED
        for the shared expert's slot, N_LOCAL ("not ours") for the rest."""
        raw = tl.load(ids_ptr + pair, mask=ok, other=-1).to(tl.int64)
        e = raw - expert_offset
        e = tl.where((e >= 0) & (e < ROUTED), e, N_LOCAL)
        return tl.where(raw == shared_id, ROUTED, e).to(tl.int32)

    @triton.jit
    def _place_pairs(e, ok, lane, pair0, start, first, sorted_pair_ptr, pair_row_ptr, N_LOCAL: tl.constexpr,
                     NB: tl.constexpr, P2: tl.constexpr, AFTER_OWN_FILL: tl.constexpr):
        """Pairs pair0 + lane (experts e) into their rows: sorted by (expert, pair), a pair's place
        among its expert's is its rank minus the expert's first place (first), after the expert's
        first row (start); lanes not ok sort after every pair and store nothing. AFTER_OWN_FILL:
        this program filled the rows with -1, so its threads wait for each other's fill first."""
        key = tl.sort(tl.where(ok, e, NB) * P2 + lane)
        se = key // P2
        pair = pair0 + key % P2
        sc = tl.minimum(se, NB - 1)
        row = tl.gather(start, sc, 0) + lane - tl.gather(first, sc, 0)
        local = se < N_LOCAL
        if AFTER_OWN_FILL:
            tl.debug_barrier()
        tl.store(sorted_pair_ptr + row, pair, mask=local)
        tl.store(pair_row_ptr + pair, tl.where(local, row, -1), mask=se < NB)

    @triton.jit
    def _block_table(padded, mine, block_expert_ptr, BM: tl.constexpr, MAX_BLOCKS: tl.constexpr, B2: tl.constexpr):
        """The expert of block b = how many local experts' padded runs end at or before it."""
        ends = tl.cumsum(padded // BM, axis=0)
        hist = tl.histogram(ends, B2, mask=mine & (ends < B2))
        b = tl.arange(0, B2)
        tl.store(block_expert_ptr + b, tl.cumsum(hist, axis=0), mask=b < MAX_BLOCKS)

    @triton.jit
    def _align_pairs(
        ids_ptr, sorted_pair_ptr, block_expert_ptr, pair_row_ptr, expert_offset, shared_id,
        PAIRS: tl.constexpr, P2: tl.constexpr, N_LOCAL: tl.constexpr, ROUTED: tl.constexpr, NB: tl.constexpr,
        BM: tl.constexpr, MAX_ROWS: tl.constexpr, MAX_BLOCKS: tl.constexpr, B2: tl.constexpr, FILL: tl.constexpr,
    ):
        """Every pair at once (P2 >= PAIRS lanes): a histogram for the counts, one sort of
        (expert, pair) keys for the places, a histogram of the experts' block ends for the
        blocks; no loop over chunks."""
        lane = tl.arange(0, P2)
        ok = lane < PAIRS
        e = _local_expert(ids_ptr, lane, ok, expert_offset, shared_id, N_LOCAL, ROUTED)
        # fill: every row starts as padding
        for r0 in range(0, MAX_ROWS, FILL):
            rows = r0 + tl.arange(0, FILL)
            tl.store(sorted_pair_ptr + rows, tl.full((FILL,), -1, tl.int32), mask=rows < MAX_ROWS)
        # count, scan
        bins = tl.arange(0, NB)  # local experts 0..N_LOCAL-1; bin N_LOCAL = "not ours"
        counts = tl.histogram(e, NB, mask=ok)
        mine = bins < N_LOCAL
        padded = tl.where(mine, (counts + BM - 1) // BM * BM, 0)
        start = tl.cumsum(padded, axis=0) - padded  # each expert's first row
        first = tl.cumsum(counts, axis=0) - counts  # its first place in the sorted pairs
        _place_pairs(e, ok, lane, 0, start, first, sorted_pair_ptr, pair_row_ptr, N_LOCAL, NB, P2, True)
        _block_table(padded, mine, block_expert_ptr, BM, MAX_BLOCKS, B2)

    @triton.jit
    def _align_kernel(
        ids_ptr, sorted_pair_ptr, block_expert_ptr, pair_row_ptr, expert_offset, shared_id,
        PAIRS: tl.constexpr, P2: tl.constexpr, N_LOCAL: tl.constexpr, ROUTED: tl.constexpr, NB: tl.constexpr,
        BM: tl.constexpr, MAX_ROWS: tl.constexpr, MAX_BLOCKS: tl.constexpr, B2: tl.constexpr, FILL: tl.constexpr,
    ):
        _align_pairs(ids_ptr, sorted_pair_ptr, block_expert_ptr, pair_row_ptr, expert_offset, shared_id,
                     PAIRS, P2, N_LOCAL, ROUTED, NB, BM, MAX_ROWS, MAX_BLOCKS, B2, FILL)


def one_program_outputs(pairs: int, n_local: int, block_m: int, shared_id: int, device: torch.device):
    """The one program's outputs (sorted_pair, block_expert, pair_row), its compile-time
    constants and warp count, for `_align_pairs` in any kernel that runs it."""
    routed = n_local
    if shared_id >= 0:
        n_local += 1
    if not align_fits(pairs):
        raise ValueError(f"align_by_expert_triton: {pairs} pairs; one program handles 1..{MAX_PAIRS}")
    max_rows = -(-(pairs + n_local * (block_m - 1)) // block_m) * block_m
    max_blocks = max_rows // block_m
    outputs = (torch.empty(max_rows, dtype=torch.int32, device=device),
               torch.empty(max_blocks, dtype=torch.int32, device=device),
               torch.empty(pairs, dtype=torch.int32, device=device))
    p2 = triton.next_power_of_2(pairs)
    constants = dict(PAIRS=pairs, P2=p2, N_LOCAL=n_local, ROUTED=routed, NB=triton.next_power_of_2(n_local + 1),
                     BM=block_m, MAX_ROWS=max_rows, MAX_BLOCKS=max_blocks, B2=triton.next_power_of_2(max_blocks),
                     FILL=1024)
    return outputs, constants, 4 if p2 <= 256 else 8 if p2 <= 1024 else 16


def align_by_expert_triton(ids: torch.Tensor, expert_offset: int, n_local: int, block_m: int,
                           shared_id: int = -2):
    """(sorted_pair, block_expert, pair_row) as kernels/moe_triton.align_by_expert returns them
    (shared_id >= 0: that id is one more local expert, n_local)."""
    outputs, constants, warps = one_program_outputs(ids.numel(), n_local, block_m, shared_id, ids.device)
    _align_kernel[(1,)](ids.reshape(-1).contiguous(), *outputs, int(expert_offset), int(shared_id), **constants,
                        num_warps=warps)
    return outputs


# ---- past one program's pairs: chunks of pairs, two launches ----
if HAVE_TRITON:

    @triton.jit
    def _chunk_counts_kernel(ids_ptr, counts_ptr, sorted_pair_ptr, expert_offset, shared_id, share,
                             PAIRS: tl.constexpr, N_LOCAL: tl.constexpr, ROUTED: tl.constexpr, NB: tl.constexpr,
                             C: tl.constexpr, MAX_ROWS: tl.constexpr, FILL: tl.constexpr):
        """Chunk c's pairs per local expert (counts[c]), and its share of the rows filled with -1
        (padding) before the second launch places the pairs."""
        c = tl.program_id(0)
        pair = c * C + tl.arange(0, C)
        ok = pair < PAIRS
        e = _local_expert(ids_ptr, pair, ok, expert_offset, shared_id, N_LOCAL, ROUTED)
        tl.store(counts_ptr + c * NB + tl.arange(0, NB), tl.histogram(e, NB, mask=ok))
        end = tl.minimum((c + 1) * share, MAX_ROWS)
        for r0 in range(c * share, end, FILL):
            rows = r0 + tl.arange(0, FILL)
            tl.store(sorted_pair_ptr + rows, tl.full((FILL,), -1, tl.int32), mask=rows < end)

    @triton.jit
    def _chunk_place_kernel(ids_ptr, counts_ptr, sorted_pair_ptr, block_expert_ptr, pair_row_ptr, expert_offset,
                            shared_id, PAIRS: tl.constexpr, N_LOCAL: tl.constexpr, ROUTED: tl.constexpr,
                            NB: tl.constexpr, BM: tl.constexpr, MAX_BLOCKS: tl.constexpr, B2: tl.constexpr,
                            C: tl.constexpr, CHUNKS: tl.constexpr, RB: tl.constexpr):
        """Chunk c's pairs into their rows: an expert's run starts where the padded runs before it
        end, then come its pairs of the earlier chunks, then this chunk's in pair order (the torch
        path's stable sort). Program 0 also writes the expert of every block."""
        c = tl.program_id(0)
        bins = tl.arange(0, NB)
        counts = tl.zeros((NB,), tl.int32)
        before = tl.zeros((NB,), tl.int32)
        own = tl.zeros((NB,), tl.int32)
        for c0 in range(0, CHUNKS, RB):
            ch = c0 + tl.arange(0, RB)
            table = tl.load(counts_ptr + ch[:, None] * NB + bins[None, :], mask=(ch < CHUNKS)[:, None], other=0)
            counts += tl.sum(table, axis=0)
            before += tl.sum(tl.where((ch < c)[:, None], table, 0), axis=0)
            own += tl.sum(tl.where((ch == c)[:, None], table, 0), axis=0)
        mine = bins < N_LOCAL
        padded = tl.where(mine, (counts + BM - 1) // BM * BM, 0)
        start = tl.cumsum(padded, axis=0) - padded + before  # this chunk's first row of each expert
        first = tl.cumsum(own, axis=0) - own  # each expert's first place among the chunk's sorted pairs
        lane = tl.arange(0, C)
        ok = c * C + lane < PAIRS
        e = _local_expert(ids_ptr, c * C + lane, ok, expert_offset, shared_id, N_LOCAL, ROUTED)
        _place_pairs(e, ok, lane, c * C, start, first, sorted_pair_ptr, pair_row_ptr, N_LOCAL, NB, C, False)
        if c == 0:
            _block_table(padded, mine, block_expert_ptr, BM, MAX_BLOCKS, B2)


def align_by_expert_chunked(ids: torch.Tensor, expert_offset: int, n_local: int, block_m: int,
                            shared_id: int = -2, chunk: int | None = None):
    """align_by_expert_triton for any pair count: chunks of `chunk` pairs (a power of two; by
    default chunk_pairs), one program each, in two launches (the counts, then the places); equal
    output."""
    pairs = ids.numel()
    chunk = chunk_pairs(pairs) if chunk is None else chunk
    if pairs == 0 or chunk & (chunk - 1):
        raise ValueError(f"align_by_expert_chunked: {pairs} pairs, chunk {chunk} (needs pairs and a power-of-two chunk)")
    routed = n_local
    if shared_id >= 0:
        n_local += 1
    max_rows = -(-(pairs + n_local * (block_m - 1)) // block_m) * block_m
    max_blocks = max_rows // block_m
    chunks = -(-pairs // chunk)
    nb = triton.next_power_of_2(n_local + 1)
    dev = ids.device
    ids = ids.reshape(-1).contiguous()
    counts = torch.empty(chunks, nb, dtype=torch.int32, device=dev)
    sorted_pair = torch.empty(max_rows, dtype=torch.int32, device=dev)
    block_expert = torch.empty(max_blocks, dtype=torch.int32, device=dev)
    pair_row = torch.empty(pairs, dtype=torch.int32, device=dev)
    warps = 4 if chunk <= 256 else 8 if chunk <= 1024 else 16
    _chunk_counts_kernel[(chunks,)](
        ids, counts, sorted_pair, int(expert_offset), int(shared_id), -(-max_rows // chunks),
        PAIRS=pairs, N_LOCAL=n_local, ROUTED=routed, NB=nb, C=chunk, MAX_ROWS=max_rows, FILL=1024, num_warps=warps)
    _chunk_place_kernel[(chunks,)](
        ids, counts, sorted_pair, block_expert, pair_row, int(expert_offset), int(shared_id),
        PAIRS=pairs, N_LOCAL=n_local, ROUTED=routed, NB=nb, BM=block_m, MAX_BLOCKS=max_blocks,
        B2=triton.next_power_of_2(max_blocks), C=chunk, CHUNKS=chunks, RB=16, num_warps=warps)
    return sorted_pair, block_expert, pair_row


def align_with_triton(ids: torch.Tensor, expert_offset: int, n_local: int, block_m: int, shared_id: int = -2):
    """The layout from Triton at any pair count: the one program up to ONE_PROGRAM_PAIRS, chunks past it."""
    if ids.numel() <= ONE_PROGRAM_PAIRS:
        return align_by_expert_triton(ids, expert_offset, n_local, block_m, shared_id)
    return align_by_expert_chunked(ids, expert_offset, n_local, block_m, shared_id)
