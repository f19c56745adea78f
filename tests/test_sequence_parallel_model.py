"""Sequence parallelism on the real (tiny) MiniMax-M3 model.

Op counts come from compiling in one process on the `fake` process group
(the collectives trace but move no data). Numerics run on real gloo ranks:
the compiled model with the pass must equal the eager model, prefill and
decode, at token counts that do not divide by the TP size (1 token: fewer
than the ranks), with every later pass on: the MoE layers lowered to
mega_moe in its sequence-parallel form (test_moe_numerics checks the op
itself, and the forms without SP).

Tolerances: float32 compares at 1e-4 of the largest logit (the only change
is the order of the cross-rank sums). bf16 at TP 2 compares at 2e-2 of the
largest logit (a two-rank sum is the same in any order, so the plain-FX
codegen should in fact match exactly; Inductor's own bf16 fusions may not).
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from conftest import tiny_m3_config
from multirank import run_multirank

AG = "_c10d_functional.all_gather_into_tensor"
AR = "_c10d_functional.all_reduce"
RS = "_c10d_functional.reduce_scatter_tensor"


def _set_recompile_limit(n: int) -> None:
    cfg = torch._dynamo.config
    if hasattr(cfg, "recompile_limit"):
        cfg.recompile_limit = n
    else:  # torch 2.11 knows it by its old name too
        cfg.cache_size_limit = n


def _build(ep: int, dtype=torch.bfloat16, **overrides):
    from minimax_backend.model.minimax import build_model, init_random_weights
    from minimax_backend.model.parallel import ParallelState

    model = build_model(tiny_m3_config(**overrides), ParallelState.from_world(ep), dtype=dtype)
    return init_random_weights(model, seed=0)


def _compile(model, tp: int, ep: int, codegen: str = "fx", **options):
    opts = {"sequence_parallel": "on", "strict": True, "codegen": codegen, "tp_size": tp, "ep_size": ep, **options}
    return torch.compile(model, backend="minimax", options=opts, fullgraph=True, dynamic=False)


# ---------------------------------------------------------------- op counts


def _compiled_report(tokens: int, dump_dir=None, **overrides):
    from minimax_backend.graph_passes.backend import last_compile_report

    torch._dynamo.reset()
    model = _build(ep=2, **overrides)
    # Only this pass: the later ones fold the collectives it makes into fused ops.
    compiled = _compile(model, tp=2, ep=2, fuse_norm_quant="off", gemm_reduce_scatter="off", moe_lower="off",
                        dump_dir=dump_dir and str(dump_dir))
    with torch.no_grad():
        compiled(torch.zeros(1, tokens, dtype=torch.long), torch.arange(tokens)[None])
    report = last_compile_report()
    return report, next(p for p in report["passes"] if p["name"] == "sequence_parallel")


def _graph_inputs(dump_dir) -> int:
    """The captured graph's inputs, read from the dump's first stage."""
    import re

    src = next(dump_dir.rglob("00_captured.py")).read_text()
    start = src.index("def forward(self,")
    header = src[start:src.index("):", start)]
    return len(re.findall(r"arg\d+_\d+:", header))


def test_op_counts_on_tiny_m3(fake_tp2, tmp_path):
    # tiny-m3: 1 dense layer + 2 MoE layers.
    report, sp = _compiled_report(tokens=8, dump_dir=tmp_path)
    before, after = report["ops_before"], report["ops_after"]
    layers = 3
    assert before[AR] == 1 + 2 * layers  # embedding + (o_proj, MLP or MoE) per layer
    assert before[AG] == 1  # the lm_head's logits
    assert AR not in after
    assert after[RS] == 1 + 2 * layers
    # per layer: one gather before attention, one before the MLP / MoE; one at the end; logits
    assert after[AG] == 2 * layers + 1 + 1
    assert sp["matches"] == 7
    assert sp["breakdown"] == {"attention": 3, "dense_mlp": 1, "embedding": 1, "moe": 2, "gathers": 6, "end gather": 1}
    assert "aten.constant_pad_nd" not in after  # 8 tokens divide by 2
    # The MTP block is left alone because it is not in this graph: the graph's inputs are the
    # two token tensors and the main model's tensors, none of the MTP module's.
    model = _build(ep=2)
    main = {id(t) for n, t in [*model.named_parameters(), *model.named_buffers()] if not n.startswith("mtp.")}
    assert len(model.mtp) == 1 and any(True for _ in model.mtp.parameters())
    assert _graph_inputs(tmp_path) == 2 + len(main)
    assert any("MTP" in d for d in sp["details"])  # and the record says so


def test_aux_hidden_states_join_the_final_gather(fake_tp2):
    report, sp = _compiled_report(tokens=7, aux_hidden_state_layers=(0, 1))
    assert sp["breakdown"]["end gather"] == 1
    assert any("1 at the end carrying 2 tensor(s)" in d for d in sp["details"])
    assert report["ops_after"]["aten.constant_pad_nd"] == 7  # 7 tokens pad to 8 before each scatter


# ---------------------------------------------------------------- numerics
def _eager_vs_sp(rank, world, ep, token_counts, dtype_name, codegen):
    from minimax_backend.graph_passes.backend import last_compile_report

    _set_recompile_limit(64)
    dtype = getattr(torch, dtype_name)
    model = _build(ep, dtype=dtype)
    compiled = _compile(model, world, ep, codegen=codegen)
    out = []
    gen = torch.Generator().manual_seed(1234)
    with torch.no_grad():
        for tokens in token_counts:
            batch = 2
            ids = torch.randint(0, model.config.vocab_size, (batch, tokens), generator=gen)
            pos = torch.arange(tokens).expand(batch, -1).contiguous()
            model.allocate_kv_cache(batch, tokens + 1)
            eager = model(ids, pos)
            next_ids = eager[:, -1:].argmax(-1)
            step_pos = torch.full((batch, 1), tokens)
            eager_step = model(next_ids, step_pos)
            sp_prefill = compiled(ids, pos)
            rep = last_compile_report()
            matches = next(p for p in rep["passes"] if p["name"] == "sequence_parallel")["matches"]
            lowered = [d for p in rep["passes"] if p["name"] == "moe_lower" for d in p["details"]]
            left = {k: rep["ops_after"].get(k, 0) for k in ("minimax.mega_moe", "minimax.moe", "aten.topk", AR)}
            sp_step = compiled(next_ids, step_pos)

            def rel(a, b):
                return ((a.float() - b.float()).abs().max() / a.float().abs().max()).item()

            out.append({"tokens": tokens, "prefill": rel(eager, sp_prefill), "decode": rel(eager_step, sp_step),
                        "matches": matches, "finite": bool(torch.isfinite(sp_prefill).all()),
                        "ops_left": left, "moe_lowered": lowered})
    return out


def _check(results, tol):
    for rank_results in results:
        for r in rank_results:
            assert r["matches"] == 7, r
            # the MoE layers lowered to mega_moe in its sequence-parallel form: no routing or
            # all-reduce left in the graph (this is also the MoE lowering's whole-model check)
            assert r["ops_left"] == {"minimax.mega_moe": 2, "minimax.moe": 0, "aten.topk": 0, AR: 0}, r
            assert len(r["moe_lowered"]) == 2 and all(": sp," in d for d in r["moe_lowered"]), r
            assert r["finite"], r
            assert r["prefill"] <= tol and r["decode"] <= tol, r


def _eager_vs_sp_last_logits(rank, world):
    """A prefill that keeps only the last position's logits: the sharded stream is gathered
    before the slice, so each rank gets every sequence's last row."""
    from minimax_backend.graph_passes.backend import last_compile_report

    model = _build(world, dtype=torch.float32)
    compiled = _compile(model, world, world)
    ids = torch.randint(0, model.config.vocab_size, (2, 37), generator=torch.Generator().manual_seed(4))
    pos = torch.arange(37).expand(2, -1).contiguous()
    with torch.no_grad():
        eager = model(ids, pos, logits_to_keep=1)
        got = compiled(ids, pos, logits_to_keep=1)
    sp = next(p for p in last_compile_report()["passes"] if p["name"] == "sequence_parallel")
    return {"shape": tuple(got.shape), "matches": sp["matches"],
            "rel": ((eager - got).abs().max() / eager.abs().max()).item()}


@pytest.mark.slow
def test_tp2_prefill_keeping_the_last_logits():
    for r in run_multirank(_eager_vs_sp_last_logits, 2, timeout=600):
        assert r["shape"] == (2, 1, 512) and r["matches"] == 7, r
        assert r["rel"] <= 1e-4, r


@pytest.mark.slow
def test_tp2_ep2_bf16_prefill_and_decode():
    results = run_multirank(_eager_vs_sp, 2, args=(2, [1, 37, 257], "bfloat16", "fx"), timeout=600)
    _check(results, tol=2e-2)


@pytest.mark.slow
def test_tp2_ep2_float32_inductor():
    results = run_multirank(_eager_vs_sp, 2, args=(2, [7], "float32", "inductor"), timeout=600)
    _check(results, tol=1e-4)


@pytest.mark.slow
def test_tp4_ep4_float32_prefill_and_decode():
    results = run_multirank(_eager_vs_sp, 4, args=(4, [1, 37], "float32", "fx"), timeout=900)
    _check(results, tol=1e-4)
