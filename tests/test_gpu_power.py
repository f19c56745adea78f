"""tools/gpu_power.py (SM clock and power beside a benchmark) and the sustained timing of bench_moe,
on the CPU: nvidia-smi is replaced by a script that prints samples in its format."""

from __future__ import annotations

import argparse
import datetime
import os

import pytest
import torch

from minimax_backend.tools import bench_common, bench_moe, gpu_power
from minimax_backend.tools.gpu_power import PowerSampler, parse_samples, summarize
from test_bench_moe import job_rows

T0 = datetime.datetime(2026, 12, 3, 13, 55, 10)


def _line(seconds: float, mhz: float, watts: float) -> str:
    t = T0 + datetime.timedelta(seconds=seconds)
    return f"{t.strftime('%Y/%m/%d %H:%M:%S')}.{t.microsecond // 1000:03d}, {mhz:g}, {watts:g}\n"


def test_parse_samples_keeps_only_well_formed_lines():
    lines = ["timestamp, clocks.current.sm [MHz], power.draw [W]\n", _line(0, 1980, 80.5),
             "2026/12/03 13:55:10.050, [N/A], 81\n", "Failed to initialize NVML: Unknown Error\n",
             _line(0.1, 1455, 694.2), "\n"]
    samples = parse_samples(lines)
    assert [(s.sm_mhz, s.watts) for s in samples] == [(1980.0, 80.5), (1455.0, 694.2)]
    assert samples[1].time == T0 + datetime.timedelta(seconds=0.1)


def test_summarize_takes_the_median_inside_the_window():
    samples = parse_samples([_line(i * 0.05, 1900 if i < 10 else 1450 + i, 400 if i < 10 else 690) for i in range(30)])
    reading = summarize(samples, T0 + datetime.timedelta(seconds=0.5), T0 + datetime.timedelta(seconds=1.45))
    assert reading["samples"] == 20
    assert reading["sm_mhz"] == pytest.approx(1450 + 19.5)  # median of 1460 ... 1479
    assert reading["watts"] == 690
    # a window shorter than a few sampling periods gives no reading rather than one sample's
    assert summarize(samples, T0, T0 + datetime.timedelta(seconds=0.06)) is None


def test_sampler_without_nvidia_smi_says_so(monkeypatch):
    monkeypatch.setattr(gpu_power.shutil, "which", lambda name: None)
    with PowerSampler() as power:
        start = power.now()
    assert not power.available and "nvidia-smi" in power.why
    assert power.reading(start, power.now()) is None


def test_sampler_reads_a_running_nvidia_smi(fake_nvidia_smi):
    import time

    with PowerSampler(device=3, period_ms=20) as power:
        time.sleep(0.1)
        start = power.now()
        time.sleep(0.3)
        end = power.now()
    args = (fake_nvidia_smi / "args").read_text().split()
    assert "-i" in args and args[args.index("-i") + 1] == "3" and "-lms" in args
    reading = power.reading(start, end)
    assert reading is not None and reading["samples"] >= 5
    assert reading == {"sm_mhz": 1500.0, "watts": 690.5, "samples": reading["samples"]}
    assert power.reading(end + datetime.timedelta(seconds=5), end + datetime.timedelta(seconds=6)) is None


def test_windows_fill_their_rows_when_sampling_stops(fake_nvidia_smi, monkeypatch):
    import time

    rows = [{}, {}]
    with PowerSampler(device=0, period_ms=20) as power:
        with power.window(rows[0], "ours_"):
            time.sleep(0.2)
        with power.window(rows[1]):
            pass  # shorter than a few samples: no reading
        assert rows[0] == {}  # not before the sampling has stopped
    assert rows[0] == {"ours_sm_mhz": 1500.0, "ours_watts": 690.5}
    assert rows[1] == {"sm_mhz": None, "watts": None}
    monkeypatch.setattr(gpu_power.shutil, "which", lambda name: None)
    row = {}
    with PowerSampler() as power, power.window(row, "x_"):
        pass
    assert row == {"x_sm_mhz": None, "x_watts": None}  # without nvidia-smi: said as None, not left out


def test_sustained_ms_runs_for_the_time_asked():
    calls = []
    ms = bench_common.sustained_ms(lambda: calls.append(1), seconds=0.05, calls_per_timing=5)
    assert ms > 0 and len(calls) >= 3 + 5 and (len(calls) - 3) % 5 == 0
    with pytest.raises(ValueError, match="seconds"):
        bench_common.sustained_ms(lambda: None, seconds=0)


def test_bench_moe_sustained_columns(fake_nvidia_smi, monkeypatch):
    """The job with --sustained: ours and the plain GEMM timed back to back, each row given the
    clock and power read in its own window."""
    (row,) = job_rows(monkeypatch, eager_max_tokens=16, eager_max_tokens_fp8=16, sustained=0.15)
    for col in bench_moe.SUSTAINED_COLUMNS[2:]:
        assert row.get(col) is not None, col
    assert row["ours_sm_mhz"] == 1500.0 and row["plain_watts"] == 690.5
    assert row["sustained_frac_of_gemm"] == pytest.approx(row["ours_sustained_tflops"] / row["plain_sustained_tflops"])


def test_bench_moe_sustained_is_one_gpu_only():
    with pytest.raises(SystemExit, match="--gpus 1"):
        bench_moe.main(["--device", "cpu", "--preset", "tiny-m3", "--gpus", "2", "--sustained", "1"])


def test_smi_device_id_on_a_machine_without_cuda(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert gpu_power.smi_device_id(2) == "2"


def test_sampler_reports_what_a_failing_nvidia_smi_said(tmp_path, monkeypatch):
    script = tmp_path / "nvidia-smi"
    script.write_text('#!/bin/sh\necho "No devices were found"\n')
    script.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}:{os.environ['PATH']}")
    import time

    with PowerSampler(device="GPU-0000") as power:
        start = power.now()
        time.sleep(0.3)  # a benchmark's block lasts seconds: nvidia-smi has exited by its end
    assert not power.available and "No devices were found" in power.why and "GPU-0000" in power.why
    assert power.reading(start, power.now()) is None


def test_the_sustained_argument_and_the_optional_sampler(monkeypatch):
    assert gpu_power.seconds_arg("2.5") == 2.5 and gpu_power.seconds_arg("0") == 0.0
    for bad, says in (("-1", "seconds must be >= 0"), ("x", "not a number of seconds")):
        with pytest.raises(argparse.ArgumentTypeError, match=says):
            gpu_power.seconds_arg(bad)
    assert gpu_power.sampler_for(0.0, 0) is None  # off: no sampler, nothing said
    monkeypatch.setattr(gpu_power.shutil, "which", lambda name: None)
    said = []
    power = gpu_power.sampler_for(2.0, 0, said.append)
    assert power is not None and not power.available and said == [f"--sustained: {power.why}"]
    assert gpu_power.sampler_for(2.0, 0, None) is not None  # a quiet rank still gets its sampler
