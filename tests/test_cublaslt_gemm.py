"""kernels/cublaslt_gemm.py: out = x @ w.T + c in one cuBLASLt call.

On the GPU (marked `gpu`, skipped without CUDA): BF16 and FP8 block-scaled
against a float32 reference (the GEMM in float32 / minimax::fp8_block_gemm in
float32, plus the addend), with the addend and the output row slices of larger
buffers as GEMM-RS passes them, odd row counts, and inside a CUDA graph.
Tolerance: one BF16 rounding of the result (2**-8 relative) plus float32
accumulation order (BF16) or Hopper's FP8 accumulation precision (4e-4 of the
largest output, as for the FP8 GEMM in tests/test_norm_quant_gpu.py). On the CPU: it declines, so callers add separately.
"""

from __future__ import annotations

import pytest
import torch

from minimax_backend.kernels import cublaslt_gemm
from minimax_backend.kernels.fp8 import quantize_weight_fp8


def test_declines_cpu_tensors():
    x, w = torch.randn(8, 512), torch.randn(16, 512)
    c, out = torch.randn(8, 16), torch.full((8, 16), 7.0)
    assert not cublaslt_gemm.try_matmul_add(x.bfloat16(), w.bfloat16(), c.bfloat16(), out.bfloat16())
    assert torch.equal(out, torch.full((8, 16), 7.0))


def _atol(want, fp8):
    # FP8: Hopper's tensor cores accumulate each 128-deep block with a ~14-bit mantissa
    # (tests/test_norm_quant_gpu.py, FP8_MMA_ATOL); BF16: float32 accumulation order only.
    return 4e-4 * float(want.abs().max()) if fp8 else 1e-3


def _fp8_reference(xq, xs, wq, wscale):
    """minimax::fp8_block_gemm's CPU reference (dequantize, float32 GEMM), on the GPU."""
    args = [t.cpu() for t in (xq, xs, wq, wscale)]
    return torch.ops.minimax.fp8_block_gemm(*args, torch.float32).to(xq.device)


def _bf16_case(m, k, n, gen, device):
    x = torch.randn(m, k, generator=gen).bfloat16().to(device)
    w = (torch.randn(n, k, generator=gen) / k**0.5).bfloat16().to(device)
    return x, w


@pytest.mark.gpu
@pytest.mark.parametrize("m", [1, 37, 1024, 2052])
@pytest.mark.parametrize("fp8", [False, True], ids=["bf16", "fp8"])
def test_matmul_add_matches_reference(m, fp8):
    device = torch.device("cuda")
    k, n = 1024, 768
    gen = torch.Generator().manual_seed(m)
    x, w = _bf16_case(m, k, n, gen, device)
    slots = torch.randn(2, m + 5, n, generator=gen).bfloat16().to(device)
    c = slots[1, 3:3 + m]  # a row slice of a larger buffer, as GEMM-RS's slot pieces are
    out_buf = torch.full((m + 8, n), float("nan"), dtype=torch.bfloat16, device=device)
    out = out_buf[4:4 + m]
    if fp8:
        xq, xs = torch.ops.minimax.quantize_fp8(x, 128)
        wq, wscale = quantize_weight_fp8(w.float())
        done = cublaslt_gemm.try_matmul_add(xq, wq, c, out, xs, wscale)
        want = _fp8_reference(xq, xs, wq, wscale) + c.float()
        if m % 4:  # the M-major activation scales need rows in fours: declined, untouched
            assert not done and torch.isnan(out).all()
            return
    else:
        done = cublaslt_gemm.try_matmul_add(x, w, c, out)
        want = x.float() @ w.float().t() + c.float()
    assert done, cublaslt_gemm.unavailable_reasons()
    torch.testing.assert_close(out.float(), want, rtol=2**-8, atol=_atol(want, fp8))
    assert torch.isnan(out_buf[:4]).all() and torch.isnan(out_buf[4 + m:]).all()  # nothing outside `out`


@pytest.mark.gpu
@pytest.mark.parametrize("fp8", [False, True], ids=["bf16", "fp8"])
def test_matmul_add_in_a_cuda_graph(fp8):
    device = torch.device("cuda")
    m, k, n = 512, 1024, 768
    gen = torch.Generator().manual_seed(5)
    x, w = _bf16_case(m, k, n, gen, device)
    c = torch.randn(m, n, generator=gen).bfloat16().to(device)
    out = torch.empty(m, n, dtype=torch.bfloat16, device=device)
    if fp8:
        xq, xs = torch.ops.minimax.quantize_fp8(x, 128)
        wq, wscale = quantize_weight_fp8(w.float())
        call = lambda: cublaslt_gemm.try_matmul_add(xq, wq, c, out, xs, wscale)  # noqa: E731
        want = lambda: _fp8_reference(xq, xs, wq, wscale) + c.float()  # noqa: E731
    else:
        call = lambda: cublaslt_gemm.try_matmul_add(x, w, c, out)  # noqa: E731
        want = lambda: x.float() @ w.float().t() + c.float()  # noqa: E731
    assert call(), cublaslt_gemm.unavailable_reasons()  # outside capture first: plan + workspace
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        call()
    for trial in range(2):
        c.copy_(torch.randn(m, n, generator=gen).bfloat16())
        if not fp8:
            x.copy_(torch.randn(m, k, generator=gen).bfloat16())
        graph.replay()
        torch.cuda.synchronize()
        ref = want()
        torch.testing.assert_close(out.float(), ref, rtol=2**-8, atol=_atol(ref, fp8))
