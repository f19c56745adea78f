"""tools/roofline.decode_bytes: the routed experts a decode step reads, from the uniform
average or from the counts of the step measured."""

from __future__ import annotations

import pytest

from minimax_backend.model.presets import load_preset
from minimax_backend.tools.roofline import decode_bytes, weight_bytes


@pytest.fixture
def config():
    return load_preset("tiny-m3-fp8")  # 3 layers, 2 MoE with 8 experts top-2


def test_measured_expert_counts_replace_the_uniform_average(config):
    one_expert = 3 * config.hidden_size * config.intermediate_size  # gate, up, down; FP8: a byte each
    assert weight_bytes(config, fp8=True)["expert"] == one_expert
    base = decode_bytes(config, 4, 64, fp8=True, touched_experts=[0, 0])
    assert decode_bytes(config, 4, 64, fp8=True, touched_experts=[3, 5]) - base == pytest.approx(8 * one_expert)
    # uniform routing: 8 * (1 - (1 - 2/8)^4) experts per layer on average
    uniform = decode_bytes(config, 4, 64, fp8=True)
    assert uniform - base == pytest.approx(2 * 8 * (1 - 0.75 ** 4) * one_expert)


def test_expert_counts_must_cover_every_moe_layer(config):
    with pytest.raises(ValueError, match="2 MoE layers"):
        decode_bytes(config, 4, 64, fp8=True, touched_experts=[3])


def test_prefill_flops_count_the_lm_head_on_the_positions_kept(config):
    from minimax_backend.tools.roofline import prefill_flops

    every = prefill_flops(config, 100)
    last = prefill_flops(config, 100, logits_positions=1)
    assert every - last == pytest.approx(2.0 * 99 * config.hidden_size * config.vocab_size)
