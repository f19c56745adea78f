"""minimax::gemm_rs on 2 GPUs (NCCL + symmetric memory): the overlapped path
against matmul + reduce-scatter, CUDA-graph capture and replay, and a model
compiled through the backend. Skipped without two CUDA GPUs.

Ranks are spawned here (not with tests/multirank.py, which is gloo on CPU),
and they end with os._exit after reporting: destroy_process_group() hung on
the GPU box once symmetric memory had been used.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from gpu_ranks import run_on_gpus

pytestmark = [pytest.mark.gpu, pytest.mark.multigpu]

WORLD = 2


def _run(check_name: str, timeout: float = 300.0):
    return run_on_gpus(__name__, check_name, WORLD, timeout)


def _inputs(rank, tokens, k, n, fp8, device):
    from minimax_backend.kernels.fp8 import quantize_weight_fp8

    g = torch.Generator(device=device).manual_seed(1000 * rank + tokens)
    x = torch.randn(tokens, k, device=device, generator=g, dtype=torch.bfloat16)
    w = (torch.randn(n, k, device=device, generator=g) / k**0.5).bfloat16()
    if not fp8:
        return (x, w, None, None, None), None
    xq, xs = torch.ops.minimax.quantize_fp8(x, 128)
    wq, ws = quantize_weight_fp8(w.float())
    return (xq, wq, xs, ws, None), torch.bfloat16


# (schedule, push) of kernels/gemm_rs_cuda.py
VARIANTS = [("sum_after", "copy"), ("epilogue", "copy"), ("sum_after", "store"), ("epilogue", "store")]


def _variant(schedule, push):
    """Force the own-rows schedule and the push of kernels/gemm_rs_cuda.py in this rank."""
    from minimax_backend.kernels.options import override_kernel_options

    return override_kernel_options(gemm_rs_schedule=schedule, gemm_rs_push=push)


def check_fused_equals_unfused(rank, world, group):
    from minimax_backend.kernels import cublaslt_gemm, gemm_rs_cuda

    device = torch.device("cuda", rank)
    diffs = {}
    for schedule, push in VARIANTS:
        with _variant(schedule, push):
            diffs.update(_fused_vs_unfused(rank, world, group, schedule, push, device))
    assert gemm_rs_cuda.workspace_count() > 0, "the fused path never ran"
    diffs["epilogue_add_unavailable"] = str(cublaslt_gemm.unavailable_reasons())
    return diffs


def _fused_vs_unfused(rank, world, group, schedule, push, device):
    diffs = {}
    for fp8 in (False, True):
        for tokens in (37, 1000, 4099):  # odd counts: padded to a multiple of the world size
            args, out_dtype = _inputs(rank, tokens, 512, 768, fp8, device)
            pad = -(-tokens // world) * world - tokens
            fused = torch.ops.minimax.gemm_rs(*args, pad, 0, world, group, out_dtype=out_dtype)
            plain = torch.ops.minimax.gemm_rs(*args, pad, 1 << 30, world, group, out_dtype=out_dtype)
            assert fused.shape == plain.shape == ((tokens + pad) // world, 768)
            # one BF16 rounding apart at most (the epilogue adds before rounding, the sum after)
            torch.testing.assert_close(fused, plain, rtol=1.6e-2, atol=1e-2)
            diffs[f"{schedule}_{push}_{'fp8' if fp8 else 'bf16'}_{tokens}"] = (fused.float() - plain.float()).abs().max().item()
    return diffs


def check_cuda_graph_capture_and_replay(rank, world, group):
    device = torch.device("cuda", rank)
    diffs = {}
    for schedule, push in VARIANTS:
        with _variant(schedule, push):
            diffs.update(_capture_and_replay(rank, world, group, schedule, push, device))
    return diffs


def _capture_and_replay(rank, world, group, schedule, push, device):
    diffs = {}
    for fp8 in (False, True):
        args, out_dtype = _inputs(rank, 4096, 1024, 1024, fp8, device)
        op = lambda: torch.ops.minimax.gemm_rs(*args, 0, 0, world, group, out_dtype=out_dtype)  # noqa: E731
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # warm-up outside capture: allocates the workspace
            op()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, capture_error_mode="thread_local"):
            out = op()
        for trial in range(3):
            args[0].copy_(torch.randn(args[0].shape, device=device).to(args[0].dtype))
            dist.barrier()
            graph.replay()
            want = torch.ops.minimax.gemm_rs(*args, 0, 1 << 30, world, group, out_dtype=out_dtype)
            torch.testing.assert_close(out, want, rtol=1.6e-2, atol=1e-2)
            diffs[f"{schedule}_{push}_{'fp8' if fp8 else 'bf16'}_{trial}"] = (out.float() - want.float()).abs().max().item()
        del graph
    return diffs


def check_compiled_model(rank, world, group):
    import minimax_backend.graph_passes as gp
    from test_gemm_rs_numerics import VOCAB, ToySP

    results = {}
    for cudagraphs in (False, True):
        model = ToySP(rank, world, group, fp8_o_proj=True).cuda()
        ids = torch.randint(0, VOCAB, (37,), generator=torch.Generator().manual_seed(0)).cuda()
        torch._dynamo.reset()
        compiled = gp.compile(model, codegen="inductor", cudagraphs=cudagraphs, strict=True, sequence_parallel="on",
                              moe_canonicalize="off", fuse_norm_quant="off", moe_lower="off", gemm_rs_min_tokens=0)
        with torch.no_grad():
            eager = model(ids)
            for _ in range(3):  # cudagraph trees: warm-up, record, replay
                out = compiled(ids)
                torch.testing.assert_close(out, eager, rtol=1e-3, atol=1e-3)
        rep = gp.last_compile_report()
        assert rep["ops_after"]["minimax.gemm_rs"] == 2, rep["ops_after"]
        results[f"cudagraphs={cudagraphs}"] = (out - eager).abs().max().item()
    return results


def test_fused_equals_unfused():
    for diffs in _run("check_fused_equals_unfused"):
        print(diffs)


def test_cuda_graph_capture_and_replay():
    print(_run("check_cuda_graph_capture_and_replay"))


def test_compiled_model_with_and_without_cudagraphs():
    print(_run("check_compiled_model"))
