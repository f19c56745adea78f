"""tools/profile_moe.py on CPU (tiny model): the JSON of the kernel breakdown is well formed."""

from __future__ import annotations

import json

import pytest


def test_profile_moe_smoke_on_cpu(tmp_path):
    from minimax_backend.tools import profile_moe

    out = tmp_path / "profile.json"
    profile_moe.main(["--device", "cpu", "--preset", "tiny-m3", "--precision", "bf16", "--tokens", "1", "5",
                      "--calls", "2", "--top", "4", "--json", str(out)])
    d = json.loads(out.read_text())
    assert [r["tokens"] for r in d["results"]] == [1, 5]
    for r in d["results"]:
        assert r["call_us"] > 0 and r["kernels_per_call"] > 0
        top = r["top"]
        assert 0 < len(top) <= 4
        times = [k["us_per_call"] for k in top]
        assert times == sorted(times, reverse=True)
        assert 0 < sum(k["share"] for k in top) <= 1.0 + 1e-9
        assert all(k["launches_per_call"] > 0 for k in top)


def test_profile_moe_rejects_bad_arguments():
    from minimax_backend.tools import profile_moe

    with pytest.raises(SystemExit, match="at least 1"):
        profile_moe.main(["--device", "cpu", "--preset", "tiny-m3", "--tokens", "0"])
