"""`minimax-compile` end to end, as a user runs it (a subprocess per command)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest


def _cli(*args, tmp_path, timeout=600):
    env = dict(os.environ, MINIMAX_CACHE_DIR=str(tmp_path / "cache"))
    return subprocess.run([sys.executable, "-m", "minimax_backend.tools.cli", *args], capture_output=True,
                          text=True, env=env, timeout=timeout, cwd=tmp_path)


@pytest.mark.slow
def test_run_defaults_show_every_pass(tmp_path):
    """The README's first command with its defaults (tiny-m3-fp8, TP 2 = EP 2, sequence
    parallelism on), shortened (7 tokens, one decode step, the FX codegen)."""
    report = tmp_path / "report.json"
    logits = tmp_path / "logits.pt"
    proc = _cli("run", "--tokens", "7", "--decode-steps", "1", "--repeats", "1",
                "--options", '{"codegen": "fx", "sequence_parallel": "on"}', "--json", str(report),
                "--save-logits", str(logits), tmp_path=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "writing the built-in tiny-m3-fp8 checkpoint" in proc.stdout  # first use makes it
    dump_index = tmp_path / "minimax_dumps" / "compile0-rank0" / "index.html"
    assert f"graph dump of every stage: minimax_dumps/compile0-rank0/index.html" in proc.stdout
    assert dump_index.is_file()
    assert "compiling" in proc.stdout and "passes:" in proc.stdout  # progress and summary
    assert "compiled prefill: padded to 1 x 8 tokens" in proc.stdout  # TP 2: buckets of even sizes
    # the summary says what a pass's matches were: here the norms are kept BF16 before the gathers
    assert "fuse_norm_quant           matches   4  (kept_bf16_before_gather 4)" in proc.stdout
    r = json.loads(report.read_text())
    assert {"tp", "ep", "tokens", "passes", "ops_before", "ops_after", "numerics", "timings_s"} <= set(r)
    assert (r["tp"], r["ep"], r["tokens"], r["dtype"]) == (2, 2, 7, "float32")
    passes = {p["name"]: p for p in r["passes"]}
    for name in ("moe_canonicalize", "fuse_indexer_qkv", "sequence_parallel", "fuse_norm_quant",
                 "gemm_reduce_scatter", "moe_lower"):
        assert passes[name]["enabled"] and passes[name]["matches"] > 0, (name, passes[name])
    assert passes["sequence_parallel"]["matches"] == 7
    assert r["ops_before"]["_c10d_functional.all_reduce"] == 7
    assert "_c10d_functional.all_reduce" not in r["ops_after"]
    # SP made 7 reduce-scatters; the later passes fold 6 of them into fused ops:
    # one gemm_rs per o_proj (3) and per dense down_proj (1), one mega_moe per MoE layer (2).
    assert r["ops_after"]["minimax.gemm_rs"] == 4
    assert r["ops_after"]["minimax.mega_moe"] == 2
    assert r["ops_after"]["_c10d_functional.reduce_scatter_tensor"] == 1  # the embedding's
    # tiny-m3's layers 1 and 2 are MSA layers: the run says so, and their indexer rides on QKV's GEMM
    assert r["attention"]["sparse_layers"] == [1, 2] and r["attention"]["dense_layers"] == [0]
    assert "attention: MSA (sparse) on layers [1, 2]" in proc.stdout
    fused = next(p for p in r["passes"] if p["name"] == "fuse_indexer_qkv")
    assert fused["enabled"] and fused["matches"] == 2
    assert r["ops_after"]["minimax.stacked_gemm"] == 2 and r["ops_after"]["minimax.msa_attention"] == 2
    assert r["numerics"]["argmax_agreement"] == 1.0
    assert r["numerics"]["max_rel_err"] < 2e-2 and r["numerics"]["median_token_rel_err"] < 5e-3
    assert r["decode_numerics"]["argmax_agreement"] == 1.0
    assert r["timings_s"]["compiled_prefill"] > 0
    import torch

    saved = torch.load(logits)
    assert set(saved) == {"input_ids", "eager", "compiled"}
    assert saved["input_ids"].shape == (1, 7) and saved["eager"].shape == saved["compiled"].shape
    assert list((tmp_path / "minimax_dumps").rglob("index.html"))
    assert "leaked semaphore" not in proc.stderr  # the ranks' exit released theirs (tools/launch.py)


def test_make_checkpoint_preset(tmp_path):
    out = tmp_path / "ckpt"
    proc = _cli("make-checkpoint", "--config", "tiny-m2", "--out", str(out), tmp_path=tmp_path)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert (out / "config.json").is_file()
    assert list(out.glob("*.safetensors"))
    assert json.loads((out / "config.json").read_text())["model_type"] == "minimax_m2"


@pytest.mark.parametrize(
    "args, message",
    [
        (["run", "--options", '{"sequence_paralel": "on"}'], "sequence_parallel"),  # typo: valid keys listed
        (["run", "--options", "[1]"], "JSON object"),
        (["run", "--options", '{"sequence_parallel": "maybe"}'], "must be one of 'auto', 'on', 'off'"),
        (["run", "--options", '{"ep_size": 3}'], "ep_size=3 must divide tp_size=2"),
        (["run", "--tp", "2", "--ep", "3"], "--ep 3 must"),
        (["run", "--tp", "3"], "4 heads are not divisible by tp_size 3"),  # tiny-m3 cannot shard 3 ways
        (["run", "--tokens", "0"], "--tokens and --batch must be at least 1"),
        (["make-checkpoint", "--config", "no-such-preset", "--out", "x"], "neither a config file nor a preset"),
    ],
)
def test_bad_input_fails_fast_with_a_message(tmp_path, args, message):
    proc = _cli(*args, tmp_path=tmp_path, timeout=120)
    assert proc.returncode != 0
    assert message in proc.stderr + proc.stdout
    assert "Traceback" not in proc.stderr, proc.stderr[-2000:]  # the message alone, before any rank starts
    assert "every pass has work" not in proc.stdout  # nothing announced for a run that does not start


def test_run_checkpoint_without_config(tmp_path):
    (tmp_path / "empty").mkdir()
    proc = _cli("run", "--checkpoint", str(tmp_path / "empty"), tmp_path=tmp_path, timeout=120)
    assert proc.returncode != 0 and "no config.json" in proc.stderr
