"""tools/bench_e2e.py runs end to end on CPU (2 gloo ranks, tiny FP8 model) and
writes the JSON the README table is made from."""

from __future__ import annotations

import json
import math

import pytest


@pytest.mark.slow
def test_bench_e2e_smoke_on_cpu(tmp_path):
    from minimax_backend.tools import bench_e2e

    out = tmp_path / "e2e.json"
    bench_e2e.main(["--device", "cpu", "--preset", "tiny-m3-fp8", "--tp", "2", "--ep", "2", "--prefill", "15",
                    "--decode-batch", "2", "--context", "32", "--variants", "torch-grouped", "minimax",
                    "--repeats", "1", "--warmup", "0", "--profile", "1", "--json", str(out)])
    d = json.loads(out.read_text())
    assert [(r["workload"], r["tokens"]) for r in d["rows"]] == [("prefill", 15), ("decode", 2)]
    for row in d["rows"]:
        for v in ("eager", "torch-grouped", "minimax"):  # eager: always added, the reference
            assert math.isfinite(row[f"{v}_ms"]) and row[f"{v}_ms"] > 0
            assert len(row[f"{v}_samples_ms"]) == 1  # every timed call kept (--repeats 1)
        assert 0.0 <= row["minimax_argmax"] <= 1.0 and math.isfinite(row["minimax_rel_err"])
        # the per-token errors: the median token's and the 90th percentile's, below the worst one
        assert 0.0 <= row["minimax_token_err_median"] <= row["minimax_token_err_p90"] <= row["minimax_rel_err"]
        assert row["minimax_x_vs_torch-grouped"] > 0
        # the baseline computes the same model (row-wise FP8 experts: a few percent off)
        assert row["torch-grouped_argmax"] >= 0.5 and row["torch-grouped_rel_err"] < 0.5
        for v in ("torch-grouped", "minimax"):  # --profile: the top ops of one call (ATen ops on CPU)
            assert row[f"{v}_kernels"] and row[f"{v}_kernel_us"] > 0
            assert all(k["us_per_call"] >= 0 and k["name"] for k in row[f"{v}_kernels"])
    prefill, decode = d["rows"]
    assert prefill["minimax_tflops"] > 0 and 0 < prefill["minimax_frac_of_gemm"]
    assert decode["floor_ms"] > 0 and decode["minimax_over_floor"] > 0
    # the floor's routed experts, counted per MoE layer in eager's step: 2 tokens x top-2, 4 local
    # experts per rank at EP 2
    assert len(decode["experts_touched"]) == 2 and all(0 <= n <= 4 for n in decode["experts_touched"])
    assert "experts_touched" not in prefill
    assert {"copy_gbs", "fp8_tflops", "bf16_tflops"} <= set(d["floors"])
    assert d["fp8"] is True and d["tp"] == 2 and d["ep"] == 2 and d["timing"].startswith("interleaved, each timed call after")
    assert d["prefill_logits"] == "last"  # the default: logits_to_keep=1, as a serving engine samples
    assert any(k.endswith("/minimax") for k in d["compiles"])


@pytest.mark.slow
def test_bench_e2e_at_one_rank_names_the_tokens_routed_otherwise(tmp_path):
    from minimax_backend.tools import bench_e2e

    out = tmp_path / "e2e.json"
    bench_e2e.main(["--device", "cpu", "--preset", "tiny-m3-fp8", "--prefill", "15", "--decode-batch", "3",
                    "--context", "32", "--variants", "torch-grouped", "minimax", "--repeats", "1", "--warmup", "0",
                    "--json", str(out)])
    for row in json.loads(out.read_text())["rows"]:
        assert isinstance(row["minimax_flipped_tokens"], int) and row["minimax_flipped_tokens"] >= 0
        assert row["minimax_rel_err_unflipped"] <= row["minimax_rel_err"]
        assert "torch-grouped_flipped_tokens" not in row  # its MoE is not our op: not watched


def test_a_kernel_variant_runs_every_call_with_its_switch(monkeypatch):
    import minimax_backend.graph_passes as gp
    from minimax_backend.kernels.options import kernel_options
    from minimax_backend.tools import bench_e2e

    seen = []
    monkeypatch.setattr(gp, "compile", lambda model, **options: (lambda *a, **k: seen.append(kernel_options().moe_gemm)))
    call = bench_e2e.make_variant("minimax-moe-gluon", object(), tp=1, ep=1)
    call(1, 2)
    call(3)
    plain = bench_e2e.make_variant("minimax", object(), tp=1, ep=1)
    plain()
    assert seen == ["gluon", "gluon", kernel_options().moe_gemm] and seen[-1] != "gluon"


@pytest.mark.slow
def test_bench_e2e_sustained_on_one_rank(tmp_path, fake_nvidia_smi):
    """--sustained: each compiled variant also run back to back, with the SM clock and power read
    beside it (a CPU smoke run; the nvidia-smi on PATH is the test's script: 1500 MHz, 690.5 W)."""
    from minimax_backend.tools import bench_e2e

    out = tmp_path / "e2e.json"
    bench_e2e.main(["--device", "cpu", "--preset", "tiny-m3-fp8", "--prefill", "7", "--decode-batch",
                    "--variants", "torch-grouped", "minimax", "--repeats", "1", "--warmup", "0",
                    "--sustained", "0.2", "--json", str(out)])
    d = json.loads(out.read_text())
    (row,) = d["rows"]
    assert d["sustained_s"] == 0.2
    for v in ("torch-grouped", "minimax"):
        assert row[f"{v}_sustained_ms"] > 0
        assert (row[f"{v}_sm_mhz"], row[f"{v}_watts"]) == (1500.0, 690.5)
    assert "eager_sustained_ms" not in row  # the reference is not a variant under test
    assert row["minimax_sustained_x_vs_torch-grouped"] == pytest.approx(
        row["torch-grouped_sustained_ms"] / row["minimax_sustained_ms"])


def test_bench_e2e_sustained_is_one_rank_only():
    from minimax_backend.tools import bench_e2e

    with pytest.raises(SystemExit, match="--tp 1"):
        bench_e2e.main(["--device", "cpu", "--preset", "tiny-m3", "--tp", "2", "--sustained", "1"])
