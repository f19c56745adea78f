"""The MoE router's float32 logits at prefill sizes, against cuBLAS and the GEMM limit (one GPU, ~1 minute).

    python -m minimax_backend.tools.bench_router --json router.json [--sweep]

M3's router: bf16 rows [T, 6144] times the float32 gate [128, 6144], float32 logits (model/moe.py).
Columns, us per call (CUDA-graph replays of back-to-back calls):

  cublas      F.linear(x.float(), w), what the model writes: a cast of the rows to float32,
              then cuBLAS's float32 GEMM (the path above 16 rows until 2026-12-04)
  three_bf16  kernels/moe_route_triton.py:logits_three_bf16, the default above 16 rows (bf16
              rows): three bf16 tensor-core products of the exactly split weight, K split
              into `splits` shares where the row blocks alone would leave SMs idle
  limit       one plain bf16 torch.mm of the same rows by a [6144, 3 x 128] matrix: the same
              products in one cuBLAS GEMM (bf16 out), the rate this card gives such a GEMM
  floor       the rows' bf16 bytes at the copy bandwidth measured in this run

and the numerics on trained-like inputs (rows of unit RMS, the gate scaled by 1/sqrt(hidden), a
correction bias of spread 0.1): each path's largest |logit - float64| over the largest |logit|,
and the fraction of tokens whose top-k experts (sigmoid + bias, as the model chooses) equal those
of the float64 logits. --sweep also times a grid of the kernel's tiles.

`TRITON_INTERPRET=1 python -m minimax_backend.tools.bench_router --dry-run` runs every code path
on the CPU (Triton interpreter, small shapes, host clock) to check the script; its numbers mean
nothing.
"""

from __future__ import annotations

import argparse
import itertools

import torch
import torch.nn.functional as F

TOKENS = (17, 64, 512, 2048, 4096, 8192, 16384)
SWEEP = {"BM": (64, 128), "BN": (128,), "BK": (64, 128), "warps": (4, 8), "stages": (2, 3, 4)}


def _timed_us(fn, device) -> float:
    from minimax_backend.tools.bench_common import graph_median_ms, median_ms

    fn()  # compile outside the capture
    if device.type != "cuda":
        return median_ms(fn, warmup=0, repeats=1) * 1e3
    return graph_median_ms(fn, calls=10) * 1e3


def _top_k_agreement(logits: torch.Tensor, want: torch.Tensor, bias: torch.Tensor, k: int) -> float:
    """Fraction of tokens whose chosen experts (top-k of sigmoid + bias) equal the float64 choice."""
    def chosen(lg):
        return (torch.sigmoid(lg.double()) + bias.double()).topk(k, dim=-1).indices.sort(dim=-1).values

    return (chosen(logits) == chosen(want)).all(dim=-1).double().mean().item()


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", type=int, nargs="+", default=list(TOKENS))
    p.add_argument("--hidden", type=int, default=6144)
    p.add_argument("--experts", type=int, default=128)
    p.add_argument("--top-k", type=int, default=4)
    p.add_argument("--sweep", action="store_true", help="also time a grid of the kernel's tiles")
    p.add_argument("--dry-run", action="store_true", help="check the script on the CPU (see above)")
    p.add_argument("--json")
    args = p.parse_args(argv)
    from minimax_backend.tools.bench_common import require_device

    require_device(args.dry_run)
    if args.dry_run:
        args.tokens, args.hidden, args.experts = [t for t in args.tokens if t <= 64][:2] or [17], 256, 16
    from minimax_backend.kernels.moe_route_triton import _sm_count, k_splits, logits_three_bf16, three_bf16_tiles
    from minimax_backend.tools.bench_common import copy_bandwidth_gbs, print_table, write_json

    device = torch.device("cpu" if args.dry_run else "cuda")
    h, e = args.hidden, args.experts
    gbs = copy_bandwidth_gbs(device)
    print(f"copy bandwidth {gbs:.0f} GB/s; router [{e}, {h}] float32, top {args.top_k}", flush=True)
    g = torch.Generator(device=device).manual_seed(0)
    w = torch.randn(e, h, generator=g, device=device) * h ** -0.5
    bias = torch.randn(e, generator=g, device=device) * 0.1
    w3 = torch.randn(h, 3 * e, generator=g, device=device, dtype=torch.bfloat16)
    grid = list(itertools.product(*SWEEP.values()))
    rows, sweep_rows = [], []
    for t in args.tokens:
        x = torch.randn(t, h, generator=g, device=device).to(torch.bfloat16)
        want = x.double() @ w.double().T
        row = {"tokens": t, "tiles": list(three_bf16_tiles(t)),
               "splits": k_splits(t, e, h, three_bf16_tiles(t), _sm_count(device)),
               "floor_us": t * h * 2 / gbs / 1e3}
        row["cublas_us"] = _timed_us(lambda: F.linear(x.float(), w), device)
        row["three_bf16_us"] = _timed_us(lambda: logits_three_bf16(x, w), device)
        if device.type == "cuda":
            row["limit_us"] = _timed_us(lambda: x @ w3, device)
            row["three_bf16_over_limit"] = row["three_bf16_us"] / row["limit_us"]
        row["speedup"] = row["cublas_us"] / row["three_bf16_us"]
        for name, got in (("cublas", F.linear(x.float(), w)), ("three_bf16", logits_three_bf16(x, w))):
            row[f"{name}_err"] = ((got.double() - want).abs().max() / want.abs().max()).item()
            row[f"{name}_topk_equal"] = _top_k_agreement(got, want, bias, args.top_k)
        if args.sweep:
            best = None
            for cfg in grid[:2] if args.dry_run else grid:
                try:
                    us = _timed_us(lambda: logits_three_bf16(x, w, cfg), device)
                except Exception as err:  # noqa: BLE001  (out of resources: recorded, not fatal)
                    sweep_rows.append({"tokens": t, "tiles": list(cfg), "error": str(err)[:120]})
                    continue
                sweep_rows.append({"tokens": t, "tiles": list(cfg), "us": us})
                if best is None or us < best[0]:
                    best = (us, list(cfg))
            row["sweep_best_us"], row["sweep_best_tiles"] = best
        rows.append(row)
        print_table([row], [c for c in row if not c.endswith("tiles")])
        if args.json:  # after every size: a run cut short keeps what it measured
            write_json(args.json, {"benchmark": "router_logits", "hidden": h, "experts": e, "top_k": args.top_k,
                                   "copy_gbs": gbs, "rows": rows,
                                   "sweep": sweep_rows})
    cols = ["tokens", "splits", "floor_us", "cublas_us", "three_bf16_us", "limit_us", "speedup", "three_bf16_over_limit",
            "cublas_err", "three_bf16_err", "cublas_topk_equal", "three_bf16_topk_equal"]
    print_table(rows, cols + (["sweep_best_us", "sweep_best_tiles"] if args.sweep else []),
                title=f"\nrouter logits [T, {h}] x [{e}, {h}]: us per call (CUDA graphs), errors against float64")


if __name__ == "__main__":
    main()
