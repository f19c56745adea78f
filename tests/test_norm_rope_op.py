"""minimax::rms_norm_rope: its reference against the model's own code, its checks, and its Triton
kernel against the reference, run on the CPU by Triton's interpreter (TRITON_INTERPRET=1).

Exactness set-up (as tests/test_norm_quant_triton.py): the kernel's sum of squares is a tree,
torch's is vectorized; they agree bit for bit when every partial sum is exact, so the inputs of
the float32 checks are multiples of 1/4 with |x| <= 4. Division, sqrt, the products and every
cast are correctly rounded on both sides (the kernel does not contract the rotation's products
into FMAs), so the outputs must be EQUAL. In bfloat16 the rounding after the norm absorbs the
order of the sum on random inputs too, up to the rare tie: those tests also compare exactly.
"""

from __future__ import annotations

import pytest
import torch

from interpreted import INTERPRETING, in_child, run_this_file_interpreted
from minimax_backend.kernels.norm_quant import rms_norm_reference
from minimax_backend.kernels.norm_rope import rms_norm_rope_reference, rope_reference
from minimax_backend.model.layers import RMSNorm, apply_rope, rope_cos_sin

EPS = 1e-6


def _cos_sin(tokens: int, rotary: int):
    return rope_cos_sin(torch.arange(tokens) * 37 + 1000, rotary, 5e6)


def _qkv_slice(tokens: int, heads: int, d: int, dtype, seed: int, exact: bool = False) -> torch.Tensor:
    """[tokens, heads, d] as a column slice of a wider row, like q of the QKV GEMM's output."""
    g = torch.Generator().manual_seed(seed)
    wide = torch.randn(tokens, heads * d + 3 * d, generator=g) * 2
    if exact:
        wide = (wide * 4).round().clamp(-16, 16) / 4
    return wide.to(dtype)[:, d:d + heads * d].view(tokens, heads, d)


@pytest.mark.skipif(INTERPRETING, reason="the parent's tests")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("gemma", [True, False])
def test_reference_is_the_models_norm_then_rope_bit_for_bit(dtype, gemma):
    x = _qkv_slice(7, 3, 64, dtype, seed=1)
    norm = RMSNorm(64, EPS, gemma, "w", dtype=dtype, device="cpu")
    with torch.no_grad():
        norm.weight.copy_(torch.randn(64) * 0.2)
    cos, sin = _cos_sin(7, 32)
    want = apply_rope(norm(x), cos, sin)
    got = torch.ops.minimax.rms_norm_rope(x, norm.weight, cos, sin, EPS, gemma)
    assert torch.equal(got, want) and got.is_contiguous()
    assert torch.equal(rope_reference(rms_norm_reference(x, norm.weight, EPS, gemma), cos, sin), want)


@pytest.mark.skipif(INTERPRETING, reason="the parent's tests")
def test_bad_inputs_name_the_problem():
    x = _qkv_slice(5, 2, 64, torch.bfloat16, seed=0)
    w = torch.zeros(64, dtype=torch.bfloat16)
    cos, sin = _cos_sin(5, 32)
    cases = [
        ((x.flatten(1), w, cos, sin), "must be \\[tokens, heads, head_dim\\]"),
        ((x, w[:32], cos, sin), "weight must be \\[head_dim=64\\]"),
        ((x, w, cos[:4], sin[:4]), "cos must be float32 \\[tokens=5"),
        ((x, w, cos.double(), sin), "cos must be float32"),
        ((x, w, cos, sin[:, :8]), "differ"),
        ((x, w, *_cos_sin(5, 256)), "rotary_dim 256 is larger than head_dim 64"),
    ]
    for args, msg in cases:
        with pytest.raises(ValueError, match=msg):
            rms_norm_rope_reference(*args, EPS, True)


@pytest.mark.skipif(INTERPRETING, reason="this is the child")
def test_in_interpreter_child():
    run_this_file_interpreted(__file__)


# (tokens, heads, head_dim, rotary_dim): odd token and head counts, rotary = head_dim, M3's shape
SHAPES = [(1, 1, 64, 32), (13, 5, 64, 32), (9, 3, 128, 64), (4, 68, 128, 64), (6, 2, 64, 64), (3, 7, 96, 32)]


@in_child
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("gemma", [True, False])
def test_kernel_equals_the_reference_bf16(shape, gemma):
    from minimax_backend.kernels.norm_rope_triton import rms_norm_rope_triton

    t, h, d, r = shape
    x = _qkv_slice(t, h, d, torch.bfloat16, seed=t * h)
    w = (torch.randn(d, generator=torch.Generator().manual_seed(d)) * 0.3).to(torch.bfloat16)
    cos, sin = _cos_sin(t, r)
    got = rms_norm_rope_triton(x, w, cos, sin, EPS, gemma)
    assert torch.equal(got, rms_norm_rope_reference(x, w, cos, sin, EPS, gemma))


@in_child
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("gemma", [True, False])
def test_kernel_equals_the_reference_float32_exact_sums(shape, gemma):
    from minimax_backend.kernels.norm_rope_triton import rms_norm_rope_triton

    t, h, d, r = shape
    x = _qkv_slice(t, h, d, torch.float32, seed=t + h, exact=True)
    w = (torch.randn(d, generator=torch.Generator().manual_seed(d)) * 0.3)
    cos, sin = _cos_sin(t, r)
    got = rms_norm_rope_triton(x, w, cos, sin, EPS, gemma)
    assert torch.equal(got, rms_norm_rope_reference(x, w, cos, sin, EPS, gemma))


@in_child
@pytest.mark.parametrize("heads_per_prog", [1, 2, 8])
def test_every_launch_split_gives_the_same_output(heads_per_prog):
    from minimax_backend.kernels.norm_rope_triton import rms_norm_rope_triton

    x = _qkv_slice(5, 7, 64, torch.bfloat16, seed=3)
    w = torch.randn(64, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16) * 0.1
    cos, sin = _cos_sin(5, 32)
    want = rms_norm_rope_reference(x, w, cos, sin, EPS, True)
    assert torch.equal(rms_norm_rope_triton(x, w, cos, sin, EPS, True, heads_per_prog, 2), want)


@in_child
def test_the_rotation_is_checked_not_just_the_norm():
    """A kernel that skipped the rotation, or swapped cos and sin, would differ: the inputs make sure."""
    from minimax_backend.kernels.norm_rope_triton import rms_norm_rope_triton

    x = _qkv_slice(5, 3, 64, torch.bfloat16, seed=4)
    w = torch.zeros(64, dtype=torch.bfloat16)
    cos, sin = _cos_sin(5, 32)
    got = rms_norm_rope_triton(x, w, cos, sin, EPS, True)
    normed = rms_norm_reference(x, w, EPS, True)
    assert not torch.equal(got[..., :32], normed[..., :32])  # rotated
    assert torch.equal(got[..., 32:], normed[..., 32:])  # passed through
    assert not torch.equal(got, rms_norm_rope_reference(x, w, sin, cos, EPS, True))
