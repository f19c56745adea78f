"""The minimax:: FP8 reference ops against a float64 reference, at awkward shapes."""

from __future__ import annotations

import math

import pytest
import torch

from minimax_backend.kernels.fp8 import FP8_MAX, dequantize_weight_fp8, quantize_weight_fp8


def _ref_quant(x: torch.Tensor, g: int):
    """float64 reference: power-of-two scale per group, scale >= amax / 448."""
    x64 = x.double().reshape(*x.shape[:-1], -1, g)
    amax = x64.abs().amax(-1).clamp(min=1e-30)
    scale = torch.tensor(2.0) ** torch.ceil(torch.log2(amax / FP8_MAX))
    return x64, scale


@pytest.mark.parametrize("shape,g", [((1, 128), 128), ((7, 384), 128), ((3, 5, 256), 128),
                                     ((37, 96), 32), ((2, 1, 64), 32)])
def test_quantize_fp8_matches_reference(shape, g):
    torch.manual_seed(0)
    x = torch.randn(shape) * torch.logspace(-3, 3, shape[-1])  # groups with very different ranges
    q, s = torch.ops.minimax.quantize_fp8(x, g)
    assert q.dtype == torch.float8_e4m3fn and q.shape == x.shape
    assert s.dtype == torch.float32 and s.shape == (*shape[:-1], shape[-1] // g)
    x64, scale = _ref_quant(x, g)
    torch.testing.assert_close(s.double(), scale, rtol=0, atol=0)  # exactly the power of two
    assert torch.all(torch.log2(s) == torch.round(torch.log2(s)))
    deq = (q.double().reshape(x64.shape) * s.double()[..., None]).reshape(shape)
    # E4M3 keeps 3 mantissa bits: relative error <= 2**-4 for normal values,
    # plus the subnormal spacing 2**-9 * scale near zero.
    bound = x.double().abs() * 2.0**-4 + (2.0**-9) * s.double().repeat_interleave(g, -1)
    assert torch.all((deq - x.double()).abs() <= bound + 1e-30)
    assert q.float().abs().max() <= FP8_MAX


def test_quantize_fp8_zero_rows_and_saturation():
    x = torch.zeros(3, 128)
    x[1, 5] = 1e-20  # tiny but nonzero
    x[2] = torch.linspace(-1000, 1000, 128)
    q, s = torch.ops.minimax.quantize_fp8(x, 128)
    assert torch.isfinite(s).all() and (s > 0).all()
    assert torch.all(q[0].float() == 0)
    assert q[2].float().abs().max() <= FP8_MAX
    assert (q[2].float() * s[2]).abs().max() == pytest.approx(1000, rel=2**-4)


def test_quantize_fp8_bad_group():
    with pytest.raises(ValueError, match="not divisible by group_size=128"):
        torch.ops.minimax.quantize_fp8(torch.randn(2, 200), 128)


@pytest.mark.parametrize("m,n,k,g", [(1, 128, 128, 128), (7, 200, 384, 128), (37, 130, 256, 32), (5, 64, 96, 32)])
def test_fp8_block_gemm_matches_float64(m, n, k, g):
    torch.manual_seed(1)
    x = torch.randn(m, k)
    w = torch.randn(n, k) * 0.05
    xq, xs = torch.ops.minimax.quantize_fp8(x, g)
    wq, ws = quantize_weight_fp8(w)
    assert ws.shape == (math.ceil(n / 128), math.ceil(k / 128))
    y = torch.ops.minimax.fp8_block_gemm(xq, xs, wq, ws, torch.float32)
    assert y.shape == (m, n) and y.dtype == torch.float32
    # Exact reference: dequantize both in float64 and multiply.
    x_deq = xq.double() * xs.double().repeat_interleave(g, -1)
    w_deq = wq.double() * ws.double().repeat_interleave(128, 0)[:n].repeat_interleave(128, 1)[:, :k]
    torch.testing.assert_close(y.double(), x_deq @ w_deq.T, rtol=1e-5, atol=1e-5)
    # And close to the unquantized product (FP8 error, a few percent).
    ref = x.double() @ w.double().T
    assert (y.double() - ref).norm() / ref.norm() < 0.08
    # Output dtype follows the argument; leading dims pass through.
    y3 = torch.ops.minimax.fp8_block_gemm(xq.view(1, m, k), xs.view(1, m, -1), wq, ws, torch.bfloat16)
    assert y3.shape == (1, m, n) and y3.dtype == torch.bfloat16


def test_weight_quant_roundtrip_ragged_blocks():
    torch.manual_seed(2)
    w = torch.randn(200, 300)
    wq, ws = quantize_weight_fp8(w)
    assert wq.dtype == torch.float8_e4m3fn and ws.shape == (2, 3)
    deq = dequantize_weight_fp8(wq, ws)
    assert ((deq - w).abs() <= w.abs() * 2.0**-4 + ws.max() * 2.0**-9).all()


def test_fp8_block_gemm_shape_errors():
    xq, xs = torch.ops.minimax.quantize_fp8(torch.randn(2, 256), 128)
    wq, ws = quantize_weight_fp8(torch.randn(64, 256))
    with pytest.raises(ValueError, match="weight scales"):
        torch.ops.minimax.fp8_block_gemm(xq, xs, wq, ws[:, :1], torch.float32)
    with pytest.raises(ValueError, match="does not match weight K"):
        torch.ops.minimax.fp8_block_gemm(xq, xs, wq[:, :128], ws[:, :1], torch.float32)


def test_ops_trace_as_single_nodes():
    """torch.compile sees each op as one node (fake kernels work, no graph break)."""
    from torch._dynamo.testing import CompileCounterWithBackend

    wq, ws = quantize_weight_fp8(torch.randn(64, 256))

    def f(x):
        xq, xs = torch.ops.minimax.quantize_fp8(x, 128)
        return torch.ops.minimax.fp8_block_gemm(xq, xs, wq, ws, x.dtype)

    cnt = CompileCounterWithBackend("aot_eager")
    x = torch.randn(5, 256)
    out = torch.compile(f, backend=cnt, fullgraph=True)(x)
    torch.testing.assert_close(out, f(x))
    assert cnt.frame_count == 1
    targets = [str(n.target) for n in cnt.graphs[0].graph.nodes if n.op == "call_function"]
    assert sum("quantize_fp8" in t for t in targets) == 1
    assert sum("fp8_block_gemm" in t for t in targets) == 1
