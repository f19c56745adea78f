"""MSA on the GPU: the Triton kernels against the float32 reference at M3 sizes and awkward
lengths, and the sparse model captured in CUDA graphs with its index-K cache.

Shapes are M3's at TP 1 (64 query heads, 4 KV heads, head_dim 128, 4 index heads x 128,
blocks of 128, top 16): prefill of two sequences at 1000 and 2100 tokens (below and above
the 2048 keys where sparse and dense part), a 777-token chunk at position 4000 of a
5000-slot cache, and decode of 3 sequences at positions 700, 3000 and 9000.

Checks: the kernel's block scores equal the reference's where they are +-inf and within
1e-4 relative elsewhere (float32 sums in another order); blocks whose scores are that
close may swap places in the top 16, so the attention kernel is checked on the
reference's selection, at ||out - ref|| / ||ref|| <= 1e-2 in bfloat16 (Hopper bf16
products, float32 accumulation).
"""

from __future__ import annotations

import pytest
import torch

from conftest import tiny_m3_config

pytestmark = pytest.mark.gpu
HQ, HKV, HI, D, BLOCK, TOPK = 64, 4, 4, 128, 128, 16


def _rel_norm(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def _inputs(batch, seq, slots, positions, seed):
    g = torch.Generator(device="cuda").manual_seed(seed)
    bf = dict(device="cuda", dtype=torch.bfloat16)
    iq = torch.randn(batch * seq, HI, D, generator=g, **bf)
    ik = torch.randn(batch, slots, D, generator=g, **bf)
    q = torch.randn(batch * seq, HQ, D, generator=g, **bf)
    k = torch.randn(batch, HKV, slots, D, generator=g, **bf)
    v = torch.randn(batch, HKV, slots, D, generator=g, **bf)
    return iq, ik, q, k, v, positions.cuda()


CASES = {
    "prefill_1000": (2, 1000, 1000, torch.arange(1000).expand(2, -1)),
    "prefill_2100": (2, 2100, 2100, torch.arange(2100).expand(2, -1)),
    "chunk_777_at_4000": (1, 777, 5000, 4000 + torch.arange(777)[None]),
    "decode_3": (3, 1, 9216, torch.tensor([[700], [3000], [9000]])),
}


@pytest.mark.parametrize("name", list(CASES))
def test_kernels_match_the_reference(name):
    from minimax_backend.kernels import msa, msa_triton

    batch, seq, slots, pos = CASES[name]
    iq, ik, q, k, v, pos = _inputs(batch, seq, slots, pos.contiguous(), seed=len(name))
    ref_scores = msa.block_scores_reference(iq, ik, pos, BLOCK, 1, 0).flatten(0, 1)
    scores = msa_triton.block_scores(iq, ik, pos, BLOCK, 1, 0, msa.num_key_blocks(slots, BLOCK))
    assert torch.equal(scores == float("inf"), ref_scores == float("inf"))
    assert torch.equal(scores == float("-inf"), ref_scores == float("-inf"))
    fin = torch.isfinite(ref_scores)
    torch.testing.assert_close(scores[fin], ref_scores[fin], rtol=1e-4, atol=1e-3)

    blocks = msa.top_blocks(ref_scores, TOPK)
    ref = msa.msa_attention_reference(q, k, v, blocks, pos, BLOCK, D ** -0.5)
    out = torch.ops.minimax.msa_attention(q, k, v, blocks, pos, BLOCK, D ** -0.5)
    assert torch.isfinite(out).all()
    assert _rel_norm(out, ref) <= 1e-2, _rel_norm(out, ref)
    # the op's own selection runs the kernels too: same blocks wherever no near-tie decides
    sel = torch.ops.minimax.msa_select(iq, ik, pos, BLOCK, TOPK, 1, 0)
    same = (sel.sort(-1).values == blocks.sort(-1).values).all(-1).float().mean().item()
    assert same >= 0.99, same


def test_decode_split_equals_unsplit():
    from minimax_backend.kernels import msa, msa_triton

    batch, seq, slots, pos = CASES["decode_3"]
    iq, ik, q, k, v, pos = _inputs(batch, seq, slots, pos, seed=3)
    blocks = msa.msa_select_reference(iq, ik, pos, BLOCK, TOPK, 1, 0)
    one = msa_triton.sparse_attention(q, k, v, blocks, pos, BLOCK, D ** -0.5, tok=1, split=1)
    for split in (2, 4, 16):
        many = msa_triton.sparse_attention(q, k, v, blocks, pos, BLOCK, D ** -0.5, tok=1, split=split)
        assert _rel_norm(many, one) <= 1e-2, (split, _rel_norm(many, one))


def test_sparse_model_in_cuda_graphs_prefill_and_decode():
    """Blocks of 16 and the top 4: sparsity bites from 65 tokens on. Captured (buckets 64 and
    128, index-K cache inside the graphs) against the same compiled code run without graphs."""
    import minimax_backend.graph_passes as gp
    from minimax_backend.graph_passes.bucketing import BucketedRunner
    from minimax_backend.model.minimax import build_model, init_random_weights
    from minimax_backend.model.parallel import ParallelState

    for name in ("recompile_limit", "cache_size_limit"):
        if hasattr(torch._dynamo.config, name):
            setattr(torch._dynamo.config, name, 64)
    torch._dynamo.reset()
    cfg = tiny_m3_config(index_block_size=16, index_topk_blocks=4, num_mtp_modules=0)
    model = init_random_weights(build_model(cfg, ParallelState.single(), torch.float32), seed=0).to("cuda")
    buckets = (1, 64, 128)
    model.allocate_kv_cache(1, 256)
    plain = BucketedRunner(gp.compile(model, cudagraphs=False, cudagraph_buckets=buckets, strict=True), buckets,
                           1, max_positions=256)
    graphs = BucketedRunner(gp.compile(model, cudagraphs=True, cudagraph_buckets=buckets, strict=True), buckets,
                            1, max_positions=256)
    eager_err = []
    with torch.no_grad():
        for size in (100, 37):
            ids = torch.randint(0, cfg.vocab_size, (1, size), device="cuda")
            pos = torch.arange(size, device="cuda")[None]
            want, got = plain(ids, pos), graphs(ids, pos)
            assert ((got - want).abs().max() / want.abs().max()).item() <= 1e-5
            eager_err.append(((model(ids, pos) - want).abs().max() / want.abs().max()).item())
            for step in range(3):  # decode reads the index-K cache the prefill wrote
                nxt, at = ids[:, -1:], torch.tensor([[size + step]], device="cuda")
                want, got = plain(nxt, at), graphs(nxt, at)
                assert ((got - want).abs().max() / want.abs().max()).item() <= 1e-5, (size, step)
    report = gp.last_compile_report()
    passes = {p["name"]: p for p in report["passes"]}
    assert passes["fuse_indexer_qkv"]["matches"] == 2
    assert max(eager_err) <= 1e-4, eager_err  # compiled on the GPU = eager on the GPU (float32)
