"""fuse_allreduce_norm_quant: the all-reduce before each fused RMSNorm + FP8 quantization folds in.

Op counts on the fake process group (tiny-m3 with FP8 weights at TP 2, sequence parallelism
off as at decode sizes); numerics on gloo at TP 2 and 4: the compiled model with the pass
equals the same compile without it bit for bit (the op runs the same ops today), and eager
to 1e-5 of the largest logit (float32 activations), prefill and decode, at token counts that
do not divide by the TP size.
"""

from __future__ import annotations

import pytest
import torch

from conftest import tiny_m3_config
from multirank import run_multirank
from pass_harness import compile_with

AR = "_c10d_functional.all_reduce"
FUSED = "minimax.allreduce_rms_norm_quant"
OPTIONS = dict(sequence_parallel="off", fuse_allreduce_norm_quant="on", strict=True)


def _model(world: int, dtype=torch.bfloat16, **overrides):
    from minimax_backend.model.minimax import build_model, init_random_weights
    from minimax_backend.model.parallel import ParallelState

    # a shared expert of 512 keeps its FP8 shards block-aligned at TP 4
    cfg = tiny_m3_config(quant_method="fp8", num_mtp_modules=0, shared_intermediate_size=512, **overrides)
    return init_random_weights(build_model(cfg, ParallelState.from_world(world), dtype), seed=1)


def test_every_all_reduce_before_a_norm_folds_in(fake_tp2):
    torch._dynamo.reset()
    model = _model(2)
    args = (torch.zeros(1, 7, dtype=torch.long), torch.arange(7)[None])
    _, rep = compile_with(model, args, tp_size=2, ep_size=2, **OPTIONS)
    record = next(p for p in rep["passes"] if p["name"] == "fuse_allreduce_norm_quant")
    # FP8 (fused norm + quant): layer 0's post-attention norm, layer 1's input norm (after the
    # dense MLP); BF16 out: layers 1 and 2's post-attention norms (in front of the MoE). Not: the
    # embedding's all-reduce (the residual stream reads it too) and the norms after a MoE (its
    # all-reduce went into mega_moe: moe_lower runs first).
    assert record["matches"] == 4 and record["candidates"] == 4, record
    assert record["breakdown"] == {"allreduce + norm + quant": 2, "allreduce + norm (BF16 out)": 2}
    assert rep["ops_after"][FUSED] == 4
    assert rep["ops_after"][AR] == 1  # the embedding's
    assert all("tokens, group" in d for d in record["details"])


def test_above_the_token_limit_is_left_alone_and_strict_fails(fake_tp2):
    torch._dynamo.reset()
    model = _model(2)
    args = (torch.zeros(1, 9, dtype=torch.long), torch.arange(9)[None])
    with pytest.raises(Exception, match="above allreduce_fusion_max_tokens=8"):
        compile_with(model, args, tp_size=2, ep_size=2, allreduce_fusion_max_tokens=8, **OPTIONS)
    torch._dynamo.reset()
    off = {**OPTIONS, "fuse_allreduce_norm_quant": "auto"}
    _, rep = compile_with(model, args, tp_size=2, ep_size=2, **off)
    record = next(p for p in rep["passes"] if p["name"] == "fuse_allreduce_norm_quant")
    assert not record["enabled"] and "off until its single-kernel" in record["skipped"]


def _with_and_without(rank: int, world: int, tokens: list[int]) -> list[dict]:
    import minimax_backend.graph_passes as gp

    torch._dynamo.config.cache_size_limit = 64
    # a dense and a MoE layer: both forms of the fusion (FP8 out, BF16 out before the MoE)
    model = _model(world, torch.float32, num_hidden_layers=2, mlp_layer_types=("dense", "moe"),
                   sparse_attention_layers=(1,))
    common = dict(codegen="fx", cudagraphs=False, tp_size=world, ep_size=world, sequence_parallel="off", strict=True)
    fused = gp.compile(model, fuse_allreduce_norm_quant="on", **common)
    plain = gp.compile(model, fuse_allreduce_norm_quant="off", **common)
    out = []
    with torch.no_grad():
        for t in tokens:
            ids = torch.randint(0, model.config.vocab_size, (2, t), generator=torch.Generator().manual_seed(t))
            pos = torch.arange(t).expand(2, -1).contiguous()
            model.allocate_kv_cache(2, t + 2)
            eager = model(ids, pos)
            step, at = eager[:, -1:].argmax(-1), torch.full((2, 1), t)
            eager_step = model(step, at)
            a = fused(ids, pos)
            fused_ops = gp.last_compile_report()["ops_after"].get(FUSED, 0)
            b = plain(ids, pos)
            a_step, b_step = fused(step, at), plain(step, at)
            rel = lambda x, y: ((x - y).abs().max() / y.abs().max()).item()  # noqa: E731
            out.append({"tokens": t, "fused_ops": fused_ops, "same": bool(torch.equal(a, b) and torch.equal(a_step, b_step)),
                        "prefill": rel(a, eager), "decode": rel(a_step, eager_step)})
    return out


@pytest.mark.slow
@pytest.mark.parametrize("world, tokens", [(2, [7]), (4, [7])])
def test_gloo_numerics_equal_the_unfused_graph(world, tokens):
    for rank_results in run_multirank(_with_and_without, world, args=(tokens,), timeout=600):
        for r in rank_results:
            # FP8 out: layer 0's post-attention norm, layer 1's input norm; BF16 out: layer 1's
            # post-attention norm (in front of the MoE)
            assert r["fused_ops"] == 3, r
            assert r["same"], r
            assert r["prefill"] <= 1e-5 and r["decode"] <= 1e-5, r
