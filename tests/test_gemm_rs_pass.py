"""The GEMM + reduce-scatter pass on hand-built graphs (fake process group) and on tiny-m3 after SP.

Graphs are traced with make_fx in the form the sequence-parallel pass leaves
them: matmul -> [pad rows] -> reduce_scatter_tensor -> wait_tensor. Counts
asserted are exact.
"""

from __future__ import annotations

import operator

import pytest
import torch
import torch.nn.functional as F
from torch.fx.experimental.proxy_tensor import make_fx

from pass_harness import run_pass

from minimax_backend.graph_passes.base import PassContext, PassError, PassWarning
from minimax_backend.graph_passes.config import BackendConfig
from minimax_backend.graph_passes.gemm_reduce_scatter import GemmReduceScatterPass
from minimax_backend.graph_passes.manager import PassManager
from minimax_backend.graph_passes.op_counts import op_counts
from minimax_backend.kernels.fp8 import quantize_weight_fp8

RS = "_c10d_functional.reduce_scatter_tensor"
WAIT = "_c10d_functional.wait_tensor"
GEMM_RS = "minimax.gemm_rs"
K, N = 256, 128
c10d = torch.ops._c10d_functional


def _rs(y, fake_tp2, tokens, tp=2):
    pad = -(-tokens // tp) * tp - tokens
    if pad:
        y = torch.constant_pad_nd(y, [0, 0, 0, pad], 0.0)
    return c10d.wait_tensor(c10d.reduce_scatter_tensor(y, "sum", tp, fake_tp2))


def _run(gm, **options):
    return run_pass("gemm_reduce_scatter", gm, PassContext(config=BackendConfig(), tp_size=2), **options)


def _gemm_rs_nodes(gm):
    return [n for n in gm.graph.nodes if n.target is torch.ops.minimax.gemm_rs.default]


def _weights():
    w = torch.randn(N, K) / K**0.5
    wq, ws = quantize_weight_fp8(w)
    return w.bfloat16(), wq, ws


@pytest.mark.parametrize("tokens, pad", [(7, 1), (8, 0)])
def test_bf16_linear_pad_and_reduce_scatter_become_one_op(fake_tp2, tokens, pad):
    gm = make_fx(lambda x, w: _rs(F.linear(x, w), fake_tp2, tokens), tracing_mode="fake")(
        torch.randn(tokens, K, dtype=torch.bfloat16), _weights()[0])
    before = op_counts(gm)
    assert before["aten.mm"] == before[RS] == 1 and before.get("aten.constant_pad_nd", 0) == (1 if pad else 0)
    res = _run(gm)
    after = op_counts(gm)
    assert res.matches == 1 and res.breakdown == {"bf16": 1, "fp8": 0, "fp8_prequantized": 0}
    # The matmul, the weight's transpose, the pad, the reduce-scatter and its wait are all gone.
    assert after == {GEMM_RS: 1}
    (node,) = _gemm_rs_nodes(gm)
    x, w, xs, ws, bias, pad_rows, min_tokens, tp, name = node.args
    assert (x.op, w.op, xs, ws, bias, pad_rows, tp, name) == ("placeholder", "placeholder", None, None, None, pad, 2, fake_tp2)
    assert tuple(node.meta["val"].shape) == ((tokens + pad) // 2, N)
    assert node.meta["val"].dtype == torch.bfloat16


def test_addmm_bias_is_carried(fake_tp2):
    gm = make_fx(lambda x, w, b: _rs(F.linear(x, w, b), fake_tp2, 7), tracing_mode="fake")(
        torch.randn(7, K), torch.randn(N, K), torch.randn(N))
    assert op_counts(gm)["aten.addmm"] == 1
    res = _run(gm)
    (node,) = _gemm_rs_nodes(gm)
    assert res.matches == 1 and node.args[4].op == "placeholder"  # the bias
    assert op_counts(gm) == {GEMM_RS: 1}


def test_fp8_quantized_right_before(fake_tp2):
    _, wq, ws = _weights()

    def f(x, wq, ws):
        q, s = torch.ops.minimax.quantize_fp8(x, 128)
        return _rs(torch.ops.minimax.fp8_block_gemm(q, s, wq, ws, torch.bfloat16), fake_tp2, 7)

    gm = make_fx(f, tracing_mode="fake")(torch.randn(7, K, dtype=torch.bfloat16), wq, ws)
    res = _run(gm)
    assert res.breakdown == {"bf16": 0, "fp8": 1, "fp8_prequantized": 0}
    assert op_counts(gm) == {GEMM_RS: 1, "minimax.quantize_fp8": 1, "operator.getitem": 2}
    (node,) = _gemm_rs_nodes(gm)
    assert node.args[0].target is operator.getitem and node.args[2].target is operator.getitem
    assert node.kwargs == {"out_dtype": torch.bfloat16}
    assert node.meta["val"].dtype == torch.bfloat16 and tuple(node.meta["val"].shape) == (4, N)


def test_fp8_input_quantized_upstream(fake_tp2):
    """The FP8 data and scales arrive from elsewhere (a graph input here; a fused
    norm+quant or an FP8 all-gather in the model): same op, reported apart."""
    _, wq, ws = _weights()
    f = lambda xq, xs, wq, ws: _rs(torch.ops.minimax.fp8_block_gemm(xq, xs, wq, ws, torch.bfloat16), fake_tp2, 7)  # noqa: E731
    xq = torch.randn(7, K).to(torch.float8_e4m3fn)
    gm = make_fx(f, tracing_mode="fake")(xq, torch.ones(7, K // 128), wq, ws)
    res = _run(gm)
    assert res.breakdown == {"bf16": 0, "fp8": 0, "fp8_prequantized": 1}
    (node,) = _gemm_rs_nodes(gm)
    assert [a.op for a in node.args[:4]] == ["placeholder"] * 4
    assert op_counts(gm) == {GEMM_RS: 1}


def test_matmul_used_elsewhere_is_left_alone(fake_tp2):
    def f(x, w):
        y = F.linear(x, w)
        return _rs(y, fake_tp2, 7), y.sum()  # the full matmul output is read a second time

    gm = make_fx(f, tracing_mode="fake")(torch.randn(7, K), torch.randn(N, K))
    before = op_counts(gm)
    res = _run(gm)
    assert res.matches == 0 and op_counts(gm) == before
    assert "also used by" in " ".join(res.details) and "fed by a matmul that only feeds it" in res.skipped
    # A matmul does feed a reduce-scatter, so fusing nothing is a miss: strict fails, else it warns.
    assert res.expected
    strict = BackendConfig(strict=True)
    with pytest.raises(PassError, match="gemm_reduce_scatter"):
        PassManager(strict, order=("gemm_reduce_scatter",)).run(gm, PassContext(config=strict, tp_size=2))
    with pytest.warns(PassWarning, match="also used by"):
        PassManager(BackendConfig(), order=("gemm_reduce_scatter",)).run(gm, PassContext(config=BackendConfig(), tp_size=2))


def test_view_that_keeps_the_shape_is_fine_a_reshape_is_not(fake_tp2):
    ok = make_fx(lambda x, w: _rs(F.linear(x, w).view(7, N), fake_tp2, 7), tracing_mode="fake")(
        torch.randn(7, K), torch.randn(N, K))
    assert _run(ok).matches == 1 and op_counts(ok) == {GEMM_RS: 1}

    bad = make_fx(lambda x, w: _rs(F.linear(x, w).reshape(14, N // 2), fake_tp2, 14), tracing_mode="fake")(
        torch.randn(7, K), torch.randn(N, K))
    res = _run(bad)
    assert res.matches == 0 and "reshaped" in " ".join(res.details)


def test_sum_of_partials_is_not_fused(fake_tp2):
    """The MoE's reduce-scatter is fed by routed experts + shared expert: not one matmul."""
    f = lambda x, w1, w2: _rs(F.linear(x, w1) + F.linear(x, w2), fake_tp2, 7)  # noqa: E731
    gm = make_fx(f, tracing_mode="fake")(torch.randn(7, K), torch.randn(N, K), torch.randn(N, K))
    res = _run(gm)
    assert res.matches == 0 and "sum of partials" in res.details[0]
    assert not res.expected  # nothing here was fusable: not a failure


def test_no_reduce_scatter_skips_with_a_reason(fake_tp2):
    f = lambda x, w: c10d.wait_tensor(c10d.all_reduce(F.linear(x, w), "sum", fake_tp2))  # noqa: E731
    gm = make_fx(f, tracing_mode="fake")(torch.randn(7, K), torch.randn(N, K))
    res = _run(gm)
    assert res.matches == 0 and "no reduce-scatter" in res.skipped and not res.expected
    strict = BackendConfig(strict=True, gemm_reduce_scatter="on")
    results = PassManager(strict, order=("gemm_reduce_scatter",)).run(gm, PassContext(config=strict, tp_size=2))
    assert results[0].enabled and results[0].matches == 0  # no PassError


def test_threshold_comes_from_the_config(fake_tp2):
    gm = make_fx(lambda x, w: _rs(F.linear(x, w), fake_tp2, 7), tracing_mode="fake")(torch.randn(7, K), torch.randn(N, K))
    res = _run(gm, gemm_rs_min_tokens=77)
    (node,) = _gemm_rs_nodes(gm)
    assert node.args[6] == 77
    assert "min_tokens 77" in res.details[-1]
    # The threshold is part of the pass's identity (compile cache).
    p77 = GemmReduceScatterPass(BackendConfig(gemm_rs_min_tokens=77))
    assert p77.uuid() != GemmReduceScatterPass(BackendConfig(gemm_rs_min_tokens=78)).uuid()


@pytest.mark.parametrize("options, tp, enabled, reason", [
    ({}, 2, True, None),
    ({}, 1, False, "TP is 1"),
    ({"gemm_reduce_scatter": "off"}, 4, False, "off in config"),
    ({"gemm_reduce_scatter": "on"}, 2, True, None),
])
def test_switch(options, tp, enabled, reason):
    config = BackendConfig(**options)
    on, why = GemmReduceScatterPass(config).decide(None, PassContext(config=config, tp_size=tp))
    assert on is enabled and (reason is None or reason in why)


# ------------------------------------------------------------ tiny-m3 after SP
def _tiny_m3_report(fake_tp2, preset: str):
    import minimax_backend.graph_passes as gp
    from minimax_backend.model.presets import load_preset
    from minimax_backend.model.minimax import build_model
    from minimax_backend.model.parallel import ParallelState

    config = load_preset(preset)
    model = build_model(config, ParallelState.create(0, 2, 2, fake_tp2), dtype=torch.bfloat16)
    ids, pos = torch.randint(0, config.vocab_size, (1, 7)), torch.arange(7)[None]
    torch._dynamo.reset()
    # Only the passes this test is about: the others are covered by their own tests.
    options = dict(codegen="fx", strict=True, sequence_parallel="on", gemm_reduce_scatter="on",
                   moe_canonicalize="off", fuse_norm_quant="off", moe_lower="off")
    with torch.no_grad():
        gp.compile(model, **options)(ids, pos)
    torch._dynamo.reset()
    rep = gp.last_compile_report()
    return config, rep, next(p for p in rep["passes"] if p["name"] == "gemm_reduce_scatter")


def _check_tiny_m3(config, rep, record, kind):
    dense = sum(t == "dense" for t in config.mlp_layer_types)
    moe = config.num_hidden_layers - dense
    # one per o_proj and per dense down_proj; the embedding's and the MoE's stay
    assert rep["ops_after"][GEMM_RS] == config.num_hidden_layers + dense
    assert record["breakdown"][kind] == config.num_hidden_layers + dense
    assert rep["ops_after"][RS] == 1 + moe
    left = [d for d in record["details"] if d.startswith("left alone")]
    assert sum("embedding" in d for d in left) == 1 and sum("sum of partials" in d for d in left) == moe


def test_tiny_m3_after_sequence_parallelism(fake_tp2):
    _check_tiny_m3(*_tiny_m3_report(fake_tp2, "tiny-m3"), "bf16")


@pytest.mark.slow
def test_tiny_m3_fp8_after_sequence_parallelism(fake_tp2):
    _check_tiny_m3(*_tiny_m3_report(fake_tp2, "tiny-m3-fp8"), "fp8")
