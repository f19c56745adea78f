"""tools/bench_allreduce_norm.py on CPU (2 gloo ranks): the unfused op and the all-reduce are timed,
the fused path is reported as not run (it needs GPUs), and bad arguments are refused."""

from __future__ import annotations

import json
import math

import pytest


def test_bench_allreduce_norm_smoke_on_cpu(tmp_path):
    from minimax_backend.tools import bench_allreduce_norm

    out = tmp_path / "ar.json"
    bench_allreduce_norm.main(["--device", "cpu", "--tp", "2", "--tokens", "3", "8", "--hidden", "256",
                               "--repeats", "2", "--warmup", "1", "--json", str(out)])
    d = json.loads(out.read_text())
    assert d["tp"] == 2 and [r["tokens"] for r in d["rows"]] == [3, 8]
    assert "needs CUDA" in d["fused_not_run"]
    for row in d["rows"]:
        assert math.isfinite(row["unfused_us"]) and row["unfused_us"] > 0 and row["allreduce_us"] > 0
        assert row["fused_us"] is None  # not run, and not faked


@pytest.mark.parametrize("argv, message", [(["--tp", "1"], "at least 2"), (["--tokens", "0"], ">= 1"),
                                           (["--hidden", "100"], "multiple of 128")])
def test_bench_allreduce_norm_rejects_bad_arguments(argv, message):
    from minimax_backend.tools import bench_allreduce_norm

    with pytest.raises(SystemExit, match=message):
        bench_allreduce_norm.main(["--device", "cpu", *argv])
