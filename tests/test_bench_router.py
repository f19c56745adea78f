"""tools/bench_router.py runs end to end on the CPU (--dry-run: Triton interpreter, small shapes).
Its numbers mean nothing; this keeps the GPU benchmark's code paths (both logits paths, the
errors, the sweep, the table, the JSON) from rotting between GPU runs."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

pytest.importorskip("triton")


def test_bench_dry_run(tmp_path):
    out = tmp_path / "router.json"
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    cmd = [sys.executable, "-m", "minimax_backend.tools.bench_router", "--dry-run", "--tokens", "17", "33",
           "--sweep", "--json", str(out)]
    r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, (r.stdout[-4000:] + r.stderr[-4000:])
    data = json.loads(out.read_text())
    assert [row["tokens"] for row in data["rows"]] == [17, 33]
    for row in data["rows"]:
        assert row["cublas_us"] > 0 and row["three_bf16_us"] > 0 and "limit_us" not in row
        # the same float32 products: both within float32 rounding of float64, the same experts chosen
        assert row["cublas_err"] < 1e-5 and row["three_bf16_err"] < 1e-5
        assert row["three_bf16_topk_equal"] == 1.0
        assert len(row["sweep_best_tiles"]) == 5
    assert len(data["sweep"]) == 2 * 2


def test_needs_the_interpreter_for_a_dry_run():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    r = subprocess.run([sys.executable, "-m", "minimax_backend.tools.bench_router", "--dry-run"], env=env,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode != 0 and "TRITON_INTERPRET=1" in r.stderr
