"""One MoE layer at MiniMax-M3 sizes: minimax::mega_moe against the eager loop
and against a torch grouped-GEMM layer, tokens 1 ... 16384, BF16 and FP8.

    python -m minimax_backend.tools.bench_moe --json moe_h200.json            # one H200
    python -m minimax_backend.tools.bench_moe --gpus 2 --json moe_ep2.json    # EP 2 (nvidia-h200-x2)
    python -m minimax_backend.tools.bench_moe --device cpu --preset tiny-m3 --tokens 1 7 --precisions bf16
                                                                               # smoke run, no GPU

The layer is preset `m3`'s MoE block (128 experts, top-4, hidden 6144,
intermediate 3072, one 3072-wide shared expert, SwiGLU-OAI) built by
model/moe.py with random weights; with --gpus N it is split N ways (EP = TP
= N) and every rank times its part. Variants, all on the same inputs:

    eager      the block as the eager model runs it: a loop over the local
               experts on their routed tokens (+ its all-reduce at EP > 1)
    torch_gmm  the same dispatch as ours (kernels/moe.py) with the experts as
               torch._grouped_mm (BF16) / torch._scaled_grouped_mm (FP8 with
               row-wise scales: the format torch offers, not our 128 x 128
               blocks); sort, gather, activation and combine in torch
    ours       minimax::mega_moe with the Triton grouped GEMMs
               (kernels/moe_triton.py); at EP > 1 in the sequence-parallel
               form (token shard in, shard out), as the compiled model uses it,
               with the all-gather + reduce-scatter exchange the pass picks
               for M3; ours_alltoall: the same with the all-to-all exchange
    *_graph    the same call captured in a CUDA graph and replayed (what the
               backend does per token bucket); the eager loop cannot be
               captured (it syncs on routed-token counts)
    ours_b2b   up to --b2b-max-tokens tokens: 20 calls back to back in one
               graph, per call, as a decode step's graph runs its layers (one
               graph launch for all of them, each call's first kernel
               following the last call's); ours_b2b_over_floor is the decode
               floor's ratio for it

Columns: median milliseconds (CUDA events, after warm-up, all ranks started
together), ours' speedup over torch_gmm and eager (graph replays where both
have them), the layer's FLOPs and bytes per GPU, ours in TFLOP/s and GB/s,
the rate of ONE plain GEMM with the layer's total rows and K measured in the
same run (torch._scaled_mm with block scales in FP8, torch.mm in BF16) and
ours as a fraction of it, the decode floor (bytes of the experts the batch
touches on this rank, read once at the copy bandwidth measured in the same
run) and ours over it, the bound (the larger of the layer's FLOPs at the
plain GEMM's rate and the decode floor: no kernel can beat either, and at
4096 tokens the two are close) and ours over it, and the max error of ours
and torch_gmm relative to the eager output's largest value.

Targets (issue 7): ours >= 1.3x torch_gmm at 1-512 tokens and >= 1.1x at
4096+; decode (1-64 tokens) within 2x of the weight-read floor. FP8 eager
runs the reference block GEMM (dequantize, float32 matmul) and is only timed
up to --eager-max-tokens-fp8 tokens to stay within the 5-minute budget.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import time
from typing import Callable

import torch
import torch.distributed as dist

from minimax_backend.tools.gpu_power import seconds_arg
from minimax_backend.tools.torch_baseline import TorchGrouped

DEFAULT_TOKENS = [1, 4, 16, 64, 128, 512, 1024, 4096, 8192, 16384]
B2B_CALLS = 20  # calls per graph in the back-to-back column (as bench_moe_select)


# ------------------------------------------------------------------ timing
def _timer(device: torch.device, warmup: int, repeats: int, barrier) -> Callable[[Callable], float]:
    if device.type == "cuda":
        from minimax_backend.tools.bench_common import median_ms

        return lambda fn: median_ms(fn, warmup, repeats, barrier)

    def cpu_ms(fn):
        for _ in range(warmup):
            fn()
        times = []
        for _ in range(repeats):
            if barrier:
                barrier()
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
        return statistics.median(times)

    return cpu_ms


def torch_grouped_path(w_args: tuple, fp8: bool):
    """(experts, weights_cls) for kernels.moe.mega_moe_reference with the torch grouped GEMMs."""
    from minimax_backend.kernels.moe_reference import MoEWeights

    routed = TorchGrouped(w_args[2], w_args[3], w_args[4], w_args[5], fp8)
    shared = TorchGrouped([w_args[6]], [w_args[7]], [w_args[8]] if fp8 else None, [w_args[9]] if fp8 else None,
                          fp8) if w_args[6] is not None else None

    def experts(x, ids, weights, w):
        return routed(x, ids, weights, w.expert_offset, w.activation, w.alpha, w.limit, w.beta)

    class Weights(MoEWeights):
        def shared_expert(self, x):
            ids = torch.zeros(x.shape[0], 1, dtype=torch.int64, device=x.device)
            ones = torch.ones(x.shape[0], 1, dtype=torch.float32, device=x.device)
            return shared(x, ids, ones, 0, self.activation, self.alpha, self.limit, self.beta).to(x.dtype)

    return experts, Weights


# ------------------------------------------------------------------- layer
def build_block(preset: str, rank: int, world: int, fp8: bool, device: torch.device, seed: int = 0):
    from minimax_backend.model.presets import load_preset
    from minimax_backend.model.moe import MoE
    from minimax_backend.model.parallel import ParallelState
    from minimax_backend.model.random_weights import fast_random_weights

    cfg = load_preset(preset)
    group = dist.group.WORLD.group_name if world > 1 else None
    ps = ParallelState.create(rank, world, world, group)
    layer = cfg.moe_layers[0] if cfg.moe_layers else 0
    with torch.device(device):
        blk = MoE(cfg, ps, f"model.layers.{layer}.block_sparse_moe", dtype=torch.bfloat16, device=device, fp8=fp8)
    fast_random_weights(blk, seed=seed, config=cfg)  # router logits of std ~1: routing spreads over the experts
    return cfg, blk.eval()


def _expert_bytes(args: tuple, fp8: bool) -> tuple[int, int]:
    """Bytes of one local routed expert (w13 + w2 [+ scales]) and of the shared expert slice."""
    def nbytes(ts):
        return sum(t.numel() * t.element_size() for t in ts if t is not None)

    routed = nbytes([args[2][0], args[3][0]] + ([args[4][0], args[5][0]] if fp8 else []))
    shared = nbytes([args[6], args[7], args[8], args[9]])
    return routed, shared


def job(rank: int, world: int, args) -> None:
    from minimax_backend.tools.bench_common import copy_bandwidth_gbs, print_table, write_json
    from minimax_backend.tools.gpu_power import sampler_for

    device = torch.device("cuda", torch.cuda.current_device()) if args.device == "cuda" else torch.device("cpu")
    barrier = dist.barrier if world > 1 else None
    timed = _timer(device, args.warmup, args.repeats, barrier)
    group = dist.group.WORLD.group_name if world > 1 else ""
    rows = []
    copy_gbs = copy_bandwidth_gbs(device)  # the memory ceiling, measured in this run
    power = sampler_for(args.sustained, device.index or 0,
                        (lambda msg: print(f"[bench_moe] {msg}", flush=True)) if rank == 0 else None)
    with power or contextlib.nullcontext():  # fills each row's SM clock and power when it ends
        for precision in args.precisions:
            _precision_rows(rank, world, args, device, precision, timed, group, copy_gbs, power, rows)
    if rank == 0:
        cols = ["precision", "tokens", "eager_ms", "torch_gmm_ms", "torch_gmm_graph_ms", "ours_ms", "ours_graph_ms",
                *(["ours_alltoall_ms"] if world > 1 else []),
                "x_vs_torch_gmm", "x_vs_eager", "ours_tflops", "plain_gemm_tflops", "frac_of_gemm", "ours_gbs",
                "floor_us", "ours_over_floor", "bound_us", "ours_over_bound", "ours_b2b_ms", "ours_b2b_over_floor",
                "err_ours", "err_torch_gmm"]
        table = print_table(rows, cols, title=f"MoE layer, preset {args.preset}, EP {world} "
                                               f"({'per GPU' if world > 1 else 'one GPU'}), medians of {args.repeats}")
        if args.sustained:
            table += "\n" + print_table(rows, SUSTAINED_COLUMNS, title=f"Back to back for {args.sustained:g} s each "
                                          "(the card at its power limit): median ms, SM clock and board power")
        if args.json:
            write_json(args.json, {"benchmark": "moe_layer", "preset": args.preset, "ep": world,
                                   "copy_gbs": copy_gbs, "sustained_s": args.sustained, "rows": rows, "table": table})


SUSTAINED_COLUMNS = ["precision", "tokens", "ours_sustained_ms", "ours_sustained_tflops", "ours_sm_mhz", "ours_watts",
                     "plain_sustained_tflops", "plain_sm_mhz", "plain_watts", "sustained_frac_of_gemm"]


def _precision_rows(rank, world, args, device, precision, timed, group, copy_gbs, power, rows) -> None:
    """The rows of one precision, appended to `rows`."""
    from minimax_backend.kernels.moe import block_op_args, flops
    from minimax_backend.kernels.moe_parallel import mega_moe_reference, shard_rows
    from minimax_backend.tools.bench_common import graph_median_ms, graphed, sustained_ms

    fp8 = precision == "fp8"
    cfg, blk = build_block(args.preset, rank, world, fp8, device)
    w_args = block_op_args(blk)
    torch_experts, torch_weights = torch_grouped_path(w_args, fp8) if _torch_gmm_ok(device, fp8) else (None, None)
    routed_bytes, shared_bytes = _expert_bytes(w_args, fp8)
    hidden, inter, k = cfg.hidden_size, cfg.intermediate_size, cfg.num_experts_per_tok
    for tokens in args.tokens:
        gen = torch.Generator(device).manual_seed(tokens)
        x = torch.randn(tokens, hidden, device=device, generator=gen).to(torch.bfloat16)
        t = shard_rows(tokens, world)
        xpad = torch.nn.functional.pad(x, [0, 0, 0, t * world - tokens])
        shard = xpad[rank * t:(rank + 1) * t].contiguous()
        sp = (group, world, world > 1, world > 1, tokens, "allgather")
        x_in = shard if world > 1 else x

        def ours():
            return torch.ops.minimax.mega_moe(x_in, *w_args, *sp)

        row = {"precision": precision, "tokens": tokens}
        with torch.no_grad():
            eager_out = blk(x)
            ref = (torch.nn.functional.pad(eager_out, [0, 0, 0, t * world - tokens])[rank * t:(rank + 1) * t]
                   if world > 1 else eager_out)
            scale = ref.float().abs().max().clamp(min=1e-6)
            eager_cap = args.eager_max_tokens_fp8 if fp8 else args.eager_max_tokens
            row["eager_ms"] = timed(lambda: blk(x)) if tokens <= eager_cap else None
            row["err_ours"] = ((ours().float() - ref.float()).abs().max() / scale).item()
            row["ours_ms"] = timed(ours)
            if world > 1:  # the other exchange (data-dependent sizes: not graph-capturable)
                a2a = (*sp[:-1], "alltoall")
                row["ours_alltoall_ms"] = timed(lambda: torch.ops.minimax.mega_moe(x_in, *w_args, *a2a))
            if torch_experts is not None:
                def torch_gmm():
                    return mega_moe_reference(x_in, *w_args, *sp, experts=torch_experts, weights_cls=torch_weights)

                row["err_torch_gmm"] = ((torch_gmm().float() - ref.float()).abs().max() / scale).item()
                row["torch_gmm_ms"] = timed(torch_gmm)
            ours_graph = None
            if device.type == "cuda" and args.cuda_graph:
                ours_graph = graphed(ours)
                row["ours_graph_ms"] = timed(ours_graph)
                if torch_experts is not None:
                    row["torch_gmm_graph_ms"] = timed(graphed(torch_gmm))
                if tokens <= args.b2b_max_tokens and world == 1:
                    row["ours_b2b_ms"] = graph_median_ms(ours, calls=B2B_CALLS, warmup=args.warmup,
                                                         repeats=args.repeats)
            weight_bytes = touched_weight_bytes(blk, x, routed_bytes, shared_bytes)
        floor_us = weight_bytes / (copy_gbs * 1e3)
        layer_flops = flops(tokens, hidden, inter, k, cfg.shared_intermediate_size)
        best = min(v for v in (row["ours_ms"], row.get("ours_graph_ms")) if v)
        row["flops"] = layer_flops / world
        row["bytes"] = weight_bytes + 2 * 2 * tokens * hidden  # weights touched + activations in and out
        row["ours_tflops"] = layer_flops / world / (best * 1e-3) / 1e12
        row["ours_gbs"] = row["bytes"] / (best * 1e-3) / 1e9
        rows_total = tokens * k // world + (tokens if cfg.shared_intermediate_size else 0)
        plain, plain_flops = _plain_gemm(device, fp8, rows_total, hidden, 2 * inter // world)
        row["plain_gemm_tflops"] = _plain_gemm_tflops(device, plain, plain_flops)
        row["frac_of_gemm"] = row["ours_tflops"] / row["plain_gemm_tflops"]
        if args.sustained:  # ours and the plain GEMM run back to back, each long enough to reach the power limit
            for prefix, fn, fl in (("ours", ours_graph or ours, layer_flops / world),
                                   ("plain", graphed(plain) if device.type == "cuda" else plain, plain_flops)):
                with torch.no_grad(), power.window(row, f"{prefix}_"):
                    ms = sustained_ms(fn, args.sustained)
                if prefix == "ours":
                    row["ours_sustained_ms"] = ms
                row[f"{prefix}_sustained_tflops"] = fl / (ms * 1e-3) / 1e12
            row["sustained_frac_of_gemm"] = row["ours_sustained_tflops"] / row["plain_sustained_tflops"]
        row["floor_us"] = floor_us
        row["ours_over_floor"] = best * 1e3 / floor_us
        row["bound_us"] = max(floor_us, row["flops"] / (row["plain_gemm_tflops"] * 1e6))
        row["ours_over_bound"] = best * 1e3 / row["bound_us"]
        if row.get("ours_b2b_ms"):
            row["ours_b2b_over_floor"] = row["ours_b2b_ms"] * 1e3 / floor_us
        if row.get("torch_gmm_ms"):
            theirs = min(v for v in (row["torch_gmm_ms"], row.get("torch_gmm_graph_ms")) if v)
            row["x_vs_torch_gmm"] = theirs / best
        if row.get("eager_ms"):
            row["x_vs_eager"] = row["eager_ms"] / best
        rows.append(row)
        if rank == 0:
            print(f"[bench_moe] {precision} {tokens} tokens: " + ", ".join(
                f"{k}={v:.3g}" if isinstance(v, float) else f"{k}={v}" for k, v in row.items()
                if k not in ("precision", "tokens")), flush=True)
    del blk, w_args, torch_experts, torch_weights
    if device.type == "cuda":
        torch.cuda.empty_cache()


def _plain_gemm(device: torch.device, fp8: bool, m: int, k: int, n: int):
    """ONE plain GEMM with the layer's total rows and K, and its FLOPs: torch.mm in BF16,
    torch._scaled_mm with 1 x 128 / 128 x 128 block scales in FP8 (minimax::fp8_block_gemm)."""
    from minimax_backend.kernels.fp8 import quantize_weight_fp8

    m = max(m, 1)
    a = torch.randn(m, k, device=device).to(torch.bfloat16)
    w = torch.randn(n, k, device=device).to(torch.bfloat16)
    if fp8:
        aq, as_ = torch.ops.minimax.quantize_fp8(a, 128)
        wq, ws = quantize_weight_fp8(w)
        fn = lambda: torch.ops.minimax.fp8_block_gemm(aq, as_, wq, ws, torch.bfloat16)  # noqa: E731
    else:
        fn = lambda: a @ w.t()  # noqa: E731
    return fn, 2.0 * m * k * n


def _plain_gemm_tflops(device: torch.device, fn, flops: float) -> float:
    """The plain GEMM's rate now (CUDA-graph replays of 10 calls on a GPU)."""
    from minimax_backend.tools.bench_common import graph_median_ms, median_ms

    ms = graph_median_ms(fn) if device.type == "cuda" else median_ms(fn, warmup=1, repeats=3)
    return flops / (ms * 1e-3) / 1e12


def touched_weight_bytes(blk, x, routed_bytes: int, shared_bytes: int) -> int:
    """The decode floor's bytes: the local experts this batch routes to (+ the shared slice), read once."""
    ids, _ = blk_route(blk, x)
    first = blk.first_expert
    touched = len(torch.unique(ids[(ids >= first) & (ids < first + len(blk.experts))]))
    return touched * routed_bytes + shared_bytes


def blk_route(blk, x):
    from minimax_backend.kernels.moe_reference import route

    return route(x, blk.gate.weight, blk.e_score_correction_bias if blk.use_routing_bias else None, blk.top_k,
                 blk.norm_topk_prob, blk.routed_scaling_factor)


def _torch_gmm_ok(device: torch.device, fp8: bool) -> bool:
    if fp8:
        return device.type == "cuda" and hasattr(torch, "_scaled_grouped_mm")
    return hasattr(torch, "_grouped_mm")


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--gpus", type=int, default=1, help="EP = TP size (ranks); 2 on nvidia-h200-x2")
    p.add_argument("--tokens", type=int, nargs="+", default=DEFAULT_TOKENS)
    p.add_argument("--precisions", nargs="+", choices=["bf16", "fp8"], default=["bf16", "fp8"])
    p.add_argument("--preset", default="m3", help="model shape (tiny-m3 for a CPU smoke run)")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--repeats", type=int, default=10)
    p.add_argument("--eager-max-tokens", type=int, default=16384)
    p.add_argument("--eager-max-tokens-fp8", type=int, default=4096)
    p.add_argument("--no-cuda-graph", dest="cuda_graph", action="store_false")
    p.add_argument("--b2b-max-tokens", type=int, default=64,
                   help=f"also time {B2B_CALLS} calls back to back in one graph up to this many tokens (one GPU)")
    p.add_argument("--sustained", type=seconds_arg, default=0.0, metavar="SECONDS",
                   help="also run ours and the plain GEMM back to back for SECONDS each and report the median ms "
                        "with the SM clock and board power nvidia-smi reads meanwhile (at prefill sizes the card "
                        "reaches its power limit and clocks down)")
    p.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    p.add_argument("--json")
    args = p.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("this benchmark needs CUDA GPUs (--device cpu --preset tiny-m3 for a smoke run)")
    if args.sustained and args.gpus > 1:  # a loop bounded by time would give the ranks different call counts
        raise SystemExit("--sustained times one GPU: use it with --gpus 1 (at EP > 1 the ranks' collectives "
                         "need the same number of calls on every rank)")
    if args.device == "cpu":
        if args.sustained:
            print("[bench_moe] --sustained on the CPU: a smoke run (host clock; a CPU has no power limit to reach)")
        args.cuda_graph = False
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")  # NVLink multicast stays off on the lent boxes
    from minimax_backend.tools.launch import run_on_ranks

    run_on_ranks(job, args.gpus, args.device, args)


if __name__ == "__main__":
    main()
