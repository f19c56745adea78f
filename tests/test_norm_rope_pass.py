"""The fuse_norm_rope pass: on hand-written graphs (traced with Inductor's decompositions, as the
backend's AOT step does) and on the built-in tiny models through the whole backend.

Counts asserted are exact: every attention layer has a q and a k rotation of a per-head RMSNorm,
every sparse (MSA) layer two more (the indexer's query and key)."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch.fx.experimental.proxy_tensor import make_fx

from minimax_backend.graph_passes.base import PassContext, PassError
from minimax_backend.graph_passes.config import BackendConfig
from minimax_backend.graph_passes.fuse_norm_rope import FuseNormRopePass
from minimax_backend.graph_passes.manager import run_passes
from minimax_backend.graph_passes.op_counts import op_counts
from minimax_backend.model.layers import RMSNorm, apply_rope, rope_cos_sin
from pass_harness import compile_with

FUSED = "minimax.rms_norm_rope"
EPS = 1e-6


def _trace(fn, *args):
    from torch._inductor.decomposition import select_decomp_table

    return make_fx(fn, decomposition_table=select_decomp_table(), tracing_mode="fake")(*args)


def _run(gm, **options):
    config = BackendConfig(**{"fuse_norm_rope": "on", **options})
    (res,) = run_passes(config, gm, PassContext(config=config), order=("fuse_norm_rope",))
    return res


def _attention_inputs(dtype=torch.bfloat16, tokens=7, heads=3, kv_heads=1, d=64, rotary=32):
    g = torch.Generator().manual_seed(0)
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * d, generator=g).to(dtype)
    wq, wk = (torch.randn(d, generator=g) * 0.2).to(dtype), (torch.randn(d, generator=g) * 0.2).to(dtype)
    cos, sin = rope_cos_sin(torch.arange(tokens) + 3, rotary, 5e6)
    return qkv, wq, wk, cos, sin


def _qk(heads=3, kv_heads=1, d=64, gemma=True, wrong_rotation=False):
    """model/layers.py Attention's QKV split -> per-head QK norm -> RoPE, as a function of tensors."""
    def norm(x, w):
        m = RMSNorm(d, EPS, gemma, "w", dtype=x.dtype, device="cpu")
        m.weight = torch.nn.Parameter(w, requires_grad=False)
        return m(x)

    def rope(x, cos, sin):
        if not wrong_rotation:
            return apply_rope(x, cos, sin)
        half = cos.shape[-1]
        x1, x2 = x[..., :half].float(), x[..., half:2 * half].float()
        c, s = cos[:, None, :], sin[:, None, :]
        rotated = torch.cat([x1 * c - x2 * s, x2 * c + x2 * s], dim=-1).to(x.dtype)  # x2 twice: not RoPE
        return torch.cat([rotated, x[..., 2 * half:]], dim=-1)

    def f(qkv, wq, wk, cos, sin):
        q, k, v = qkv.split([heads * d, kv_heads * d, kv_heads * d], dim=-1)
        q, k = q.reshape(-1, heads, d), k.reshape(-1, kv_heads, d)
        return rope(norm(q, wq), cos, sin), rope(norm(k, wk), cos, sin), v

    return f


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("gemma", [True, False])
def test_fuses_q_and_k_and_keeps_the_values(dtype, gemma):
    args = _attention_inputs(dtype)
    f = _qk(gemma=gemma)
    gm = _trace(f, *args)
    assert op_counts(gm.graph).get("aten.rsqrt") == 2
    res = _run(gm)
    assert (res.matches, res.candidates, res.breakdown) == (2, 2, {"fused": 1 * 2})
    counts = op_counts(gm.graph)
    assert counts.get(FUSED) == 2 and "aten.rsqrt" not in counts and "aten.cat" not in counts
    assert all("RMSNorm (" + ("Gemma" if gemma else "plain") in d for d in res.details)
    got, want = gm(*args), f(*args)
    for a, b in zip(got, want):
        assert torch.equal(a, b)


def test_rotary_over_the_whole_head():
    args = _attention_inputs(rotary=64)
    f = _qk()
    gm = _trace(f, *args)
    assert _run(gm).matches == 2
    assert all(torch.equal(a, b) for a, b in zip(gm(*args), f(*args)))


def test_a_rotation_that_is_not_rope_is_a_miss():
    """A norm feeds a rotation-shaped cat that is not RoPE: left alone, and reported (strict: an error)."""
    args = _attention_inputs()
    gm = _trace(_qk(wrong_rotation=True), *args)
    with pytest.raises(PassError, match="not x2 \\* cos \\+ x1 \\* sin"):
        _run(gm, strict=True)
    gm = _trace(_qk(wrong_rotation=True), *args)
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        res = _run(gm)
    assert res.matches == 0 and res.candidates == 2 and "not x2 * cos + x1 * sin" in res.skipped
    assert any("fuse_norm_rope" in str(x.message) for x in w)
    assert FUSED not in op_counts(gm.graph)


def test_rope_without_a_norm_is_not_a_candidate():
    args = _attention_inputs()

    def f(qkv, wq, wk, cos, sin):
        q = qkv[:, :192].reshape(-1, 3, 64)
        return apply_rope(q, cos, sin)

    gm = _trace(f, *args)
    config = BackendConfig()
    assert FuseNormRopePass(config).decide(gm, PassContext(config=config)) == (
        False, "auto: no RoPE rotation of an RMSNorm output in the graph: nothing to fuse")
    with pytest.raises(PassError):  # forced on, finding nothing is a miss
        _run(gm, strict=True)


def test_auto_runs_it_where_a_norm_is_rotated():
    gm = _trace(_qk(), *_attention_inputs())
    config = BackendConfig()
    assert FuseNormRopePass(config).decide(gm, PassContext(config=config)) == (True, None)


def _tiny(preset: str, dtype=torch.bfloat16):
    from minimax_backend.model.minimax import build_model
    from minimax_backend.model.presets import load_preset
    from minimax_backend.model.random_weights import init_random_weights

    cfg = load_preset(preset)
    model = init_random_weights(build_model(cfg, dtype=dtype))
    ids = torch.randint(0, cfg.vocab_size, (1, 13), generator=torch.Generator().manual_seed(1))
    return cfg, model, (ids, torch.arange(13)[None])


def _record(report, name="fuse_norm_rope"):
    return next(p for p in report["passes"] if p["name"] == name)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_tiny_m3_every_qk_norm_fuses_and_the_logits_are_eagers(dtype):
    cfg, model, args = _tiny("tiny-m3", dtype)
    out, rep = compile_with(model, args, strict=True)  # auto
    rec = _record(rep)
    layers = cfg.num_hidden_layers
    sparse = sum(1 for line in rec["details"] if "[1 heads" in line)  # the indexer's one key head per sparse layer
    assert sparse >= 1
    assert rec["matches"] == 2 * layers + 2 * sparse == rep["ops_after"][FUSED]
    with torch.no_grad():
        want = model(*args)
    assert torch.equal(out, want)
    off, rep_off = compile_with(model, args, fuse_norm_rope="off")
    assert rep_off["ops_after"].get(FUSED, 0) == 0 and torch.equal(off, want)


def test_tiny_m2_per_layer_qk_norm_is_not_a_candidate():
    """M2 normalizes the whole projection: its rotations are listed as left alone; under auto no miss,
    forced on a miss (nothing it could fuse)."""
    _, model, args = _tiny("tiny-m2")
    out, rep = compile_with(model, args, strict=True)
    rec = _record(rep)
    assert rec["matches"] == 0 and rec["skipped"].startswith("auto: no RoPE rotation of an RMSNorm output")
    with warnings.catch_warnings(record=True):
        warnings.simplefilter("always")
        out, rep = compile_with(model, args, fuse_norm_rope="on")
    rec = _record(rep)
    assert rec["matches"] == 0 and rep["ops_after"].get(FUSED, 0) == 0
    assert any("not an RMSNorm output left alone" in d for d in rec["details"])
