"""minimax::moe and minimax::mega_moe on one device: against the eager block,
fake (meta) shapes, argument checks, and the dispatch choice."""

from __future__ import annotations

import pytest
import torch

from conftest import tiny_m2_config, tiny_m3_config
from minimax_backend.kernels import moe as K
from minimax_backend.kernels import moe_parallel as P


_BLOCKS: dict = {}


def _block(cfg, dtype=torch.float32, fp8=False):
    key = (cfg.model_type, dtype, fp8)
    if key not in _BLOCKS:
        _BLOCKS[key] = _build(cfg, dtype, fp8)
    return _BLOCKS[key]


def _build(cfg, dtype, fp8):
    from minimax_backend.model.minimax import init_random_weights
    from minimax_backend.model.moe import MoE
    from minimax_backend.model.parallel import ParallelState

    blk = MoE(cfg, ParallelState.single(), "model.layers.0.block_sparse_moe", dtype=dtype, device="cpu", fp8=fp8)
    blk.config = cfg
    return init_random_weights(blk, seed=0).eval()


CASES = {
    "m3_f32": (tiny_m3_config, torch.float32, False),
    "m3_bf16": (tiny_m3_config, torch.bfloat16, False),
    "m3_fp8": (tiny_m3_config, torch.bfloat16, True),
    "m2_bf16": (tiny_m2_config, torch.bfloat16, False),
}


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("tokens", [1, 13])
def test_ops_equal_the_eager_block(case, tokens):
    make, dtype, fp8 = CASES[case]
    blk = _block(make(), dtype, fp8)
    x = torch.randn(tokens, blk.gate.weight.shape[1], generator=torch.Generator().manual_seed(tokens)).to(dtype)
    args = K.block_op_args(blk)
    with torch.no_grad():
        ref = blk(x)
        moe = torch.ops.minimax.moe(x, *args)
        mega = torch.ops.minimax.mega_moe(x, *args, "", 1, False, False, tokens, "allgather")
        sharded = torch.ops.minimax.mega_moe(x, *args, "", 1, True, True, tokens, "alltoall")
    # One device: the same ops in the same order as the eager block.
    for out in (moe, mega, sharded):
        assert out.dtype == dtype and out.shape == x.shape
        torch.testing.assert_close(out, ref, rtol=0, atol=0)


def test_padding_rows_on_one_device_are_zero():
    blk = _block(tiny_m3_config())
    x = torch.randn(5, 256)
    args = K.block_op_args(blk)
    out = torch.ops.minimax.mega_moe(x, *args, "", 1, True, True, 3, "allgather")
    assert out.shape == (5, 256) and out[3:].abs().max() == 0
    torch.testing.assert_close(out[:3], torch.ops.minimax.moe(x[:3], *args))


@pytest.mark.parametrize(
    "rows, tp, in_sharded, out_sharded, tokens, want",
    [
        (7, 2, False, False, 7, 7),  # replicated in and out
        (4, 2, True, True, 7, 4),  # SP: shard of 7 tokens padded to 8
        (4, 2, True, False, 7, 7),
        (7, 2, False, True, 7, 4),
        (1, 4, True, True, 1, 1),  # decode at TP 4: one row per rank
        (9, 1, False, False, 9, 9),
    ],
)
def test_fake_shapes(rows, tp, in_sharded, out_sharded, tokens, want):
    from torch._subclasses.fake_tensor import FakeTensorMode

    blk = _block(tiny_m3_config())
    args = K.block_op_args(blk)
    with FakeTensorMode(allow_non_fake_inputs=True):
        x = torch.empty(rows, 256)
        out = torch.ops.minimax.mega_moe(x, *args, "g" if tp > 1 else "", tp, in_sharded, out_sharded, tokens,
                                         "allgather")
        assert tuple(out.shape) == (want, 256)
        assert tuple(torch.ops.minimax.moe(x, *args).shape) == (rows, 256)


def test_opcheck():
    blk = _block(tiny_m2_config())
    args = K.block_op_args(blk)
    x = torch.randn(6, 256)
    torch.library.opcheck(torch.ops.minimax.moe.default, (x, *args), test_utils=("test_schema", "test_faketensor"))
    torch.library.opcheck(torch.ops.minimax.mega_moe.default, (x, *args, "", 1, False, False, 6, "allgather"),
                          test_utils=("test_schema", "test_faketensor"))


def test_argument_errors():
    blk = _block(tiny_m3_config())
    args = list(K.block_op_args(blk))
    x = torch.randn(3, 256)
    bad_act = args.copy()
    bad_act[14] = "gelu"
    with pytest.raises(ValueError, match="unknown activation 'gelu'"):
        torch.ops.minimax.moe(x, *bad_act)
    bad_off = args.copy()
    bad_off[13] = 3
    with pytest.raises(ValueError, match="do not tile 8 experts"):
        torch.ops.minimax.moe(x, *bad_off)
    with pytest.raises(ValueError, match="dispatch 'nccl'"):
        torch.ops.minimax.mega_moe(x, *args, "", 1, False, False, 3, "nccl")


def test_dispatch_choice():
    assert P.choose_dispatch(has_shared=True, group_size=8, ep_size=8) == "allgather"  # M3: shared expert
    assert P.choose_dispatch(has_shared=False, group_size=8, ep_size=8) == "alltoall"  # M2 with EP
    assert P.choose_dispatch(has_shared=False, group_size=8, ep_size=1) == "allgather"  # experts on every rank
    assert P.choose_dispatch(has_shared=False, group_size=1, ep_size=1) == "allgather"
