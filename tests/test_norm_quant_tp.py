"""fuse_norm_quant numerics: the real model's graph at TP 1, and TP 2 on gloo.

* TP 1: the tiny FP8 MiniMax-M3 compiled with backend="minimax" (FX codegen)
  gets every input / post-attention norm fused and its logits equal eager
  bit for bit (the fused op's CPU path is the model's own arithmetic).
* TP 2 (gloo), toy: quantize-then-gather (the fp8_allgather option) gives
  the same FP8 data and scales as gather-then-quantize, byte for byte, at an
  odd token count (sequence-parallel padding on), and the whole toy's output
  is equal to the unsharded eager function.
* TP 2 (gloo), model (slow): the tiny FP8 model with sequence parallelism,
  compiled with the pass, with and without fp8_allgather, equals eager:
  stated tolerance 0 (bit-equal) with FX codegen. (With Inductor codegen the
  compiled model differs from eager by Inductor's own reordering of the
  unfused float math, by the same amount with the pass on or off.)
"""

from __future__ import annotations

import pytest
import torch

import minimax_backend.graph_passes as gp

FUSED = "minimax.rms_norm_quant_fp8"
QUANT = "minimax.quantize_fp8"
OFF = dict(moe_canonicalize="off", gemm_reduce_scatter="off", moe_lower="off")  # other passes: not under test


def tiny_fp8_config():
    from conftest import tiny_m3_config

    # 1 dense + 1 MoE layer, 2 experts: every norm kind, compiles in seconds
    return tiny_m3_config(quant_method="fp8", num_local_experts=2, num_hidden_layers=2,
                          mlp_layer_types=("dense", "moe"), sparse_attention_layers=(1,), num_mtp_modules=0)


def _fuse_record(rep):
    return next(p for p in rep["passes"] if p["name"] == "fuse_norm_quant")


def test_tiny_fp8_model_tp1_fused_equals_eager():
    from minimax_backend.model.minimax import build_model, init_random_weights

    torch._dynamo.reset()
    cfg = tiny_fp8_config()
    m = init_random_weights(build_model(cfg, dtype=torch.bfloat16), seed=0)
    ids = torch.randint(0, cfg.vocab_size, (1, 7), generator=torch.Generator().manual_seed(3))
    pos = torch.arange(7)[None]
    with torch.no_grad():
        ref = m(ids, pos)
        out = gp.compile(m, codegen="fx", strict=True, fuse_norm_quant="on", **OFF)(ids, pos)
    assert torch.equal(out, ref)
    rep = gp.last_compile_report()
    rec = _fuse_record(rep)
    # 2 layers x (input norm, post-attention norm); the MoE's post norm keeps BF16 for the router;
    # every norm but the first takes over its residual add
    assert rec["breakdown"] == {"fused": 3, "fused_with_bf16_output": 1, "kept_bf16_before_gather": 0,
                                "with_residual_add": 3}
    assert rep["ops_after"][FUSED] == 4
    # gone: the QKV inputs (2; layer 1's QKV + indexer projections share one after fuse_indexer_qkv:
    # 2 more), the dense gate_up input (1), the 2 experts' + shared expert's inputs (3);
    # left: the o_proj and down_proj inputs (not behind a norm)
    assert rep["ops_after"][QUANT] == rep["ops_before"][QUANT] - 2 - 2 - 1 - 3 == 6
    torch._dynamo.reset()


# ------------------------------------------------------------------ gloo, toy
def _toy_rank(rank: int, world: int, tokens: int):
    import torch.distributed as dist
    from test_norm_quant_pass import HIDDEN, rms_norm, run_pass, toy, toy_args, trace

    from minimax_backend.graph_passes.meta_refresh import refresh_fake_meta
    from minimax_backend.graph_passes.op_counts import op_counts
    from minimax_backend.patterns.sequence_parallel import shard_residual_stream

    group = dist.group.WORLD.group_name
    c10d = torch.ops._c10d_functional
    out = {}

    # 1. the gathered FP8 data and scales themselves
    def gather_then_quantize(h_shard, n):
        full = c10d.wait_tensor(c10d.all_gather_into_tensor(rms_norm(h_shard, n), world, group))
        return torch.ops.minimax.quantize_fp8(full[:tokens], 128)

    g = torch.Generator().manual_seed(100 + rank)  # each rank its own shard
    shard = (torch.randn(-(-tokens // world), HIDDEN, generator=g) * 3).to(torch.bfloat16)
    n = (torch.randn(HIDDEN, generator=torch.Generator().manual_seed(1)) * 0.1).to(torch.bfloat16)
    bf16_gm = trace(gather_then_quantize, (shard, n))
    fp8_gm = trace(gather_then_quantize, (shard, n))
    assert run_pass(bf16_gm, tp=world).breakdown["kept_bf16_before_gather"] == 1
    assert run_pass(fp8_gm, tp=world, fp8_allgather=True).breakdown["fp8_allgather"] == 1
    out["gathered_bf16"] = bf16_gm(shard, n)
    out["gathered_fp8"] = fp8_gm(shard, n)
    out["ops_fp8"] = op_counts(fp8_gm)

    # 2. the toy model, sequence parallel, with both gather forms, against eager
    args = toy_args(tokens, seed=7)
    out["eager"] = toy(group, 2)(*args)
    for fp8_allgather in (False, True):
        gm = trace(toy(group, 2), args)
        shard_residual_stream(gm.graph)
        gm.recompile()
        refresh_fake_meta(gm)
        rec = run_pass(gm, tp=world, fp8_allgather=fp8_allgather)
        out[f"toy_{fp8_allgather}"] = (gm(*args), dict(rec.breakdown))  # plain dict: it crosses a process
    return out


def test_fp8_allgather_equals_gather_then_quantize_tp2():
    from multirank import run_multirank

    tokens = 7  # odd: the shards carry one padding row
    results = run_multirank(_toy_rank, 2, args=(tokens,), timeout=240)
    for r in results:
        (q_ref, s_ref), (q, s) = r["gathered_bf16"], r["gathered_fp8"]
        assert q.shape == (tokens, 256) and s.shape == (tokens, 2)
        assert torch.equal(q.view(torch.uint8), q_ref.view(torch.uint8))
        assert torch.equal(s, s_ref)
        assert r["ops_fp8"]["_c10d_functional.all_gather_into_tensor"] == 2  # data (bytes) + scales
        assert QUANT not in r["ops_fp8"]
        out_bf16, rec_bf16 = r["toy_False"]
        out_fp8, rec_fp8 = r["toy_True"]
        assert rec_bf16["kept_bf16_before_gather"] == 4
        assert rec_fp8["fp8_allgather"] == 2 and rec_fp8["kept_bf16_before_gather"] == 2
        assert torch.equal(out_fp8, out_bf16)
        assert torch.equal(out_bf16, r["eager"])
    # both ranks gathered the same full tensors
    assert torch.equal(results[0]["gathered_fp8"][1], results[1]["gathered_fp8"][1])


# ------------------------------------------------------------------ gloo, model
def _model_rank(rank: int, world: int, tokens: int):
    from minimax_backend.model.minimax import build_model, init_random_weights
    from minimax_backend.model.parallel import ParallelState

    cfg = tiny_fp8_config()
    m = init_random_weights(build_model(cfg, ParallelState.from_world(world), dtype=torch.bfloat16), seed=0)
    ids = torch.randint(0, cfg.vocab_size, (1, tokens), generator=torch.Generator().manual_seed(tokens))
    pos = torch.arange(tokens)[None]
    out = {}
    with torch.no_grad():
        out["eager"] = m(ids, pos)
        for fp8_allgather in (False, True):
            torch._dynamo.reset()
            f = gp.compile(m, codegen="fx", strict=True, sequence_parallel="on", fuse_norm_quant="on",
                           fp8_allgather=fp8_allgather, tp_size=world, **OFF)
            logits = f(ids, pos)
            rep = gp.last_compile_report()
            out[fp8_allgather] = (logits, _fuse_record(rep)["breakdown"], rep["ops_after"])
    return out


@pytest.mark.slow
def test_tiny_fp8_model_tp2_sp_compiled_equals_eager():
    from multirank import run_multirank

    for r in run_multirank(_model_rank, 2, args=(7,), timeout=300):
        logits_bf16, rec_bf16, ops_bf16 = r[False]
        logits_fp8, rec_fp8, ops_fp8 = r[True]
        # every norm's output is gathered under SP: all kept BF16 in front of their gathers
        assert rec_bf16 == {"fused": 0, "fused_with_bf16_output": 0, "kept_bf16_before_gather": 4,
                            "with_residual_add": 0}
        assert FUSED not in ops_bf16
        # FP8 gather: both attention inputs and the dense MLP input; the MoE input stays BF16 (router)
        assert rec_fp8 == {"fused": 0, "fused_with_bf16_output": 0, "kept_bf16_before_gather": 1,
                           "fp8_allgather": 3, "with_residual_add": 2}
        assert ops_fp8[FUSED] == 3
        assert torch.equal(logits_bf16, r["eager"])  # tolerance: none (FX codegen)
        assert torch.equal(logits_fp8, logits_bf16)  # FP8 gather == BF16 gather + quantize
