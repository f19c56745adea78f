"""Benchmarks of the norm + quant fusion on the H200 (one command, a few minutes).

    python -m minimax_backend.tools.bench_norm_quant --json norm_quant.json

Three parts, each a table, all in one JSON:

1. kernel: residual add + Gemma RMSNorm + FP8 quantization (1 x 128 groups)
   at hidden 6144, M = 128 ... 16384 tokens:
     fused    our Triton kernel (minimax::rms_norm_quant_fp8)
     eager    the model's unfused path: h = x + r; RMSNorm (model/layers.py); quantize_fp8
     inductor stock torch.compile of the same plain-torch code
   with the bytes each must move, and the fused kernel's share of the copy
   bandwidth measured on this card (a 1 GiB device-to-device copy). Target:
   >= 85% at M >= 4096. The fused kernel's num_warps and rows per program
   are swept, each with the row as one padded tile and as two exact tiles
   (split_tiles); `fused_ms` is the default launch, `fused_best_ms` the best
   of the sweep. (Persistent grids of 2, 4 or 8 programs per SM were swept
   on the H200 on 2026-11-30 and were slower at every M:
   docs/results/2026-11-30_h200_norm_quant_persistent_sweep.json.) Parts 1 and 2 time CUDA-graph replays of 10 back-to-back calls
   (as the backend runs them; --no-graphs times single Python launches,
   which at these sizes mostly measures the host). Each M also
   reports whether the fused outputs equal the reference (fraction of equal
   FP8 bytes; scales and residual must be equal).
2. gemm: FP8 block-scaled GEMM (1 x 128 activation, 128 x 128 weight scales)
   against the BF16 GEMM, for the QKV (N 4608, K 6144 at TP 2) and o_proj
   (N 6144, K 4096) shapes: torch._scaled_mm blockwise (scale relayout
   included) and the Triton fallback (kernels/fp8_gemm_cuda.py).
3. allgather (needs 2 GPUs; skipped with a note otherwise): from the
   residual-stream shard to GEMM-ready FP8 of all tokens, hidden 6144:
     bf16     norm on the shard (Inductor) -> all-gather BF16 -> quantize (Inductor)
     bf16_tq  the same with our Triton quantize (kernels/norm_quant_triton.py)
     fp8      fused kernel on the shard -> all-gather FP8 bytes + all-gather scales
     packed   fused kernel -> pack data + scales in one byte buffer -> one
              all-gather -> unpack (the alternative to two gathers)
   each including the scales' relayout for cuBLAS (M-major); plus the bare
   collectives (BF16 gather vs FP8 + scales gathers).

Inductor is compiled with dynamic=True (one compile for all M; its kernels
are persistent row reductions either way); --static-inductor recompiles per M.

`TRITON_INTERPRET=1 python -m minimax_backend.tools.bench_norm_quant --dry-run`
runs every code path on the CPU (Triton interpreter, gloo, wall-clock timer,
tiny M) to check the script itself; its numbers mean nothing.
"""

from __future__ import annotations

import argparse
import os
import time

import torch

HIDDEN = 6144
GROUP = 128
EPS = 1e-6
M_LIST = [128, 256, 512, 1024, 2048, 4096, 8192, 16384]
DEV = "cuda"  # "cpu" under --dry-run
SWEEP_WARPS, SWEEP_ROWS = (2, 4, 8, 16), (1, 2, 4)  # the launch configs the kernel part sweeps
GEMM_SHAPES = ((4608, 6144, "qkv"), (6144, 4096, "o_proj"))  # (N, K): QKV and o_proj at TP 2


def _wall_ms(fn, warmup=1, repeats=2, barrier=None):
    """--dry-run stand-in for bench_common.median_ms (no CUDA events on the CPU)."""
    import statistics

    fn()
    times = []
    for _ in range(repeats):
        if barrier is not None:
            barrier()
        t = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t) * 1e3)
    return statistics.median(times)


def _gen(seed: int) -> torch.Generator:
    return torch.Generator(device=DEV).manual_seed(seed)


def _bandwidth_gbs(median_ms) -> float:
    n = 1 << 30
    n = n if DEV == "cuda" else 1 << 24
    a = torch.empty(n, dtype=torch.uint8, device=DEV)
    b = torch.empty_like(a)
    ms = median_ms(lambda: b.copy_(a), 3, 20)
    return 2 * n / (ms * 1e-3) / 1e9


def _eager(x, res, w):
    from minimax_backend.kernels.norm_quant import rms_norm_reference

    h = x + res
    y = rms_norm_reference(h, w, EPS, True)
    q, s = torch.ops.minimax.quantize_fp8(y, GROUP)
    return q, s, h


def _plain(x, res, w):
    """The same computation in plain torch ops (what Inductor sees)."""
    from minimax_backend.kernels.fp8 import quantize_fp8_reference
    from minimax_backend.kernels.norm_quant import rms_norm_reference

    h = x + res
    q, s = quantize_fp8_reference(rms_norm_reference(h, w, EPS, True), GROUP)
    return q, s, h


def part_kernel(args, median_ms, bw) -> list[dict]:
    from minimax_backend.kernels.norm_quant import rms_norm_quant_fp8_reference
    from minimax_backend.kernels.norm_quant_triton import launch_config, rms_norm_quant_fp8_triton

    inductor = torch.compile(_plain, dynamic=not args.static_inductor)
    rows = []
    for m in args.m:
        if args.static_inductor:
            torch._dynamo.reset()
            inductor = torch.compile(_plain, dynamic=False)
        g = _gen(m)
        x = torch.randn(m, HIDDEN, device=DEV, generator=g).to(torch.bfloat16)
        res = torch.randn(m, HIDDEN, device=DEV, generator=g).to(torch.bfloat16)
        w = (torch.randn(HIDDEN, device=DEV, generator=g) * 0.1).to(torch.bfloat16)
        nbytes = m * HIDDEN * (2 + 2 + 2 + 1) + m * (HIDDEN // GROUP) * 4 + HIDDEN * 2
        row = {"M": m, "MB_moved": nbytes / 1e6}

        def fused(nw=None, rows_per_program=None, split=None):
            return rms_norm_quant_fp8_triton(x, res, w, EPS, True, GROUP, False, num_warps=nw,
                                             rows_per_program=rows_per_program, split_tiles=split)

        out = fused()
        ref = rms_norm_quant_fp8_reference(x, res, w, EPS, True, GROUP, False)
        row["scales_equal"] = bool(torch.equal(out[1], ref[1]))
        row["residual_equal"] = bool(torch.equal(out[3], ref[3]))
        row["fp8_equal_frac"] = float((out[0].view(torch.uint8) == ref[0].view(torch.uint8)).float().mean())
        row["fused_ms"] = median_ms(lambda: fused(), args.warmup, args.repeats)
        # The other tile layout against the same reference (not against `out` bit for bit: on
        # the GPU the sum of squares is reduced in a different order, so a rare last-bit change
        # of the norm can move an FP8 rounding; the exact-sum GPU test checks bit equality).
        other = fused(split=not launch_config(HIDDEN, GROUP, m)["SPLIT"])
        row["other_layout_scales_equal"] = bool(torch.equal(other[1], ref[1]))
        row["other_layout_fp8_equal_frac"] = float((other[0].view(torch.uint8) == ref[0].view(torch.uint8)).float().mean())
        sweep = {}
        for split in (False, True):
            for nw in SWEEP_WARPS:
                for rpp in SWEEP_ROWS:
                    sweep[(nw, rpp, split)] = median_ms(lambda: fused(nw, rpp, split), args.warmup, args.repeats)
        best = min(sweep, key=sweep.get)
        cfg = launch_config(HIDDEN, GROUP, m)
        row["default_warps"], row["default_rows"], row["default_split"] = cfg["num_warps"], cfg["ROWS"], cfg["SPLIT"]
        row["best_warps"], row["best_rows"], row["best_split"] = best
        row["fused_best_ms"] = sweep[best]
        row["sweep_ms"] = {f"warps={k[0]} rows={k[1]} split={k[2]}": v for k, v in sweep.items()}
        row["eager_ms"] = median_ms(lambda: _eager(x, res, w), args.warmup, args.repeats)
        inductor(x, res, w)
        row["inductor_ms"] = median_ms(lambda: inductor(x, res, w), args.warmup, args.repeats)
        for name in ("fused", "fused_best", "eager", "inductor"):
            row[f"{name}_GBs"] = nbytes / (row[f"{name}_ms"] * 1e-3) / 1e9
        row["fused_bw_frac"] = row["fused_best_GBs"] / bw
        row["inductor_bw_frac"] = row["inductor_GBs"] / bw
        row["speedup_vs_eager"] = row["eager_ms"] / row["fused_best_ms"]
        row["speedup_vs_inductor"] = row["inductor_ms"] / row["fused_best_ms"]
        rows.append(row)
    if DEV == "cuda":
        torch.cuda.empty_cache()
    return rows


def part_gemm(args, median_ms) -> list[dict]:
    from minimax_backend.kernels.fp8 import dequantize_weight_fp8, quantize_weight_fp8
    from minimax_backend.kernels.fp8_gemm_cuda import fp8_block_gemm_scaled_mm, fp8_block_gemm_triton

    rows = []
    for n, k, name in GEMM_SHAPES:
        wb = (torch.randn(n, k, device=DEV) * k**-0.5).to(torch.bfloat16)
        wq, ws = quantize_weight_fp8(wb.float())
        for m in args.gemm_m:
            x = torch.randn(m, k, device=DEV).to(torch.bfloat16)
            xq, xs = torch.ops.minimax.quantize_fp8(x, GROUP)
            flop = 2 * m * n * k
            row = {"shape": name, "M": m, "N": n, "K": k}
            row["bf16_ms"] = median_ms(lambda: x @ wb.t(), args.warmup, args.repeats)
            ref = None
            if m <= 4096:  # the reference formula itself (the op may dispatch to the kernels under test)
                ref = (xq.float() * xs.repeat_interleave(GROUP, -1)) @ dequantize_weight_fp8(wq, ws).T
            for label, fn in (("scaled_mm", fp8_block_gemm_scaled_mm), ("triton", fp8_block_gemm_triton)):
                try:
                    out = fn(xq, xs, wq, ws, torch.bfloat16)
                    row[f"{label}_ms"] = median_ms(lambda: fn(xq, xs, wq, ws, torch.bfloat16), args.warmup, args.repeats)
                    row[f"{label}_TFLOPs"] = flop / (row[f"{label}_ms"] * 1e-3) / 1e12
                    row[f"{label}_speedup"] = row["bf16_ms"] / row[f"{label}_ms"]
                    if ref is not None:
                        row[f"{label}_max_rel_err"] = float((out.float() - ref).abs().max() / ref.abs().max())
                except Exception as e:  # noqa: BLE001 - report, do not stop the benchmark
                    msg = (str(e).strip().splitlines() or [""])[0][:60]
                    row[f"{label}_ms"] = f"error: {type(e).__name__}: {msg}"
            row["bf16_TFLOPs"] = flop / (row["bf16_ms"] * 1e-3) / 1e12
            rows.append(row)
    if DEV == "cuda":
        torch.cuda.empty_cache()
    return rows


def part_allgather(rank, world, args, median_ms) -> list[dict]:
    import torch.distributed as dist

    from minimax_backend.kernels.fp8 import quantize_fp8_reference
    from minimax_backend.kernels.norm_quant import rms_norm_reference
    from minimax_backend.kernels.norm_quant_triton import quantize_fp8_triton, rms_norm_quant_fp8_triton

    groups = HIDDEN // GROUP
    norm = torch.compile(lambda h, w: rms_norm_reference(h, w, EPS, True), dynamic=True)
    quant = torch.compile(lambda y: quantize_fp8_reference(y, GROUP), dynamic=True)

    def gather(t):
        out = t.new_empty((t.shape[0] * world, *t.shape[1:]))
        dist.all_gather_into_tensor(out, t)
        return out

    def mmajor(s):
        return s.t().contiguous().t()  # what the cuBLAS GEMM wants (kernels/fp8_gemm_cuda.py)

    rows = []
    for m in args.ag_m:
        shard = m // world
        g = _gen(rank * 1000 + m)
        x = torch.randn(shard, HIDDEN, device=DEV, generator=g).to(torch.bfloat16)
        res = torch.randn(shard, HIDDEN, device=DEV, generator=g).to(torch.bfloat16)
        w = (torch.randn(HIDDEN, device=DEV, generator=_gen(0)) * 0.1
             ).to(torch.bfloat16)

        def bf16_path():
            y = norm(x + res, w)
            q, s = quant(gather(y))
            return q, mmajor(s)

        def bf16_tq_path():  # the same, quantized by our Triton kernel
            y = norm(x + res, w)
            q, s = quantize_fp8_triton(gather(y), GROUP)
            return q, mmajor(s)

        def fp8_path():
            q, s, _, _ = rms_norm_quant_fp8_triton(x, res, w, EPS, True, GROUP, False)
            qf = gather(q.view(torch.uint8)).view(torch.float8_e4m3fn)
            return qf, mmajor(gather(s))

        def packed_path():
            q, s, _, _ = rms_norm_quant_fp8_triton(x, res, w, EPS, True, GROUP, False)
            buf = torch.cat([q.view(torch.uint8), s.view(torch.uint8)], dim=1)
            full = gather(buf)
            qf = full[:, :HIDDEN].contiguous().view(torch.float8_e4m3fn)
            sf = full[:, HIDDEN:].contiguous().view(torch.float32)
            return qf, mmajor(sf)

        q_ref, s_ref = bf16_path()
        q_fp8, s_fp8 = fp8_path()
        q_pk, s_pk = packed_path()
        row = {"M_total": m, "shard": shard}
        # same data through all three (the BF16 path's norm is Inductor's: compare the FP8 paths to each other)
        row["fp8_eq_packed"] = bool(torch.equal(q_fp8.view(torch.uint8), q_pk.view(torch.uint8))
                                    and torch.equal(s_fp8, s_pk))
        row["fp8_vs_bf16_equal_frac"] = float((q_fp8.view(torch.uint8) == q_ref.view(torch.uint8)).float().mean())
        for name, fn in (("bf16", bf16_path), ("bf16_tq", bf16_tq_path), ("fp8", fp8_path), ("packed", packed_path)):
            row[f"{name}_ms"] = median_ms(fn, args.warmup, args.repeats, dist.barrier)
        y = torch.empty(shard, HIDDEN, device=DEV, dtype=torch.bfloat16)
        qb = torch.empty(shard, HIDDEN, device=DEV, dtype=torch.uint8)
        sb = torch.empty(shard, groups, device=DEV, dtype=torch.float32)
        row["ag_bf16_ms"] = median_ms(lambda: gather(y), args.warmup, args.repeats, dist.barrier)
        row["ag_fp8_scales_ms"] = median_ms(lambda: (gather(qb), gather(sb)), args.warmup, args.repeats, dist.barrier)
        row["ag_bytes_ratio"] = (qb.numel() + sb.numel() * 4) / (y.numel() * 2)
        row["speedup_fp8"] = row["bf16_ms"] / row["fp8_ms"]
        row["speedup_fp8_vs_tq"] = row["bf16_tq_ms"] / row["fp8_ms"]
        row["speedup_packed"] = row["bf16_ms"] / row["packed_ms"]
        rows.append(row)
    return rows


def job(rank: int, world: int, args) -> None:
    import torch.distributed as dist

    from minimax_backend.tools.bench_common import graph_median_ms, median_ms, print_table, write_json

    import warnings

    warnings.filterwarnings("ignore", category=FutureWarning)  # all_gather_into_tensor is "deprecated" in 2.13
    global DEV, GEMM_SHAPES, SWEEP_WARPS, SWEEP_ROWS
    kernel_ms = median_ms
    if args.graphs:  # single-GPU parts: CUDA-graph replays (a Python launch is as long as the kernel)
        def kernel_ms(fn, warmup, repeats):
            return graph_median_ms(fn, 10, warmup, repeats)
    if args.dry_run:
        DEV, median_ms = "cpu", _wall_ms
        kernel_ms = _wall_ms
        GEMM_SHAPES = ((384, 512, "qkv"), (512, 256, "o_proj"))
        SWEEP_WARPS, SWEEP_ROWS = (4,), (1, 4)  # the interpreter ignores warps; each config is seconds there

    torch._dynamo.config.cache_size_limit = 64
    t0 = time.time()
    payload = {"benchmark": "norm_quant", "hidden": HIDDEN, "group": GROUP,
               "timing": "CUDA-graph replays of 10 back-to-back calls" if args.graphs else "one launch per timing"}
    if rank == 0:
        bw = _bandwidth_gbs(median_ms)
        payload["copy_bandwidth_GBs"] = bw
        print(f"device-to-device copy bandwidth: {bw:.0f} GB/s (the 100% of 'bw_frac')", flush=True)
        if "kernel" in args.parts:
            rows = part_kernel(args, kernel_ms, bw)
            payload["kernel"] = rows
            print_table(rows, ["M", "MB_moved", "fused_ms", "fused_best_ms", "best_warps", "best_rows", "best_split", "eager_ms", "inductor_ms",
                               "fused_bw_frac", "inductor_bw_frac", "speedup_vs_eager", "speedup_vs_inductor",
                               "scales_equal", "fp8_equal_frac", "other_layout_fp8_equal_frac"],
                        title=f"residual add + Gemma RMSNorm + FP8 quant, hidden {HIDDEN}, G {GROUP}, "
                              f"medians of {args.repeats}")
        if "gemm" in args.parts:
            rows = part_gemm(args, kernel_ms)
            payload["gemm"] = rows
            print_table(rows, ["shape", "M", "N", "K", "bf16_ms", "scaled_mm_ms", "triton_ms", "bf16_TFLOPs",
                               "scaled_mm_TFLOPs", "triton_TFLOPs", "scaled_mm_speedup", "triton_speedup",
                               "scaled_mm_max_rel_err"],
                        title="FP8 block-scaled GEMM vs BF16 GEMM")
    if world > 1:
        dist.barrier()  # rank 1 waits here while rank 0 runs the single-GPU parts
        if "allgather" in args.parts:
            rows = part_allgather(rank, world, args, median_ms)
            payload["allgather"] = rows
            if rank == 0:
                print_table(rows, ["M_total", "shard", "bf16_ms", "bf16_tq_ms", "fp8_ms", "packed_ms", "speedup_fp8",
                                   "speedup_fp8_vs_tq",
                                   "speedup_packed", "ag_bf16_ms", "ag_fp8_scales_ms", "ag_bytes_ratio",
                                   "fp8_eq_packed", "fp8_vs_bf16_equal_frac"],
                            title=f"shard -> GEMM-ready FP8 of all tokens on {world} GPUs (NCCL), hidden {HIDDEN}")
    elif "allgather" in args.parts:
        payload["allgather"] = "skipped: needs 2 GPUs (run on nvidia-h200-x2)"
        print("allgather part skipped: needs 2 GPUs", flush=True)
    if rank == 0:
        payload["seconds"] = time.time() - t0
        if args.json:
            write_json(args.json, payload)
        print(f"done in {payload['seconds']:.0f} s", flush=True)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--m", type=int, nargs="+", default=M_LIST, help="token counts for the kernel table")
    p.add_argument("--gemm-m", type=int, nargs="+", default=[128, 1024, 4096, 16384])
    p.add_argument("--ag-m", type=int, nargs="+", default=[1024, 4096, 16384], help="total tokens (all ranks)")
    p.add_argument("--parts", nargs="+", default=["kernel", "gemm", "allgather"],
                   choices=["kernel", "gemm", "allgather"])
    p.add_argument("--gpus", type=int, default=None, help="default: 2 when visible, else 1")
    p.add_argument("--static-inductor", action="store_true", help="recompile Inductor per M (slower to run)")
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--repeats", type=int, default=20)
    p.add_argument("--json", default="bench_norm_quant.json")
    p.add_argument("--dry-run", action="store_true", help="check the script on the CPU (see above)")
    p.add_argument("--no-graphs", dest="graphs", action="store_false",
                   help="time single launches instead of CUDA-graph replays (includes the host's launch time)")
    args = p.parse_args(argv)
    from minimax_backend.tools.launch import run_on_ranks

    from minimax_backend.tools.bench_common import require_device

    require_device(args.dry_run)
    if args.dry_run:
        args.m, args.gemm_m, args.ag_m, args.warmup, args.repeats = [3], [5], [6], 1, 2
        run_on_ranks(job, 2 if "allgather" in args.parts else 1, "cpu", args)
        return
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")  # NVLink multicast stays off on the lent boxes
    world = args.gpus or (2 if torch.cuda.device_count() >= 2 and "allgather" in args.parts else 1)
    run_on_ranks(job, world, "cuda", args)


if __name__ == "__main__":
    main()
