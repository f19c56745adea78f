"""QK norm + RoPE of one attention layer: our kernel against stock torch.compile (one GPU, ~1 minute).

    python -m minimax_backend.tools.bench_norm_rope --json norm_rope.json

M3's attention at TP 1: 64 query heads and 4 KV heads of 128, RoPE on the first 64 dims, q and k
read as column slices of the QKV GEMM's [T, 9216] output. Per token count, us per layer (q and k,
CUDA-graph replays of back-to-back calls):

  inductor  the model's code (model/layers.py: RMSNorm per head, apply_rope) under torch.compile
  ours      minimax::rms_norm_rope on q and on k (kernels/norm_rope_triton.py)
  floor     the bytes either must move (q, k read and written; cos, sin read) at the copy
            bandwidth measured in the same run

Each output is compared with the model's eager code on the same GPU: the largest difference over
the largest value, and the fraction of equal values (Inductor keeps float32 where the model rounds
to bfloat16 between the norm and the rotation; ours rounds where the model does). --sweep also
times our kernel's launch choices (heads per program, warps) at each size.

`TRITON_INTERPRET=1 python -m minimax_backend.tools.bench_norm_rope --dry-run` runs every code path
on the CPU (Triton interpreter, small sizes, torch.compile with the eager backend) to check the
script; its numbers mean nothing.
"""

from __future__ import annotations

import argparse

import torch

TOKENS = (1, 64, 1024, 8192, 16384)
EPS = 1e-6


def _layer_inputs(t: int, heads: int, kv_heads: int, d: int, rotary: int, device, seed: int = 0):
    from minimax_backend.model.layers import rope_cos_sin

    g = torch.Generator(device=device).manual_seed(seed)
    qkv = torch.randn(t, (heads + 2 * kv_heads) * d, generator=g, device=device).to(torch.bfloat16)
    wq = (0.1 * torch.randn(d, generator=g, device=device)).to(torch.bfloat16)
    wk = (0.1 * torch.randn(d, generator=g, device=device)).to(torch.bfloat16)
    cos, sin = rope_cos_sin(torch.arange(t, device=device) + 1000, rotary, 5e6)
    return qkv, wq, wk, cos, sin


def _model_code(qkv, wq, wk, cos, sin, heads, kv_heads, d):
    """What the model runs between the QKV GEMM and the attention (model/layers.py)."""
    from minimax_backend.kernels.norm_quant import rms_norm_reference
    from minimax_backend.model.layers import apply_rope

    q, k, _ = qkv.split([heads * d, kv_heads * d, kv_heads * d], dim=-1)
    q, k = q.reshape(-1, heads, d), k.reshape(-1, kv_heads, d)
    return (apply_rope(rms_norm_reference(q, wq, EPS, True), cos, sin),
            apply_rope(rms_norm_reference(k, wk, EPS, True), cos, sin))


def _ours(qkv, wq, wk, cos, sin, heads, kv_heads, d):
    from minimax_backend.kernels.norm_rope_triton import rms_norm_rope_triton

    q, k, _ = qkv.split([heads * d, kv_heads * d, kv_heads * d], dim=-1)
    q, k = q.view(-1, heads, d), k.view(-1, kv_heads, d)
    # the op on the GPU; the kernel itself under --dry-run (the op's CPU kernel is the reference)
    op = torch.ops.minimax.rms_norm_rope if qkv.is_cuda else rms_norm_rope_triton
    return op(q, wq, cos, sin, EPS, True), op(k, wk, cos, sin, EPS, True)


def _errors(got: torch.Tensor, want: torch.Tensor) -> tuple[float, float]:
    """(largest |got - want| over the largest |want|, fraction of equal values)."""
    diff = (got.float() - want.float()).abs()
    return float(diff.max() / want.float().abs().max()), float((diff == 0).float().mean())


def _sweep(inputs, shape, graph_median_ms) -> dict[str, float]:
    from minimax_backend.kernels.norm_rope_triton import rms_norm_rope_triton

    qkv, wq, wk, cos, sin = inputs
    h, hk, d = shape
    q, k = qkv[:, :h * d].view(-1, h, d), qkv[:, h * d:(h + hk) * d].view(-1, hk, d)
    times = {}
    for hp in (2, 4, 8, 16, 32):
        for warps in (1, 2, 4, 8):
            def fn(hp=hp, warps=warps):
                rms_norm_rope_triton(q, wq, cos, sin, EPS, True, min(hp, h), warps)
                rms_norm_rope_triton(k, wk, cos, sin, EPS, True, min(hp, hk), warps)
            times[f"{hp}x{warps}"] = 1e3 * graph_median_ms(fn)
    return times


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", type=int, nargs="+", default=list(TOKENS))
    p.add_argument("--heads", type=int, default=64)
    p.add_argument("--kv-heads", type=int, default=4)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--rotary-dim", type=int, default=64)
    p.add_argument("--sweep", action="store_true", help="also time heads per program x warps")
    p.add_argument("--dry-run", action="store_true", help="check the script on the CPU (see above)")
    p.add_argument("--json")
    args = p.parse_args(argv)
    from minimax_backend.tools.bench_common import (copy_bandwidth_gbs, graph_median_ms, hardware, print_table,
                                                    require_device, write_json)

    require_device(args.dry_run)
    if args.dry_run:
        args.tokens = [t for t in args.tokens if t <= 64][:2] or [5]
    if any(t <= 0 for t in args.tokens):
        raise SystemExit(f"--tokens must be positive, got {args.tokens}")
    import minimax_backend.kernels  # noqa: F401  (registers minimax::rms_norm_rope)

    device = torch.device("cpu" if args.dry_run else "cuda")
    h, hk, d = args.heads, args.kv_heads, args.head_dim
    inductor = torch.compile(_model_code, dynamic=False, backend="eager" if args.dry_run else "inductor")
    copy_gbs = copy_bandwidth_gbs(device)
    rows = []
    for t in args.tokens:
        inputs = _layer_inputs(t, h, hk, d, args.rotary_dim, device, seed=t)
        shape = (h, hk, d)
        want = _model_code(*inputs, *shape)
        row = {"tokens": t}
        for name, fn in (("inductor", inductor), ("ours", _ours)):
            got = fn(*inputs, *shape)
            (rq, eq), (rk, ek) = _errors(got[0], want[0]), _errors(got[1], want[1])
            row[f"{name}_rel_err"] = max(rq, rk)
            row[f"{name}_equal_frac"] = (eq * h + ek * hk) / (h + hk)
            row[f"{name}_us"] = 1e3 * graph_median_ms(lambda fn=fn: fn(*inputs, *shape))
        if args.sweep:
            row["sweep_us"] = _sweep(inputs, shape, graph_median_ms)
        nbytes = 2 * t * (h + hk) * d * 2 + 2 * t * (args.rotary_dim // 2) * 4
        row["floor_us"] = nbytes / copy_gbs / 1e3
        row["ours_x_vs_inductor"] = row["inductor_us"] / row["ours_us"]
        row["ours_of_copy_bw"] = row["floor_us"] / row["ours_us"]
        rows.append(row)
        if args.json:  # after every size: a run cut short keeps what it measured
            write_json(args.json, {"benchmark": "norm_rope", "hardware": hardware(), "copy_gbs": copy_gbs,
                                   "heads": h, "kv_heads": hk, "head_dim": d, "rotary_dim": args.rotary_dim,
                                   "rows": rows})
    print_table(rows, ["tokens", "inductor_us", "ours_us", "floor_us", "ours_x_vs_inductor", "ours_of_copy_bw",
                       "inductor_rel_err", "ours_rel_err", "inductor_equal_frac", "ours_equal_frac"],
                title=f"QK norm + RoPE, {h} + {hk} heads of {d}, rotary {args.rotary_dim}: us per layer "
                      f"(CUDA graphs), copy bandwidth {copy_gbs:.0f} GB/s")


if __name__ == "__main__":
    main()
