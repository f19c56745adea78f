"""tools/tune_moe.py on CPU (tiny model, kernels in Triton's interpreter): the sweep's rows and JSON."""

from __future__ import annotations

import json
import os
import sys

import pytest

import background
from conftest import write_fake_nvidia_smi

SMOKE_ARGS = ("--device", "cpu", "--preset", "tiny-m3", "--tokens", "5", "--precisions", "bf16", "fp8", "--calls", "1",
              "--configs", "16,128,64,4,2", "16,128,128,4,2", "--gate-up", "two_dots", "one_dot", "--group-m", "0", "2")
background.register(__file__, "test_tune_moe_smoke_in_the_interpreter", lambda out: (
    [sys.executable, "-m", "minimax_backend.tools.tune_moe", *SMOKE_ARGS, "--json", str(out / "tune.json")],
    {**os.environ, "TRITON_INTERPRET": "1"}))

SUSTAINED_ARGS = ("--device", "cpu", "--preset", "tiny-m3", "--tokens", "5", "--precisions", "bf16", "--calls", "1",
                  "--configs", "32,128,64,4,2", "--expert-groups", "2", "--half-blocks", "off", "on", "--sustained", "0.3")


def _sustained_command(out):
    # a fake nvidia-smi first on PATH (conftest.write_fake_nvidia_smi): 1500 MHz and 690.5 W
    write_fake_nvidia_smi(out)
    env = {**os.environ, "TRITON_INTERPRET": "1", "PATH": f"{out}{os.pathsep}{os.environ['PATH']}"}
    return [sys.executable, "-m", "minimax_backend.tools.tune_moe", *SUSTAINED_ARGS, "--json", str(out / "tune.json")], env


background.register(__file__, "test_tune_moe_sustained_columns_and_expert_groups", _sustained_command)


def test_tune_moe_smoke_in_the_interpreter():
    pytest.importorskip("triton", reason="the kernels need triton")
    r = background.result(__file__, "test_tune_moe_smoke_in_the_interpreter")  # started ahead, in the background
    assert r.returncode == 0, r.tail()
    rows = json.loads((r.out / "tune.json").read_text())["rows"]
    # every config with each product and each tile order
    assert ({(row["gate_up"], row["group_m"]) for row in rows}
            == {(g, m) for g in ("two_dots", "one_dot") for m in (0, 2)})
    assert len(rows) == 16
    by = {(row["precision"], row["config"]): row for row in rows if row["gate_up"] == "one_dot" and row["group_m"] == 2}
    assert set(by) == {(p, c) for p in ("bf16", "fp8") for c in ("16,128,64,4,2", "16,128,128,4,2")}
    # FP8 needs BK = 128 (the quantization group): that config is reported as an error, not dropped
    assert "BN = BK = 128" in by[("fp8", "16,128,64,4,2")]["error"]
    for key in (("bf16", "16,128,64,4,2"), ("bf16", "16,128,128,4,2"), ("fp8", "16,128,128,4,2")):
        row = by[key]
        assert "error" not in row and row["call_us"] > 0 and row["layer_tflops"] > 0
    assert "MoE grouped GEMMs per tile config" in r.stdout


def test_tune_moe_runs_the_tables_variant_unless_asked():
    from minimax_backend.tools.tune_moe import variants

    assert variants(8192, 4, 128, True, (), ()) == (("one_dot",), ("expert:8",))  # M3 FP8 prefill
    assert variants(8192, 4, 128, False, (), ()) == (("one_dot",), ("expert:8",))  # BF16 too
    assert variants(16, 4, 128, True, (), ()) == (("two_dots",), (0,))  # decode
    assert variants(16, 4, 128, True, ("one_dot", "two_dots"), (0, 2)) == (("one_dot", "two_dots"), (0, 2))


def test_tune_moe_rejects_a_negative_group():
    from minimax_backend.tools import tune_moe

    with pytest.raises(SystemExit, match="--group-m"):
        tune_moe.main(["--device", "cpu", "--preset", "tiny-m3", "--tokens", "3", "--group-m", "-1"])


def test_tune_moe_rejects_a_malformed_config():
    from minimax_backend.tools import tune_moe

    with pytest.raises(SystemExit, match="BM,BN,BK,warps,stages"):
        tune_moe.main(["--device", "cpu", "--preset", "tiny-m3", "--tokens", "3", "--configs", "64,128"])


def test_tune_moe_refuses_gluon_on_cpu():
    """The Gluon kernel needs an sm_90 GPU: on CPU the rows would silently be the Triton kernel's."""
    from minimax_backend.tools import tune_moe

    with pytest.raises(SystemExit, match="sm_90"):
        tune_moe.main(["--device", "cpu", "--preset", "tiny-m3", "--tokens", "3", "--moe-gemm", "triton", "gluon"])


def test_tune_moe_sustained_columns_and_expert_groups():
    """--sustained: every config also timed back to back, with the clock and power read beside it
    (a CPU smoke run: the nvidia-smi on PATH is the test's script, 1500 MHz and 690.5 W); with
    --expert-groups the groups by expert are run beside the table's order; --half-blocks off on runs
    each with and without the half-block copy (BLOCK_M 32: the tiny model's blocks are half idle)."""
    pytest.importorskip("triton", reason="the kernels need triton")
    r = background.result(__file__, "test_tune_moe_sustained_columns_and_expert_groups")  # started ahead
    assert r.returncode == 0, r.tail()
    rows = json.loads((r.out / "tune.json").read_text())["rows"]
    # --expert-groups: the table's order (decode size: rows fastest) and the groups by expert
    assert [(row["half_blocks"], row["group_m"]) for row in rows] == [
        ("off", 0), ("off", "expert:2"), ("on", 0), ("on", "expert:2")]
    for row in rows:
        assert row["sustained_us"] > 0 and row["sustained_layer_tflops"] > 0
        assert (row["sm_mhz"], row["watts"]) == (1500.0, 690.5)
        assert row["precision"] == "bf16"
    assert "sm_mhz" in r.stdout


def test_tune_moe_rejects_an_empty_expert_group():
    from minimax_backend.tools import tune_moe

    with pytest.raises(SystemExit, match="--expert-groups"):
        tune_moe.main(["--device", "cpu", "--preset", "tiny-m3", "--tokens", "3", "--expert-groups", "0"])


def test_kernel_pairs_per_precision():
    """--moe-gemm / --moe-down: FP8 runs every gate/up kernel, the down choice after the 192-row one;
    BF16 has no 64-row Gluon kernel and its 192-row form brings its own Gluon down."""
    from minimax_backend.tools.tune_moe import gemm_and_down

    gemms, downs = ["triton", "gluon", "gluon192"], ["auto", "triton"]
    assert gemm_and_down(gemms, downs, fp8=True) == [("triton", "triton"), ("gluon", "triton"),
                                                     ("gluon192", "auto"), ("gluon192", "triton")]
    assert gemm_and_down(gemms, downs, fp8=False) == [("triton", "triton"), ("gluon192", "auto")]
    assert gemm_and_down(["gluon"], downs, fp8=False) == []


def test_trio_rows_only_with_the_192_row_kernels():
    from minimax_backend.tools.tune_moe import trio_rows_for

    assert trio_rows_for("gluon192", ["all", "live"]) == ["all", "live"]
    assert trio_rows_for("gluon", ["all", "live"]) == trio_rows_for("triton", ["live"]) == ["all"]


def test_bf16_passes_only_with_the_bf16_192_row_gate_up():
    from minimax_backend.tools.tune_moe import bf16_passes_for

    assert bf16_passes_for("gluon192", False, ["2", "1"]) == ["2", "1"]
    assert bf16_passes_for("gluon192", True, ["2", "1"]) == ["2"]  # FP8 has no one-pass form
    assert bf16_passes_for("triton", False, ["1"]) == ["2"]


def test_fp8_yield_only_with_the_fp8_192_row_kernels():
    from minimax_backend.tools.tune_moe import fp8_yield_for

    assert fp8_yield_for("gluon192", True, ["off", "2"]) == ["off", "2"]
    assert fp8_yield_for("gluon192", False, ["off", "2"]) == ["off"]  # BF16 has no promotion FFMAs
    assert fp8_yield_for("gluon", True, ["2"]) == ["off"]


def test_half_blocks_only_where_a_triton_gemm_runs():
    from minimax_backend.tools.tune_moe import half_blocks_for

    assert half_blocks_for("gluon192", "auto", ["off", "on"]) == ["off"]  # both GEMMs in Gluon
    assert half_blocks_for("gluon192", "triton", ["off", "on"]) == ["off", "on"]  # the Triton down
    assert half_blocks_for("gluon", "triton", ["off", "on"]) == ["off", "on"]
    assert half_blocks_for("triton", "triton", ["on"]) == ["on"]
