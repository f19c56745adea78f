"""tools/bench_fp8_decode_gemm.py runs end to end on the CPU (--dry-run: Triton interpreter,
shapes divided by 24). Its numbers mean nothing; this keeps the GPU benchmark's code paths
(the small-M kernel, the sweep, the table, the JSON) from rotting between GPU runs."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

import background

pytest.importorskip("triton")

background.register(__file__, "test_bench_dry_run", lambda out: (
    [sys.executable, "-m", "minimax_backend.tools.bench_fp8_decode_gemm", "--dry-run", "--rows", "1", "3", "--sweep",
     "--sweep-rows", "1", "--json", str(out / "fp8_decode_gemm.json")],
    {**os.environ, "TRITON_INTERPRET": "1"}))


@pytest.mark.slow
def test_bench_dry_run():
    r = background.result(__file__, "test_bench_dry_run")  # started ahead, in the background
    assert r.returncode == 0, r.tail()
    data = json.loads((r.out / "fp8_decode_gemm.json").read_text())
    rows = data["rows"]
    assert [(r["gemm"], r["rows"]) for r in rows[:2]] == [("qkv", 1), ("qkv", 3)]
    assert {r["gemm"] for r in rows} == {"qkv", "o_proj", "dense_gate_up", "dense_down"}
    for r in rows:
        assert r["small_m_ms"] > 0 and r["op_ms"] > 0 and r["floor_ms"] > 0 and "cublas_ms" not in r
    assert all("sweep_best_config" in r for r in rows if r["rows"] == 1)
    assert len(data["sweep"]) == 4 * 3 and all("ms" in s for s in data["sweep"])


def test_needs_the_interpreter_for_a_dry_run():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    cmd = [sys.executable, "-m", "minimax_backend.tools.bench_fp8_decode_gemm", "--dry-run"]
    r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode != 0 and "TRITON_INTERPRET=1" in r.stderr
