"""Decode-step attention of M3's dense layers over a KV cache, on one GPU.

    python -m minimax_backend.tools.bench_decode_attention --json docs/results/decode_attention.json

M3 at TP 1: 64 query heads, 4 KV heads, head_dim 128, bfloat16 (`--tp N`: one
rank's heads at TP N, the KV heads replicated below 4 per rank). Each of B
sequences has one new query at position C - 1 of a cache of C + 8 slots (as
bench_e2e allocates it) and the model's mask (slots <= position). Per shape,
medians of CUDA-graph replays (10 calls per replay), ms:

    ours         minimax::decode_attention (what the decode_attention pass puts in
                 the graph), bool mask; ours_additive with the additive mask the
                 compiled graph hands SDPA
    sdpa         F.scaled_dot_product_attention(enable_gqa=True) with the mask, the
                 backend torch picks; sdpa_cudnn / sdpa_efficient forced
                 (a backend that refuses the inputs is left out and named)
    flashinfer   FlashInfer's BatchDecodeWithPagedKVCacheWrapper (tensor cores) on the
                 same buffers as one page per sequence (HND), with --flashinfer and
                 where it imports (../shared/gpu-libs/README.md)

and the limit from the same run: the K and V bytes of the visible keys over
the time, against the device-to-device copy bandwidth (`frac_of_copy`).
`--sweep` also times our kernel at other tiles (64 / 128 keys, 2 / 3 stages)
and splits (half, the plan's, double). Every variant's
output is compared with ours (relative norm of the difference).

`--device cpu --smoke` runs tiny shapes on the CPU to check the script; its
numbers mean nothing.
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F

from .. import kernels  # noqa: F401  (registers the minimax:: ops)
from . import bench_common as bc

HQ, HKV, D = 64, 4, 128
SDPA_BACKENDS = ("cudnn", "efficient")


def _inputs(batch: int, context: int, device: torch.device, seed: int):
    g = torch.Generator(device=device).manual_seed(seed)
    slots = context + 8
    bf = dict(device=device, dtype=torch.bfloat16)
    q = torch.randn(batch, 1, HQ, D, generator=g, **bf).transpose(1, 2)
    k = torch.randn(batch, HKV, slots, D, generator=g, **bf)
    v = torch.randn(batch, HKV, slots, D, generator=g, **bf)
    pos = torch.full((batch, 1), context - 1, device=device)
    mask = torch.arange(slots, device=device)[None, None, None, :] <= pos[:, None, :, None]
    return q, k, v, mask, pos


def _sdpa(q, k, v, mask, backend: str | None):
    from torch.nn.attention import SDPBackend, sdpa_kernel

    def call():
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)

    if backend is None:
        return call
    chosen = {"cudnn": SDPBackend.CUDNN_ATTENTION, "efficient": SDPBackend.EFFICIENT_ATTENTION,
              "math": SDPBackend.MATH}[backend]

    def forced():
        with sdpa_kernel([chosen]):
            return call()

    return forced


def _flashinfer(q, k, v, pos):
    """FlashInfer's paged decode with each sequence's cache as one page (HND), or a reason."""
    try:
        import flashinfer
    except Exception as e:  # noqa: BLE001 - report why, keep the other rows
        return None, f"flashinfer does not import: {type(e).__name__}: {e}"
    batch, slots = q.shape[0], k.shape[2]
    dev = q.device
    workspace = torch.empty(256 << 20, dtype=torch.uint8, device=dev)
    wrapper = flashinfer.BatchDecodeWithPagedKVCacheWrapper(workspace, kv_layout="HND", use_tensor_cores=True)
    wrapper.plan(torch.arange(batch + 1, dtype=torch.int32, device=dev), torch.arange(batch, dtype=torch.int32,
                 device=dev), (pos[:, 0] + 1).to(torch.int32), HQ, HKV, D, slots, q_data_type=torch.bfloat16,
                 kv_data_type=torch.bfloat16)
    q3 = q[:, :, 0].contiguous()  # [B, Hq, d]
    return (lambda: wrapper.run(q3, (k, v)).unsqueeze(2)), None


def _rel(a, b) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def _shape(device, batch: int, context: int, copy_gbs: float, args) -> dict:
    from minimax_backend.kernels import decode_attention_triton as dt

    q, k, v, mask, pos = _inputs(batch, context, device, seed=batch + context)
    additive = torch.where(mask, 0.0, float("-inf")).to(torch.bfloat16)
    scale = D ** -0.5
    row = {"shape": f"b{batch} ctx{context}", "batch": batch, "context": context,
           "split": dt.split_plan(batch, HKV, k.shape[2], device) if device.type == "cuda" else None}
    fns = {"ours": lambda: torch.ops.minimax.decode_attention(q, k, v, mask, scale),
           "ours_additive": lambda: torch.ops.minimax.decode_attention(q, k, v, additive, scale),
           "sdpa": _sdpa(q, k, v, mask, None)}
    for b in SDPA_BACKENDS:
        fns[f"sdpa_{b}"] = _sdpa(q, k, v, mask, b)
    if args.flashinfer and device.type == "cuda":
        fn, why = _flashinfer(q, k, v, pos)
        if fn is None:
            row["flashinfer_error"] = why
        else:
            fns["flashinfer"] = fn
    if args.sweep and device.type == "cuda":
        plan = row["split"]
        splits = sorted({max(1, plan // 2), plan, min(dt.MAX_SPLIT, plan * 2)})
        for block_n in (64, 128):
            for stages in (2, 3):
                for split in splits:
                    if split * block_n <= k.shape[2] * 2:
                        fns[f"ours_n{block_n}_s{stages}_p{split}"] = (
                            lambda b=block_n, st=stages, sp=split:
                            dt.decode_attention(q, k, v, mask, scale, split=sp, block_n=b, stages=st))
    ref = fns["ours"]()
    calls = 10 if device.type == "cuda" else 1
    for name, fn in fns.items():
        try:
            out = fn()
        except Exception as e:  # noqa: BLE001 - a backend that refuses these inputs
            row[f"{name}_error"] = f"{type(e).__name__}: {str(e)[:160]}"
            continue
        row[f"{name}_rel_err"] = _rel(out, ref)
        row[f"{name}_ms"] = (bc.graph_median_ms(fn, calls=calls) if device.type == "cuda"
                             else bc.median_ms(fn, warmup=1, repeats=3))
    kv_bytes = 2 * 2.0 * D * HKV * float((pos + 1).sum())
    row["kv_mb"] = kv_bytes / 1e6
    row["ours_gbs"] = kv_bytes / row["ours_ms"] / 1e6
    row["frac_of_copy"] = row["ours_gbs"] / copy_gbs
    best = min((row[f"{n}_ms"], n) for n in fns if f"{n}_ms" in row and not n.startswith("ours"))
    row["best_other"], row["x_vs_best_other"] = best[1], best[0] / row["ours_ms"]
    return row


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batch", type=int, nargs="*", default=[1, 16, 64])
    p.add_argument("--context", type=int, nargs="*", default=[8192, 32768])
    p.add_argument("--flashinfer", action="store_true", help="also time FlashInfer's paged decode (JIT at first use)")
    p.add_argument("--sweep", action="store_true", help="also time our kernel at other tiles and splits")
    p.add_argument("--tp", type=int, nargs="*", default=[1], help="one rank's heads at these TP sizes")
    p.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    p.add_argument("--smoke", action="store_true", help="tiny shapes (a CPU check of the script)")
    p.add_argument("--json")
    args = p.parse_args(argv)
    global HQ, HKV, D
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("bench_decode_attention needs a CUDA GPU (--device cpu --smoke checks the script)")
    if args.smoke:
        HQ, HKV, D = 8, 2, 16
        args.batch, args.context = [3], [100]
    copy = bc.copy_bandwidth_gbs(device)
    print(f"device copy {copy:.0f} GB/s", flush=True)
    rows = []
    full_hq, full_hkv = HQ, HKV
    with torch.no_grad():
        for tp in args.tp:
            HQ, HKV = full_hq // tp, max(1, full_hkv // tp)
            for context in args.context:
                for batch in args.batch:
                    rows.append(_shape(device, batch, context, copy, args))
                    rows[-1].update(tp=tp, shape=f"tp{tp} {rows[-1]['shape']}")
                    print({k: (round(v, 4) if isinstance(v, float) else v) for k, v in rows[-1].items()},
                          flush=True)
                    if device.type == "cuda":
                        torch.cuda.empty_cache()
    names = sorted({c[:-3] for r in rows for c in r if c.endswith("_ms")}, key=lambda n: (not n.startswith("ours"), n))
    sweep = [n for n in names if n.startswith("ours_n")]
    for r in rows:  # the best of the swept configs, with its name
        timed = [(r[f"{n}_ms"], n) for n in sweep if f"{n}_ms" in r]
        if timed:
            r["best_swept_ms"], r["best_swept"] = min(timed)
    cols = ["shape", "split", *[f"{n}_ms" for n in names if n not in sweep],
            *(["best_swept", "best_swept_ms"] if sweep else []), "best_other", "x_vs_best_other", "kv_mb", "ours_gbs",
            "frac_of_copy"]
    table = bc.print_table(rows, cols, title="decode attention, one rank of an M3 dense layer (ms, CUDA-graph replays)")
    if args.json:
        bc.write_json(args.json, {"benchmark": "decode_attention", "copy_gbs": copy, "rows": rows, "table": table,
                                  "shape": dict(HQ=HQ, HKV=HKV, D=D)})


if __name__ == "__main__":
    main()
