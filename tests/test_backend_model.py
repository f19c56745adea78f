"""The tiny-m3 preset compiled with backend="minimax" equals eager (TP 1)."""

from __future__ import annotations

import pytest
import torch

import minimax_backend.graph_passes as gp
from minimax_backend.model.presets import load_preset
from minimax_backend.model.minimax import build_model, init_random_weights


def _model():
    return init_random_weights(build_model(load_preset("tiny-m3"), dtype=torch.float32), seed=0)


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


@pytest.mark.parametrize("codegen", ["fx", pytest.param("inductor", marks=pytest.mark.slow)])
def test_tiny_m3_prefill_equals_eager(codegen):
    m = _model()
    vocab = m.config.vocab_size
    ids = torch.randint(0, vocab, (2, 7), generator=torch.Generator().manual_seed(1))
    pos = torch.arange(7).expand(2, 7)
    with torch.no_grad():
        ref = m(ids, pos)
        out = torch.compile(m, backend="minimax", fullgraph=True, options={"codegen": codegen, "strict": True})(ids, pos)
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-4)
    rep = gp.last_compile_report()
    # At TP 1 the only rewrites are the MoE's: each of the 2 MoE layers becomes one fused op.
    assert rep["ops_after"]["minimax.mega_moe"] == 2
    assert "aten.topk" not in rep["ops_after"] and rep["ops_before"]["aten.topk"] == 2


def test_prefill_keeping_only_the_last_logits_equals_eager():
    """logits_to_keep=1 compiles (the lm_head runs on one row per sequence) and equals eager's."""
    m = _model()
    ids = torch.randint(0, m.config.vocab_size, (2, 7), generator=torch.Generator().manual_seed(5))
    pos = torch.arange(7).expand(2, 7)
    with torch.no_grad():
        ref = m(ids, pos, logits_to_keep=1)
        out = torch.compile(m, backend="minimax", fullgraph=True, options={"codegen": "fx", "strict": True})(
            ids, pos, logits_to_keep=1)
    assert out.shape == (2, 1, m.config.vocab_size)
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-4)
    rep = gp.last_compile_report()
    assert rep["ops_after"]["minimax.mega_moe"] == 2  # the MoE rewrite still matches


def test_tiny_m3_with_kv_cache_prefill_then_decode():
    eager, comp = _model(), _model()
    for m in (eager, comp):
        m.allocate_kv_cache(batch=1, max_len=16)
    f = gp.compile(comp, codegen="fx", strict=True)
    ids = torch.randint(0, eager.config.vocab_size, (1, 8), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        for lo, hi in ((0, 5), (5, 6), (6, 7)):  # prefill 5, then two decode steps
            pos = torch.arange(lo, hi)[None]
            torch.testing.assert_close(f(ids[:, lo:hi], pos), eager(ids[:, lo:hi], pos), rtol=1e-4, atol=1e-4)
    # the cache writes are graph input mutations: they must land in the module's buffers
    for (name, b_eager), (_, b_comp) in zip(eager.named_buffers(), comp.named_buffers()):
        torch.testing.assert_close(b_comp, b_eager, rtol=1e-4, atol=1e-4, msg=name)


@pytest.mark.slow
def test_decode_writes_the_kv_cache_in_place_under_inductor():
    """A decode step writes its new rows into the KV and index-K caches in place: the generated
    code allocates no buffer of a cache's size (a functional scatter rewrote each whole cache,
    twice per step), and the buffers end up equal to eager's."""
    from torch._inductor.utils import run_and_get_code

    eager, comp = _model(), _model()
    batch, max_len = 2, 45  # odd sizes: a cache's shape is not confused with an activation's
    for m in (eager, comp):
        m.allocate_kv_cache(batch=batch, max_len=max_len)
    ids = torch.randint(0, eager.config.vocab_size, (batch, 6), generator=torch.Generator().manual_seed(3))
    prefill_pos = torch.arange(5).expand(batch, 5)
    decode_pos = torch.tensor([[5], [5]])
    f = gp.compile(comp, codegen="inductor", cudagraphs=False)
    with torch.no_grad():
        for m in (eager, comp):
            m(ids[:, :5], prefill_pos)  # eager prefill on both: the compiled call below is the decode step
        out, code = run_and_get_code(f, ids[:, 5:], decode_pos)
        ref = eager(ids[:, 5:], decode_pos)
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-4)
    cache_shapes = {tuple(b.shape) for name, b in comp.named_buffers()
                    if name.endswith((".k", ".v", ".index_k")) and b.numel()}  # a dense layer: no index-K
    assert len(cache_shapes) == 2  # KV [B, h, L, d] and index-K [B, L, d]
    src = "\n".join(code)
    for shape in cache_shapes:
        assert f"empty_strided_cpu({shape}" not in src, f"the decode step allocates a whole cache {shape}"
    for (name, b_eager), (_, b_comp) in zip(eager.named_buffers(), comp.named_buffers()):
        torch.testing.assert_close(b_comp, b_eager, rtol=1e-4, atol=1e-4, msg=name)
