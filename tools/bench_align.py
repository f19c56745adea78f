"""The MoE's expert alignment (pairs sorted by expert, runs padded to BLOCK_M) per form and size (one GPU, ~1 minute).

    python -m minimax_backend.tools.bench_align --json align.json

M3's routing: 128 experts, top-4 + the shared expert's slot (5 pairs a token), random choices.
Columns, us per alignment (CUDA-graph replays of back-to-back calls):

  torch        kernels/moe_triton.py:align_by_expert, the torch sort (~15-40 small kernels)
  one_program  kernels/moe_align_triton.py:align_by_expert_triton, every pair in one program
               (up to MAX_PAIRS pairs)
  chunks_N     align_by_expert_chunked with N pairs a chunk (two launches)
  default      what the MoE op takes (moe_align=triton: align_with_triton)

Every form's three tensors are compared with the torch path's element for element; a
difference is an error, not a column.

`TRITON_INTERPRET=1 python -m minimax_backend.tools.bench_align --dry-run` runs every code path
on the CPU (Triton interpreter, small sizes, host clock) to check the script; its numbers mean
nothing.
"""

from __future__ import annotations

import argparse

import torch

# 102 / 103 tokens: 510 / 515 pairs, either side of ONE_PROGRAM_PAIRS; 204 / 205: either side of
# its earlier 1024; 819: 4095 pairs, the one program's largest
TOKENS = (1, 16, 64, 102, 103, 128, 204, 205, 512, 819, 2048, 8192, 16384)
CHUNKS = (256, 512, 1024, 2048)


def _timed_us(fn, device) -> float:
    from minimax_backend.tools.bench_common import graph_median_ms, median_ms

    fn()  # compile outside the capture
    if device.type != "cuda":
        return median_ms(fn, warmup=0, repeats=1) * 1e3
    return graph_median_ms(fn, calls=20) * 1e3


def _routing(tokens: int, experts: int, top_k: int, device) -> torch.Tensor:
    """[tokens, top_k + 1] expert ids: top_k distinct routed experts, then the shared slot (id `experts`)."""
    g = torch.Generator(device=device).manual_seed(tokens)
    routed = torch.rand(tokens, experts, generator=g, device=device).topk(top_k, dim=1).indices
    shared = torch.full((tokens, 1), experts, device=device, dtype=routed.dtype)
    return torch.cat([routed, shared], 1).to(torch.int32)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", type=int, nargs="+", default=list(TOKENS))
    p.add_argument("--experts", type=int, default=128)
    p.add_argument("--top-k", type=int, default=4)
    p.add_argument("--chunks", type=int, nargs="+", default=list(CHUNKS), help="pairs per chunk to time")
    p.add_argument("--block-m", type=int, default=0,
                   help="rows a run is padded to (0: 64, or 192 from 4096 tokens on, as the FP8 prefill tiles)")
    p.add_argument("--dry-run", action="store_true", help="check the script on the CPU (see above)")
    p.add_argument("--json")
    args = p.parse_args(argv)
    from minimax_backend.tools.bench_common import require_device

    require_device(args.dry_run)
    if args.dry_run:
        args.tokens = [t for t in args.tokens if t <= 64][:2] or [13]
        args.chunks = [c for c in args.chunks if c <= 64] or [32]
    bad = [c for c in args.chunks if c <= 0 or c & (c - 1)]
    if bad:
        raise SystemExit(f"--chunks must be powers of two, got {bad}")
    from minimax_backend.kernels import moe_align_triton as al
    from minimax_backend.kernels.moe_triton import align_by_expert
    from minimax_backend.tools.bench_common import print_table, write_json

    device = torch.device("cpu" if args.dry_run else "cuda")
    e, rows = args.experts, []
    for t in args.tokens:
        ids = _routing(t, e, args.top_k, device)
        pairs = ids.numel()
        bm = args.block_m or (192 if t >= 4096 else 64)
        forms = {"torch": lambda: align_by_expert(ids, 0, e, bm, e)}
        if al.align_fits(pairs):
            forms["one_program"] = lambda: al.align_by_expert_triton(ids, 0, e, bm, e)
        for c in args.chunks:
            forms[f"chunks_{c}"] = lambda c=c: al.align_by_expert_chunked(ids, 0, e, bm, e, chunk=c)
        forms["default"] = lambda: al.align_with_triton(ids, 0, e, bm, e)
        want = align_by_expert(ids, 0, e, bm, e)
        want = (want.sorted_pair, want.block_expert, want.pair_row)
        row = {"tokens": t, "pairs": pairs, "block_m": bm,
               "default_form": "one_program" if pairs <= al.ONE_PROGRAM_PAIRS else f"chunks_{al.chunk_pairs(pairs)}"}
        for name, fn in forms.items():
            out = fn()
            got = (out.sorted_pair, out.block_expert, out.pair_row) if name == "torch" else out
            for a, b, what in zip(got, want, ("sorted_pair", "block_expert", "pair_row")):
                if not torch.equal(a, b):
                    raise SystemExit(f"{name} at {t} tokens: its {what} differs from the torch path's")
            row[f"{name}_us"] = _timed_us(fn, device)
        row["default_x_vs_torch"] = row["torch_us"] / row["default_us"]
        rows.append(row)
        print_table([row], list(row), title=f"{t} tokens")
        if args.json:  # after every size: a run cut short keeps what it measured
            write_json(args.json, {"benchmark": "moe_align", "experts": e, "top_k": args.top_k, "rows": rows})
    cols = ["tokens", "pairs", "block_m", "torch_us", "one_program_us", *[f"chunks_{c}_us" for c in args.chunks],
            "default_us", "default_form", "default_x_vs_torch"]
    print_table(rows, cols, title=f"\nexpert alignment, {e} experts, top {args.top_k} + the shared slot: "
                                  "us per call (CUDA graphs); every form equal to the torch path")


if __name__ == "__main__":
    main()
