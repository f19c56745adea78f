"""tools/bench_weight_stream.py and kernels/moe_weight_stream.py: the rings that fit, the errors
for those that do not and for bad input, and on a Hopper GPU a stream that reads every byte (its
rate cannot beat the same run's copy rate)."""

from __future__ import annotations

import pytest
import torch

from minimax_backend.kernels import moe_weight_stream as ws
from minimax_backend.tools import bench_weight_stream as bench


def test_ring_bytes_are_the_stages_tiles():
    assert ws.ring_shared_bytes(4, 0) == 4 * 128 * 128
    assert ws.ring_shared_bytes(4, 3) == 4 * (128 * 128 + 3 * 64 * 128)  # the gate/up's 40 KB stages


@pytest.mark.parametrize("stages, a_tiles, programs, words", [
    (1, 0, 1, "at least 2"),
    (4, 4, 1, "0 to 3"),
    (4, 0, 0, "programs per SM"),
    (6, 3, 1, "shared memory"),  # 240 KB
    (4, 3, 2, "shared memory"),  # two 160 KB rings
])
def test_rings_that_cannot_run_are_named(stages, a_tiles, programs, words):
    with pytest.raises(ValueError, match=words):
        ws.check_ring(stages, a_tiles, programs)


def test_the_benchmark_lists_what_it_skips():
    run, skipped = bench._rings([2, 5, 6], [0, 3], [1, 2])
    assert (0, 2, 2) in run and (3, 5, 1) in run
    assert (3, 6, 1) not in run and (3, 5, 2) not in run
    assert len(run) + len(skipped) == 12
    assert all("shared memory" in line for line in skipped)


def test_the_benchmark_says_what_it_needs():
    with pytest.raises(SystemExit, match="multiples of 128"):
        bench.main(["--rows", "100"])
    if not torch.cuda.is_available():
        with pytest.raises(SystemExit, match="sm_90"):
            bench.main([])


def test_stream_weights_needs_a_hopper_gpu():
    if torch.cuda.is_available() and ws.gluon_available(torch.device("cuda")):
        pytest.skip("a Hopper GPU is here: the GPU test below covers it")
    w = torch.zeros(128, 128, dtype=torch.float8_e4m3fn)
    with pytest.raises(RuntimeError, match="sm_90"):
        ws.stream_weights(w, torch.zeros(192, 128, dtype=torch.float8_e4m3fn), 4, 0)


@pytest.mark.gpu
def test_gpu_stream_reads_every_byte():
    """1 GiB of weights (8191 slabs: odd, more than the programs) streamed through rings of
    2 and 4 stages with 0 and 3 activation tiles: each finishes, its weight rate below 1.3x the
    copy bandwidth (the HBM's peak is ~1.15x it on an H100 / H200, so a ring that skipped loads
    would report more), and bad shapes are refused."""
    from minimax_backend.tools.bench_common import copy_bandwidth_gbs, median_ms

    device = torch.device("cuda")
    if not ws.gluon_available(device):
        pytest.skip("needs triton's Gluon and an sm_90 GPU")
    w = torch.randint(0, 256, (8191 * 128, 1024), dtype=torch.uint8, device=device).view(torch.float8_e4m3fn)
    rows = torch.randint(0, 256, (2 * 192, 1024), dtype=torch.uint8, device=device).view(torch.float8_e4m3fn)
    copy = copy_bandwidth_gbs(device)
    for stages, a_tiles in ((2, 0), (4, 0), (4, 3)):
        ms = median_ms(lambda: ws.stream_weights(w, rows, stages, a_tiles), warmup=2, repeats=5)
        assert w.numel() / ms / 1e6 < 1.3 * copy, (stages, a_tiles, ms)
    with pytest.raises(ValueError, match="multiples of 128"):
        ws.stream_weights(w[:100], rows, 4, 0)
    with pytest.raises(ValueError, match="192"):
        ws.stream_weights(w, rows[:100], 4, 3)
