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


def test_output_differences_see_a_changed_scale():
    """The fused-vs-unfused comparison (GPU runs) on the op's real outputs: zero for equal ones,
    and a doubled block scale shows in the dequantized rows and the scale check."""
    import torch

    import minimax_backend.kernels  # noqa: F401
    from minimax_backend.tools.bench_allreduce_norm import _differences, _inputs

    x, residual, weight = _inputs(0, 5, 256, torch.device("cpu"))
    out = torch.ops.minimax.allreduce_rms_norm_quant(x, residual, weight, 1e-6, True, 128, False, 1, "")
    same = _differences(out, out)
    assert same == {"fp8_max_rel_diff": 0.0, "fp8_bytes_differing": 0, "scales_equal": True, "residual_equal": True}
    q, s, y, r = out
    s2 = s.clone()
    s2[2, 1] *= 2
    off = _differences((q, s2, y, r), out)
    assert off["fp8_max_rel_diff"] > 0.1 and not off["scales_equal"] and off["residual_equal"]
