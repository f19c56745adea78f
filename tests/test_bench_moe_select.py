"""tools/bench_moe_select.py runs end to end on the CPU (--dry-run: Triton interpreter, tiny-m3).
Its numbers mean nothing; this keeps the GPU benchmark's code paths (both forms, the bit-equality
check, the floor, the table, the JSON) from rotting between GPU runs."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

pytest.importorskip("triton")


def _run(*args):
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    return subprocess.run([sys.executable, "-m", "minimax_backend.tools.bench_moe_select", *args], env=env,
                          capture_output=True, text=True, timeout=600)


def test_bench_dry_run(tmp_path):
    out = tmp_path / "select.json"
    r = _run("--dry-run", "--tokens", "1", "7", "--precisions", "fp8", "--repeats", "1", "--json", str(out))
    assert r.returncode == 0, (r.stdout[-4000:] + r.stderr[-4000:])
    rows = json.loads(out.read_text())["rows"]
    assert [row["tokens"] for row in rows] == [1, 7]
    for row in rows:
        assert row["fused_taken"] and row["floor_us"] > 0
        assert row["separate_us"] > 0 and row["fused_plain_us"] > 0 and row["fused_us"] > 0


def test_refuses_zero_tokens():
    r = _run("--dry-run", "--tokens", "0")
    assert r.returncode != 0 and "at least 1" in r.stderr
