"""tools/bench_align.py runs end to end on the CPU (--dry-run: Triton interpreter, small sizes).
Its numbers mean nothing; this keeps the GPU benchmark's code paths (every form, the equality
check against the torch path, the table, the JSON) from rotting between GPU runs."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

pytest.importorskip("triton")


def _run(*args, interpret=True):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    if interpret:
        env["TRITON_INTERPRET"] = "1"
    return subprocess.run([sys.executable, "-m", "minimax_backend.tools.bench_align", *args], env=env,
                          capture_output=True, text=True, timeout=600)


def test_bench_dry_run(tmp_path):
    out = tmp_path / "align.json"
    r = _run("--dry-run", "--tokens", "13", "--chunks", "16", "32", "--json", str(out))
    assert r.returncode == 0, (r.stdout[-4000:] + r.stderr[-4000:])
    (row,) = json.loads(out.read_text())["rows"]
    assert row["tokens"] == 13 and row["pairs"] == 65 and row["default_form"] == "one_program"
    for form in ("torch", "one_program", "chunks_16", "chunks_32", "default"):
        assert row[f"{form}_us"] > 0


def test_refuses_chunks_that_are_not_powers_of_two():
    r = _run("--dry-run", "--tokens", "13", "--chunks", "24")
    assert r.returncode != 0 and "powers of two" in r.stderr
