"""All-reduce + residual add + RMSNorm + FP8 quantization: the one-kernel path against NCCL + our norm kernel.

    python -m minimax_backend.tools.bench_allreduce_norm --tp 2 --json ar_norm.json      # nvidia-h200-x2
    python -m minimax_backend.tools.bench_allreduce_norm --device cpu --tp 2 --tokens 3   # smoke run (gloo)

One op, `minimax::allreduce_rms_norm_quant` (kernels/allreduce_norm.py), at
M3's width (hidden 6144, BF16 partial sums, Gemma norm, a residual, 1 x 128
FP8 groups), decode and small-prefill token counts. Variants, on the same
inputs on every rank:

    unfused   the default: NCCL all-reduce, then minimax::rms_norm_quant_fp8
              (one Triton kernel: add, norm, quantization)
    fused     kernel option allreduce_norm=symm_mem: copy into symmetric memory,
              barrier, one Triton kernel that sums every rank's partial and does
              the add, the norm and the quantization, barrier
              (kernels/allreduce_norm_cuda.py); GPUs only
    allreduce the NCCL all-reduce alone: what the unfused path pays before its
              norm, and the bar the fused one must get under

Each is a CUDA graph of --calls back-to-back calls, replayed (all ranks start
together); medians of --repeats, per call. Columns: microseconds, fused over
unfused, fused over the all-reduce alone, the bytes one rank reads over
NVLink in the one-shot fused path ((ranks - 1) partials) over that time, and
the largest difference of the fused outputs from the unfused ones (the FP8
rows dequantized, relative to their largest value; FP8 bytes that differ). Target
(issue 20): fused >= 1.5x over unfused at <= 64 tokens. The result sets
`allreduce_fusion_max_tokens` and whether `auto` turns the pass on.
On the CPU only `unfused` and `allreduce` run (gloo); `fused` is reported
as not run, with the reason.
"""

from __future__ import annotations

import argparse
import os

import torch
import torch.distributed as dist

DEFAULT_TOKENS = [1, 2, 4, 8, 16, 32, 64, 128, 256, 512]


def _inputs(rank: int, tokens: int, hidden: int, device: torch.device):
    g = torch.Generator(device).manual_seed(1000 * rank + tokens)
    x = torch.randn(tokens, hidden, device=device, generator=g).to(torch.bfloat16)
    residual = (torch.randn(tokens, hidden, device=device, generator=g) * 4).to(torch.bfloat16)
    weight = (torch.randn(hidden, device=device, generator=torch.Generator(device).manual_seed(7)) * 0.1
              ).to(torch.bfloat16)
    return x, residual, weight


def _timer(device: torch.device, calls: int, warmup: int, repeats: int):
    from minimax_backend.tools.bench_common import graphed, median_ms

    def time_us(fn) -> float:
        if device.type != "cuda":
            return median_ms(fn, warmup, repeats, dist.barrier) * 1e3
        replay = graphed(fn, calls, before_capture=dist.barrier, capture_error_mode="thread_local")
        return median_ms(replay, warmup, repeats, dist.barrier) * 1e3 / calls

    return time_us


def _differences(fused, unfused, group_size: int = 128) -> dict:
    """How far the fused outputs are from the unfused ones: the FP8 rows dequantized (relative to
    their largest value), FP8 bytes that differ, and whether scales and the new residual are equal."""
    q_f, s_f, _, r_f = fused
    q_u, s_u, _, r_u = unfused

    def dequantized(q, scales):
        return q.float() * scales.repeat_interleave(group_size, dim=1)

    want = dequantized(q_u, s_u)
    return {"fp8_max_rel_diff": ((dequantized(q_f, s_f) - want).abs().max() / want.abs().max()).item(),
            "fp8_bytes_differing": int((q_f.view(torch.uint8) != q_u.view(torch.uint8)).sum().item()),
            "scales_equal": bool(torch.equal(s_f, s_u)), "residual_equal": bool(torch.equal(r_f, r_u))}


def job(rank: int, world: int, args) -> None:
    import minimax_backend.kernels  # noqa: F401  (registers the ops)
    from minimax_backend.kernels.options import override_kernel_options
    from minimax_backend.tools.bench_common import print_table, write_json

    device = torch.device("cuda", torch.cuda.current_device()) if args.device == "cuda" else torch.device("cpu")
    group = dist.group.WORLD.group_name
    op = torch.ops.minimax.allreduce_rms_norm_quant
    c10d = torch.ops._c10d_functional
    time_us = _timer(device, args.calls, args.warmup, args.repeats)
    fused_why = None if device.type == "cuda" else "the symmetric-memory path needs CUDA GPUs"
    rows = []
    for tokens in args.tokens:
        x, residual, weight = _inputs(rank, tokens, args.hidden, device)
        call = (x, residual, weight, 1e-6, True, 128, False, world, group)
        row = {"tokens": tokens}
        with torch.no_grad():
            with override_kernel_options(allreduce_norm="unfused"):
                unfused_out = op(*call)
                row["unfused_us"] = time_us(lambda: op(*call))
            row["allreduce_us"] = time_us(lambda: c10d.wait_tensor(c10d.all_reduce(x, "sum", group)))
            if fused_why is None:
                with override_kernel_options(allreduce_norm="symm_mem"):
                    fused_out = op(*call)  # the first call sets up the symmetric buffers (before capture)
                    row.update(_differences(fused_out, unfused_out))
                    row["fused_us"] = time_us(lambda: op(*call))
                row["fused_x_vs_unfused"] = row["unfused_us"] / row["fused_us"]
                row["fused_x_vs_allreduce"] = row["allreduce_us"] / row["fused_us"]
                peer_bytes = (world - 1) * x.numel() * x.element_size()
                row["fused_peer_gbs"] = peer_bytes / (row["fused_us"] * 1e-6) / 1e9
            else:
                row["fused_us"] = None
        rows.append(row)
        if rank == 0:
            print(f"[bench_allreduce_norm] {tokens} tokens: " + ", ".join(
                f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in row.items() if k != "tokens"),
                flush=True)
    if rank == 0:
        cols = ["tokens", "unfused_us", "fused_us", "allreduce_us", "fused_x_vs_unfused", "fused_x_vs_allreduce",
                "fused_peer_gbs", "fp8_max_rel_diff", "fp8_bytes_differing"]
        table = print_table(rows, [c for c in cols if any(c in r for r in rows)],
                            title=f"all-reduce + add + RMSNorm + FP8, TP {world}, hidden {args.hidden}, "
                                  f"us per call (medians of {args.repeats})")
        if fused_why:
            print(f"fused: not run ({fused_why})")
        if args.json:
            write_json(args.json, {"benchmark": "allreduce_norm", "tp": world, "hidden": args.hidden,
                                   "device": str(device), "fused_not_run": fused_why, "calls": args.calls,
                                   "rows": rows, "table": table})


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tp", type=int, default=2, help="ranks (GPUs); 2 on nvidia-h200-x2")
    p.add_argument("--tokens", type=int, nargs="+", default=DEFAULT_TOKENS)
    p.add_argument("--hidden", type=int, default=6144)
    p.add_argument("--calls", type=int, default=10, help="calls per CUDA graph")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--repeats", type=int, default=20)
    p.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    p.add_argument("--json")
    args = p.parse_args(argv)
    if args.tp < 2:
        raise SystemExit("--tp must be at least 2: the op is an all-reduce across ranks")
    if min(args.tokens) < 1 or args.hidden % 128:
        raise SystemExit("--tokens must be >= 1 and --hidden a multiple of 128 (the FP8 group)")
    if args.device == "cuda" and torch.cuda.device_count() < args.tp:
        raise SystemExit(f"--tp {args.tp} needs {args.tp} CUDA GPUs, this machine has {torch.cuda.device_count()} "
                         "(use --device cpu for a smoke run)")
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")  # NVLink multicast stays off on the lent boxes
    os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")
    from minimax_backend.tools.launch import run_on_ranks

    run_on_ranks(job, args.tp, args.device, args)


if __name__ == "__main__":
    main()
