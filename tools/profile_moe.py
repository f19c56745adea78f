"""Where the time of one MoE layer goes: kernels per call and their times (one device).

    python -m minimax_backend.tools.profile_moe --tokens 1 64 --json moe_profile.json    # one H200, FP8
    python -m minimax_backend.tools.profile_moe --device cpu --preset tiny-m3 --tokens 3 # smoke run

The layer is bench_moe's (preset `m3`: 128 experts, top-4, hidden 6144, FP8
or BF16 random weights) run as minimax::mega_moe on one device. On the GPU
the call is captured in a CUDA graph (as the backend runs it) and
torch.profiler records `--calls` replays; per kernel name: time per call,
launches per call and share of the kernel time. Also printed: the replay's
median time, the sum of kernel times (the rest is the gaps between kernels)
and the kernel count per call. At decode sizes this says whether launches
or the grouped GEMMs dominate (one H200, 1 token FP8, 2026-11-30: 120
kernels, GEMMs 141 of 288 us at first; 11 kernels, GEMMs 82 of 115 us after
the decode kernels; README "MoE layer"). The kernel switches
(kernels/options.py: MINIMAX_MOE_ALIGN, MINIMAX_MOE_ROUTE, MINIMAX_MOE_SHARED,
MINIMAX_MOE_TILES, ...; read once, when the process starts using the
kernels) apply, so a change can be compared in one call. On sm_90 the decode
kernels are programmatic dependent launches (moe_overlap=auto): each kernel's
span then starts while its predecessor runs and includes the wait, so the spans
overlap and their sum exceeds the call; MINIMAX_MOE_OVERLAP=off gives each
kernel's own time.

On the CPU (no graphs) the profiler records CPU ops instead; the numbers
only check the script.
"""

from __future__ import annotations

import argparse

import torch


def profile_tokens(w_args, hidden: int, tokens: int, calls: int, top: int, device: torch.device) -> dict:
    from minimax_backend.tools.bench_common import graphed, kernel_profile, median_ms, top_kernels

    x = torch.randn(tokens, hidden, device=device, generator=torch.Generator(device).manual_seed(tokens))
    x = x.to(torch.bfloat16)
    sp = ("", 1, False, False, tokens, "allgather")  # one device: the block on its tokens

    def ours():
        return torch.ops.minimax.mega_moe(x, *w_args, *sp)

    ours()
    run = graphed(ours) if device.type == "cuda" else ours
    call_ms = median_ms(run, 3, 10)
    kernels, total_us = kernel_profile(run, calls, device)
    return {
        "tokens": tokens,
        "call_us": call_ms * 1e3,
        "kernel_us_per_call": total_us / calls,
        "kernels_per_call": sum(n for _, n in kernels.values()) / calls,
        "top": top_kernels(kernels, total_us, calls, top),
    }


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", type=int, nargs="+", default=[1, 64])
    p.add_argument("--precision", choices=["fp8", "bf16"], default="fp8")
    p.add_argument("--preset", default="m3")
    p.add_argument("--calls", type=int, default=5, help="profiled calls per token count")
    p.add_argument("--top", type=int, default=15, help="kernel names listed per token count")
    p.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    p.add_argument("--json")
    args = p.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda needs a CUDA GPU (use --device cpu --preset tiny-m3 for a smoke run)")
    if min(args.tokens) < 1 or args.calls < 1:
        raise SystemExit("--tokens and --calls must be at least 1")

    import minimax_backend.kernels  # noqa: F401  (registers the ops)
    from minimax_backend.kernels.moe import block_op_args
    from minimax_backend.tools.bench_common import print_table, write_json
    from minimax_backend.tools.bench_moe import build_block

    device = torch.device("cuda", torch.cuda.current_device()) if args.device == "cuda" else torch.device("cpu")
    cfg, blk = build_block(args.preset, 0, 1, args.precision == "fp8", device)
    w_args = block_op_args(blk)
    results = []
    for tokens in args.tokens:
        r = profile_tokens(w_args, cfg.hidden_size, tokens, args.calls, args.top, device)
        results.append(r)
        print(f"\n== {args.precision} {tokens} tokens: call {r['call_us']:.1f} us, kernels "
              f"{r['kernel_us_per_call']:.1f} us in {r['kernels_per_call']:.0f} launches per call", flush=True)
        print_table(r["top"], ["us_per_call", "launches_per_call", "share", "name"])
        if r["kernel_us_per_call"] > r["call_us"]:
            print("(the kernels' spans overlap: programmatic dependent launches, moe_overlap=auto; "
                  "MINIMAX_MOE_OVERLAP=off for each kernel's own time)", flush=True)
    if args.json:
        write_json(args.json, {"benchmark": "moe_profile", "preset": args.preset, "precision": args.precision,
                               "device": str(device), "calls": args.calls,
                               "call_us_is": "median of 10 timed calls (CUDA-graph replays on a GPU)",
                               "results": results})


if __name__ == "__main__":
    main()
