"""The ceiling of the MoE GEMMs' load structure: an expert stack's FP8 weights streamed through a
TMA ring by one producer warp per program, no math (one Hopper GPU, ~1 minute).

    python -m minimax_backend.tools.bench_weight_stream --json stream.json

kernels/moe_weight_stream.py reads M3's gate/up weights (128 experts x [6144, 6144] FP8, 4.8 GB)
in [128, 128] tiles walking K, as the 192-row gate/up loads them, each stage with 0-3 64-row
activation tiles that 24 consecutive weight slabs share (from the L2 after the first), and
releases each stage as it lands. Per ring depth, activation tiles a stage and programs per SM:
the time, the weights' rate and its fraction of the same run's copy bandwidth (a device copy of
1 GiB: bytes read and written per second, as the other benchmarks' weight-read floors use; a
stream that only reads runs a little above it). A GEMM kernel with the same stage structure cannot stream its weights faster
than its row here; how far below it runs is the cost of its math and epilogue
(docs/kernel-notes.md#what-the-gateups-loads-can-stream). Rings that do not fit an SM's shared
memory are listed as skipped, not run.
"""

from __future__ import annotations

import argparse
from itertools import product

import torch

from minimax_backend.kernels import moe_weight_stream as ws


def _rings(stages: list[int], a_tiles: list[int], programs: list[int]) -> tuple[list[tuple], list[str]]:
    """The (a_tiles, stages, programs per SM) to run, and a line for each one that does not fit."""
    run, skipped = [], []
    for a, s, p in product(a_tiles, stages, programs):
        try:
            ws.check_ring(s, a, p)
        except ValueError as exc:
            skipped.append(str(exc))
            continue
        run.append((a, s, p))
    return run, skipped


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--stages", type=int, nargs="+", default=[2, 3, 4, 5, 6, 8])
    p.add_argument("--a-tiles", type=int, nargs="+", default=[0, 2, 3],
                   help="64-row activation tiles a stage (the gate/up at ~128 rows per expert loads 2-3)")
    p.add_argument("--programs-per-sm", type=int, nargs="+", default=[1],
                   help="2 moved no ring by more than 3%% on an H100 (2026-12-07)")
    p.add_argument("--experts", type=int, default=128)
    p.add_argument("--rows", type=int, default=6144, help="weight rows per expert (M3's gate/up: 2 x 3072)")
    p.add_argument("--k", type=int, default=6144, help="weight columns (M3's hidden size)")
    p.add_argument("--repeats", type=int, default=15)
    p.add_argument("--json")
    args = p.parse_args(argv)
    if args.rows % 128 or args.k % 128 or args.experts < 1:
        raise SystemExit(f"--rows {args.rows} and --k {args.k} must be multiples of 128, --experts at least 1")
    device = torch.device("cuda")
    if not torch.cuda.is_available() or not ws.gluon_available(device):
        raise SystemExit("bench_weight_stream needs triton's Gluon and an sm_90 GPU (H100 / H200)")
    rings, skipped = _rings(args.stages, args.a_tiles, args.programs_per_sm)
    for line in skipped:
        print("skipped:", line, flush=True)
    if not rings:
        raise SystemExit("no ring of the given sizes fits an SM's shared memory")

    from minimax_backend.tools.bench_common import copy_bandwidth_gbs, median_ms, print_table, write_json

    g = torch.Generator(device=device).manual_seed(0)
    w = torch.randint(0, 256, (args.experts * args.rows, args.k), generator=g, dtype=torch.uint8, device=device)
    w = w.view(torch.float8_e4m3fn)
    rows = torch.randint(0, 256, (16 * ws.ROWS_PER_BLOCK, args.k), generator=g, dtype=torch.uint8, device=device)
    rows = rows.view(torch.float8_e4m3fn)
    copy_gbs = copy_bandwidth_gbs(device)
    results = []
    for i, (a, s, prog) in enumerate(rings):
        ms = median_ms(lambda: ws.stream_weights(w, rows, s, a, prog), warmup=3, repeats=args.repeats)
        gbs = w.numel() / ms / 1e6
        results.append({"a_tiles": a, "stages": s, "programs_per_sm": prog,
                        "shared_kb": ws.ring_shared_bytes(s, a) // 1024, "us": ms * 1e3, "weights_gbs": gbs,
                        "of_copy": gbs / copy_gbs})
        print(f"[{i + 1}/{len(rings)}] a_tiles {a} stages {s} programs/SM {prog}: {ms * 1e3:.0f} us", flush=True)
    print_table(results, ["a_tiles", "stages", "programs_per_sm", "shared_kb", "us", "weights_gbs", "of_copy"],
                title=f"weights {w.numel() / 1e9:.2f} GB through the ring; copy bandwidth {copy_gbs:.0f} GB/s "
                      f"(median of {args.repeats})")
    if args.json:
        write_json(args.json, {"benchmark": "weight_stream", "weight_bytes": w.numel(), "copy_gbs": copy_gbs,
                               "args": vars(args), "skipped": skipped, "rows": results})


if __name__ == "__main__":
    main()
