"""GEMM + reduce-scatter on tp GPUs: minimax::gemm_rs against the alternatives.

    python -m minimax_backend.tools.bench_gemm_rs --tp 2 --json gemm_rs.json

For N = 6144 (hidden), K in {2048, 4096, 6144} (o_proj / down_proj inputs at
TP 4 and TP 2 of MiniMax-M3) and M (tokens) from 128 to 32768, in BF16 and
FP8 (1x128 activation, 128x128 weight block scales), every rank times:

    gemm      the local GEMM alone (the floor)
    mm_rs     GEMM + NCCL reduce-scatter (functional collective): the unfused graph
    ours      minimax::gemm_rs, overlapped path (min_tokens = 0); with --pieces,
              also ours with the row blocks computed in that many pieces; with
              --schedules, also ours with the own rows in each schedule
              (epilogue / sum_after, see kernels/gemm_rs_cuda.py); with --push,
              also ours with the partials pushed by the copy engine or stored
              by the GEMM into the peer's memory
    torch     torch.ops.symm_mem.fused_matmul_reduce_scatter (BF16);
              fused_scaled_matmul_reduce_scatter with row-wise scales (FP8: the
              only scaling it takes; our block scales were refused); "-" where it fails

Medians of CUDA-event timings after warm-up, all ranks started together by a
barrier; by default `--calls` (10) back-to-back calls are captured in one
CUDA graph and a replay's time is divided by them (how the model runs: no CPU
launch cost, and the ranks stay in step from one collective to the next, as
they do layer after layer; a single call per replay also counts the ranks'
launch skew, 25-70 us measured on 2 x H200, in every collective method).
`--calls 1` times one call per replay, `--eager` plain calls. `--trace` also
records one replay of ours per shape with torch.profiler and writes its GPU
timeline (every kernel and copy: start, duration, stream, name) into the
JSON row as `ours_trace`, with a kernels-per-call summary in the progress
line. Prints one
progress line per shape, the table, the smallest M at which ours beats
mm_rs from there on for each K (the `gemm_rs_min_tokens` recommendation), and
writes JSON with the hardware. The ranks leave through tools/launch.py (a
barrier, then os._exit: destroy_process_group() hung on the GPU box after
symmetric memory was used).
"""

from __future__ import annotations

import argparse
import os
import time

import torch
import torch.distributed as dist

N = 6144
KS = (2048, 4096, 6144)
MS = (128, 256, 512, 1024, 2048, 4096, 8192, 16384, 32768)
METHODS = ("gemm", "mm_rs", "ours", "torch")


def _log(rank: int, msg: str) -> None:
    if rank == 0:
        print(f"[bench_gemm_rs {time.strftime('%H:%M:%S')}] {msg}", flush=True)


def _methods(x, w, fp8_args, world, group):
    """{name: callable} for one shape; fp8_args = (xq, xs, wq, ws) or None."""
    from minimax_backend.kernels.gemm_rs import local_gemm

    c10d = torch.ops._c10d_functional
    if fp8_args is None:
        a, b, a_s, b_s, out_dtype = x, w, None, None, None
    else:
        a, a_s, b, b_s = fp8_args
        out_dtype = torch.bfloat16

    def gemm():
        return local_gemm(a, b, a_s, b_s, None, out_dtype)

    def mm_rs():
        return c10d.wait_tensor(c10d.reduce_scatter_tensor(gemm(), "sum", world, group))

    def ours():
        return torch.ops.minimax.gemm_rs(a, b, a_s, b_s, None, 0, 0, world, group, out_dtype=out_dtype)

    if fp8_args is None:
        def torch_fused():
            return torch.ops.symm_mem.fused_matmul_reduce_scatter(x, w.t(), "sum", 0, group)
    else:
        # torch's FP8 op takes tensor-wise or row-wise scales only (our 1 x 128 / 128 x 128
        # blocks were refused there): time it row-wise, one scale per token and per output
        # channel, its own format. A timing comparison; its numbers are not ours.
        from minimax_backend.tools.bench_common import rowwise_fp8

        xr, xr_s = rowwise_fp8(x)
        wr, wr_s = rowwise_fp8(w)

        def torch_fused():  # scales as [M, 1] and [1, N]
            return torch.ops.symm_mem.fused_scaled_matmul_reduce_scatter(
                xr, wr.t(), xr_s[:, None], wr_s[None, :], "sum", 0, 0, group, [xr.shape[0], wr.shape[0]],
                out_dtype=torch.bfloat16)

    return {"gemm": gemm, "mm_rs": mm_rs, "ours": ours, "torch": torch_fused}


def _time(fn, args) -> float | None:
    from minimax_backend.tools.bench_common import graphed, median_ms

    if args.eager:
        fn()
        return median_ms(fn, args.warmup, args.repeats, dist.barrier) * 1e3
    replay = graphed(fn, args.calls, before_capture=dist.barrier, capture_error_mode="thread_local")
    try:
        return median_ms(replay, args.warmup, args.repeats, dist.barrier) * 1e3 / args.calls
    finally:
        del replay  # frees the graph and its pool before the next shape


def _trace(fn, args) -> list[dict]:
    """GPU timeline of one CUDA-graph replay of `args.calls` calls of fn (bench_common.gpu_timeline)."""
    from torch.profiler import ProfilerActivity, profile

    from minimax_backend.tools.bench_common import graphed, gpu_timeline

    replay = graphed(fn, args.calls, before_capture=dist.barrier, capture_error_mode="thread_local")
    try:
        for _ in range(args.warmup):
            replay()
        torch.cuda.synchronize()
        dist.barrier()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            replay()
            torch.cuda.synchronize()
        return gpu_timeline(prof.events())
    finally:
        del replay


def _time_with_option(fn, option: str, value, args) -> float:
    """_time(fn) with kernel option `option` = value (kernels/options.py; read when the call is captured)."""
    from minimax_backend.kernels.options import override_kernel_options

    with override_kernel_options(**{option: value}):
        return _time(fn, args)


def _all_ok(ok: bool) -> bool:
    """True only if every rank says ok (so all ranks skip a failing method together)."""
    flag = torch.tensor([0 if ok else 1], device="cuda")
    dist.all_reduce(flag)
    return flag.item() == 0


def _thresholds(rows, dtype):
    """{K: smallest M from which ours beats mm_rs at every larger M measured (None: never)}."""
    out = {}
    for k in sorted({r["K"] for r in rows if r["dtype"] == dtype}):
        series = sorted((r for r in rows if r["dtype"] == dtype and r["K"] == k), key=lambda r: r["M"])
        best = None
        for r in reversed(series):
            if r["ours_us"] is None or r["mm_rs_us"] is None or r["ours_us"] >= r["mm_rs_us"]:
                break
            best = r["M"]
        out[k] = best
    return out


def job(rank: int, world: int, args) -> None:
    from minimax_backend.kernels.fp8 import quantize_weight_fp8
    from minimax_backend.kernels.cublaslt_gemm import unavailable_reasons
    from minimax_backend.kernels.options import kernel_options
    from minimax_backend.tools.bench_common import print_table, write_json

    t0 = time.time()
    device = torch.device("cuda", torch.cuda.current_device())
    group = dist.group.WORLD.group_name
    # torch's fused ops live in this module and need symmetric memory on the group.
    from torch.distributed import _symmetric_memory as symm_mem

    if hasattr(symm_mem, "enable_symm_mem_for_group"):
        symm_mem.enable_symm_mem_for_group(group)
    rows, failures = [], set()
    variants = ([(f"ours_p{n}_us", "gemm_rs_pieces", n) for n in args.pieces]  # (column, kernel option, value)
                + [(f"ours_{s}_us", "gemm_rs_schedule", s) for s in args.schedules]
                + [(f"ours_push_{p}_us", "gemm_rs_push", p) for p in args.push])
    total = len(args.dtypes) * len(args.k) * len(args.m)
    for dtype in args.dtypes:
        for k in args.k:
            g = torch.Generator(device=device).manual_seed(1000 * rank + k)
            w = (torch.randn(N, k, device=device, generator=g) / k**0.5).bfloat16()
            wq_ws = quantize_weight_fp8(w.float()) if dtype == "fp8" else None
            for m in args.m:
                x = torch.randn(m, k, device=device, generator=g, dtype=torch.bfloat16)
                fp8_args = None
                if dtype == "fp8":
                    xq, xs = torch.ops.minimax.quantize_fp8(x, 128)
                    fp8_args = (xq, xs, *wq_ws)
                fns = _methods(x, w, fp8_args, world, group)
                row = {"dtype": dtype, "K": k, "M": m, "N": N}
                outs = {}
                for name in args.methods:
                    us, err = None, None
                    try:
                        outs[name] = fns[name]()
                        torch.cuda.synchronize()
                        us = _time(fns[name], args)
                    except Exception as e:  # noqa: BLE001
                        err = f"{type(e).__name__}: {(str(e).splitlines() or [''])[0][:200]}"
                    if not _all_ok(err is None):  # every rank drops the number together
                        if (dtype, name, err) not in failures:
                            _log(rank, f"{dtype} {name} failed at K={k} M={m}: {err or 'on another rank'}")
                        failures.add((dtype, name, err))
                        us = None
                    row[f"{name}_us"] = us
                for name in set(METHODS) - set(args.methods):
                    row[f"{name}_us"] = None
                for column, option, value in variants:  # ours with one setting forced
                    row[column] = _time_with_option(fns["ours"], option, value, args)
                trace_note = ""
                if args.trace and row["ours_us"] is not None:  # the same on every rank (a collective)
                    row["ours_trace"] = _trace(fns["ours"], args)
                    trace_note = f" (trace: {len(row['ours_trace']) / args.calls:.0f} kernels + copies a call)"
                row["max_abs_diff"] = row["max_rel_diff"] = None
                if "ours" in outs and "mm_rs" in outs:  # ours rounds once where mm_rs rounds twice (BF16 epilogue add)
                    diff = (outs["ours"].float() - outs["mm_rs"].float()).abs().max().item()
                    row["max_abs_diff"] = diff
                    row["max_rel_diff"] = diff / max(outs["mm_rs"].float().abs().max().item(), 1e-30)
                r = row
                r["ours_vs_mm_rs"] = r["mm_rs_us"] / r["ours_us"] if r["ours_us"] and r["mm_rs_us"] else None
                r["ours_vs_torch"] = r["torch_us"] / r["ours_us"] if r["ours_us"] and r["torch_us"] else None
                rows.append(row)
                del outs, fns, x, fp8_args
                fmt = lambda v: "-" if v is None else f"{v:.0f}"  # noqa: E731
                _log(rank, f"[{len(rows)}/{total}] {dtype} K={k} M={m}: gemm {fmt(r['gemm_us'])} us, mm+RS "
                           f"{fmt(r['mm_rs_us'])}, ours {fmt(r['ours_us'])}, torch {fmt(r['torch_us'])}"
                           + (f", ours {r['ours_vs_mm_rs']:.2f}x vs mm+RS" if r["ours_vs_mm_rs"] else "") + trace_note)
            torch.cuda.empty_cache()

    thresholds = {d: _thresholds(rows, d) for d in args.dtypes}
    safe = [m for per_k in thresholds.values() for m in per_k.values()]
    recommended = max(safe) if safe and None not in safe else None
    targets = {}
    for d in args.dtypes:
        big = [r["ours_vs_mm_rs"] for r in rows if r["dtype"] == d and r["M"] >= 4096 and r["ours_vs_mm_rs"]]
        vs_torch = [r["ours_vs_torch"] for r in rows if r["dtype"] == d and r["M"] >= 1024 and r["ours_vs_torch"]]
        targets[d] = {"min_speedup_vs_mm_rs_at_M>=4096": min(big) if big else None,
                      "min_speedup_vs_torch_at_M>=1024": min(vs_torch) if vs_torch else None}
    if rank == 0:
        mode = "eager calls" if args.eager else f"CUDA-graph replays of {args.calls} calls"
        print_table(rows, ["dtype", "K", "M", "gemm_us", "mm_rs_us", "ours_us", "torch_us", "ours_vs_mm_rs",
                           "ours_vs_torch", "max_rel_diff"] + [column for column, _, _ in variants],
                    title=f"GEMM + reduce-scatter, N={N}, {world} GPUs, medians of {args.repeats} {mode} (us)")
        for d, per_k in thresholds.items():
            for k, m in per_k.items():
                print(f"threshold {d} K={k}: ours beats matmul + reduce-scatter from M = {m} on"
                      if m is not None else f"threshold {d} K={k}: ours does not win at the largest M measured")
        print(f"recommended gemm_rs_min_tokens: {recommended} (largest per-K threshold, {world} GPUs)")
        for d, t in targets.items():
            print(f"targets {d}: {t}")
        if args.json:
            write_json(args.json, {"benchmark": "gemm_reduce_scatter", "world": world, "N": N, "mode": mode,
                                   "calls_per_graph": None if args.eager else args.calls,
                                   "kernel_options": kernel_options().to_dict(),  # the switches in force
                                   "epilogue_add_unavailable": {str(k): v for k, v in unavailable_reasons().items()},
                                   "warmup": args.warmup, "repeats": args.repeats, "rows": rows,
                                   "thresholds": thresholds, "recommended_min_tokens": recommended,
                                   "targets": targets, "seconds": time.time() - t0})
        print(f"done in {time.time() - t0:.0f}s", flush=True)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tp", type=int, default=2, help="ranks = GPUs (default 2)")
    p.add_argument("--k", type=int, nargs="+", default=list(KS))
    p.add_argument("--m", type=int, nargs="+", default=list(MS))
    p.add_argument("--dtypes", nargs="+", choices=["bf16", "fp8"], default=["bf16", "fp8"])
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--repeats", type=int, default=10)
    p.add_argument("--eager", action="store_true", help="time plain calls instead of CUDA-graph replays")
    p.add_argument("--calls", type=int, default=10, help="back-to-back calls per captured graph (default 10)")
    p.add_argument("--methods", nargs="+", choices=METHODS, default=list(METHODS))
    p.add_argument("--pieces", type=int, nargs="*", default=[],
                   help="also time ours with the peer blocks pushed in each of these piece counts")
    p.add_argument("--schedules", nargs="*", default=[], choices=["epilogue", "sum_after"],
                   help="also time ours with the own rows in each of these schedules (kernel option gemm_rs_schedule)")
    p.add_argument("--push", nargs="*", default=[], choices=["copy", "store"],
                   help="also time ours with the partials pushed each of these ways (kernel option gemm_rs_push)")
    p.add_argument("--trace", action="store_true",
                   help="also record one replay of ours per shape with torch.profiler: GPU timeline in the JSON")
    p.add_argument("--json")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("this benchmark needs CUDA GPUs")
    if any(n < 1 for n in args.pieces):
        raise SystemExit("--pieces values must be at least 1")
    if (args.pieces or args.schedules or args.push) and "ours" not in args.methods:
        raise SystemExit("--pieces, --schedules and --push time ours: keep 'ours' in --methods")
    if args.trace and args.eager:
        raise SystemExit("--trace records a CUDA-graph replay: leave out --eager")
    if args.trace and "ours" not in args.methods:
        raise SystemExit("--trace records ours: keep 'ours' in --methods")
    if args.calls < 1:
        raise SystemExit("--calls must be at least 1")
    if args.tp < 2:
        raise SystemExit("--tp must be at least 2: a reduce-scatter needs two ranks")
    bad = [m for m in args.m if m % args.tp]
    if bad:
        raise SystemExit(f"--m values must divide by --tp {args.tp}: {bad}")
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")
    from minimax_backend.tools.launch import run_on_ranks

    run_on_ranks(job, args.tp, "cuda", args)


if __name__ == "__main__":
    main()
