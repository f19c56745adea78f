"""tools/bench_common.interleaved_median_ms: every variant timed in the same rounds,
the order rotated, each median its own calls'."""

from __future__ import annotations

import time

from minimax_backend.tools.bench_common import interleaved_median_ms


def test_rounds_call_every_variant_once_in_rotated_order():
    calls = []
    fns = {name: (lambda name=name: calls.append(name)) for name in ("a", "b", "c")}
    interleaved_median_ms(fns, warmup=1, repeats=4)
    warm, timed = calls[:3], calls[3:]
    assert warm == ["a", "b", "c"]
    assert timed == ["a", "b", "c", "b", "c", "a", "c", "a", "b", "a", "b", "c"]


def test_each_median_is_its_own_variants_time():
    fns = {"slow": lambda: time.sleep(0.02), "fast": lambda: time.sleep(0.002)}
    ms = interleaved_median_ms(fns, warmup=0, repeats=5)
    assert set(ms) == {"slow", "fast"}
    assert 19.0 <= ms["slow"] < 60.0 and 1.9 <= ms["fast"] < 15.0


def test_barrier_runs_before_every_timed_call():
    log = []
    fns = {"a": lambda: log.append("a"), "b": lambda: log.append("b")}
    interleaved_median_ms(fns, warmup=0, repeats=3, barrier=lambda: log.append("|"))
    assert log == ["|", "a", "|", "b", "|", "b", "|", "a", "|", "a", "|", "b"]
