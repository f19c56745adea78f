"""Shared pieces of the GPU benchmarks: timing, random weights, tables, JSON.

Every benchmark compares against the alternative in the same run, quotes
medians of CUDA-event timings after warm-up, prints a table and writes JSON
with the date, the hardware and the software versions.
"""

from __future__ import annotations

import datetime
import json
import platform
import statistics
import time
from pathlib import Path
from typing import Any, Callable, Sequence

import torch


def _timed_call_ms(fn: Callable[[], Any], barrier: Callable[[], None] | None) -> float:
    """One call of fn in ms: the barrier first, then CUDA events around the call after a
    synchronize (the host clock without CUDA)."""
    if barrier is not None:
        barrier()
    if not torch.cuda.is_available():
        t0 = time.perf_counter()
        fn()
        return (time.perf_counter() - t0) * 1e3
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end)


def median_ms(fn: Callable[[], Any], warmup: int = 3, repeats: int = 10, barrier: Callable[[], None] | None = None) -> float:
    """Median wall time of fn() in milliseconds, timed with CUDA events.

    `barrier` (e.g. a distributed barrier) runs before every timed call so all
    ranks start together and a collective's wait is not counted as compute.
    Without CUDA (smoke runs on CPU) the host clock is used.
    """
    for _ in range(warmup):
        fn()
    return statistics.median(_timed_call_ms(fn, barrier) for _ in range(repeats))


def interleaved_median_ms(fns: dict[str, Callable[[], Any]], warmup: int = 3, repeats: int = 10,
                          barrier: Callable[[], None] | None = None, lead_in: int = 1,
                          samples: dict[str, list[float]] | None = None) -> dict[str, float]:
    """Median wall ms of each fn, timed in rounds that visit every fn once, the order
    rotated from round to round.

    Timed one after the other, a drift of the GPU's clocks or temperature over the
    run (prefill keeps the card near its power limit) falls on whichever variant runs
    later; interleaved, it reaches every variant alike (docs/measurements/2026-12-02.md).
    Each visit makes `lead_in` untimed calls of the same fn before the timed one, so a
    timed call follows a call of its own kind, as in a server running one model: with
    three variants, rotation alone made one variant follow a given other one in two
    rounds of three (the baseline mostly followed the plain model, ours the baseline),
    and a prefill's speed depends on what the card just ran (its power and clocks;
    docs/measurements/2026-12-03.md). Each call is timed as in median_ms; `samples`, if
    given, receives every variant's timed calls in order (for the JSON: spread, drift)."""
    names = list(fns)
    for name in names:
        for _ in range(warmup):
            fns[name]()
    times: dict[str, list[float]] = {name: [] for name in names}
    for r in range(repeats):
        for name in names[r % len(names):] + names[:r % len(names)]:
            for _ in range(lead_in):
                if barrier is not None:
                    barrier()
                fns[name]()
            times[name].append(_timed_call_ms(fns[name], barrier))
    if samples is not None:
        samples.update(times)
    return {name: statistics.median(t) for name, t in times.items()}


QUEUE_AHEAD_CYCLES = 40_000_000  # ~20 ms of GPU clock: longer than any call's host work


def host_and_device_ms(fn: Callable[[], Any], repeats: int = 10,
                       barrier: Callable[[], None] | None = None) -> dict[str, float]:
    """Where a call's time goes: median host ms (Python until fn returns) and device ms.

    Each call is issued behind a GPU kept busy by a sleep kernel, so the
    device time (CUDA events around the call) holds only its GPU work and the
    gaps inside it, not the host work that `median_ms` exposes. A call that
    synchronizes inside waits for the sleep and shows as host time >= ~20 ms.
    `barrier` (several ranks) runs before each call, as in median_ms.
    """
    host, device = [], []
    for _ in range(repeats):
        torch.cuda.synchronize()
        if barrier is not None:
            barrier()
        torch.cuda._sleep(QUEUE_AHEAD_CYCLES)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        t0 = time.perf_counter()
        fn()
        host.append((time.perf_counter() - t0) * 1e3)
        end.record()
        end.synchronize()
        device.append(start.elapsed_time(end))
    return {"host_ms": statistics.median(host), "device_ms": statistics.median(device)}


def graphed(fn: Callable[[], Any], calls: int = 1, before_capture: Callable[[], None] | None = None,
            capture_error_mode: str = "global") -> Callable[[], Any]:
    """`calls` back-to-back calls of fn captured in one CUDA graph; returns a replay
    function that gives the last captured call's output.

    Three warm-up calls run first on a side stream, so compiles, autotuning,
    workspaces and the allocator's first allocations happen outside capture.
    Multi-rank callers pass a rank barrier as `before_capture` and
    capture_error_mode="thread_local" (NCCL's threads run during capture)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    if before_capture is not None:
        torch.cuda.synchronize()
        before_capture()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, capture_error_mode=capture_error_mode):
        for _ in range(calls):
            out = fn()

    def replay():
        graph.replay()
        return out

    return replay


def graph_median_ms(fn: Callable[[], Any], calls: int = 10, warmup: int = 3, repeats: int = 10) -> float:
    """Median GPU time of one fn() in ms, from CUDA-graph replays of `calls` back-to-back calls.

    For kernels of tens of microseconds a Python launch (custom-op dispatch,
    Triton's launcher) takes about as long as the kernel, so event timing of
    single calls measures the host. In a graph the calls run back to back, as
    they do in the backend's captured model. Without CUDA: median_ms."""
    if not torch.cuda.is_available():
        return median_ms(fn, warmup, repeats)
    return median_ms(graphed(fn, calls), warmup, repeats) / calls


def sustained_ms(fn: Callable[[], Any], seconds: float, calls_per_timing: int = 5) -> float:
    """Median ms of fn() run back to back for `seconds` (after 3 untimed calls), each
    timing over `calls_per_timing` calls: the rate a card keeps once it has reached its
    power limit, where a median of single calls measures the first milliseconds of a burst
    (tools/gpu_power.py). CUDA events on a GPU, the host clock without CUDA."""
    if seconds <= 0:
        raise ValueError(f"sustained_ms: seconds must be > 0, got {seconds}")

    def calls():
        for _ in range(calls_per_timing):
            fn()

    for _ in range(3):
        fn()
    times = []
    t_end = time.perf_counter() + seconds
    while time.perf_counter() < t_end or not times:
        times.append(_timed_call_ms(calls, None) / calls_per_timing)
    return statistics.median(times)


def gpu_timeline(events) -> list[dict[str, Any]]:
    """The GPU kernels and copies among torch.profiler events (``prof.events()``), in start
    order: start (us after the first starts), us (duration), stream, name. For a schedule
    spread over several streams this shows what runs beside what and where the gaps are."""
    gpu = sorted((e for e in events if e.device_type == torch.autograd.DeviceType.CUDA),
                 key=lambda e: e.time_range.start)
    if not gpu:
        return []
    t0 = gpu[0].time_range.start
    return [{"start": round(e.time_range.start - t0, 1), "us": round(e.time_range.elapsed_us(), 1),
             "stream": e.device_resource_id, "name": e.name} for e in gpu]


def idle_gaps(timeline: Sequence[dict[str, Any]], top: int = 8) -> dict[str, Any]:
    """Where the GPU idles inside a gpu_timeline: span_us (first start to last end), busy_us
    (time some kernel or copy runs, overlaps across streams merged), idle_us = span - busy,
    and the `top` longest gaps: us, at (start of the gap, us after the first kernel), and
    the work that ended last before it (`after`) and the first that starts when it ends
    (`before`)."""
    if not timeline:
        return {"span_us": 0.0, "busy_us": 0.0, "idle_us": 0.0, "gaps": []}
    gaps, busy = [], 0.0
    run_start, run_end, last = timeline[0]["start"], timeline[0]["start"] + timeline[0]["us"], timeline[0]
    for e in timeline[1:]:
        end = e["start"] + e["us"]
        if e["start"] > run_end:
            busy += run_end - run_start
            gaps.append({"us": round(e["start"] - run_end, 1), "at": round(run_end, 1),
                         "after": last["name"][:80], "before": e["name"][:80]})
            run_start, run_end, last = e["start"], end, e
        elif end >= run_end:
            run_end, last = end, e
    busy += run_end - run_start
    span = run_end - timeline[0]["start"]
    gaps.sort(key=lambda g: -g["us"])
    return {"span_us": round(span, 1), "busy_us": round(busy, 1), "idle_us": round(span - busy, 1),
            "gaps": gaps[:top]}


def call_timeline(fn: Callable[[], Any]) -> list[dict[str, Any]]:
    """The gpu_timeline of one call of fn, issued on an idle GPU (torch.profiler, CUDA)."""
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return gpu_timeline(prof.events())


def kernel_profile(fn: Callable[[], Any], calls: int, device: torch.device) -> tuple[dict[str, tuple[float, int]], float]:
    """{kernel name: (total us, launches)} over `calls` calls of fn, and the total us.

    On a GPU the device kernels (and copies) torch.profiler records; on the CPU
    (smoke runs) the leaf ATen ops' self time."""
    from collections import defaultdict

    from torch.profiler import ProfilerActivity, profile

    activity = ProfilerActivity.CUDA if device.type == "cuda" else ProfilerActivity.CPU
    with profile(activities=[activity]) as prof:
        for _ in range(calls):
            fn()
        if device.type == "cuda":
            torch.cuda.synchronize()
    per_name: dict = defaultdict(lambda: [0.0, 0])
    for ev in prof.events():
        on_device = ev.device_type == torch.autograd.DeviceType.CUDA
        if (device.type == "cuda") != on_device:
            continue
        if device.type == "cpu" and not ev.name.startswith("aten::"):
            continue
        entry = per_name[ev.name]
        entry[0] += ev.device_time_total if on_device else ev.self_cpu_time_total
        entry[1] += 1
    return {k: (v[0], v[1]) for k, v in per_name.items()}, sum(v[0] for v in per_name.values())


def top_kernels(kernels: dict[str, tuple[float, int]], total_us: float, calls: int, top: int) -> list[dict[str, Any]]:
    """The `top` kernels of a kernel_profile by time: us and launches per call, share of the total."""
    rows = sorted(kernels.items(), key=lambda kv: -kv[1][0])
    return [{"name": name[:90], "us_per_call": us / calls, "launches_per_call": n / calls,
             "share": us / total_us if total_us else 0.0} for name, (us, n) in rows[:top]]


def copy_bandwidth_gbs(device: torch.device) -> float:
    """Device-to-device copy of 1 GiB (bytes read + written per second, GB/s): the memory ceiling."""
    n = (1 << 30) if device.type == "cuda" else (1 << 20)
    src = torch.empty(n, dtype=torch.uint8, device=device).random_()
    dst = torch.empty_like(src)
    ms = median_ms(lambda: dst.copy_(src), warmup=3, repeats=10)
    return 2 * n / ms / 1e6


def gemm_tflops(device: torch.device, fp8: bool = False, n: int = 8192) -> float:
    """A plain n^3 GEMM's rate on random data: torch.mm in BF16, or FP8 with 1 x 128 / 128 x 128
    block scales through minimax::fp8_block_gemm (torch._scaled_mm blockwise on the H200)."""
    if device.type != "cuda":
        n = 256
    g = torch.Generator(device=device).manual_seed(0)
    a = torch.randn(n, n, generator=g, device=device, dtype=torch.bfloat16)
    b = torch.randn(n, n, generator=g, device=device, dtype=torch.bfloat16)
    if fp8:
        from minimax_backend.kernels.fp8 import quantize_weight_fp8

        aq, as_ = torch.ops.minimax.quantize_fp8(a, 128)
        bq, bs = quantize_weight_fp8(b)
        fn = lambda: torch.ops.minimax.fp8_block_gemm(aq, as_, bq, bs, torch.bfloat16)  # noqa: E731
    else:
        fn = lambda: a @ b  # noqa: E731
    ms = median_ms(fn, warmup=3, repeats=10)
    return 2 * n ** 3 / ms / 1e9


def rowwise_fp8(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row FP8 E4M3 quantization (the scaling torch's own FP8 ops take): data, float32 scales [rows]."""
    amax = t.float().abs().amax(dim=-1).clamp(min=1e-12)
    scale = amax / 448.0
    return (t.float() / scale.unsqueeze(-1)).clamp(-448, 448).to(torch.float8_e4m3fn), scale


def require_device(dry_run: bool) -> None:
    """A GPU benchmark's start: --dry-run needs the Triton interpreter (its kernels then run on the
    CPU), a real run a CUDA GPU; a SystemExit that says which otherwise."""
    if dry_run:
        from minimax_backend.kernels.interpreter import triton_interpreting

        if not triton_interpreting():
            raise SystemExit("--dry-run needs TRITON_INTERPRET=1 in the environment (set before Python starts)")
    elif not torch.cuda.is_available():
        raise SystemExit("this benchmark needs a CUDA GPU (--dry-run checks the script on the CPU)")


def hardware() -> dict[str, Any]:
    info = {
        "date": datetime.date.today().isoformat(),
        "torch": torch.__version__,
        "python": platform.python_version(),
    }
    if torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name()
        info["gpus"] = torch.cuda.device_count()
        info["cuda"] = torch.version.cuda
    try:
        import triton

        info["triton"] = triton.__version__
    except ImportError:
        pass
    return info


def print_table(rows: Sequence[dict[str, Any]], columns: Sequence[str], title: str = "") -> str:
    """A plain fixed-width table; returns it as text too (for the docs)."""
    def fmt(v):
        if isinstance(v, float):  # small nonzero values (errors) in scientific notation, not as 0.000
            return f"{v:.2e}" if 0 < abs(v) < 1e-3 else f"{v:.3f}"
        return str(v)

    widths = [max([len(c), *(len(fmt(r.get(c, ""))) for r in rows)]) for c in columns]
    lines = [title] if title else []
    lines.append("  ".join(c.rjust(w) for c, w in zip(columns, widths)))
    lines.append("  ".join("-" * w for w in widths))
    for r in rows:
        lines.append("  ".join(fmt(r.get(c, "")).rjust(w) for c, w in zip(columns, widths)))
    text = "\n".join(lines)
    print(text, flush=True)
    return text


def write_json(path: str | Path, payload: dict[str, Any]) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"hardware": hardware(), **payload}, indent=2, default=str))
    print(f"wrote {path}", flush=True)
