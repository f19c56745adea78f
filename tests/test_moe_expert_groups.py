"""kernels/moe_expert_groups.py: the per-block table of the programs' groups by expert, against a
plain Python walk over the runs; and the mapping the kernels make of it is a bijection."""

from __future__ import annotations

import random

import pytest
import torch

from minimax_backend.kernels.moe_expert_groups import expert_group_table


def _groups(experts: list[int], cap: int) -> list[tuple[int, int]]:
    """(first block, size) of each block's group: runs of one expert, cut every `cap` blocks."""
    out, i = [], 0
    while i < len(experts):
        j = i
        while j < len(experts) and experts[j] == experts[i]:
            j += 1
        for first in range(i, j, cap):
            size = min(cap, j - first)
            out += [(first, size)] * size
        i = j
    return out


def test_runs_and_caps_against_a_python_walk():
    rng = random.Random(0)
    for _ in range(300):
        n, cap = rng.randint(1, 40), rng.randint(1, 6)
        experts: list[int] = []
        while len(experts) < n + 3:  # the table may be longer than the blocks asked for
            experts += [rng.randint(0, 5)] * rng.randint(1, 9)
        got = expert_group_table(torch.tensor(experts, dtype=torch.int32), n, cap)
        assert got.dtype == torch.int32 and got.shape == (n, 2)
        assert [tuple(r) for r in got.tolist()] == _groups(experts[:n], cap), (experts[:n], cap)


def test_the_kernels_mapping_visits_every_tile_once():
    """_tile_of with GROUP_M -1: pid -> (block, column tile) through the table, for every pid."""
    experts = [0, 0, 0, 1, 2, 2, 2, 2, 2, 7, 7]  # 7: the idle blocks' sentinel after the used ones
    for cap in (1, 2, 3, 8):
        table = expert_group_table(torch.tensor(experts), len(experts), cap).tolist()
        for n_tiles in (1, 3, 48):
            seen = set()
            for pid in range(len(experts) * n_tiles):
                first, size = table[pid // n_tiles]
                local = pid - first * n_tiles
                seen.add((first + local % size, local // size))
            assert seen == {(b, t) for b in range(len(experts)) for t in range(n_tiles)}, (cap, n_tiles)


def test_bad_arguments_are_named():
    with pytest.raises(ValueError, match="cap"):
        expert_group_table(torch.zeros(4, dtype=torch.int32), 4, 0)
    with pytest.raises(ValueError, match="5 blocks"):
        expert_group_table(torch.zeros(4, dtype=torch.int32), 5, 2)
