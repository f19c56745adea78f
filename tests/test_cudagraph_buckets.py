"""CUDA-graph buckets on CPU: bucket arithmetic, padding that leaves the real
tokens' logits unchanged, capture skipped cleanly without a GPU, and the
capture wrapper's bookkeeping (static copies, replays, outputs, re-capture)
with the CUDA calls replaced by a simulation that re-runs the function."""

from __future__ import annotations

import logging

import pytest
import torch

import minimax_backend.graph_passes as gp
from minimax_backend.graph_passes import cudagraph_capture as cg
from minimax_backend.graph_passes.bucketing import (
    BucketedRunner, effective_buckets, pad_tokens, padded_length, pick_bucket,
)
from minimax_backend.model.minimax import build_model, init_random_weights
from conftest import tiny_m3_config


# ------------------------------------------------------------ bucket arithmetic
def test_buckets_round_up_to_the_tp_multiple():
    assert effective_buckets((1, 2, 4, 8, 1000), 1) == (1, 2, 4, 8, 1000)
    assert effective_buckets((1, 2, 4, 6, 1000), 4) == (4, 8, 1000)
    assert effective_buckets((1, 3, 1000), 3) == (3, 1002)


@pytest.mark.parametrize("tokens,multiple,want", [(1, 1, 1), (3, 1, 4), (37, 1, 64), (37, 2, 64), (5, 4, 8),
                                                  (1, 4, 4), (64, 1, 64), (65, 1, None)])
def test_pick_bucket(tokens, multiple, want):
    assert pick_bucket(tokens, (1, 2, 4, 8, 16, 32, 64), multiple) == want


def test_bad_bucket_arguments_are_errors():
    with pytest.raises(ValueError, match="token count"):
        pick_bucket(0, (1, 2))
    with pytest.raises(ValueError, match="multiple"):
        effective_buckets((1, 2), 0)
    with pytest.raises(gp.BackendOptionError, match="cudagraph_buckets"):
        gp.BackendConfig(cudagraph_buckets=(8, 4))
    with pytest.raises(gp.BackendOptionError, match="cudagraph_copy_outputs"):
        gp.BackendConfig(cudagraph_copy_outputs="yes")


def test_padded_length_rules():
    buckets = (1, 2, 4, 8, 16, 64)
    assert padded_length(1, 7, buckets) == 8
    assert padded_length(1, 37, buckets) == 64
    assert padded_length(4, 1, buckets) == 1  # batch 4 decode: 4 tokens is a bucket
    assert padded_length(3, 1, buckets) == 1  # no bucket divisible by 3 at or above 3: unpadded
    assert padded_length(2, 5, buckets) == 8  # 2 x 8 = 16
    assert padded_length(1, 100, buckets) == 100  # above the largest bucket
    # the pad would write past the KV cache (positions 30..36 + pad up to 63 >= 40): unpadded
    assert padded_length(1, 7, (64,), last_position=36, max_positions=40) == 7
    assert padded_length(1, 7, (8,), last_position=36, max_positions=40) == 8


def test_pad_tokens_continues_positions():
    ids = torch.tensor([[5, 6, 7], [8, 9, 10]])
    pos = torch.tensor([[0, 1, 2], [10, 11, 12]])
    pids, ppos = pad_tokens(ids, pos, 5)
    assert pids.tolist() == [[5, 6, 7, 0, 0], [8, 9, 10, 0, 0]]
    assert ppos.tolist() == [[0, 1, 2, 3, 4], [10, 11, 12, 13, 14]]
    with pytest.raises(ValueError, match="pad 3 tokens down"):
        pad_tokens(ids, pos, 2)


# ------------------------------------------------------------ padding keeps the real logits
@pytest.fixture(scope="module")
def tiny_model():
    model = init_random_weights(build_model(tiny_m3_config(), None, dtype=torch.float32, device="cpu"), seed=0)
    model.eval()
    return model


@pytest.mark.parametrize("tokens", [1, 7, 37])
def test_padded_prefill_and_decode_equal_unpadded(tiny_model, tokens):
    """Prefill (odd sizes) then two decode steps with the KV cache, padded vs not (float32, 1e-5 of max)."""
    cfg = tiny_model.config
    ids = torch.randint(0, cfg.vocab_size, (1, tokens), generator=torch.Generator().manual_seed(tokens))
    pos = torch.arange(tokens)[None]
    runner = BucketedRunner(tiny_model, buckets=(1, 2, 4, 8, 16, 64), multiple=2, max_positions=80)
    results = {}
    with torch.no_grad():
        for name, fn in (("plain", tiny_model), ("padded", runner)):
            tiny_model.allocate_kv_cache(1, 80)
            steps = [fn(ids, pos)]
            for s in range(2):
                nxt = steps[-1][:, -1:].argmax(-1) if s == 0 else torch.tensor([[3]])
                steps.append(fn(nxt, torch.tensor([[tokens + s]])))
            results[name] = steps
    for a, b in zip(results["plain"], results["padded"]):
        assert a.shape == b.shape
        torch.testing.assert_close(b, a, rtol=0, atol=1e-5 * a.abs().max().item())
    assert runner.length_for(ids, pos) == (2 if tokens == 1 else 8 if tokens == 7 else 64)
    tiny_model.free_kv_cache()


def test_padded_prefill_keeps_the_last_real_positions_logits(tiny_model):
    """logits_to_keep=n through the runner: the last n REAL positions' logits, not the pads',
    eager and compiled; the compiled runner makes one graph for two lengths of one bucket
    (the kept positions are a tensor input there)."""
    from minimax_backend.graph_passes.backend import compile_reports

    torch._dynamo.reset()
    compiled = gp.compile(tiny_model, codegen="fx", strict=True)
    runners = {"eager": BucketedRunner(tiny_model, buckets=(8, 64)),
               "compiled": BucketedRunner(compiled, buckets=(8, 64))}
    before = len(compile_reports())
    with torch.no_grad():
        for tokens in (5, 7):
            ids = torch.randint(0, 512, (2, tokens), generator=torch.Generator().manual_seed(tokens))
            pos = torch.arange(tokens).expand(2, -1)
            full = tiny_model(ids, pos)
            for name, runner in runners.items():
                for n in (1, 2):
                    got = runner(ids, pos, logits_to_keep=n)
                    assert got.shape == (2, n, 512), (name, n)
                    torch.testing.assert_close(got, full[:, -n:], rtol=0, atol=1e-5 * full.abs().max().item())
                got = runner(ids, pos, logits_to_keep=torch.tensor([0, 3]))
                torch.testing.assert_close(got, full[:, [0, 3]], rtol=0, atol=1e-5 * full.abs().max().item())
            with pytest.raises(ValueError, match="logits_to_keep=9"):
                runners["eager"](ids, pos, logits_to_keep=9)
    # one graph per number of kept positions (1, 2; the explicit pair [0, 3] is two too), shared by lengths 5 and 7
    assert len(compile_reports()) - before == 2


def test_warm_up_runs_every_bucket_with_progress(tiny_model):
    calls, lines = [], []

    def model(ids, pos):
        calls.append(tuple(ids.shape))
        return torch.zeros(*ids.shape, 3)

    runner = BucketedRunner(model, buckets=(1, 2, 4, 8, 64), multiple=2, max_positions=16)
    timings = runner.warm_up("cpu", batch=2, progress=lines.append)
    assert calls == [(2, 1), (2, 2), (2, 4)]  # 2, 4, 8 tokens; 64 would need 32 positions > 16
    assert sorted(timings) == [2, 4, 8] and len(lines) == 3 and "warm-up 3/3: 8 tokens" in lines[-1]


# ------------------------------------------------------------ CPU: capture skipped cleanly
def test_capture_is_skipped_without_a_gpu(tiny_model, caplog):
    ids = torch.randint(0, 512, (1, 7), generator=torch.Generator().manual_seed(1))
    pos = torch.arange(7)[None]
    torch._dynamo.reset()
    compiled = gp.compile(tiny_model, codegen="fx")  # cudagraphs on by default
    with torch.no_grad(), caplog.at_level(logging.INFO, logger="minimax"):
        out = compiled(ids, pos)
        want = tiny_model(ids, pos)
    torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-5)
    info = gp.last_compile_report()["cudagraphs"]
    assert info["enabled"] is False and "CUDA graphs not captured" in info["skipped"], info
    assert "CUDA graphs not captured" in caplog.text

    torch._dynamo.reset()
    gp.compile(tiny_model, codegen="fx", cudagraphs=False)(ids, pos)
    assert gp.last_compile_report()["cudagraphs"]["skipped"] == "cudagraphs=False"


# ------------------------------------------------------------ the wrapper's bookkeeping, simulated
class SimGraph:
    """Replay = run the captured call again and write into the captured outputs."""

    def __init__(self, call, outputs):
        self.call, self.outputs = call, outputs

    def replay(self):
        for buf, new in zip(self.outputs, self.call()):
            buf.copy_(new)


class SimOps:
    captures = 0

    @classmethod
    def capture(cls, call, device):
        cls.captures += 1
        for _ in range(cg.WARMUP_RUNS):
            call()
        outputs = call()
        return SimGraph(call, outputs), outputs

    @staticmethod
    def pool_bytes(device):
        return 1234


def _toy(args):
    """args = [weight (static), cache (static, written), ids (per call), x (per call, written)]."""
    weight, cache, ids, x = args
    cache[: ids.numel()] = ids.float()
    x.add_(0)  # a write to a per-call input (must reach the caller's tensor)
    x.mul_(1)
    return [weight[ids].sum(-1) + cache[: ids.numel()], x * 2]


def _wrapped(buckets=(1, 2, 4, 8), copy_outputs=True):
    SimOps.captures = 0
    report = {}
    w = cg.CapturedGraphs(_toy, [torch.ones(4), torch.zeros(16), torch.zeros(1, dtype=torch.long), torch.zeros(1)],
                          static_idxs=[0, 1], mutated_idxs=[1, 3], buckets=buckets, copy_outputs=copy_outputs,
                          report=report)
    w.device_ops = SimOps
    return w, report


def _args(weight, cache, n, seed):
    g = torch.Generator().manual_seed(seed)
    return [weight, cache, torch.randint(0, 4, (n,), generator=g), torch.randn(n, generator=g)]


def test_wrapper_captures_once_per_shape_and_replays_with_new_inputs():
    weight, cache = torch.arange(16.0).reshape(4, 4), torch.zeros(16)
    w, report = _wrapped()
    outs = []
    for seed in range(3):
        args = _args(weight, cache, 4, seed)
        want = _toy(list(args))
        got = w(list(args))
        torch.testing.assert_close(got[0], want[0])
        torch.testing.assert_close(got[1], want[1])
        outs.append((got, want))
    assert SimOps.captures == 1 and len(report["cudagraphs"]["captured"]) == 1
    assert report["cudagraphs"]["captured"][0]["tokens"] == 4 and report["cudagraphs"]["pool_bytes"] == 1234
    # copies: the first call's result survives the later replays
    torch.testing.assert_close(outs[0][0][0], outs[0][1][0])
    assert cache[:4].tolist() == _args(weight, cache, 4, 2)[2].float().tolist()  # the static cache was written


def test_wrapper_without_output_copies_hands_out_the_graph_buffers():
    weight, cache = torch.ones(4, 4), torch.zeros(16)
    w, _ = _wrapped(copy_outputs=False)
    a = w(_args(weight, cache, 2, 0))
    b = w(_args(weight, cache, 2, 1))
    assert a[0].data_ptr() == b[0].data_ptr()


def test_wrapper_skips_sizes_above_the_largest_bucket_and_warns_off_bucket():
    weight, cache = torch.ones(4, 4), torch.zeros(16)
    w, report = _wrapped(buckets=(1, 2, 4, 8))
    w(_args(weight, cache, 9, 0))
    assert SimOps.captures == 0 and report["cudagraphs"]["uncaptured"][0]["tokens"] == 9
    with pytest.warns(UserWarning, match="5 tokens, which is not one of cudagraph_buckets"):
        w(_args(weight, cache, 5, 0))
    assert SimOps.captures == 1


def test_wrapper_recaptures_when_a_parameter_moves(caplog):
    cache = torch.zeros(16)
    w, _ = _wrapped()
    w(_args(torch.ones(4, 4), cache, 2, 0))
    with caplog.at_level(logging.WARNING, logger="minimax"):
        got = w(_args(torch.full((4, 4), 2.0), cache, 2, 0))  # a new weight tensor
    assert SimOps.captures == 2 and "moved since capture" in caplog.text
    assert got[0].tolist() == [8.0 + v for v in _args(None, None, 2, 0)[2].float().tolist()]


def test_wrapper_captures_again_under_other_kernel_switches():
    """A graph freezes the kernels chosen while it was captured: another moe_gemm must not replay it."""
    from minimax_backend.kernels.options import kernel_options, override_kernel_options

    seen = []

    def records_switch(args):
        seen.append(kernel_options().moe_gemm)
        return _toy(args)

    SimOps.captures = 0
    w = cg.CapturedGraphs(records_switch, [torch.ones(4), torch.zeros(16), torch.zeros(1, dtype=torch.long),
                                           torch.zeros(1)], static_idxs=[0, 1], mutated_idxs=[1, 3],
                          buckets=(1, 2, 4), copy_outputs=True, report={})
    w.device_ops = SimOps
    weight, cache = torch.ones(4, 4), torch.zeros(16)
    default = kernel_options().moe_gemm
    w(_args(weight, cache, 2, 0))
    with override_kernel_options(moe_gemm="gluon" if default != "gluon" else "triton"):
        w(_args(weight, cache, 2, 1))
    assert SimOps.captures == 2 and len(set(seen)) == 2
    w(_args(weight, cache, 2, 2))  # the default again: its first graph
    assert SimOps.captures == 2


def test_wrapper_hands_writes_to_per_call_inputs_back():
    def writes_x(args):
        args[3].add_(1)
        return [args[3] * 1]

    w, _ = _wrapped()
    w.run = writes_x
    x = torch.zeros(2)
    w([torch.ones(4, 4), torch.zeros(16), torch.zeros(2, dtype=torch.long), x])
    # warm-ups and capture wrote our copy only; it is reset from x before the
    # replay, whose one increment is copied back
    assert x.tolist() == [1.0, 1.0]


# ------------------------------------------------------------ the GPU test's bookkeeping, on gloo
def _two_ranks_every_pass_simulated(rank, world):
    """tests/test_cudagraph_gpu.py's two-GPU check with the CUDA calls simulated: buckets,
    padding, captured / uncaptured sizes and replays under SP, GEMM-RS and MegaMoE."""
    import test_cudagraph_gpu as gpu_check
    from minimax_backend.model.parallel import ParallelState

    cg.capture_available = lambda example_inputs: (True, None)
    cg.CapturedGraphs.device_ops = SimOps
    model = build_model(tiny_m3_config(), ParallelState.from_world(world), dtype=torch.bfloat16, device="cpu",
                        quantize_fp8=True)
    model = init_random_weights(model, seed=0)
    options = {"codegen": "fx", "strict": True, "tp_size": world, "ep_size": world,
               "sequence_parallel": "on", "fuse_norm_quant": "on", "gemm_reduce_scatter": "on",
               "moe_canonicalize": "on", "moe_lower": "on", "gemm_rs_min_tokens": 0}
    return gpu_check._compare(model, options, torch.device("cpu"), rel_tol=1e-2, multiple=world)


@pytest.mark.slow
def test_two_rank_capture_bookkeeping_on_gloo():
    from multirank import run_multirank

    for result in run_multirank(_two_ranks_every_pass_simulated, 2, timeout=600):
        assert result["captured"] == [2, 8, 64] and result["max_rel_err"] <= 1e-2, result
