"""Sequence-parallel rewrite on small hand-written TP graphs (fake process group).

The toy below has the shape of the real model's residual stream: a
vocab-parallel embedding all-reduce, then per layer an attention-like
block and an MoE-like block (router + top-k) each ending in an all-reduce,
a final norm, lm_head, and auxiliary hidden states returned next to the
logits. The counts asserted are exact.
"""

from __future__ import annotations

import pytest
import torch
from torch.fx.experimental.proxy_tensor import make_fx

from pass_harness import run_pass

from minimax_backend.graph_passes.base import PassContext, PassError
from minimax_backend.graph_passes.config import BackendConfig
from minimax_backend.graph_passes.manager import PassManager
from minimax_backend.graph_passes.meta_refresh import refresh_fake_meta
from minimax_backend.graph_passes.op_counts import op_counts
from minimax_backend.graph_passes.sequence_parallel import SequenceParallelPass
from minimax_backend.patterns.sequence_parallel import NotRecognized, shard_residual_stream

AG = "_c10d_functional.all_gather_into_tensor"
AR = "_c10d_functional.all_reduce"
RS = "_c10d_functional.reduce_scatter_tensor"
HIDDEN, VOCAB, EXPERTS = 16, 10, 4


def _toy(group: str, layers: int, aux: bool):
    c10d = torch.ops._c10d_functional

    def all_reduce(x):
        return c10d.wait_tensor(c10d.all_reduce(x, "sum", group))

    def norm(h, w):
        y = h.float()
        y = y * torch.rsqrt(y.pow(2).mean(-1, keepdim=True) + 1e-6)
        return (y * (1 + w.float())).to(h.dtype)

    def forward(ids, emb, wq, wo, w_router, w_expert, n1, n2, nf, w_head):
        h = all_reduce(torch.nn.functional.embedding(ids, emb))
        hidden_states = []
        for _ in range(layers):
            x = norm(h, n1)
            h = h + all_reduce((x @ wq).softmax(-1) @ wo)
            x = norm(h, n2)
            top = torch.topk((x.float() @ w_router).sigmoid(), 1, dim=-1)
            h = h + all_reduce((x @ w_expert) * top.values.to(x.dtype))
            hidden_states.append(h)
        logits = norm(h, nf) @ w_head
        return (logits, torch.stack(hidden_states, 1)) if aux else logits

    return forward


def _trace(group, tokens, layers=2, aux=True):
    bf = torch.bfloat16
    args = (
        torch.randint(0, VOCAB, (tokens,)),
        torch.randn(VOCAB, HIDDEN, dtype=bf),
        torch.randn(HIDDEN, HIDDEN, dtype=bf),
        torch.randn(HIDDEN, HIDDEN, dtype=bf),
        torch.randn(HIDDEN, EXPERTS),
        torch.randn(HIDDEN, HIDDEN, dtype=bf),
        torch.randn(HIDDEN, dtype=bf),
        torch.randn(HIDDEN, dtype=bf),
        torch.randn(HIDDEN, dtype=bf),
        torch.randn(HIDDEN, VOCAB, dtype=bf),
    )
    return make_fx(_toy(group, layers, aux), tracing_mode="fake")(*args)


def _rewrite(gm):
    record = shard_residual_stream(gm.graph)
    gm.recompile()
    refresh_fake_meta(gm)
    return record


@pytest.mark.parametrize("layers", [1, 3])
def test_op_counts_per_layer(fake_tp2, layers):
    gm = _trace(fake_tp2, tokens=8, layers=layers)
    before = op_counts(gm)
    assert before.get(AR) == 1 + 2 * layers
    record = _rewrite(gm)
    after = op_counts(gm)
    # Every residual all-reduce is now a reduce-scatter: embedding + 2 per layer.
    assert AR not in after
    assert after[RS] == 1 + 2 * layers
    # One gather in front of each block (attention input, MoE input), one at the end.
    assert after[AG] == 2 * layers + 1
    assert record.replaced == {"embedding": 1, "dense_mlp": layers, "moe": layers}
    assert (record.stream_gathers, record.end_gathers, record.end_gathered_tensors) == (2 * layers, 1, 2)
    # 8 tokens split evenly over 2 ranks: no padding anywhere.
    assert "aten.constant_pad_nd" not in after


def test_residual_stream_is_sharded_between_collectives(fake_tp2):
    gm = _trace(fake_tp2, tokens=8)
    _rewrite(gm)
    for node in gm.graph.nodes:
        if node.target is torch.ops.aten.add.Tensor and node.meta["val"].dim() == 2 and node.meta["val"].shape[1] == HIDDEN:
            # the residual adds run on 8 / 2 = 4 rows per rank
            assert node.meta["val"].shape[0] == 4, node.format_node()
    outputs = next(n for n in gm.graph.nodes if n.op == "output").args[0]
    assert [tuple(o.meta["val"].shape) for o in outputs] == [(8, VOCAB), (8, 2, HIDDEN)]


def test_final_and_aux_hidden_states_share_one_gather(fake_tp2):
    gm = _trace(fake_tp2, tokens=8, aux=True)
    _rewrite(gm)
    gathers = [n for n in gm.graph.nodes if n.target is torch.ops._c10d_functional.all_gather_into_tensor.default]
    last = gathers[-1]
    assert last.args[0].target is torch.ops.aten.cat.default
    assert len(last.args[0].args[0]) == 2  # final normed hidden + stacked aux states


def test_without_aux_the_end_gathers_only_final_hidden(fake_tp2):
    gm = _trace(fake_tp2, tokens=8, aux=False)
    record = _rewrite(gm)
    assert (record.end_gathers, record.end_gathered_tensors) == (1, 1)
    assert "aten.cat" not in op_counts(gm)


@pytest.mark.parametrize("tokens", [1, 7, 37])
def test_odd_token_counts_pad_and_slice(fake_tp2, tokens):
    gm = _trace(fake_tp2, tokens=tokens, layers=2)
    record = _rewrite(gm)
    after = op_counts(gm)
    padded = -(-tokens // 2) * 2
    assert (record.tokens, record.padded_tokens) == (tokens, padded)
    # one pad in front of every reduce-scatter, one row slice after every gather
    assert after["aten.constant_pad_nd"] == after[RS] == 5
    row_slices = [n for n in gm.graph.nodes if n.target is torch.ops.aten.slice.Tensor and n.args[1] == 0]
    assert len(row_slices) == after[AG] == 5
    for n in row_slices:
        assert n.args[3] == tokens and n.meta["val"].shape[0] == tokens


def test_router_cast_stays_after_the_gather(fake_tp2):
    """The MoE input is gathered once in BF16; the router's fp32 copy is made after it."""
    gm = _trace(fake_tp2, tokens=8, layers=1)
    _rewrite(gm)
    gathers = [n for n in gm.graph.nodes if n.target is torch.ops._c10d_functional.all_gather_into_tensor.default]
    assert all(g.meta["val"].dtype == torch.bfloat16 for g in gathers)


def test_unrecognized_graph_is_left_alone(fake_tp2):
    c10d = torch.ops._c10d_functional

    def vector_sum(x):  # a 1-D all-reduce: not a [tokens, hidden] residual stream
        return c10d.wait_tensor(c10d.all_reduce(x * 2, "sum", fake_tp2)) + 1

    gm = make_fx(vector_sum, tracing_mode="fake")(torch.randn(8))
    before = op_counts(gm)
    with pytest.raises(NotRecognized, match="not a 2-D"):
        shard_residual_stream(gm.graph)
    assert op_counts(gm) == before

    ctx = PassContext(config=BackendConfig(sequence_parallel="on"), tp_size=2)
    result = run_pass("sequence_parallel", gm, ctx, sequence_parallel="on")
    assert result.matches == 0 and "not recognized" in result.skipped
    strict = BackendConfig(sequence_parallel="on", strict=True)
    with pytest.raises(PassError, match="sequence_parallel is forced on"):
        PassManager(strict, order=("sequence_parallel",)).run(gm, PassContext(config=strict, tp_size=2))


def test_graph_without_collectives_is_not_recognized():
    gm = make_fx(lambda x: x @ x)(torch.randn(4, 4))
    with pytest.raises(NotRecognized, match="no all-reduce"):
        shard_residual_stream(gm.graph)


@pytest.mark.parametrize(
    "options, tp, ep, tokens, enabled, reason",
    [
        ({}, 2, 2, None, True, None),  # token count unknown: no floor
        ({}, 2, 2, 4096, True, None),
        ({}, 2, 1, 4096, False, "without expert parallelism"),
        ({"moe_lower": "off"}, 2, 2, 4096, False, "fused MoE backend"),
        ({"sequence_parallel": "on"}, 2, 1, 4096, True, None),
        ({"sequence_parallel": "off"}, 4, 4, 4096, False, "off in config"),
        ({"sequence_parallel": "on"}, 1, 1, 4096, False, "TP is 1"),
        ({"sequence_parallel": "on", "pp_size": 2}, 2, 2, 4096, False, "pipeline"),
        ({}, 2, 2, 16, False, "below sequence_parallel_min_tokens=1024 (16 tokens"),  # a decode step
        ({"sequence_parallel_min_tokens": 16}, 2, 2, 16, True, None),
        ({"sequence_parallel": "on"}, 2, 2, 16, True, None),  # 'on' ignores the floor
    ],
)
def test_auto_rule_and_overrides(options, tp, ep, tokens, enabled, reason):
    config = BackendConfig.from_options(options)
    ctx = PassContext(config=config, tp_size=tp, ep_size=ep, pp_size=config.pp_size, num_tokens=tokens)
    on, why = SequenceParallelPass(config).decide(None, ctx)
    assert on is enabled
    if reason:
        assert reason in why


@pytest.mark.parametrize("tokens", [1, 37, 2048])
def test_context_reads_the_token_count_and_auto_applies_the_floor(fake_tp2, tokens):
    gm = _trace(fake_tp2, tokens)
    config = BackendConfig(tp_size=2, ep_size=2)
    ctx = PassContext.from_graph(config, gm)
    assert ctx.num_tokens == tokens
    on, why = SequenceParallelPass(config).decide(gm, ctx)
    assert on is (tokens >= config.sequence_parallel_min_tokens), why
    assert PassContext.from_graph(config, make_fx(lambda x: x @ x)(torch.randn(4, 4))).num_tokens is None
