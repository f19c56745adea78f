"""Tensor / expert parallel MiniMax on CPU ranks (gloo) against the single-device model.

Every rank builds its shard of the SAME full weights (init_random_weights draws
each checkpoint tensor from its global indices), so TP N logits must equal TP 1
logits. Token counts are odd (7, 15, 37), so none divides the TP size.

Tolerances:
  float32  every logit within 2e-4 (seen: ~4e-6; only summation order differs).
  bfloat16 per token, all logits within 0.1 + 2% of the reference (seen: <= 0.05),
           for all but max(1, 10%) of the tokens. A token whose top-k expert choice is a
           near tie may legitimately route differently when bf16 partial sums are
           added in another order (seen: 1 token of 37 at TP 4), which changes
           that token's logits by O(1); float32 runs show the layout itself is exact.
  FP8      (float32 activations) TP N vs TP 1: relative (Frobenius) error < 5%
           (seen: 1e-7 on one input, 1.4% on others). Every layout uses the same
           1 x 128 activation groups and 128 x 128 weight blocks, but a last-bit
           float32 difference can move an activation across an E4M3 rounding
           boundary (a 6% step for that element), and that propagates. A wrong
           scale slice would give O(1) errors. (FP8 vs float32 itself: ~10-20%.)

One launch per world size runs all its scenarios (process start-up dominates).
"""

from __future__ import annotations

import pytest
import torch

from conftest import tiny_m2_config, tiny_m3_config
from multirank import run_multirank

from minimax_backend.model.minimax import build_model, init_random_weights
from minimax_backend.model.parallel import ParallelState

SHAPES = ((1, 7), (3, 5), (1, 37))  # (batch, seq): T = 7, 15, 37


def _inputs(vocab: int):
    g = torch.Generator().manual_seed(1234)
    return [torch.randint(0, vocab, shape, generator=g) for shape in SHAPES]


# name -> (config factory, overrides, dtype, ep_size, mode)
SCENARIOS = {
    "m3_fp32_ep1": ("m3", {}, torch.float32, 1, "full"),
    "m3_fp32_ep2": ("m3", {}, torch.float32, 2, "full"),
    "m3_fp32_ep4": ("m3", {}, torch.float32, 4, "full"),
    "m3_bf16_ep1": ("m3", {}, torch.bfloat16, 1, "full"),
    "m3_bf16_ep2": ("m3", {}, torch.bfloat16, 2, "full"),
    "m2_fp32_ep1": ("m2", {}, torch.float32, 1, "full"),
    "m2_fp32_ep2": ("m2", {}, torch.float32, 2, "full"),
    "m3_fp32_decode": ("m3", {}, torch.float32, 2, "decode"),
    "m3_fp8": ("m3", {}, torch.float32, 1, "fp8"),
    "m3_aux": ("m3", {"aux_hidden_state_layers": (0, 2)}, torch.float32, 2, "aux"),
}
WORLD = {
    2: ["m3_fp32_ep1", "m3_fp32_ep2", "m3_bf16_ep2", "m2_fp32_ep1", "m2_fp32_ep2", "m3_fp32_decode", "m3_fp8",
        "m3_aux"],
    # KV heads (2) < TP 4: replicated; M2's whole-projection k_norm sums over replicas.
    4: ["m3_fp32_ep1", "m3_fp32_ep2", "m3_fp32_ep4", "m3_bf16_ep1", "m2_fp32_ep1", "m3_fp32_decode"],
}


def run_scenario(name: str, ps: ParallelState):
    kind, overrides, dtype, _, mode = SCENARIOS[name]
    config = (tiny_m3_config if kind == "m3" else tiny_m2_config)(**overrides)
    model = init_random_weights(build_model(config, ps, dtype, quantize_fp8=mode == "fp8"), seed=7)
    outs = []
    with torch.no_grad():
        if mode == "decode":
            # Prefill 6 tokens of a batch of 2, then decode 3 tokens one at a time.
            ids = _inputs(config.vocab_size)[1][:2, :5].repeat(1, 2)[:, :9]
            model.allocate_kv_cache(batch=2, max_len=16)
            steps = [(0, 6), (6, 7), (7, 8), (8, 9)]
            logits = [model(ids[:, a:b], torch.arange(a, b).expand(2, -1)) for a, b in steps]
            return [torch.cat(logits, dim=1).float()]
        for ids in _inputs(config.vocab_size):
            pos = torch.arange(ids.shape[1]).expand(ids.shape[0], -1)
            out = model(ids, pos)
            outs.append([o.float() for o in out] if isinstance(out, tuple) else out.float())
    return outs


def _reference(name: str):
    """TP 1 result; for decode, the full-sequence forward without a cache."""
    if SCENARIOS[name][4] != "decode":
        return run_scenario(name, ParallelState.single())
    kind, overrides, dtype, _, _ = SCENARIOS[name]
    config = (tiny_m3_config if kind == "m3" else tiny_m2_config)(**overrides)
    model = init_random_weights(build_model(config, ParallelState.single(), dtype), seed=7)
    ids = _inputs(config.vocab_size)[1][:2, :5].repeat(1, 2)[:, :9]
    with torch.no_grad():
        return [model(ids, torch.arange(9).expand(2, -1)).float()]


def _compiled(ps: ParallelState):
    """TP 2 under torch.compile(aot_eager, fullgraph): logits and the collectives captured."""
    from torch._dynamo.testing import CompileCounterWithBackend

    from minimax_backend.graph_passes.op_counts import op_counts

    out = {}
    for kind, config in (("m3", tiny_m3_config(num_mtp_modules=0)), ("m2", tiny_m2_config())):
        model = init_random_weights(build_model(config, ps, torch.float32), seed=7)
        ids = _inputs(config.vocab_size)[0]
        cnt = CompileCounterWithBackend("aot_eager")
        with torch.no_grad():
            logits = torch.compile(model, backend=cnt, fullgraph=True)(ids, torch.arange(ids.shape[1])[None])
        counts = {k: v for k, v in op_counts(cnt.graphs[0]).items() if "c10d" in k}
        out[kind] = (logits, cnt.frame_count, counts)
    torch._dynamo.reset()
    return out


def _worker(rank: int, world: int, names: list[str]):
    results = {}
    if world == 2:
        results["compiled"] = _compiled(ParallelState.from_world(1))
    for name in names:
        ps = ParallelState.from_world(ep_size=SCENARIOS[name][3])
        results[name] = run_scenario(name, ps)
    return results


_CACHE: dict[int, list[dict]] = {}


def _launch(world: int) -> list[dict]:
    if world not in _CACHE:
        _CACHE[world] = run_multirank(_worker, world, args=(WORLD[world],), timeout=400)
    return _CACHE[world]


def _flat(x):
    return [t for item in x for t in (item if isinstance(item, list) else [item])]


def _check(name: str, ranks: list[dict]):
    ref = _flat(_reference(name))
    got = _flat(ranks[0][name])
    for r, other in enumerate(ranks[1:], start=1):  # every rank returns the same full logits
        for a, b in zip(got, _flat(other[name])):
            assert torch.equal(a, b), f"{name}: rank {r} differs from rank 0"
    dtype, mode = SCENARIOS[name][2], SCENARIOS[name][4]
    for a, b in zip(ref, got):
        assert a.shape == b.shape, (name, a.shape, b.shape)
        if mode == "fp8":
            rel = ((b - a).norm() / a.norm()).item()
            assert rel < 0.05, f"{name}: FP8 TP N vs TP 1 relative error {rel:.3g}"
        elif dtype == torch.float32:
            torch.testing.assert_close(b, a, atol=2e-4, rtol=0, msg=lambda m: f"{name}: {m}")
        else:
            # BF16: another summation order moves a token's logits by about 0.5% of the largest
            # (well-conditioned weights, model/random_weights.py); 2% per token, except where a
            # near-tie in the router picks another expert (at most one token here)
            err = (b - a).abs().flatten(0, -2).amax(dim=-1) / a.abs().max()
            close = err <= 0.02
            assert (~close).sum() <= 1, f"{name}: {(~close).sum()} of {close.numel()} tokens differ from TP 1: {err}"


@pytest.mark.parametrize("name", WORLD[2])
def test_tp2(name):
    _check(name, _launch(2))


@pytest.mark.parametrize("name", WORLD[4])
def test_tp4(name):
    _check(name, _launch(4))


@pytest.mark.parametrize("kind", ["m3", "m2"])
def test_tp2_compiles_to_one_graph_with_the_expected_collectives(kind):
    """Embedding 1 all-reduce; per layer attention + MLP/MoE all-reduces (M2: + the
    whole-projection QK-norm variance); lm_head 1 all-gather. Logits = TP 1 eager."""
    logits, frames, counts = _launch(2)[0]["compiled"][kind]
    assert frames == 1
    layers = 3 if kind == "m3" else 2
    per_layer = 2 if kind == "m3" else 3
    assert counts == {
        "_c10d_functional.all_reduce": 1 + per_layer * layers,
        "_c10d_functional.all_gather_into_tensor": 1,
        "_c10d_functional.wait_tensor": 2 + per_layer * layers,
    }
    config = tiny_m3_config(num_mtp_modules=0) if kind == "m3" else tiny_m2_config()
    ref_model = init_random_weights(build_model(config, ParallelState.single(), torch.float32), seed=7)
    ids = _inputs(config.vocab_size)[0]
    with torch.no_grad():
        ref = ref_model(ids, torch.arange(ids.shape[1])[None])
    torch.testing.assert_close(logits, ref, atol=2e-4, rtol=0)


def test_aux_hidden_states_shape():
    ranks = _launch(2)
    logits, aux = ranks[0]["m3_aux"][0]
    assert logits.shape == (1, 7, 512) and aux.shape == (1, 7, 2, 256)


def test_rank_error_names_the_rank():
    from multirank import RankError

    with pytest.raises(RankError, match="rank 1 failed"):
        run_multirank(_fail_on_rank_1, 2, timeout=120)


def test_from_world_rejects_bad_ep():
    ranks = run_multirank(_bad_ep, 2, timeout=120)
    assert all("ep_size=4 must be >= 1 and divide the world size 2" in r for r in ranks)


def _fail_on_rank_1(rank, world):
    if rank == 1:
        raise ValueError("boom")
    return rank


def _bad_ep(rank, world):
    try:
        ParallelState.from_world(ep_size=4)
    except ValueError as e:
        return str(e)
    return "no error"
