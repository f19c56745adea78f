"""tools/bench_moe.py on the CPU (tiny-m3): the limit columns. Its timings mean nothing here; this
checks that each row says which limit binds it (the weight-read floor or the plain GEMM's rate)."""

from __future__ import annotations

import argparse

import pytest
import torch

from minimax_backend.tools import bench_moe


def job_rows(monkeypatch, **args) -> list[dict]:
    """bench_moe's rows from one run of its job on the CPU (tiny-m3, BF16), `args` replacing the defaults."""
    defaults = dict(device="cpu", warmup=1, repeats=2, precisions=["bf16"], preset="tiny-m3", tokens=[5],
                    eager_max_tokens=0, eager_max_tokens_fp8=0, cuda_graph=False, sustained=0.0, b2b_max_tokens=64,
                    json=None)
    captured = {}
    real = bench_moe._precision_rows

    def spy(*a):
        real(*a)
        captured["rows"] = a[-1]

    monkeypatch.setattr(bench_moe, "_precision_rows", spy)
    with torch.no_grad():
        bench_moe.job(0, 1, argparse.Namespace(**{**defaults, **args}))
    return captured["rows"]


def test_rows_carry_the_bound_of_both_limits(monkeypatch):
    rows = job_rows(monkeypatch, tokens=[1, 9])
    assert [r["tokens"] for r in rows] == [1, 9]
    for row in rows:
        compute_us = row["flops"] / (row["plain_gemm_tflops"] * 1e6)
        assert row["bound_us"] == pytest.approx(max(row["floor_us"], compute_us))
        assert row["ours_over_bound"] <= row["ours_over_floor"] * (1 + 1e-9)
        assert "ours_b2b_ms" not in row  # back-to-back graphs only on a GPU
