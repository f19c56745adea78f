"""tools/bench_common.interleaved_median_ms: every variant timed in the same rounds,
the order rotated, each median its own calls'."""

from __future__ import annotations

import time

from minimax_backend.tools.bench_common import interleaved_median_ms


def test_rounds_visit_every_variant_once_in_rotated_order():
    calls = []
    fns = {name: (lambda name=name: calls.append(name)) for name in ("a", "b", "c")}
    interleaved_median_ms(fns, warmup=1, repeats=4, lead_in=0)
    warm, timed = calls[:3], calls[3:]
    assert warm == ["a", "b", "c"]
    assert timed == ["a", "b", "c", "b", "c", "a", "c", "a", "b", "a", "b", "c"]


def test_every_timed_call_follows_a_call_of_its_own_kind(monkeypatch):
    """With three variants, rotation alone made b follow a in 2 rounds of 3 and c follow b in 2
    of 3; a lead-in call per visit makes every timed call's predecessor its own variant."""
    import minimax_backend.tools.bench_common as bc

    calls, timed = [], []
    fns = {name: (lambda name=name: calls.append(name)) for name in ("a", "b", "c")}
    real = bc._timed_call_ms
    monkeypatch.setattr(bc, "_timed_call_ms", lambda fn, barrier: timed.append(len(calls)) or real(fn, barrier))
    interleaved_median_ms(fns, warmup=0, repeats=6)
    assert len(calls) == 2 * 3 * 6 and len(timed) == 3 * 6
    for i in timed:  # calls[i] is the timed call, calls[i - 1] what the card ran just before it
        assert calls[i - 1] == calls[i]


def test_each_median_is_its_own_variants_time():
    fns = {"slow": lambda: time.sleep(0.02), "fast": lambda: time.sleep(0.002)}
    samples = {}
    ms = interleaved_median_ms(fns, warmup=0, repeats=5, samples=samples)
    assert set(ms) == {"slow", "fast"}
    assert 19.0 <= ms["slow"] < 60.0 and 1.9 <= ms["fast"] < 15.0
    assert {k: len(v) for k, v in samples.items()} == {"slow": 5, "fast": 5}
    assert all(ms[k] == sorted(v)[2] for k, v in samples.items())  # the median of its own samples


def test_barrier_runs_before_every_timed_call():
    log = []
    fns = {"a": lambda: log.append("a"), "b": lambda: log.append("b")}
    interleaved_median_ms(fns, warmup=0, repeats=3, barrier=lambda: log.append("|"), lead_in=0)
    assert log == ["|", "a", "|", "b", "|", "b", "|", "a", "|", "a", "|", "b"]
    log.clear()
    interleaved_median_ms(fns, warmup=0, repeats=1, barrier=lambda: log.append("|"))  # and before a lead-in
    assert log == ["|", "a", "|", "a", "|", "b", "|", "b"]
