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
