"""kernels/moe_expert_groups.py: the per-block table of the programs' groups by expert, against a
plain Python walk over the runs; and the mapping the kernels make of it is a bijection."""

from __future__ import annotations

import random

import pytest
import torch

from interpreted import INTERPRETING, in_child, run_this_file_interpreted
from minimax_backend.kernels import moe_expert_groups as G
from minimax_backend.kernels.moe_expert_groups import expert_group_table, with_expert_groups


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


def _random_runs(rng: random.Random, n: int) -> list[int]:
    experts: list[int] = []
    while len(experts) < n + 3:  # the table may be longer than the blocks asked for
        experts += [rng.randint(0, 9)] * rng.randint(1, 9)
    return experts


def _torch_form(experts: torch.Tensor, n: int, cap: int) -> torch.Tensor:
    return torch.cat([experts[:n], expert_group_table(experts, n, cap).reshape(-1)])


def test_with_expert_groups_is_the_experts_then_the_table():
    """Off the GPU and the interpreter: the torch ops, laid out as the kernels read them."""
    rng = random.Random(1)
    for _ in range(50):
        n, cap = rng.randint(1, 40), rng.randint(1, 9)
        experts = torch.tensor(_random_runs(rng, n), dtype=torch.int32)
        got = with_expert_groups(experts, n, cap)
        assert got.dtype == torch.int32 and torch.equal(got, _torch_form(experts, n, cap))
    with pytest.raises(ValueError, match="cap"):
        with_expert_groups(torch.zeros(4, dtype=torch.int32), 4, 0)
    with pytest.raises(ValueError, match="5 blocks"):
        with_expert_groups(torch.zeros(4, dtype=torch.int32), 5, 2)


class _CountedLaunches:
    """Stands in for a Triton kernel: counts its launches and forwards them."""

    def __init__(self, kernel):
        self.kernel, self.grids = kernel, []

    def __getitem__(self, grid):
        self.grids.append(grid)
        return self.kernel[grid]


@in_child
def test_the_triton_program_equals_the_torch_ops(monkeypatch):
    """The one-program kernel against the torch ops: runs crossing the power-of-two width's end, one
    run over every block, every block its own run, caps 1 to past the longest run; 1 to 600 blocks,
    as M3's layouts have at prefill sizes (idle blocks: a last run of the sentinel)."""
    rng = random.Random(2)
    counted = _CountedLaunches(G._groups_kernel)
    monkeypatch.setattr(G, "_groups_kernel", counted)
    cases = [(_random_runs(rng, n), n, cap) for n in (1, 2, 3, 63, 64, 65, 127, 255, 333, 600)
             for cap in (1, 3, 8, 1000)]
    cases += [([4] * 70, 70, 8), (list(range(70)), 70, 8), ([0] * 5 + [1] * 64 + [129] * 30, 99, 8)]
    for experts, n, cap in cases:
        table = torch.tensor(experts, dtype=torch.int32)
        assert torch.equal(with_expert_groups(table, n, cap), _torch_form(table, n, cap)), (n, cap)
    assert len(counted.grids) == len(cases)  # every case ran the kernel, none the torch ops


@pytest.mark.skipif(INTERPRETING, reason="this is the child")
def test_in_interpreter_child():
    pytest.importorskip("triton")
    run_this_file_interpreted(__file__)


@pytest.mark.gpu
def test_gpu_triton_program_equals_the_torch_ops():
    if not torch.cuda.is_available():
        pytest.skip("needs a GPU")
    rng = random.Random(3)
    for n in (1, 129, 151, 560, 1409, 5000):
        experts = torch.tensor(sorted(_random_runs(rng, n)), dtype=torch.int32)
        for cap in (1, 4, 8):
            got = with_expert_groups(experts.cuda(), n, cap).cpu()
            assert torch.equal(got, _torch_form(experts, n, cap)), (n, cap)
