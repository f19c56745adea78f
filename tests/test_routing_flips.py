"""tools/routing_flips.py and kernels/moe_probe.py: which tokens took another expert than eager."""

from __future__ import annotations

import pytest
import torch

from minimax_backend.kernels.moe_probe import RouterCall, watch_router_inputs
from minimax_backend.tools.routing_flips import (eager_router_calls, errors_without, logit_rows, routing_flips,
                                                 top_k_and_margin)


def _call(x, w, bias=None, k=2):
    return RouterCall(x, w, bias, k)


def test_top_k_and_margin_follow_the_router_math():
    w = torch.eye(4)  # logits = x
    x = torch.tensor([[3.0, 1.0, 2.0, -1.0], [0.0, 0.1, 0.2, 0.3]])
    bias = torch.tensor([0.0, 0.0, 0.0, -1.0])  # takes expert 3 out of token 1's top-2
    ids, margin = top_k_and_margin(_call(x, w, bias))
    s = torch.sigmoid(x) + bias
    assert ids.tolist() == [[0, 2], [1, 2]]
    assert torch.allclose(margin, torch.stack([s[0, 2] - s[0, 1], s[1, 1] - s[1, 0]]))


def test_a_token_pushed_across_a_near_tie_is_named_and_no_other():
    g = torch.Generator().manual_seed(0)
    w = torch.randn(8, 16, generator=g)
    x = torch.randn(11, 16, generator=g)
    eager = [_call(x, w), _call(x * 0.5, w)]
    ids, margin = top_k_and_margin(eager[1])
    # move token 7 of the second layer along the direction that swaps its 2nd and 3rd choice
    logits = x[7] * 0.5 @ w.T
    order = torch.topk(torch.sigmoid(logits), 3).indices
    second, third = order[1], order[2]
    step = (w[third] - w[second]) / (w[third] - w[second]).norm() ** 2
    gap = logits[second] - logits[third]
    pushed = x * 0.5
    pushed[7] = pushed[7] + (gap + 1e-3) * step
    other = [_call(x.clone(), w), _call(pushed, w)]
    flips = routing_flips(eager, other)
    assert flips.tokens == [7]
    assert flips.layers[0]["tokens"] == [] and flips.layers[1]["tokens"] == [7]
    assert flips.layers[1]["eager_margins"] == [pytest.approx(float(margin[7]))]
    assert flips.min_margin <= float(margin[7])
    # rounding-sized differences elsewhere flip nothing
    assert routing_flips(eager, [_call(x * (1 + 1e-6), w), _call(x * 0.5, w)]).tokens == []


def test_errors_without_leaves_out_the_named_tokens():
    ref = torch.zeros(1, 5, 3)
    ref[0, :, 0] = 10.0
    other = ref.clone()
    other[0, 2, 1] = 4.0  # token 2: 0.4 of the largest logit
    other[0, 4, 2] = 0.1  # token 4: 0.01
    assert errors_without(ref, other, [])["max_rel_err"] == pytest.approx(0.4)
    assert errors_without(ref, other, [2])["max_rel_err"] == pytest.approx(0.01)


def test_logit_rows_map_tokens_to_the_rows_kept():
    assert logit_rows([3, 9], 12, 12, 1) == [3, 9]  # every position kept
    assert logit_rows([3, 11], 12, 1, 1) == [0]  # the last position of one sequence
    assert logit_rows([5, 6, 11], 12, 2, 2) == [0, 1]  # two sequences of 6: their last positions
    with pytest.raises(ValueError, match="logits rows"):
        logit_rows([1], 12, 5, 1)


def test_a_run_without_the_ops_or_with_other_rows_is_refused():
    x, w = torch.randn(4, 8), torch.randn(6, 8)
    with pytest.raises(ValueError, match="CUDA graph replay"):
        routing_flips([_call(x, w)], [])
    with pytest.raises(ValueError, match="same token rows"):
        routing_flips([_call(x, w)], [_call(x[:2], w)])


def test_the_watch_sees_each_op_call_only_while_open():
    from minimax_backend.kernels.moe import block_op_args
    from minimax_backend.model.minimax import init_random_weights
    from minimax_backend.model.moe import MoE
    from minimax_backend.model.parallel import ParallelState
    from minimax_backend.model.presets import load_preset

    cfg = load_preset("tiny-m3")
    blk = MoE(cfg, ParallelState.single(), "m", dtype=torch.float32, device="cpu", fp8=False)
    blk.config = cfg  # init_random_weights reads it on a lone block
    blk = init_random_weights(blk)
    x = torch.randn(5, cfg.hidden_size)
    torch.ops.minimax.moe(x, *block_op_args(blk))  # no watch open: nothing kept
    with watch_router_inputs() as outer:
        with watch_router_inputs() as inner:
            torch.ops.minimax.moe(x, *block_op_args(blk))
        torch.ops.minimax.moe(x * 2, *block_op_args(blk))
    assert len(inner) == 1 and len(outer) == 2
    assert torch.equal(outer[0].x, x) and outer[0].top_k == cfg.num_experts_per_tok
    assert outer[0].router_weight is blk.gate.weight


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_compiled_tiny_m3_routes_every_token_as_eager(dtype):
    """The compiled model's MoE inputs are eager's to rounding: in float32 exactly, and no token of
    these 29 sits on a near-tie in BF16 (eager's smallest margin is reported and checked)."""
    from minimax_backend.graph_passes import compile as minimax_compile
    from minimax_backend.model.minimax import build_model
    from minimax_backend.model.presets import load_preset
    from minimax_backend.model.random_weights import init_random_weights

    cfg = load_preset("tiny-m3")
    model = init_random_weights(build_model(cfg, dtype=dtype)).eval()
    ids = torch.randint(0, cfg.vocab_size, (1, 29), generator=torch.Generator().manual_seed(3))
    args = (ids, torch.arange(29)[None])
    eager_calls, want = eager_router_calls(model, *args)
    moe_layers = len(cfg.moe_layers)
    assert len(eager_calls) == moe_layers
    torch._dynamo.reset()
    with torch.no_grad(), watch_router_inputs() as calls:
        got = minimax_compile(model, codegen="fx", cudagraphs=False)(*args)
    assert len(calls) == moe_layers
    flips = routing_flips(eager_calls, calls)
    assert flips.tokens == [] and flips.min_margin > 0
    if dtype == torch.float32:
        assert all(torch.equal(e.x, c.x) for e, c in zip(eager_calls, calls))
    assert errors_without(want, got, flips.tokens)["max_rel_err"] <= (0.0 if dtype == torch.float32 else 0.02)
