"""bench_common.gpu_timeline: the GPU part of a torch.profiler recording, in start order."""

from __future__ import annotations

import time
from types import SimpleNamespace

import pytest
import torch

from minimax_backend.tools.bench_common import gpu_timeline

CUDA, CPU = torch.autograd.DeviceType.CUDA, torch.autograd.DeviceType.CPU


def _event(name, device_type, start, end, stream=7):
    span = SimpleNamespace(start=start, elapsed_us=lambda: end - start)
    return SimpleNamespace(name=name, device_type=device_type, time_range=span, device_resource_id=stream)


def test_gpu_events_only_in_start_order_from_the_first():
    events = [
        _event("gemm piece 2", CUDA, 1100.0, 1182.5, stream=7),
        _event("aten::mm", CPU, 900.0, 950.0),  # host side: not GPU work
        _event("Memcpy PtoP", CUDA, 1105.25, 1173.0, stream=21),
        _event("gemm piece 1", CUDA, 1010.0, 1091.4, stream=7),
    ]
    got = gpu_timeline(events)
    assert [e["name"] for e in got] == ["gemm piece 1", "gemm piece 2", "Memcpy PtoP"]
    assert got[0] == {"start": 0.0, "us": 81.4, "stream": 7, "name": "gemm piece 1"}
    assert got[2]["start"] == 95.2 and got[2]["us"] == 67.8 and got[2]["stream"] == 21


def test_nothing_on_the_gpu_is_an_empty_timeline():
    assert gpu_timeline([_event("aten::add", CPU, 0.0, 1.0)]) == []


def test_a_real_cpu_recording_has_no_gpu_timeline():
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        torch.ones(4) + 1
    assert any(e.name == "aten::add" for e in prof.events())  # the attributes gpu_timeline reads exist
    assert all(hasattr(e, "time_range") and hasattr(e, "device_resource_id") for e in prof.events())
    assert gpu_timeline(prof.events()) == []


@pytest.mark.gpu
def test_host_and_device_split_tells_host_work_from_gpu_work():
    from minimax_backend.tools.bench_common import host_and_device_ms

    x = torch.ones(1 << 20, device="cuda")

    def slow_host_quick_gpu():
        time.sleep(0.005)  # 5 ms of host work, one tiny kernel
        x.add_(1)

    def quick_host_slow_gpu():
        torch.cuda._sleep(10_000_000)  # ~5 ms of GPU work, issued in microseconds

    a = host_and_device_ms(slow_host_quick_gpu, repeats=3)
    b = host_and_device_ms(quick_host_slow_gpu, repeats=3)
    assert a["host_ms"] >= 5.0 and a["device_ms"] < 1.0, a
    assert b["host_ms"] < 1.0 and b["device_ms"] >= 2.0, b


def _at(name, start, us, stream=7):
    return {"start": start, "us": us, "stream": stream, "name": name}


def test_idle_gaps_merges_streams_and_names_the_work_around_each_gap():
    from minimax_backend.tools.bench_common import idle_gaps

    timeline = [
        _at("gemm", 0.0, 50.0),
        _at("copy", 10.0, 60.0, stream=21),  # overlaps gemm on another stream: no gap, ends last
        _at("norm", 75.0, 5.0),  # 5 us after copy ended
        _at("moe", 100.0, 30.0),  # 20 us after norm
        _at("tiny", 105.0, 1.0, stream=21),  # inside moe: no gap, does not end last
        _at("combine", 131.5, 2.0),  # 1.5 us after moe
    ]
    got = idle_gaps(timeline, top=2)
    assert got["span_us"] == 133.5
    assert got["busy_us"] == 70.0 + 5.0 + 30.0 + 2.0
    assert got["idle_us"] == 26.5
    assert got["gaps"] == [{"us": 20.0, "at": 80.0, "after": "norm", "before": "moe"},
                           {"us": 5.0, "at": 70.0, "after": "copy", "before": "norm"}]


def test_idle_gaps_of_nothing():
    from minimax_backend.tools.bench_common import idle_gaps

    assert idle_gaps([]) == {"span_us": 0.0, "busy_us": 0.0, "idle_us": 0.0, "gaps": []}
