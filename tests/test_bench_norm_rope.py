"""tools/bench_norm_rope.py runs end to end on the CPU (--dry-run: Triton interpreter, small sizes).
Its numbers mean nothing; this keeps the GPU benchmark's code paths (both forms, the comparison
with the model's code, the launch sweep, the table, the JSON) from rotting between GPU runs."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

import background

pytest.importorskip("triton")

DRY_RUN_ARGS = ("--dry-run", "--tokens", "3", "--heads", "4", "--kv-heads", "2", "--head-dim", "64", "--rotary-dim", "32",
                "--sweep")
background.register(__file__, "test_bench_dry_run", lambda out: (
    [sys.executable, "-m", "minimax_backend.tools.bench_norm_rope", *DRY_RUN_ARGS, "--json", str(out / "norm_rope.json")],
    {**os.environ, "TRITON_INTERPRET": "1"}))


def _run(*args):
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    return subprocess.run([sys.executable, "-m", "minimax_backend.tools.bench_norm_rope", *args], env=env,
                          capture_output=True, text=True, timeout=600)


def test_bench_dry_run():
    r = background.result(__file__, "test_bench_dry_run")  # started ahead, in the background
    assert r.returncode == 0, r.tail()
    (row,) = json.loads((r.out / "norm_rope.json").read_text())["rows"]
    assert row["tokens"] == 3 and row["ours_equal_frac"] == 1.0 and row["ours_rel_err"] == 0.0
    assert row["inductor_us"] > 0 and row["ours_us"] > 0 and row["floor_us"] > 0 and len(row["sweep_us"]) == 20


def test_refuses_token_counts_below_one():
    r = _run("--dry-run", "--tokens", "0")
    assert r.returncode != 0 and "--tokens must be positive" in r.stderr
