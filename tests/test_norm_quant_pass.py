"""The fuse_norm_quant pass on small hand-written FP8 graphs (fake process group).

The toy has the model's residual stream in FP8: an all-reduced embedding,
then per layer an attention-like block (input norm -> FP8 QKV linear -> BF16
projection -> all-reduce) and an MoE-like block (post norm -> FP8 expert
linear, and a router that reads the BF16 norm output -> all-reduce), a final
norm and a BF16 lm_head. The norms are written as model/layers.py writes
them and the FP8 linears as model/linear.py does (quantize_fp8 then
fp8_block_gemm); the graph is traced with Inductor's decompositions, as the
backend's AOT step does. Counts asserted are exact.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.fx.experimental.proxy_tensor import make_fx

from minimax_backend.graph_passes.base import PassContext, PassError
from minimax_backend.graph_passes.config import BackendConfig
from minimax_backend.graph_passes.fuse_norm_quant import NO_FP8, NO_NORM_QUANT, FuseNormQuantPass
from minimax_backend.graph_passes.manager import run_passes
from minimax_backend.graph_passes.meta_refresh import refresh_fake_meta
from minimax_backend.graph_passes.op_counts import op_counts
from minimax_backend.patterns.sequence_parallel import shard_residual_stream
from minimax_backend.kernels.fp8 import quantize_weight_fp8

AG = "_c10d_functional.all_gather_into_tensor"
FUSED = "minimax.rms_norm_quant_fp8"
QUANT = "minimax.quantize_fp8"
HIDDEN, VOCAB, EXPERTS, EPS = 256, 64, 4, 1e-6
mx = torch.ops.minimax
c10d = torch.ops._c10d_functional


# ------------------------------------------------------------------ the toy
def rms_norm(h, w, gemma=True):
    """model/layers.py RMSNorm.forward, verbatim."""
    x32 = h.float()
    normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + EPS)
    if gemma:
        return (normed * (1.0 + w.float())).to(h.dtype)
    return normed.to(h.dtype) * w


def fp8_linear(x, w, s):
    """model/linear.py ParallelLinear.forward (FP8)."""
    xq, xs = mx.quantize_fp8(x, 128)
    return mx.fp8_block_gemm(xq, xs, w, s, x.dtype)


def toy(group: str | None, layers: int = 2, gemma: bool = True, router: bool = True):
    def all_reduce(x):
        return x if group is None else c10d.wait_tensor(c10d.all_reduce(x, "sum", group))

    def forward(ids, emb, wq, sq, wo, wr, wu, su, n1, n2, nf, head):
        h = all_reduce(F.embedding(ids, emb))
        for _ in range(layers):
            a = fp8_linear(rms_norm(h, n1, gemma), wq, sq)
            h = h + all_reduce(a @ wo)
            x = rms_norm(h, n2, gemma)
            y = fp8_linear(x, wu, su)
            if router:
                top = torch.topk((x.float() @ wr).sigmoid(), 1, dim=-1)
                y = y * top.values.to(y.dtype)
            h = h + all_reduce(y)
        return rms_norm(h, nf, gemma) @ head

    return forward


def toy_args(tokens: int, seed: int = 0, scale: float = 1.0):
    """Real inputs (the same on every rank for a given seed); FP8 weights quantized in 128 x 128 blocks."""
    g = torch.Generator().manual_seed(seed)
    bf = torch.bfloat16

    def rnd(*shape, s=1.0):
        return torch.randn(*shape, generator=g) * s

    wq, sq = quantize_weight_fp8(rnd(HIDDEN, HIDDEN, s=HIDDEN**-0.5))
    wu, su = quantize_weight_fp8(rnd(HIDDEN, HIDDEN, s=HIDDEN**-0.5))
    return (
        torch.randint(0, VOCAB, (tokens,), generator=g),
        rnd(VOCAB, HIDDEN, s=scale).to(bf),
        wq, sq,
        rnd(HIDDEN, HIDDEN, s=HIDDEN**-0.5).to(bf),
        rnd(HIDDEN, EXPERTS),
        wu, su,
        rnd(HIDDEN, s=0.1).to(bf), rnd(HIDDEN, s=0.1).to(bf), rnd(HIDDEN, s=0.1).to(bf),
        rnd(HIDDEN, VOCAB, s=HIDDEN**-0.5).to(bf),
    )


def trace(fn, args):
    from torch._inductor.decomposition import select_decomp_table

    return make_fx(fn, decomposition_table=select_decomp_table(), tracing_mode="fake")(*args)


def run_pass(gm, tp: int = 1, **options):
    config = BackendConfig(fuse_norm_quant="on", strict=True, **options)
    (res,) = run_passes(config, gm, PassContext(config=config, tp_size=tp), order=("fuse_norm_quant",))
    return res


def nodes(gm, name):
    from minimax_backend.patterns.fx import op_name

    return [n for n in gm.graph.nodes if op_name(n) == name]


# ------------------------------------------------------------------ no SP
@pytest.mark.parametrize("layers", [1, 3])
def test_no_sp_every_norm_quant_pair_is_fused(fake_tp2, layers):
    gm = trace(toy(fake_tp2, layers), toy_args(8))
    before = op_counts(gm)
    assert before[QUANT] == 2 * layers and FUSED not in before
    res = run_pass(gm)
    after = op_counts(gm)
    assert after[FUSED] == 2 * layers
    assert QUANT not in after
    assert after["minimax.fp8_block_gemm"] == before["minimax.fp8_block_gemm"]
    # input norms: FP8 only; post norms: FP8 + BF16 for the router
    assert res.breakdown == {"fused": layers, "fused_with_bf16_output": layers, "kept_bf16_before_gather": 0,
                             "with_residual_add": 2 * layers - 1}
    assert res.matches == 2 * layers
    # the norms' float32 math is gone, except the final norm (its lm_head is BF16)
    assert after["aten.rsqrt"] == 1
    # the residual adds moved into the kernel (the first norm reads the embedding)
    assert after["aten.add"] < before["aten.add"]


def test_dual_output_router_reads_bf16_experts_read_fp8(fake_tp2):
    gm = trace(toy(fake_tp2, 1), toy_args(8))
    run_pass(gm)
    fused = nodes(gm, FUSED)
    assert [f.args[6] for f in fused] == [False, True]  # want_bf16_output
    post = fused[1]
    outs = {u.args[1]: u for u in post.users}
    assert set(outs) == {0, 1, 2, 3}
    # the BF16 output feeds the router's float32 cast -> mm; the FP8 data + scales the GEMM
    assert all(u.target is torch.ops.prims.convert_element_type.default for u in outs[2].users)
    assert {u.target for u in outs[0].users} == {torch.ops.minimax.fp8_block_gemm.default}
    # the updated residual goes on to the next residual add
    assert {u.target for u in outs[3].users} == {torch.ops.aten.add.Tensor}


def test_without_router_the_post_norm_has_no_bf16_output(fake_tp2):
    gm = trace(toy(fake_tp2, 2, router=False), toy_args(8))
    res = run_pass(gm)
    assert res.breakdown["fused"] == 4 and res.breakdown["fused_with_bf16_output"] == 0
    assert all(f.args[6] is False for f in nodes(gm, FUSED))


@pytest.mark.parametrize("gemma", [True, False])
@pytest.mark.parametrize("tokens", [1, 7])
def test_fused_graph_equals_unfused_bit_for_bit(gemma, tokens):
    """TP 1 (no collectives): run the graph before and after the pass on real tensors."""
    args = toy_args(tokens, seed=tokens)
    gm = trace(toy(None, 2, gemma=gemma), args)
    ref = gm(*args)
    res = run_pass(gm)
    assert res.matches == 4 and op_counts(gm)[FUSED] == 4
    out = gm(*args)
    assert torch.equal(out, ref)


def test_quantize_behind_a_view_of_a_3d_norm_output():
    def fn(h, n, w, s):
        x = rms_norm(h, n)  # [B, S, K]
        return fp8_linear(x.view(-1, HIDDEN), w, s), x.sum()

    args = (torch.randn(2, 3, HIDDEN).to(torch.bfloat16), (torch.randn(HIDDEN) * 0.1).to(torch.bfloat16),
            *quantize_weight_fp8(torch.randn(128, HIDDEN) * 0.05))
    gm = trace(fn, args)
    ref = gm(*args)
    res = run_pass(gm)
    assert res.breakdown["fused_with_bf16_output"] == 1  # x.sum() reads BF16
    fused = nodes(gm, FUSED)[0]
    assert tuple(fused.meta["val"][0].shape) == (2, 3, HIDDEN)
    out = gm(*args)
    assert all(torch.equal(a, b) for a, b in zip(out, ref))


# ------------------------------------------------------------------ SP
def sp_graph(group, tokens, layers=2, router=True):
    gm = trace(toy(group, layers, router=router), toy_args(tokens))
    shard_residual_stream(gm.graph)
    gm.recompile()
    refresh_fake_meta(gm)
    return gm


def _gathered_from(gm):
    """For each all-gather: (its input's dtype, the op that produced the input)."""
    return [(g.args[0].meta["val"].dtype, g.args[0].target) for g in nodes(gm, AG)]


@pytest.mark.parametrize("tokens", [8, 7])
def test_sp_keeps_bf16_in_front_of_the_gathers(fake_tp2, tokens):
    """The source engine's start-up crash: norm -> all_gather -> quantize must NOT be fused."""
    gm = sp_graph(fake_tp2, tokens)
    before = op_counts(gm)
    assert before[AG] == 2 * 2 + 1 and before[QUANT] == 4
    res = run_pass(gm, tp=2)
    after = op_counts(gm)
    assert FUSED not in after
    assert after == before  # nothing changed
    assert res.breakdown == {"fused": 0, "fused_with_bf16_output": 0, "kept_bf16_before_gather": 4,
                             "with_residual_add": 0}
    assert res.matches == 4
    # every gather moves BF16 norm outputs; quantization happens after the gather
    assert all(dt == torch.bfloat16 for dt, _ in _gathered_from(gm))
    for q in nodes(gm, QUANT):
        src = q.args[0]
        if tokens % 2:
            assert src.target is torch.ops.aten.slice.Tensor
            src = src.args[0]
        assert src.target is torch.ops._c10d_functional.wait_tensor.default
    assert any("kept BF16 in front of" in d for d in res.details)


def test_same_model_without_sp_gets_the_fusion(fake_tp2):
    gm = trace(toy(fake_tp2, 2), toy_args(8))
    assert run_pass(gm).breakdown["kept_bf16_before_gather"] == 0
    assert op_counts(gm)[FUSED] == 4


def test_sp_form_fuses_where_no_gather_intervenes(fake_tp2):
    """Post-SP form where the MoE-like block consumes the token shard directly
    (as after MegaMoE lowering): that norm is fused on the shard; the attention
    input, which is gathered, stays BF16 in front of its gather."""
    group = fake_tp2

    def fn(x0, wq, sq, wu, su, n1, n2):
        h = c10d.wait_tensor(c10d.reduce_scatter_tensor(x0, "sum", 2, group))  # [T/2, H]
        xg = c10d.wait_tensor(c10d.all_gather_into_tensor(rms_norm(h, n1), 2, group))[:7]
        a = fp8_linear(xg, wq, sq)
        h = h + c10d.wait_tensor(c10d.reduce_scatter_tensor(F.pad(a, (0, 0, 0, 1)), "sum", 2, group))
        y = fp8_linear(rms_norm(h, n2), wu, su)  # on the shard
        return h + y

    a = toy_args(8)
    args = (torch.randn(8, HIDDEN).to(torch.bfloat16), a[2], a[3], a[6], a[7], a[8], a[9])
    gm = trace(fn, args)
    res = run_pass(gm, tp=2)
    assert res.breakdown == {"fused": 1, "fused_with_bf16_output": 0, "kept_bf16_before_gather": 1,
                             "with_residual_add": 1}
    after = op_counts(gm)
    assert after[FUSED] == 1 and after[QUANT] == 1 and after[AG] == 1
    assert _gathered_from(gm) == [(torch.bfloat16, torch.ops.prims.convert_element_type.default)]
    fused = nodes(gm, FUSED)[0]
    assert tuple(fused.meta["val"][0].shape) == (4, HIDDEN)  # the token shard


# ------------------------------------------------------------------ FP8 all-gather
@pytest.mark.parametrize("tokens", [8, 7])
def test_fp8_allgather_gathers_data_and_scales(fake_tp2, tokens):
    gm = sp_graph(fake_tp2, tokens)
    before = op_counts(gm)
    res = run_pass(gm, tp=2, fp8_allgather=True)
    after = op_counts(gm)
    # attention inputs: fused on the shard, FP8 data + scales gathered (2 gathers each);
    # MoE inputs: the router reads BF16 after the gather, so BF16 is gathered there
    assert res.breakdown == {"fused": 0, "fused_with_bf16_output": 0, "kept_bf16_before_gather": 2,
                             "fp8_allgather": 2, "with_residual_add": 1}
    assert after[FUSED] == 2 and after[QUANT] == before[QUANT] - 2
    assert after[AG] == before[AG] + 2
    kinds = sorted(str(dt) for dt, _ in _gathered_from(gm))
    assert kinds == sorted(["torch.uint8"] * 2 + ["torch.float32"] * 2 + ["torch.bfloat16"] * 3)
    fused = nodes(gm, FUSED)
    assert all(tuple(f.meta["val"][0].shape) == ((tokens + 1) // 2, HIDDEN) for f in fused)
    # padding rows are dropped from both the data and the scales before the GEMM
    for gemm in nodes(gm, "minimax.fp8_block_gemm"):
        xq, xs = gemm.args[0], gemm.args[1]
        assert xq.meta["val"].shape[0] == xs.meta["val"].shape[0] == tokens
    if tokens % 2:
        slices = [n for n in nodes(gm, "aten.slice") if n.args[1] == 0 and n.args[3] == tokens]
        assert len(slices) == 2 * 2 + 3  # q and s of 2 FP8 gathers, 3 BF16 gathers


def test_fp8_allgather_without_router_gathers_every_norm_in_fp8(fake_tp2):
    gm = sp_graph(fake_tp2, 8, router=False)
    res = run_pass(gm, tp=2, fp8_allgather=True)
    assert res.breakdown["fp8_allgather"] == 4 and res.breakdown["kept_bf16_before_gather"] == 0
    assert QUANT not in op_counts(gm)


# ------------------------------------------------------------------ enabling, reporting
def test_bf16_graph_has_nothing_to_fuse_and_is_no_failure(fake_tp2):
    def bf16(h, w, n):
        return rms_norm(h, n) @ w

    gm = trace(bf16, (torch.randn(4, HIDDEN).to(torch.bfloat16), torch.randn(HIDDEN, 8).to(torch.bfloat16),
                      torch.randn(HIDDEN).to(torch.bfloat16)))
    res = run_pass(gm)  # forced on, strict: still no error
    assert res.matches == 0 and res.skipped == NO_FP8
    config = BackendConfig()
    assert FuseNormQuantPass(config).decide(gm, PassContext(config=config)) == (False, "auto: " + NO_FP8)


def test_quantize_without_a_norm_in_front_is_no_failure():
    gm = trace(lambda x, w, s: fp8_linear(x * 2, w, s),
               (torch.randn(4, HIDDEN).to(torch.bfloat16), *quantize_weight_fp8(torch.randn(128, HIDDEN) * 0.05)))
    res = run_pass(gm)
    assert res.matches == 0 and res.skipped == NO_NORM_QUANT


def test_unrecognized_norm_before_a_quantize_is_a_strict_failure():
    def odd_norm(h, n, w, s):  # sum / K instead of mean: not the model's RMSNorm
        x32 = h.float()
        y = (x32 * torch.rsqrt(x32.pow(2).sum(-1, keepdim=True) / HIDDEN + EPS) * (1.0 + n.float())).to(h.dtype)
        return fp8_linear(y, w, s)

    gm = trace(odd_norm, (torch.randn(4, HIDDEN).to(torch.bfloat16), torch.randn(HIDDEN).to(torch.bfloat16),
                          *quantize_weight_fp8(torch.randn(128, HIDDEN) * 0.05)))
    with pytest.raises(PassError, match="fuse_norm_quant is forced on .* matched nothing"):
        run_pass(gm)


def test_auto_rule_and_record_line(fake_tp2):
    config = BackendConfig()
    gm = trace(toy(fake_tp2, 1), toy_args(8))
    assert FuseNormQuantPass(config).decide(gm, PassContext(config=config)) == (True, None)
    off = BackendConfig(fuse_norm_quant="off")
    assert FuseNormQuantPass(off).decide(gm, PassContext(config=off))[0] is False
    res = run_pass(gm)
    line = res.summary()
    assert line.startswith("minimax: fuse_norm_quant matched 2 (fused 1, fused_with_bf16_output 1, "
                           "kept_bf16_before_gather 0, with_residual_add 1)")
    # the pass hash follows the FP8 gather option
    assert FuseNormQuantPass(config).uuid() != FuseNormQuantPass(config.replace(fp8_allgather=True)).uuid()
