"""MiniMax sparse attention (MSA) in the model: against transformers, across TP layouts, compiled.

External reference: transformers' `MiniMaxM3VLForCausalLM` (its indexer and
block mask; nobody here wrote it), tiny, float32, with blocks of 16 keys and
the top 4 blocks, so a query sees at most 64 keys and selection drops blocks
from about 65 tokens on. Its config is saved by transformers and read by our
config reader; its weights, renamed to the checkpoint names (the same
translation as tests/test_model_hf.py), are loaded by our checkpoint loader.

Tolerances (float32): max |ours - reference| <= 1e-4 * max |reference|. The
two sum in different orders (fused QKV + indexer GEMM, float32 router, the
expert accumulation order); a wrong block selection moves logits by far
more (the dense-attention check shows by how much).
"""

from __future__ import annotations

import json

import pytest
import torch
import torch.distributed as dist

from conftest import tiny_m3_config
from multirank import run_multirank

RTOL = 1e-4
BLOCK, TOPK = 16, 4
PREFILL = (100, 131)  # 7 and 9 blocks: 3 and 5 of them dropped per query at the end
DECODE_FROM, DECODE_STEPS = 90, 4
AG = "_c10d_functional.all_gather_into_tensor"


def _rel(ours: torch.Tensor, ref: torch.Tensor) -> float:
    return ((ours.float() - ref.float()).abs().max() / ref.float().abs().max()).item()


def _inputs(vocab: int, tokens: int, seed: int):
    ids = torch.randint(0, vocab, (2, tokens), generator=torch.Generator().manual_seed(seed))
    return ids, torch.arange(tokens).expand(2, -1).contiguous()


# ------------------------------------------------------------ the reference
@pytest.fixture(scope="module")
def hf_m3(tmp_path_factory):
    """(checkpoint dir, {name: reference logits}) of a tiny random transformers M3 with MSA."""
    transformers = pytest.importorskip("transformers")
    mod = pytest.importorskip("transformers.models.minimax_m3_vl.modeling_minimax_m3_vl")
    from safetensors.torch import save_file

    from test_model_hf import _randomize, _to_checkpoint_names

    cfg = mod.MiniMaxM3VLTextConfig(
        vocab_size=256, hidden_size=128, intermediate_size=64, dense_intermediate_size=128,
        shared_intermediate_size=64, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
        head_dim=32, rotary_dim=16,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5},
        num_local_experts=4, num_experts_per_tok=2, routed_scaling_factor=2.0, rms_norm_eps=1e-6,
        mlp_layer_types=["dense", "sparse", "sparse"],
        layer_types=["full_attention", "minimax_m3_sparse", "minimax_m3_sparse"],
        index_n_heads=2, index_head_dim=32, index_block_size=BLOCK, index_topk_blocks=TOPK, index_local_blocks=1,
        bos_token_id=None, eos_token_id=None, max_position_embeddings=1024,
    )
    cfg._attn_implementation = "eager"
    torch.manual_seed(0)
    hf = mod.MiniMaxM3VLForCausalLM(cfg).float().eval()
    _randomize(hf, gemma=True)
    out = tmp_path_factory.mktemp("hf_m3_msa")
    hf.config.save_pretrained(out)
    weights = {k: v.contiguous() for k, v in _to_checkpoint_names(hf.state_dict()).items() if "rotary" not in k}
    save_file(weights, str(out / "model.safetensors"))

    refs = {}
    with torch.no_grad():
        for tokens in PREFILL:
            ids, pos = _inputs(cfg.vocab_size, tokens, seed=tokens)
            refs[f"prefill{tokens}"] = hf(input_ids=ids, position_ids=pos).logits
        ids, _ = _inputs(cfg.vocab_size, DECODE_FROM + DECODE_STEPS, seed=7)
        cache = transformers.DynamicCache(config=cfg)
        r = hf(input_ids=ids[:, :DECODE_FROM], cache=cache, use_cache=True)
        steps = [r.logits[:, -1]]
        for i in range(DECODE_STEPS):
            r = hf(input_ids=ids[:, DECODE_FROM + i:DECODE_FROM + i + 1], cache=cache, use_cache=True)
            steps.append(r.logits[:, -1])
        refs["decode"] = torch.stack(steps, dim=1)
    return out, refs


def _ours_on_reference(rank: int, world: int, ckpt: str, sparse: bool = True) -> dict[str, torch.Tensor]:
    """Our model from the transformers checkpoint on this rank: the reference's prefills and decode."""
    from minimax_backend.model.checkpoint_loader import load_checkpoint
    from minimax_backend.model.config import MiniMaxConfig
    from minimax_backend.model.minimax import build_model
    from minimax_backend.model.parallel import ParallelState

    cfg = MiniMaxConfig.from_json_file(ckpt)
    ignore = []
    if not sparse:
        cfg, ignore = cfg.replace(sparse_attention_layers=()), ["*.self_attn.index_*"]
    ps = ParallelState.from_world() if world > 1 else ParallelState.single()
    model = build_model(cfg, ps, torch.float32)
    load_checkpoint(model, ckpt, ignore=ignore)
    out = {}
    with torch.no_grad():
        for tokens in PREFILL:
            out[f"prefill{tokens}"] = model(*_inputs(cfg.vocab_size, tokens, seed=tokens))
        ids, _ = _inputs(cfg.vocab_size, DECODE_FROM + DECODE_STEPS, seed=7)
        model.allocate_kv_cache(2, 128)
        steps = [model(ids[:, :DECODE_FROM], torch.arange(DECODE_FROM).expand(2, -1))[:, -1]]
        for i in range(DECODE_STEPS):
            step = ids[:, DECODE_FROM + i:DECODE_FROM + i + 1]
            steps.append(model(step, torch.full((2, 1), DECODE_FROM + i))[:, -1])
        out["decode"] = torch.stack(steps, dim=1)
    return out


def test_transformers_config_reads_as_the_same_model(hf_m3):
    from minimax_backend.model.config import MiniMaxConfig

    ckpt, _ = hf_m3
    saved = json.loads((ckpt / "config.json").read_text())
    assert saved["model_type"] == "minimax_m3_vl_text" and saved["hidden_act"] == "silu"  # transformers' rewrite
    cfg = MiniMaxConfig.from_json_file(ckpt)
    assert cfg.hidden_act == "swigluoai"  # what transformers' M3 modeling computes
    assert cfg.sparse_attention_layers == (1, 2) and cfg.mlp_layer_types == ("dense", "moe", "moe")
    assert (cfg.index_n_heads, cfg.index_head_dim, cfg.index_block_size, cfg.index_topk_blocks,
            cfg.index_local_blocks, cfg.index_init_blocks) == (2, 32, BLOCK, TOPK, 1, 0)
    assert cfg.rotary_dim == 16 and cfg.rope_theta == 10000.0


def test_matches_transformers_prefill_and_decode(hf_m3):
    ckpt, refs = hf_m3
    ours = _ours_on_reference(0, 1, str(ckpt))
    for name, ref in refs.items():
        assert _rel(ours[name], ref) <= RTOL, (name, _rel(ours[name], ref))


def test_dense_attention_does_not_match_where_selection_drops_blocks(hf_m3):
    ckpt, refs = hf_m3
    dense = _ours_on_reference(0, 1, str(ckpt), sparse=False)
    for name in ("prefill100", "prefill131", "decode"):
        assert _rel(dense[name], refs[name]) > 100 * RTOL, (name, _rel(dense[name], refs[name]))
    # ...while every query that sees <= TOPK * BLOCK keys is the same under both.
    first = TOPK * BLOCK
    assert _rel(dense["prefill100"][:, :first], refs["prefill100"][:, :first]) <= RTOL


@pytest.mark.slow
def test_matches_transformers_at_tp2(hf_m3):
    ckpt, refs = hf_m3
    results = run_multirank(_ours_on_reference, 2, args=(str(ckpt),), timeout=300)
    for rank, ours in enumerate(results):
        for name, ref in refs.items():
            assert _rel(ours[name], ref) <= RTOL, (rank, name, _rel(ours[name], ref))


# ------------------------------------------------------------- TP layouts
def _sparse_cfg(**overrides):
    return tiny_m3_config(index_block_size=BLOCK, index_topk_blocks=TOPK, num_mtp_modules=0, **overrides)


def _eager_logits(rank: int, world: int, ep: int, tokens: int) -> torch.Tensor:
    from minimax_backend.model.minimax import build_model, init_random_weights
    from minimax_backend.model.parallel import ParallelState

    cfg = _sparse_cfg()
    ps = ParallelState.from_world(ep) if world > 1 else ParallelState.single()
    model = init_random_weights(build_model(cfg, ps, torch.float32), seed=3)
    with torch.no_grad():
        return model(*_inputs(cfg.vocab_size, tokens, seed=11))


@pytest.mark.slow
def test_eager_tp_layouts_agree():
    """TP 2 splits the index heads (one per rank); TP 4 replicates them like the KV heads."""
    tokens = 101
    single = _eager_logits(0, 1, 1, tokens)
    for world, ep in ((2, 1), (4, 2)):
        for rank, out in enumerate(run_multirank(_eager_logits, world, args=(ep, tokens), timeout=300)):
            assert _rel(out, single) <= RTOL, (world, rank, _rel(out, single))


# ----------------------------------------------------------------- compiled
def _eager_vs_compiled(rank: int, world: int, token_counts: list[int], codegen: str) -> list[dict]:
    from minimax_backend.graph_passes.backend import last_compile_report
    from minimax_backend.model.minimax import build_model, init_random_weights
    from minimax_backend.model.parallel import ParallelState

    torch._dynamo.config.cache_size_limit = 64
    cfg = _sparse_cfg()
    model = init_random_weights(build_model(cfg, ParallelState.from_world(world), torch.float32), seed=5)
    opts = {"sequence_parallel": "on", "strict": True, "codegen": codegen, "tp_size": world, "ep_size": world,
            "cudagraphs": False}
    compiled = torch.compile(model, backend="minimax", options=opts, fullgraph=True, dynamic=False)
    out = []
    with torch.no_grad():
        for tokens in token_counts:
            ids, pos = _inputs(cfg.vocab_size, tokens, seed=tokens)
            model.allocate_kv_cache(2, tokens + 2)
            eager = model(ids, pos)
            step_ids, step_pos = eager[:, -1:].argmax(-1), torch.full((2, 1), tokens)
            eager_step = model(step_ids, step_pos)
            prefill = compiled(ids, pos)
            passes = {p["name"]: p for p in last_compile_report()["passes"]}
            step = compiled(step_ids, step_pos)
            out.append({"tokens": tokens, "prefill": _rel(prefill, eager), "decode": _rel(step, eager_step),
                        "fused": passes["fuse_indexer_qkv"]["matches"], "sp": passes["sequence_parallel"]["matches"]})
    return out


@pytest.mark.slow
def test_compiled_every_pass_equals_eager_tp2():
    for rank_results in run_multirank(_eager_vs_compiled, 2, args=([37, 300], "fx"), timeout=600):
        for r in rank_results:
            assert r["fused"] == 2 and r["sp"] == 7, r
            assert r["prefill"] <= RTOL and r["decode"] <= RTOL, r




def _ops_after(sparse: bool, tokens: int = 40) -> tuple[dict, dict]:
    from minimax_backend.graph_passes.backend import last_compile_report
    from minimax_backend.model.minimax import build_model, init_random_weights
    from minimax_backend.model.parallel import ParallelState

    torch._dynamo.reset()
    cfg = _sparse_cfg() if sparse else _sparse_cfg(sparse_attention_layers=())
    model = init_random_weights(build_model(cfg, ParallelState.from_world(2), torch.bfloat16), seed=0)
    opts = {"sequence_parallel": "on", "strict": True, "codegen": "fx", "tp_size": 2, "ep_size": 2,
            "cudagraphs": False}
    compiled = torch.compile(model, backend="minimax", options=opts, fullgraph=True, dynamic=False)
    with torch.no_grad():
        compiled(torch.zeros(1, tokens, dtype=torch.long), torch.arange(tokens)[None])
    report = last_compile_report()
    return report["ops_after"], {p["name"]: p for p in report["passes"]}


def test_indexer_reads_the_gathered_hidden_state(fake_tp2):
    """Under sequence parallelism the indexer shares QKV's all-gather and GEMM: the
    sparse model has exactly the dense model's collectives, one stacked GEMM per
    sparse layer, and the record says so."""
    sparse_ops, passes = _ops_after(sparse=True)
    dense_ops, _ = _ops_after(sparse=False)
    assert sparse_ops[AG] == dense_ops[AG]
    assert sparse_ops["minimax.stacked_gemm"] == 2 and "minimax.stacked_gemm" not in dense_ops
    assert sparse_ops["minimax.msa_select"] == 2 and sparse_ops["minimax.msa_attention"] == 2
    assert sparse_ops.get("aten.mm", 0) == dense_ops.get("aten.mm", 0) - 2  # the sparse layers' QKV: stackedKV...
    fused = passes["fuse_indexer_qkv"]
    assert fused["matches"] == 2 and fused["breakdown"] == {"sparse layers": 2, "bf16": 2}
    assert all("3 bf16 GEMMs" in d for d in fused["details"]), fused["details"]
