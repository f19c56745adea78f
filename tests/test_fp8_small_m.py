"""kernels/fp8_small_m_triton.py (the FP8 block GEMM for decode's few rows) against the
reference op: in Triton's interpreter on the CPU, and at M3's decode shapes on a GPU."""

from __future__ import annotations

import pytest
import torch

from interpreted import INTERPRETING, in_child, run_this_file_interpreted
from minimax_backend.kernels.fp8 import quantize_weight_fp8
from minimax_backend.kernels.fp8_small_m_triton import SmallMConfig, row_tile, small_m_config, small_m_supports


def _args(m, n, k, seed=0, device="cpu"):
    """Activations with very different ranges per 128-group and a weight whose blocks differ
    up to 16x in scale, so a kernel reading the wrong group's or block's scale is far off."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=gen) * torch.logspace(-1, 1, k // 128).repeat_interleave(128)
    amp = torch.exp2(torch.randint(-2, 3, (-(-n // 128), k // 128), generator=gen).float())
    w = torch.randn(n, k, generator=gen) * k**-0.5 * amp.repeat_interleave(128, 0)[:n].repeat_interleave(128, 1)
    xq, xs = torch.ops.minimax.quantize_fp8(x, 128)
    wq, ws = quantize_weight_fp8(w)
    return [t.to(device) for t in (xq, xs, wq, ws)]


def test_config_splits_k_only_where_the_columns_leave_sms_idle():
    assert small_m_config(24576, 6144).split_k == 1  # 384 column slices: plenty
    assert small_m_config(6144, 8192).split_k == 4  # 96 slices < 2 per SM
    assert small_m_config(6144, 1536).split_k == 1  # 12 K groups: slices of 3 would be too short
    assert small_m_config(6144, 2048).split_k == 2
    assert small_m_config(256, 384).split_k == 1  # 3 K groups: nothing to split
    assert small_m_supports(1, 6144, 128) and small_m_supports(64, 256, 128)
    assert not small_m_supports(65, 6144, 128) and not small_m_supports(4, 6144, 32)
    assert [row_tile(m) for m in (1, 16, 17, 32, 33, 64)] == [16, 16, 32, 32, 64, 64]


@pytest.mark.skipif(INTERPRETING, reason="this is the child")
def test_in_interpreter_child():
    run_this_file_interpreted(__file__)


@in_child
@pytest.mark.parametrize("m,n,k,config", [
    (1, 200, 384, SmallMConfig(32, 1, 4, 4)),   # ragged N (last weight block 72 rows), 3 K groups
    (3, 130, 1024, SmallMConfig(32, 2, 4, 4)),  # split K in two
    (16, 256, 768, SmallMConfig(64, 3, 4, 4)),  # a full row tile, K in three slices
    (5, 96, 512, None),                         # the default config
    (33, 200, 384, SmallMConfig(32, 1, 4, 4)),  # a 64-row tile, 31 rows of it empty
    (64, 256, 768, SmallMConfig(64, 3, 4, 4)),  # a full 64-row tile, K in three slices
    (21, 130, 1024, None),                      # a 32-row tile, the default config
])
def test_matches_reference_op(m, n, k, config):
    from minimax_backend.kernels.fp8_small_m_triton import fp8_small_m_gemm

    xq, xs, wq, ws = _args(m, n, k, seed=m + n)
    ref = torch.ops.minimax.fp8_block_gemm(xq, xs, wq, ws, torch.float32)
    out = fp8_small_m_gemm(xq, xs, wq, ws, torch.float32, config)
    # float32 out: only the summation order differs from the reference
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5 * float(ref.abs().max()))
    out16 = fp8_small_m_gemm(xq, xs, wq, ws, torch.bfloat16, config)
    assert out16.dtype == torch.bfloat16 and out16.shape == (m, n)
    torch.testing.assert_close(out16.float(), ref, rtol=2**-7, atol=1e-5 * float(ref.abs().max()))


@in_child
def test_a_wrong_weight_block_scale_is_seen():
    """Swapping two weight blocks' scales moves the output far past the tolerance above."""
    from minimax_backend.kernels.fp8_small_m_triton import fp8_small_m_gemm

    xq, xs, wq, ws = _args(2, 256, 512, seed=3)
    ref = torch.ops.minimax.fp8_block_gemm(xq, xs, wq, ws, torch.float32)
    swapped = ws.clone()
    swapped[0, 1], swapped[0, 2] = ws[0, 2], ws[0, 1]
    assert ws[0, 1] != ws[0, 2]
    out = fp8_small_m_gemm(xq, xs, wq, swapped, torch.float32, SmallMConfig(32, 2, 4, 4))
    assert (out - ref).abs().max() > 1e-2 * ref.abs().max()


@in_child
def test_the_op_runs_it_for_at_most_64_rows():
    """fp8_block_gemm's CUDA entry (kernels/fp8_gemm_cuda.py) sends <= 64 rows here (the same
    bytes as calling the kernel), leading dims and `out=` included; 65 rows go elsewhere."""
    from minimax_backend.kernels.fp8_gemm_cuda import fp8_block_gemm_cuda
    from minimax_backend.kernels.fp8_small_m_triton import fp8_small_m_gemm

    xq, xs, wq, ws = _args(6, 256, 1024, seed=5)
    want = fp8_small_m_gemm(xq, xs, wq, ws, torch.bfloat16)
    got = fp8_block_gemm_cuda(xq.view(2, 3, -1), xs.view(2, 3, -1), wq, ws, torch.bfloat16)
    assert got.shape == (2, 3, 256) and torch.equal(got.view(6, 256), want)
    out = torch.full((6, 256), float("nan"), dtype=torch.bfloat16)
    assert fp8_block_gemm_cuda(xq, xs, wq, ws, torch.bfloat16, out=out) is out and torch.equal(out, want)
    xq, xs, wq, ws = _args(65, 256, 1024, seed=5)
    ref = torch.ops.minimax.fp8_block_gemm(xq, xs, wq, ws, torch.float32)
    torch.testing.assert_close(fp8_block_gemm_cuda(xq, xs, wq, ws, torch.float32), ref,
                               rtol=1e-5, atol=1e-5 * float(ref.abs().max()))


@in_child
def test_refuses_what_it_does_not_take():
    from minimax_backend.kernels.fp8_small_m_triton import fp8_small_m_gemm

    xq, xs, wq, ws = _args(65, 128, 256)
    with pytest.raises(ValueError, match="1-64 rows"):
        fp8_small_m_gemm(xq, xs, wq, ws, torch.float32)
    xq, xs, wq, ws = _args(2, 128, 384)
    with pytest.raises(ValueError, match="does not divide the 3 K groups"):
        fp8_small_m_gemm(xq, xs, wq, ws, torch.float32, SmallMConfig(32, 2, 4, 4))


# M3's decode GEMMs (hidden 6144): fused QKV (64 + 2 x 4 heads of 128), o_proj, the dense
# MLP's gate/up and down.
M3_DECODE_SHAPES = [(9216, 6144), (6144, 8192), (24576, 6144), (6144, 12288)]


@pytest.mark.gpu
@pytest.mark.parametrize("m", [1, 7, 16])
@pytest.mark.parametrize("n,k", M3_DECODE_SHAPES)
def test_gpu_matches_reference_at_m3_shapes(m, n, k):
    """A 16-row tile widens E4M3 to FP16 for the MMA: products and their float32 sums as
    exact as the reference's (measured max error 5e-7 of the largest output)."""
    from minimax_backend.kernels.fp8_small_m_triton import fp8_small_m_gemm

    xq, xs, wq, ws = _args(m, n, k, seed=m)
    ref = torch.ops.minimax.fp8_block_gemm(xq, xs, wq, ws, torch.float32)
    out = fp8_small_m_gemm(*(t.cuda() for t in (xq, xs, wq, ws)), torch.bfloat16)
    torch.testing.assert_close(out.float().cpu(), ref, rtol=2**-7, atol=1e-5 * float(ref.abs().max()))


@pytest.mark.gpu
@pytest.mark.parametrize("m", [17, 33, 64])
@pytest.mark.parametrize("n,k", M3_DECODE_SHAPES)
def test_gpu_larger_row_tiles_are_as_exact_as_cublas(m, n, k):
    """32- and 64-row tiles run Hopper's FP8 MMA, whose accumulator keeps fewer bits than
    float32 within a 128-wide K group, as cuBLAS's blockwise GEMM (the path these rows took
    before) does: on the same inputs our error against the float64 reference must not
    exceed cuBLAS's by more than 10% (measured on the H200: equal, relative norm 1.3e-4)."""
    from minimax_backend.kernels.fp8_gemm_cuda import fp8_block_gemm_scaled_mm, scaled_mm_supports
    from minimax_backend.kernels.fp8_small_m_triton import fp8_small_m_gemm

    if not scaled_mm_supports(m, k, 128):
        pytest.skip("this torch / GPU has no blockwise torch._scaled_mm to compare with")
    xq, xs, wq, ws = _args(m, n, k, seed=m)
    ref = torch.ops.minimax.fp8_block_gemm(xq, xs, wq, ws, torch.float32).double()
    gpu = [t.cuda() for t in (xq, xs, wq, ws)]
    ours = (fp8_small_m_gemm(*gpu, torch.float32).double().cpu() - ref).abs()
    cublas = (fp8_block_gemm_scaled_mm(*gpu, torch.float32).double().cpu() - ref).abs()
    assert ours.norm() <= 1.1 * cublas.norm() + 1e-9 * ref.norm(), (ours.norm() / ref.norm()).item()
    assert ours.max() <= 1.1 * cublas.max() + 1e-9 * ref.abs().max()
    assert ours.norm() <= 1e-3 * ref.norm()  # and both are close: the scales were applied right
