"""minimax::rms_norm_quant_fp8 on the CPU: bit for bit the model's own unfused path.

The reference is the model's RMSNorm module (model/layers.py) followed by
minimax::quantize_fp8, with the residual add done as the model does it
(h = h + x in the model dtype). Every output is compared with torch.equal
(FP8 data as bytes), at odd token counts.
"""

from __future__ import annotations

import pytest
import torch

from minimax_backend.kernels.fp8 import FP8_DTYPE
from minimax_backend.model.layers import RMSNorm

op = torch.ops.minimax.rms_norm_quant_fp8


def _norm(k: int, gemma: bool, dtype, seed: int = 0) -> RMSNorm:
    g = torch.Generator().manual_seed(seed)
    m = RMSNorm(k, 1e-6, gemma, "test.norm.weight", dtype=dtype, device="cpu")
    with torch.no_grad():
        m.weight.copy_((torch.randn(k, generator=g) * 0.1 + (0.0 if gemma else 1.0)).to(dtype))
    return m


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8) if t.dtype == FP8_DTYPE else t


def _assert_same(a: torch.Tensor, b: torch.Tensor) -> None:
    assert a.dtype == b.dtype and a.shape == b.shape
    assert torch.equal(_bits(a), _bits(b))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("gemma", [True, False])
@pytest.mark.parametrize("m,k,g", [(1, 256, 128), (7, 384, 128), (37, 256, 32)])
@pytest.mark.parametrize("with_residual", [False, True])
def test_equals_model_norm_then_quantize(dtype, gemma, m, k, g, with_residual):
    gen = torch.Generator().manual_seed(m * k)
    norm = _norm(k, gemma, dtype)
    x = (torch.randn(m, k, generator=gen) * torch.logspace(-2, 1, k)).to(dtype)
    residual = (torch.randn(m, k, generator=gen) * 3).to(dtype) if with_residual else None
    with torch.no_grad():
        h = residual + x if with_residual else x  # the model: h = h + block(...)
        y = norm(h)
        q_ref, s_ref = torch.ops.minimax.quantize_fp8(y, g)
        q, s, y_out, r_out = op(x, residual, norm.weight, norm.eps, gemma, g, True)
    _assert_same(q, q_ref)
    _assert_same(s, s_ref)
    _assert_same(y_out, y)
    if with_residual:
        _assert_same(r_out, h)
    else:
        assert r_out.numel() == 0


def test_outputs_not_wanted_are_empty_and_3d_inputs_work():
    norm = _norm(256, True, torch.bfloat16)
    x = torch.randn(2, 5, 256).to(torch.bfloat16)
    q, s, y, r = op(x, None, norm.weight, 1e-6, True, 128, False)
    assert q.shape == (2, 5, 256) and s.shape == (2, 5, 2)
    assert y.numel() == 0 and r.numel() == 0
    q_ref, s_ref = torch.ops.minimax.quantize_fp8(norm(x), 128)
    _assert_same(q, q_ref)
    _assert_same(s, s_ref)


def test_fake_shapes():
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        x = torch.empty(7, 384, dtype=torch.bfloat16)
        w = torch.empty(384, dtype=torch.bfloat16)
        q, s, y, r = op(x, x, w, 1e-6, True, 32, True)
        assert (q.dtype, tuple(q.shape)) == (FP8_DTYPE, (7, 384))
        assert (s.dtype, tuple(s.shape)) == (torch.float32, (7, 12))
        assert (y.dtype, tuple(y.shape)) == (torch.bfloat16, (7, 384))
        assert tuple(r.shape) == (7, 384)
        _, _, y, r = op(x, None, w, 1e-6, True, 128, False)
        assert y.numel() == 0 and r.numel() == 0


def test_opcheck():
    x = torch.randn(3, 256).to(torch.bfloat16)
    w = torch.randn(256).to(torch.bfloat16)
    torch.library.opcheck(op, (x, x.clone(), w, 1e-6, True, 128, True),
                          test_utils=("test_schema", "test_faketensor"))


@pytest.mark.parametrize(
    "shape,wk,g,msg",
    [((4, 200), 200, 128, "not divisible"), ((4, 256), 128, 128, "weight must be"), ((4, 256), 256, 64, "group_size")],
)
def test_bad_inputs(shape, wk, g, msg):
    with pytest.raises(ValueError, match=msg):
        op(torch.randn(shape), None, torch.randn(wk), 1e-6, True, g, False)
