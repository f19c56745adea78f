"""tools/bench_norm_quant.py runs end to end (on the CPU: --dry-run, Triton interpreter, gloo).

The numbers of a dry run mean nothing; this keeps the GPU benchmark's code
paths (tables, JSON, the 2-rank all-gather part) from rotting between GPU runs.
"""

from __future__ import annotations

import json
import os
import sys

import pytest

import background

pytest.importorskip("triton")

background.register(__file__, "test_bench_dry_run", lambda out: (
    [sys.executable, "-m", "minimax_backend.tools.bench_norm_quant", "--dry-run", "--json", str(out / "bench.json")],
    {**os.environ, "TRITON_INTERPRET": "1"}))


@pytest.mark.slow
def test_bench_dry_run():
    r = background.result(__file__, "test_bench_dry_run")  # started ahead, in the background
    assert r.returncode == 0, r.tail()
    data = json.loads((r.out / "bench.json").read_text())
    assert {"kernel", "gemm", "allgather", "copy_bandwidth_GBs", "hardware"} <= set(data)
    k = data["kernel"][0]
    assert k["scales_equal"] and k["residual_equal"] and k["other_layout_scales_equal"]
    assert any("split=True" in name for name in k["sweep_ms"])
    assert isinstance(data["gemm"][0]["triton_ms"], float)
    ag = data["allgather"][0]
    assert ag["fp8_eq_packed"] and 0.5 < ag["ag_bytes_ratio"] < 0.53  # (1 + 4/128) / 2
