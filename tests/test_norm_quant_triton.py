"""The Triton kernel of minimax::rms_norm_quant_fp8 against the CPU reference,
run on the CPU by Triton's interpreter (TRITON_INTERPRET=1), at odd shapes.

Exactness set-up. The kernel's row sum is a tree, torch's is vectorized: the
two agree bit for bit when every partial sum is exact, so the inputs are
multiples of 1/4 with |x| <= 4 (then sum(x * x) is an exact float32 at any
order). Division, rsqrt and all casts are correctly rounded on both sides,
so the scales, the BF16 output and the residual must be EQUAL.

The interpreter's float32 -> float8 conversion is not the GPU's: it rounds
ties away from zero instead of to even, truncates subnormal results, and
loses the carry when rounding up crosses into an odd exponent (7.94 -> 4.0
instead of 8.0). So the FP8 data is compared exactly wherever the reference
value y / scale is exactly representable or rounds without a tie, a carry or
a subnormal result; at the other positions the interpreter's value must be
one of the two E4M3 neighbours of y / scale, or half the upper one after a
lost carry (nothing else). No tolerance. On the GPU (tests/test_norm_quant_gpu.py)
the same inputs compare exactly everywhere.

Triton picks interpreter or compiler when it is imported (its own tl.sum is
a jit function), and torch imports it early. So under a plain `pytest` run,
test_in_interpreter_child re-runs this file in a child process started with
TRITON_INTERPRET=1, where the other tests run; in the parent they skip.
"""

from __future__ import annotations

import pytest
import torch

from interpreted import INTERPRETING, in_child, run_this_file_interpreted
from minimax_backend.kernels.fp8 import FP8_DTYPE
from minimax_backend.kernels.norm_quant import rms_norm_quant_fp8_reference

pytest.importorskip("triton")

E4M3_MIN_NORMAL = 2.0**-6


@pytest.mark.skipif(INTERPRETING, reason="this is the child")
def test_in_interpreter_child():
    run_this_file_interpreted(__file__)


@pytest.fixture(scope="module")
def nqt():
    import minimax_backend.kernels.norm_quant_triton as mod

    return mod


def _e4m3_values() -> torch.Tensor:
    v = torch.arange(256, dtype=torch.uint8).view(FP8_DTYPE).double()
    v = v[torch.isfinite(v) & (v >= 0)]
    return torch.unique(v)  # sorted, 0 ... 448


def check_fp8_data(q: torch.Tensor, q_ref: torch.Tensor, y_ref: torch.Tensor, s_ref: torch.Tensor,
                   interpreter: bool = True) -> float:
    """Exact where the conversion is well defined; documented interpreter cases elsewhere.

    Returns the fraction of positions compared exactly."""
    g = y_ref.shape[-1] // s_ref.shape[-1]
    v = y_ref.double() / s_ref.double().repeat_interleave(g, -1)  # exact: scales are powers of two
    a = v.abs().flatten()
    table = _e4m3_values()
    hi_i = torch.searchsorted(table, a).clamp(max=len(table) - 1)
    upper = table[hi_i]
    lower = table[(torch.searchsorted(table, a, right=True) - 1).clamp(min=0)]
    qa, qr = q.double().flatten(), q_ref.double().flatten()
    exact = lower == a
    tie = ~exact & ((a - lower) == (upper - a))
    pow2 = torch.frexp(upper).mantissa == 0.5
    carry = ~exact & (qr.abs() == upper) & pow2
    sub = ~exact & (a < E4M3_MIN_NORMAL)
    safe = exact | ~(tie | carry | sub)
    if not interpreter:
        safe = torch.ones_like(safe)
    bad = safe & (qa != qr)
    assert not bad.any(), f"{int(bad.sum())} FP8 values differ where the rounding is well defined: " \
                          f"ref {qr[bad][:5].tolist()} got {qa[bad][:5].tolist()} (y/scale {v.flatten()[bad][:5].tolist()})"
    rest = ~safe
    same_sign = (torch.sign(qa) == torch.sign(v.flatten())) | (qa == 0)
    allowed = (qa.abs() == lower) | (qa.abs() == upper) | (carry & (qa.abs() == upper / 2))
    odd = rest & ~(allowed & same_sign)
    assert not odd.any(), f"unexplained FP8 values: y/scale {v.flatten()[odd][:5].tolist()} -> {qa[odd][:5].tolist()}"
    return float(safe.double().mean())


def _nice(shape, gen, dtype) -> torch.Tensor:
    return (torch.randint(-16, 17, shape, generator=gen) / 4).to(dtype)


CASES = [
    # m, k, g, gemma, residual, dtype
    (1, 256, 128, True, False, torch.bfloat16),
    (7, 384, 128, True, True, torch.bfloat16),
    (37, 256, 128, False, True, torch.bfloat16),
    (37, 384, 32, True, False, torch.bfloat16),
    (7, 256, 32, False, False, torch.bfloat16),
    (1, 384, 128, False, True, torch.bfloat16),
    (7, 384, 128, True, True, torch.float32),
    (37, 256, 32, False, False, torch.float32),
]


@in_child
@pytest.mark.parametrize("split", [False, True], ids=["one_tile", "split_tiles"])
@pytest.mark.parametrize("m,k,g,gemma,with_residual,dtype", CASES)
def test_interpreter_matches_reference(nqt, m, k, g, gemma, with_residual, dtype, split):
    """split: rows of 3 or 12 groups as two tiles (2 + 1, 8 + 4); 2 or 8 groups stay one tile."""
    gen = torch.Generator().manual_seed(m * 1000 + k + g)
    x = _nice((m, k), gen, dtype)
    residual = _nice((m, k), gen, dtype) if with_residual else None
    w = (torch.randn(k, generator=gen) * 0.2 + (0.0 if gemma else 1.0)).to(dtype)
    ref = rms_norm_quant_fp8_reference(x, residual, w, 1e-6, gemma, g, True)
    assert nqt.supported(x, residual, w, g)
    out = nqt.rms_norm_quant_fp8_triton(x, residual, w, 1e-6, gemma, g, True, split_tiles=split)
    q, s, y, r = out
    assert q.dtype == FP8_DTYPE and q.shape == (m, k) and s.shape == (m, k // g)
    assert torch.equal(s, ref[1]), "scales differ"
    assert torch.equal(y, ref[2]), "normed output differs"
    if with_residual:
        assert torch.equal(r, ref[3]), "residual differs"
    else:
        assert r.numel() == 0
    safe = check_fp8_data(q, ref[0], ref[2], ref[1])
    assert safe > 0.75, f"only {safe:.0%} of the FP8 values were comparable exactly"


@in_child
def test_interpreter_without_bf16_output_and_3d(nqt):
    gen = torch.Generator().manual_seed(5)
    x = _nice((3, 5, 256), gen, torch.bfloat16)
    w = torch.randn(256, generator=gen).to(torch.bfloat16) * 0.1
    q, s, y, r = nqt.rms_norm_quant_fp8_triton(x, None, w, 1e-6, True, 128, False)
    ref = rms_norm_quant_fp8_reference(x, None, w, 1e-6, True, 128, True)
    assert q.shape == (3, 5, 256) and s.shape == (3, 5, 2) and y.numel() == 0 and r.numel() == 0
    assert torch.equal(s, ref[1])
    check_fp8_data(q, ref[0], ref[2], ref[1])


@in_child
def test_interpreter_general_inputs_within_one_rounding(nqt):
    """Arbitrary inputs: the row sum's order may move rstd by an ulp, so the BF16
    output may differ by one BF16 rounding (rarely); everything else follows it."""
    gen = torch.Generator().manual_seed(11)
    m, k = 37, 384
    x = (torch.randn(m, k, generator=gen) * torch.logspace(-2, 1, k)).to(torch.bfloat16)
    res = torch.randn(m, k, generator=gen).to(torch.bfloat16)
    w = (torch.randn(k, generator=gen) * 0.1).to(torch.bfloat16)
    ref = rms_norm_quant_fp8_reference(x, res, w, 1e-6, True, 128, True)
    q, s, y, r = nqt.rms_norm_quant_fp8_triton(x, res, w, 1e-6, True, 128, True)
    assert torch.equal(r, ref[3])
    diff = (y.float() - ref[2].float()).abs()
    assert torch.all(diff <= ref[2].float().abs() * 2.0**-7)  # at most one BF16 step
    assert (diff == 0).float().mean() > 0.99
    same_rows = (diff == 0).all(-1)
    assert torch.equal(s[same_rows], ref[1][same_rows])
    check_fp8_data(q[same_rows], ref[0][same_rows], ref[2][same_rows], ref[1][same_rows])


def test_tile_groups():
    from minimax_backend.kernels.norm_quant_triton import tile_groups

    assert tile_groups(48, False) == (64, 0)  # hidden 6144, G 128: one tile, 16 idle groups
    assert tile_groups(48, True) == (32, 16)
    assert tile_groups(192, True) == (128, 64)  # G 32 (MXFP8)
    assert tile_groups(64, True) == (64, 0)  # a power of two needs no split
    assert tile_groups(40, True) == (32, 8)
    assert tile_groups(56, True) == (64, 0)  # 32 + 24: the rest is no power of two


@in_child
@pytest.mark.parametrize("rows", [1, 2])
def test_split_tiles_equal_one_tile_at_the_served_width(nqt, rows):
    """Hidden 6144 (48 groups as 32 + 16), 5 rows (an odd last block at 2 rows per program)."""
    gen = torch.Generator().manual_seed(rows)
    x = _nice((5, 6144), gen, torch.bfloat16)
    res = _nice((5, 6144), gen, torch.bfloat16)
    w = (torch.randn(6144, generator=gen) * 0.2).to(torch.bfloat16)
    want = nqt.rms_norm_quant_fp8_triton(x, res, w, 1e-6, True, 128, True, rows_per_program=rows)
    got = nqt.rms_norm_quant_fp8_triton(x, res, w, 1e-6, True, 128, True, rows_per_program=rows, split_tiles=True)
    for a, b in zip(got, want):
        assert torch.equal(a.view(torch.uint8) if a.dtype == FP8_DTYPE else a,
                           b.view(torch.uint8) if b.dtype == FP8_DTYPE else b)


@in_child
def test_zero_rows_and_all_zero_groups(nqt):
    x = torch.zeros(3, 256, dtype=torch.bfloat16)
    x[1, :128] = 2.0
    w = torch.zeros(256, dtype=torch.bfloat16)
    ref = rms_norm_quant_fp8_reference(x, None, w, 1e-6, True, 128, True)
    q, s, y, _ = nqt.rms_norm_quant_fp8_triton(x, None, w, 1e-6, True, 128, True)
    assert torch.equal(s, ref[1]) and torch.equal(y, ref[2])
    assert torch.equal(q.view(torch.uint8), ref[0].view(torch.uint8))


def test_not_supported_falls_back():
    from minimax_backend.kernels import norm_quant_triton as mod

    x = torch.randn(4, 256).to(torch.float16)
    assert not mod.supported(x, None, torch.randn(256).half(), 128)  # fp16: reference path


@in_child
@pytest.mark.parametrize("m,n,k,g", [(7, 200, 384, 128), (37, 130, 256, 32), (1, 256, 256, 128)])
def test_fp8_block_gemm_triton_fallback_matches_reference(m, n, k, g):
    """The Triton fallback of the FP8 GEMM (kernels/fp8_gemm_cuda.py) against the CPU op,
    float32 output: only the accumulation order differs."""
    from minimax_backend.kernels.fp8 import quantize_weight_fp8
    from minimax_backend.kernels.fp8_gemm_cuda import fp8_block_gemm_triton

    gen = torch.Generator().manual_seed(m + n + k)
    xq, xs = torch.ops.minimax.quantize_fp8(torch.randn(m, k, generator=gen), g)
    w, ws = quantize_weight_fp8(torch.randn(n, k, generator=gen) * 0.05)
    ref = torch.ops.minimax.fp8_block_gemm(xq, xs, w, ws, torch.float32)
    out = fp8_block_gemm_triton(xq, xs, w, ws, torch.float32)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5 * float(ref.abs().max()))
    out16 = fp8_block_gemm_triton(xq, xs, w, ws, torch.bfloat16)
    assert out16.dtype == torch.bfloat16
    torch.testing.assert_close(out16.float(), ref, rtol=2**-7, atol=1e-5 * float(ref.abs().max()))


@in_child
@pytest.mark.parametrize("m", [0, 5, 8])
def test_fp8_block_gemm_cuda_writes_into_out(m, monkeypatch):
    """The entry GEMM-RS calls with `out=` (its row blocks) gives the bytes of the plain call
    (Triton backend here, seen to run: cuBLAS needs the GPU, and the small-M kernel would take
    these rows by default) and rejects an out of the wrong shape."""
    import minimax_backend.kernels.fp8_gemm_cuda as fg
    from minimax_backend.kernels.fp8 import quantize_weight_fp8
    from minimax_backend.kernels.fp8_gemm_cuda import fp8_block_gemm_cuda
    from minimax_backend.kernels.options import override_kernel_options

    gen = torch.Generator().manual_seed(m)
    xq, xs = torch.ops.minimax.quantize_fp8(torch.randn(m, 512, generator=gen), 128)
    w, ws = quantize_weight_fp8(torch.randn(256, 512, generator=gen))
    ran = []
    real = fg.fp8_block_gemm_triton
    monkeypatch.setattr(fg, "fp8_block_gemm_triton", lambda *a, **kw: ran.append(1) or real(*a, **kw))
    monkeypatch.setattr(fg, "fp8_small_m_gemm", lambda *a, **kw: pytest.fail("the small-M kernel ran"))
    with override_kernel_options(fp8_gemm="triton"):
        want = fp8_block_gemm_cuda(xq, xs, w, ws, torch.float32)
        out = torch.full((m, 256), float("nan"))
        got = fp8_block_gemm_cuda(xq, xs, w, ws, torch.float32, out=out)
        assert got.data_ptr() == out.data_ptr() and torch.equal(out, want)
        with pytest.raises(ValueError, match="out must be a contiguous"):
            fp8_block_gemm_cuda(xq, xs, w, ws, torch.float32, out=torch.empty(m, 255))
    assert len(ran) == (2 if m else 0)  # 0 rows return before any kernel


@in_child
@pytest.mark.parametrize("shape,g,dtype", [((7, 384), 128, torch.bfloat16), ((37, 256), 32, torch.bfloat16),
                                           ((2, 3, 256), 128, torch.float32)])
def test_quantize_only_kernel_matches_quantize_fp8(nqt, shape, g, dtype):
    """The same kernel without the norm, as a CUDA path for minimax::quantize_fp8."""
    gen = torch.Generator().manual_seed(sum(shape))
    x = (torch.randn(shape, generator=gen) * torch.logspace(-2, 2, shape[-1])).to(dtype)
    q_ref, s_ref = torch.ops.minimax.quantize_fp8(x, g)
    q, s = nqt.quantize_fp8_triton(x, g)
    assert q.shape == q_ref.shape and torch.equal(s, s_ref)
    check_fp8_data(q, q_ref, x, s_ref)
