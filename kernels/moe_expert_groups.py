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
host sync, CUDA-graph safe). tile_config's table uses it for FP8 at prefill sizes (at most 8
blocks a group: 1-4% faster than groups of 4 back to back on the H200, 2026-12-03:
docs/kernel-notes.md#moe-at-the-power-limit); the kernel option moe_expert_groups sets the cap
anywhere.
"""

from __future__ import annotations

import torch

__all__ = ["expert_group_table"]


def expert_group_table(block_expert: torch.Tensor, num_blocks: int, cap: int) -> torch.Tensor:
    """[num_blocks, 2] int32: each block's group's first block and size, where a group is a run
    of consecutive blocks of one expert (block_expert[:num_blocks]), cut every `cap` blocks."""
    if cap < 1:
        raise ValueError(f"expert_group_table: cap must be >= 1, got {cap}")
    if num_blocks < 1 or block_expert.numel() < num_blocks:
        raise ValueError(f"expert_group_table: {num_blocks} blocks asked of a table of {block_expert.numel()}")
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
