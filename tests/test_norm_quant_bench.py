"""tools/bench_norm_quant.py runs end to end (on the CPU: --dry-run, Triton interpreter, gloo).

The numbers of a dry run mean nothing; this keeps the GPU benchmark's code
paths (tables, JSON, the 2-rank all-gather part) from rotting between GPU runs.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

pytest.importorskip("triton")


@pytest.mark.slow
def test_bench_dry_run(tmp_path):
    out = tmp_path / "bench.json"
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    cmd = [sys.executable, "-m", "minimax_backend.tools.bench_norm_quant", "--dry-run", "--json", str(out)]
    r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, (r.stdout[-4000:] + r.stderr[-4000:])
    data = json.loads(out.read_text())
    assert {"kernel", "gemm", "allgather", "copy_bandwidth_GBs", "hardware"} <= set(data)
    k = data["kernel"][0]
    assert k["scales_equal"] and k["residual_equal"] and k["other_layout_scales_equal"]
    assert any("split=True" in name for name in k["sweep_ms"])
    assert isinstance(data["gemm"][0]["triton_ms"], float)
    ag = data["allgather"][0]
    assert ag["fp8_eq_packed"] and 0.5 < ag["ag_bytes_ratio"] < 0.53  # (1 + 4/128) / 2
