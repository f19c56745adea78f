"""The grouped MoE GEMMs' program order by expert: each group is one expert's row blocks.

With groups of a fixed number of row blocks (tile_config's GROUP_M), a group boundary falls
inside an expert's run of blocks wherever the run is not a multiple of the group size, and
that expert's weight column tiles are then read by two groups, a whole sweep of the column
tiles apart; its weights (37.7 MB of gate/up at M3's width) do not stay in a 50 MB L2 that
long. Groups that follow the experts read each weight tile once for all the expert's blocks.
Runs longer than `cap` blocks (the shared expert's, one block per 64 tokens) are cut into
groups of `cap`, so the activations of a group still fit in L2 across its column tiles.

The kernels find a program's group from a per-block table (kernels/moe_triton.py:_tile_of,
GROUP_M = -1): for block b, the first block of its group and the group's size. Programs of a
group are [first * n_tiles, (first + size) * n_tiles), so pid // n_tiles is a block of the
group and its table entry names the group. Built here with a few fixed-size torch ops (no
host sync, CUDA-graph safe), or by one Triton program (with_expert_groups, what the GEMMs read:
the experts and the table in one tensor): 30-40 us less per layer call than the ~18 small
launches. tile_config's table uses it at prefill sizes (at most 8 blocks a group: 1-4% faster
than groups of 4 back to back on the H200, 2026-12-03); the kernel option moe_expert_groups sets
the cap anywhere. Both measured: docs/kernel-notes.md#moe-at-the-power-limit.
"""

from __future__ import annotations

import torch

from .interpreter import triton_interpreting

try:
    import triton
    import triton.language as tl

    HAVE_TRITON = True
except ImportError:  # pragma: no cover
    HAVE_TRITON = False

__all__ = ["expert_group_table", "with_expert_groups"]

# one program holds every block: a few hundred to a few thousand at M3's sizes (8192 blocks of 64
# rows are ~100k tokens); longer tables take the torch ops
MAX_BLOCKS_ONE_PROGRAM = 8192


def _check_arguments(who: str, block_expert: torch.Tensor, num_blocks: int, cap: int) -> None:
    if cap < 1:
        raise ValueError(f"{who}: cap must be >= 1, got {cap}")
    if num_blocks < 1 or block_expert.numel() < num_blocks:
        raise ValueError(f"{who}: {num_blocks} blocks asked of a table of {block_expert.numel()}")


def groups_kernel_warps(width: int) -> int:
    """Warps of _groups_kernel's one program over `width` (a power of two) blocks."""
    return 4 if width <= 2048 else 8


def expert_group_table(block_expert: torch.Tensor, num_blocks: int, cap: int) -> torch.Tensor:
    """[num_blocks, 2] int32: each block's group's first block and size, where a group is a run
    of consecutive blocks of one expert (block_expert[:num_blocks]), cut every `cap` blocks."""
    _check_arguments("expert_group_table", block_expert, num_blocks, cap)
    be = block_expert[:num_blocks]
    idx = torch.arange(num_blocks, device=be.device)
    starts = torch.ones(num_blocks, dtype=torch.bool, device=be.device)
    starts[1:] = be[1:] != be[:-1]
    run_start = torch.cummax(torch.where(starts, idx, 0), 0).values
    # the next run's first block after b (num_blocks past the last run)
    next_start = torch.where(starts, idx, num_blocks)
    next_start = torch.cat([next_start[1:], next_start.new_full((1,), num_blocks)])
    run_end = torch.flip(torch.cummin(torch.flip(next_start, [0]), 0).values, [0])
    first = run_start + (idx - run_start) // cap * cap
    size = torch.clamp(run_end - first, max=cap)
    return torch.stack([first, size], 1).to(torch.int32)


def with_expert_groups(block_expert: torch.Tensor, num_blocks: int, cap: int) -> torch.Tensor:
    """[3 * num_blocks] int32 as the kernels read it (_tile_of, GROUP_M -1): the first num_blocks
    entries of block_expert, then expert_group_table's rows flattened. One Triton launch on the GPU
    (or in the interpreter), the torch ops elsewhere; the same values."""
    _check_arguments("with_expert_groups", block_expert, num_blocks, cap)
    if (HAVE_TRITON and (block_expert.is_cuda or triton_interpreting()) and num_blocks <= MAX_BLOCKS_ONE_PROGRAM
            and block_expert.dtype == torch.int32 and block_expert.is_contiguous()):
        out = torch.empty(3 * num_blocks, dtype=torch.int32, device=block_expert.device)
        width = triton.next_power_of_2(num_blocks)
        _groups_kernel[(1,)](block_expert, out, num_blocks, cap, B2=width, num_warps=groups_kernel_warps(width))
        return out
    groups = expert_group_table(block_expert, num_blocks, cap).to(block_expert.dtype)
    return torch.cat([block_expert[:num_blocks], groups.reshape(-1)])


if HAVE_TRITON:

    @triton.jit
    def _larger(a, b):
        return tl.maximum(a, b)

    @triton.jit
    def _smaller(a, b):
        return tl.minimum(a, b)

    @triton.jit
    def _groups_kernel(be_ptr, out_ptr, num_blocks, cap, B2: tl.constexpr):
        """Every block at once: a run starts where the expert differs from the block before and ends
        where it differs from the block after; a running max of the starts and a reversed running min
        of the ends give each block its run, cut every `cap` blocks from the run's start."""
        b = tl.arange(0, B2)
        ok = b < num_blocks
        expert = tl.load(be_ptr + b, mask=ok, other=0)
        before = tl.load(be_ptr + b - 1, mask=ok & (b > 0), other=0)
        after = tl.load(be_ptr + b + 1, mask=b + 1 < num_blocks, other=0)
        starts = ok & ((b == 0) | (expert != before))
        ends = (b + 1 >= num_blocks) | (expert != after)  # past the blocks: an end, never the first one
        run_start = tl.associative_scan(tl.where(starts, b, 0), 0, _larger)
        run_end = tl.associative_scan(tl.where(ends, b + 1, B2 + 1), 0, _smaller, reverse=True)
        first = run_start + (b - run_start) // cap * cap
        size = tl.minimum(run_end - first, cap)
        tl.store(out_ptr + b, expert, mask=ok)
        tl.store(out_ptr + num_blocks + 2 * b, first, mask=ok)
        tl.store(out_ptr + num_blocks + 2 * b + 1, size, mask=ok)
