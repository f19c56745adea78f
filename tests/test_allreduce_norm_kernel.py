"""The one-kernel all-reduce + residual add + RMSNorm + FP8 quantization (kernels/allreduce_norm_cuda.py)
against the unfused reference, in Triton's interpreter on the CPU.

The kernel reads every rank's partial sum; here the "ranks" are local tensors, so what
is checked is the math the GPU kernel runs (the symmetric-memory exchange around it
needs several GPUs). The reference is the op's unfused sequence: the partials summed
(the all-reduce), then minimax::rms_norm_quant_fp8's reference.

Inputs are small multiples of 1/8 such that every float32 sum (over ranks, of squares)
is exact in any order, so scales, normed rows and residual must be equal bit for bit
(a separate case makes the sum over ranks need one bit more than BF16 has: it must be
rounded as the all-reduce's output is); FP8 data is compared with test_norm_quant_triton's check, exact except where the
interpreter's float8 conversion is documented wrong. No tolerance. Runs in a
TRITON_INTERPRET=1 child (test_in_interpreter_child), like the other kernel tests.
"""

from __future__ import annotations

import pytest
import torch

from interpreted import INTERPRETING, in_child, run_this_file_interpreted
from minimax_backend.kernels.fp8 import FP8_DTYPE
from minimax_backend.kernels.norm_quant import rms_norm_quant_fp8_reference, rms_norm_reference



@pytest.mark.skipif(INTERPRETING, reason="this is the child")
def test_in_interpreter_child():
    run_this_file_interpreted(__file__)


def _nice(shape, gen, dtype) -> torch.Tensor:
    return (torch.randint(-8, 9, shape, generator=gen) / 8).to(dtype)




CASES = [  # ranks, tokens, K, group, gemma, residual, dtype
    (2, 1, 256, 128, True, True, torch.bfloat16),
    (2, 5, 384, 128, True, False, torch.bfloat16),  # 3 groups: a padded tile; the first layer (no residual)
    (4, 7, 256, 128, False, True, torch.bfloat16),
    (8, 3, 384, 128, True, True, torch.bfloat16),
    (4, 5, 256, 32, True, True, torch.float32),
    (2, 7, 384, 0, True, True, torch.bfloat16),  # no quantization: the BF16 norm in front of the MoE
    (4, 1, 256, 0, False, True, torch.float32),
]


@in_child
@pytest.mark.parametrize("want_normed", [True, False])
@pytest.mark.parametrize("ranks,tokens,k,group,gemma,with_residual,dtype", CASES)
def test_kernel_equals_the_unfused_sequence(ranks, tokens, k, group, gemma, with_residual, dtype, want_normed):
    from test_norm_quant_triton import check_fp8_data

    from minimax_backend.kernels import allreduce_norm_cuda as arn

    gen = torch.Generator().manual_seed(ranks * 100 + tokens + k + group)
    partials = [_nice((tokens, k), gen, dtype) for _ in range(ranks)]
    residual = _nice((tokens, k), gen, dtype) if with_residual else None
    w = (torch.randn(k, generator=gen) * 0.2 + (0.0 if gemma else 1.0)).to(dtype)
    allreduced = torch.stack([p.float() for p in partials]).sum(0).to(dtype)  # exact: small multiples of 1/8
    assert arn.supported(partials[0], residual, w, group, ranks)
    q, s, y, r = arn.allreduce_norm_rows(partials, residual, w, 1e-6, gemma, group, want_normed)
    h = allreduced if residual is None else (allreduced + residual)
    if with_residual:
        assert torch.equal(r, h), "the new residual (all-reduced + residual) differs"
    else:
        assert r.numel() == 0
    if group == 0:
        assert q.numel() == 0 and s.numel() == 0
        assert torch.equal(y, rms_norm_reference(h, w, 1e-6, gemma)), "normed rows differ"
        return
    ref_q, ref_s, ref_y, _ = rms_norm_quant_fp8_reference(allreduced, residual, w, 1e-6, gemma, group, True)
    assert q.dtype == FP8_DTYPE and q.shape == (tokens, k) and torch.equal(s, ref_s), "scales differ"
    if want_normed:
        assert torch.equal(y, ref_y), "normed rows differ"
    else:
        assert y.numel() == 0
    assert check_fp8_data(q, ref_q, ref_y, ref_s) > 0.75


@in_child
@pytest.mark.parametrize("ranks", [2, 4])
def test_the_sum_over_ranks_is_rounded_to_bf16_before_the_norm(ranks):
    """Rank 0 holds 4 + k/4, rank 1 odd 64ths, the others 0 or 1/32: the sum lies in [4, 8) with a 9th bit,
    which BF16 does not have (a tie, to even). Squares stay multiples of 2^-10 below 64,
    so the norm's sum over K = 256 is still exact."""
    from minimax_backend.kernels import allreduce_norm_cuda as arn

    gen = torch.Generator().manual_seed(ranks)
    shape = (3, 256)
    sign = torch.randint(0, 2, shape, generator=gen) * 2 - 1
    first = sign * (4 + torch.randint(0, 14, shape, generator=gen) / 4)
    odd = sign * (2 * torch.randint(0, 2, shape, generator=gen) + 1) / 64  # the 9th bit
    fine = [odd] + [sign * torch.randint(0, 2, shape, generator=gen) / 32 for _ in range(ranks - 2)]
    partials = [t.to(torch.bfloat16) for t in [first, *fine]]
    assert all(torch.equal(p.double(), t.double()) for p, t in zip(partials, [first, *fine]))
    exact = torch.stack([p.double() for p in partials]).sum(0)
    allreduced = exact.to(torch.bfloat16)
    assert (allreduced.double() != exact).float().mean() > 0.5  # most sums are rounded
    w = (torch.randn(256, generator=gen) * 0.2).to(torch.bfloat16)
    q, s, y, _ = arn.allreduce_norm_rows(partials, None, w, 1e-6, True, 128, True)
    ref_q, ref_s, ref_y, _ = rms_norm_quant_fp8_reference(allreduced, None, w, 1e-6, True, 128, True)
    assert torch.equal(y, ref_y) and torch.equal(s, ref_s)


@in_child
def test_partials_of_another_layout_or_too_many_ranks_are_refused():
    from minimax_backend.kernels import allreduce_norm_cuda as arn

    x = torch.zeros(3, 256, dtype=torch.bfloat16)
    w = torch.zeros(256, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="share shape"):
        arn.allreduce_norm_rows([x, torch.zeros(4, 256, dtype=torch.bfloat16)], None, w, 1e-6, True, 128, True)
    with pytest.raises(ValueError, match="9 partials"):
        arn.allreduce_norm_rows([x] * 9, None, w, 1e-6, True, 128, True)
    assert not arn.supported(torch.zeros(3, 200, dtype=torch.bfloat16), None, w, 128, 2)  # K not whole groups


def test_the_fused_path_is_off_by_default():
    """Until it has run on several GPUs the op takes the unfused sequence unless asked."""
    from minimax_backend.kernels.options import KernelOptions, kernel_options

    assert KernelOptions().allreduce_norm == "unfused"
    assert KernelOptions.from_env({"MINIMAX_ALLREDUCE_NORM": "symm_mem"}).allreduce_norm == "symm_mem"
    with pytest.raises(ValueError, match="MINIMAX_ALLREDUCE_NORM"):
        KernelOptions.from_env({"MINIMAX_ALLREDUCE_NORM": "nccl"})
    assert "allreduce_norm" in kernel_options().to_dict()
