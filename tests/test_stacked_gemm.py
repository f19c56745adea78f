"""One GEMM for linears that share an input (kernels/stacked_gemm.py, model/linear.py
place_adjacent, graph_passes/fuse_indexer_qkv.py): the op equals the separate GEMMs,
the model keeps the rows stacked through .to(), and the pass fails loudly when they are not."""

from __future__ import annotations

import logging

import pytest
import torch
import torch.nn.functional as F

from conftest import tiny_m3_config
from minimax_backend.kernels.fp8 import quantize_weight_fp8
from minimax_backend.kernels.stacked_gemm import rows_are_stacked


def _stacked(*shapes, dtype=torch.float32):
    base = torch.randn(sum(n for n, _ in shapes), shapes[0][1], generator=torch.Generator().manual_seed(0))
    out, start = [], 0
    for n, _ in shapes:
        out.append(base[start:start + n].to(dtype) if dtype != torch.float32 else base[start:start + n])
        start += n
    return base, out


def test_bf16_stacked_equals_separate_and_falls_back_loudly(caplog):
    _, ws = _stacked((96, 64), (32, 64), (16, 64))
    assert rows_are_stacked(ws)
    x = torch.randn(7, 64)
    want = torch.cat([F.linear(x, w) for w in ws], dim=-1)
    got = torch.ops.minimax.stacked_gemm(x, None, ws, [], torch.float32)
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    apart = [w.clone() for w in ws]
    assert not rows_are_stacked(apart)
    with caplog.at_level(logging.WARNING, logger="minimax"):
        got = torch.ops.minimax.stacked_gemm(x, None, apart, [], torch.float32)
    assert torch.equal(got, want) or torch.allclose(got, want, rtol=1e-6, atol=1e-6)
    assert "not consecutive rows" in caplog.text


def test_fp8_stacked_equals_separate():
    g = torch.Generator().manual_seed(1)
    parts = [quantize_weight_fp8(torch.randn(n, 256, generator=g)) for n in (256, 128, 128)]
    base_w = torch.cat([q for q, _ in parts])
    base_s = torch.cat([s for _, s in parts])
    ws, ss, r, b = [], [], 0, 0
    for q, s in parts:
        ws.append(base_w[r:r + q.shape[0]])
        ss.append(base_s[b:b + s.shape[0]])
        r, b = r + q.shape[0], b + s.shape[0]
    xq, xs = torch.ops.minimax.quantize_fp8(torch.randn(5, 256, generator=g), 128)
    want = torch.cat([torch.ops.minimax.fp8_block_gemm(xq, xs, w, s, torch.float32) for w, s in zip(ws, ss)], -1)
    got = torch.ops.minimax.stacked_gemm(xq, xs, ws, ss, torch.float32)
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-5)


def _qkv_and_indexer(model, layer):
    a = model.layers[layer].self_attn
    return [a.qkv_proj.weight, a.indexer.index_q_proj.weight, a.indexer.index_k_proj.weight]


@pytest.mark.parametrize("fp8", [False, True])
def test_model_keeps_the_rows_stacked(fp8):
    from minimax_backend.model.minimax import build_model, init_random_weights
    from minimax_backend.model.weights import get_plan

    model = init_random_weights(build_model(tiny_m3_config(), None, torch.bfloat16, quantize_fp8=fp8))
    ws = _qkv_and_indexer(model, 1)
    assert rows_are_stacked(ws)
    assert get_plan(ws[1]).names == ("model.layers.1.self_attn.index_q_proj.weight",)
    if fp8:
        a = model.layers[1].self_attn
        assert rows_are_stacked([a.qkv_proj.weight_scale_inv, a.indexer.index_q_proj.weight_scale_inv,
                                 a.indexer.index_k_proj.weight_scale_inv])
    before = [w.float().clone() for w in ws]
    model = model.to(torch.float32)  # moves each parameter on its own; Attention stacks them again
    ws = _qkv_and_indexer(model, 1)
    assert rows_are_stacked(ws)
    assert all(torch.equal(a, b.float()) for a, b in zip(before, ws))


def test_pass_fails_loudly_when_the_rows_are_apart():
    import minimax_backend.graph_passes as gp
    from minimax_backend.model.minimax import build_model, init_random_weights

    torch._dynamo.reset()
    model = init_random_weights(build_model(tiny_m3_config(num_mtp_modules=0), None, torch.float32))
    k = model.layers[2].self_attn.indexer.index_k_proj
    k.weight = torch.nn.Parameter(k.weight.detach().clone(), requires_grad=False)  # no longer after QKV's rows
    ids, pos = torch.zeros(1, 9, dtype=torch.long), torch.arange(9)[None]
    from minimax_backend.graph_passes.base import PassWarning

    with torch.no_grad(), pytest.warns(PassWarning, match="1 fused for 2 sparse layers.*not consecutive rows"):
        gp.compile(model, codegen="fx", strict=True, cudagraphs=False)(ids, pos)
    torch._dynamo.reset()
