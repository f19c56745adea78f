"""The FP8 block GEMMs of a decode step against the weight-read floor (one GPU, ~1 minute).

    python -m minimax_backend.tools.bench_fp8_decode_gemm --json fp8_decode_gemm.json [--sweep]

M3's decode GEMMs at TP 1 (hidden 6144; --tp divides them as the model does):
fused QKV, o_proj, the dense MLP's gate/up and down, at 1-64 rows. Columns, ms
per call (CUDA-graph replays of back-to-back calls, each on its own copy of
the weight so that no call finds its weight in L2):

  cublas     torch._scaled_mm blockwise, with the row padding and the scale
             relayout our op did around it (kernels/fp8_gemm_cuda.py)
  small_m    the Triton kernel for <= 64 rows (kernels/fp8_small_m_triton.py),
             its default config
  op         what minimax::fp8_block_gemm runs on CUDA now (the dispatch)
  floor      the weight's bytes at the copy bandwidth measured in this run
plus each one over the floor. --sweep also times every small-M config of a grid
(BLOCK_N, SPLIT_K, warps, stages) and reports the best per shape and rows.

`TRITON_INTERPRET=1 python -m minimax_backend.tools.bench_fp8_decode_gemm --dry-run`
runs every code path on the CPU (Triton interpreter, shapes divided by 24, host
clock; cuBLAS is reported as not run) to check the script; its numbers mean nothing.
"""

from __future__ import annotations

import argparse
import itertools

import torch

ROWS = (1, 2, 4, 8, 16, 32, 64)
SWEEP = {"block_n": (16, 32, 64, 128), "split_k": (1, 2, 4), "warps": (4,), "stages": (3, 4, 6)}
L2_CLEAR_BYTES = 256 << 20  # weight copies per shape: at least this many bytes, well past the 50 MB L2


def m3_shapes(tp: int) -> list[tuple[str, int, int]]:
    """(name, N, K) of M3's decode GEMMs at tensor parallelism tp."""
    hidden, heads, kv_heads, head_dim, dense_inter = 6144, 64, 4, 128, 12288
    return [("qkv", (heads + 2 * kv_heads) * head_dim // tp, hidden),
            ("o_proj", hidden, heads * head_dim // tp),
            ("dense_gate_up", 2 * dense_inter // tp, hidden),
            ("dense_down", hidden, dense_inter // tp)]


def _weights(n: int, k: int, device, seed: int):
    from minimax_backend.kernels.fp8 import quantize_weight_fp8

    g = torch.Generator(device=device).manual_seed(seed)
    copies = max(2, -(-L2_CLEAR_BYTES // (n * k))) if device.type == "cuda" else 2
    w, ws = quantize_weight_fp8(torch.randn(n, k, generator=g, device=device) * k**-0.5)
    return [(w.clone(), ws.clone()) for _ in range(copies)]


def _timed(make_call, weights, calls_per_graph: int = 12) -> float:
    """Median ms of one call, from graph replays of calls that cycle through the weight copies."""
    from minimax_backend.tools.bench_common import graphed, median_ms

    calls = iter(itertools.cycle(weights))

    def step():
        for _ in range(calls_per_graph):
            w, ws = next(calls)
            make_call(w, ws)

    make_call(*weights[0])  # compile / pick the layout outside the capture
    if not torch.cuda.is_available():  # --dry-run: the host clock, a call or two
        return median_ms(step, warmup=0, repeats=1) / calls_per_graph
    return median_ms(graphed(step), warmup=3, repeats=10) / calls_per_graph


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tp", type=int, default=1)
    p.add_argument("--rows", type=int, nargs="+", default=list(ROWS))
    p.add_argument("--sweep", action="store_true", help="also time every small-M config of the grid")
    p.add_argument("--sweep-rows", type=int, nargs="+", default=[1, 16], help="the row counts the sweep runs at")
    p.add_argument("--dry-run", action="store_true", help="check the script on the CPU (see above)")
    p.add_argument("--json")
    args = p.parse_args(argv)
    from minimax_backend.tools.bench_common import require_device

    require_device(args.dry_run)
    if args.dry_run:
        args.rows = [r for r in args.rows if r <= 16][:2]
    import minimax_backend.kernels  # noqa: F401  (registers the ops)
    from minimax_backend.kernels.fp8_gemm_cuda import fp8_block_gemm_scaled_mm
    from minimax_backend.kernels.fp8_small_m_triton import (SmallMConfig, fp8_small_m_gemm, small_m_config,
                                                            small_m_supports)
    from minimax_backend.tools.bench_common import copy_bandwidth_gbs, print_table, write_json

    device = torch.device("cpu" if args.dry_run else "cuda")
    gbs = copy_bandwidth_gbs(device)
    print(f"copy bandwidth {gbs:.0f} GB/s", flush=True)
    rows, sweep_rows = [], []
    shapes = m3_shapes(args.tp)
    if args.dry_run:  # the same GEMMs divided by 24 (K stays a multiple of 128)
        shapes = [(name, n // 24, max(128, k // 24 // 128 * 128)) for name, n, k in shapes]
    for si, (name, n, k) in enumerate(shapes):
        weights = _weights(n, k, device, seed=si)
        floor = n * k / gbs / 1e6  # FP8 bytes; the activations and scales are noise at these rows
        for m in args.rows:
            g = torch.Generator(device=device).manual_seed(m)
            xq, xs = torch.ops.minimax.quantize_fp8(torch.randn(m, k, generator=g, device=device), 128)
            row = {"gemm": name, "n": n, "k": k, "rows": m, "floor_ms": floor}
            if device.type == "cuda":
                row["cublas_ms"] = _timed(lambda w, ws: fp8_block_gemm_scaled_mm(xq, xs, w, ws, torch.bfloat16),
                                          weights)
            row["op_ms"] = _timed(lambda w, ws: torch.ops.minimax.fp8_block_gemm(xq, xs, w, ws, torch.bfloat16),
                                  weights)
            if small_m_supports(m, k, 128):
                cfg = small_m_config(n, k)
                row["small_m_config"] = list(cfg)
                row["small_m_ms"] = _timed(lambda w, ws: fp8_small_m_gemm(xq, xs, w, ws, torch.bfloat16, cfg),
                                           weights)
                if args.sweep and m in args.sweep_rows:
                    best = None
                    grid = list(itertools.product(*SWEEP.values()))
                    for bn, sk, wp, st in grid[:3] if args.dry_run else grid:
                        if (k // 128) % sk:
                            continue
                        c = SmallMConfig(bn, sk, wp, st)
                        try:
                            ms = _timed(lambda w, ws: fp8_small_m_gemm(xq, xs, w, ws, torch.bfloat16, c), weights)
                        except Exception as e:  # noqa: BLE001  (out of resources: recorded, not fatal)
                            sweep_rows.append({"gemm": name, "rows": m, "config": list(c), "error": str(e)[:120]})
                            continue
                        sweep_rows.append({"gemm": name, "rows": m, "config": list(c), "ms": ms})
                        if best is None or ms < best[0]:
                            best = (ms, list(c))
                    row["sweep_best_ms"], row["sweep_best_config"] = best
            for col in ("cublas", "small_m", "op", "sweep_best"):
                if f"{col}_ms" in row:
                    row[f"{col}_over_floor"] = row[f"{col}_ms"] / floor
            rows.append(row)
            print_table([row], [c for c in row if not c.endswith("config")])
        if args.json:  # after every shape: a run cut short keeps what it measured
            write_json(args.json, {"benchmark": "fp8_decode_gemm", "tp": args.tp, "copy_gbs": gbs, "rows": rows,
                                   "sweep": sweep_rows})
        del weights
        torch.cuda.empty_cache()
    cols = ["gemm", "rows", "floor_ms", "cublas_ms", "small_m_ms", "op_ms", "cublas_over_floor",
            "small_m_over_floor", "op_over_floor"] + (["sweep_best_ms", "sweep_best_config"] if args.sweep else [])
    print_table(rows, cols, title=f"\nFP8 block GEMM at decode rows, TP {args.tp}: ms per call (CUDA graphs)")


if __name__ == "__main__":
    main()
