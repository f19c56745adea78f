"""The MSA layer (indexer + block-sparse attention) against dense attention, on one GPU.

    python -m minimax_backend.tools.bench_msa --json docs/results/msa.json

M3's attention at TP 1: 64 query heads, 4 KV heads, head_dim 128; the indexer's
4 heads x 128 and one key head; blocks of 128 keys, the top 16 per query.
Inputs are the projected q / k / v and index q / k (the GEMMs before them are
the same for both, except the indexer's 7% extra rows of the QKV GEMM).

    prefill S   S tokens from position 0, no cache (causal over S keys)
    decode B C  B sequences with C keys each in the cache, one new token at
                position C - 1 (every key visible)

Per shape, medians of CUDA-event timings:
    dense       F.scaled_dot_product_attention with the FlashAttention backend,
                GQA (enable_gqa); the strongest dense kernel torch ships
    select      minimax::msa_select (block scores + top-k)
    attention   minimax::msa_attention on those blocks
    sparse      both, back to back (the layer's attention part)
and the limits measured in the same run: the sparse attention's FLOPs over
its time against a plain BF16 GEMM's rate (8192^3), and at decode the bytes
it must read (the index-K cache, the selected blocks' K and V) over its time
against the device-to-device copy bandwidth. `check` compares sparse with
dense at 2048 tokens, where every block is selected and the two must agree.

`--device cpu --smoke` runs tiny shapes on the CPU (the reference ops) to
check the script; its numbers mean nothing.
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F

from .. import kernels  # noqa: F401  (registers the minimax:: ops)
from . import bench_common as bc

HQ, HKV, HI, D, ID, BLOCK, TOPK = 64, 4, 4, 128, 128, 128, 16


def _dense(q, k, v, causal: bool):
    """q [B, Hq, S, d], k/v [B, Hkv, L, d] -> flash attention (GQA)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    backend = SDPBackend.FLASH_ATTENTION if q.is_cuda else SDPBackend.MATH
    with sdpa_kernel(backend):
        return F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=True)


def _attended_keys(blocks: torch.Tensor, pos: torch.Tensor) -> float:
    """Keys attended per (query, index head), summed: each selected block's keys <= the position."""
    p = pos.reshape(-1, 1, 1).long()
    blk = blocks.long()
    n = (p - blk * BLOCK + 1).clamp(0, BLOCK)
    return float(torch.where(blk >= 0, n, 0).sum())


def _time(fn, device, calls: int) -> float:
    if device.type == "cuda":
        return bc.graph_median_ms(fn, calls=calls)
    return bc.median_ms(fn, warmup=1, repeats=3)


def _index_inputs(batch, seq, slots, pos, keys: str, g, device):
    """Index queries and keys. random: every key block equally likely for every query (no
    overlap between neighbours' selections: the worst case for tiles of several tokens).
    coherent: keys drift slowly with position and each query resembles the keys around
    it, so neighbouring queries pick mostly the same blocks (as in a trained model)."""
    bf = dict(device=device, dtype=torch.bfloat16)
    if keys == "random":
        return (torch.randn(batch * seq, HI, ID, generator=g, **bf), torch.randn(batch, slots, ID, generator=g, **bf))
    walk = torch.randn(batch, slots, ID, generator=g, device=device).mul_(0.05).cumsum(1)
    walk += torch.randn(batch, 1, ID, generator=g, device=device)
    ik = (walk + 0.3 * torch.randn(batch, slots, ID, generator=g, device=device)).to(torch.bfloat16)
    at = walk[torch.arange(batch, device=device)[:, None], pos]  # [B, S, ID]
    iq = at[:, :, None] + 0.3 * torch.randn(batch, seq, HI, ID, generator=g, device=device)
    return iq.reshape(batch * seq, HI, ID).to(torch.bfloat16), ik


def _shape(device, batch: int, seq: int, slots: int, pos: torch.Tensor, gemm_tflops: float, copy_gbs: float,
           label: str, seed: int, keys: str = "random", toks=()) -> dict:
    g = torch.Generator(device=device).manual_seed(seed)
    bf = dict(device=device, dtype=torch.bfloat16)
    pos = pos.to(device)
    q = torch.randn(batch * seq, HQ, D, generator=g, **bf)
    k = torch.randn(batch, HKV, slots, D, generator=g, **bf)
    v = torch.randn(batch, HKV, slots, D, generator=g, **bf)
    iq, ik = _index_inputs(batch, seq, slots, pos, keys, g, device)
    scale = D ** -0.5
    select = lambda: torch.ops.minimax.msa_select(iq, ik, pos, BLOCK, TOPK, 1, 0)  # noqa: E731
    blocks = select()
    attend = lambda: torch.ops.minimax.msa_attention(q, k, v, blocks, pos, BLOCK, scale)  # noqa: E731

    def sparse():
        return torch.ops.minimax.msa_attention(q, k, v, select(), pos, BLOCK, scale)

    qd = q.view(batch, seq, HQ, D).transpose(1, 2)
    dense = lambda: _dense(qd, k, v, causal=seq > 1)  # noqa: E731
    calls = 1 if batch * seq >= 4096 else 10
    row = {"shape": label, "batch": batch, "tokens": seq, "keys": slots, "index_keys": keys}
    row["dense_ms"] = _time(dense, device, calls)
    row["select_ms"] = _time(select, device, calls)
    row["attention_ms"] = _time(attend, device, calls)
    row["sparse_ms"] = _time(sparse, device, calls)
    row["speedup"] = row["dense_ms"] / row["sparse_ms"]
    if seq > 1 and device.type == "cuda":
        from minimax_backend.kernels import msa_triton

        for tok in toks:  # tokens per attention program (the default plan picks one)
            fn = lambda tok=tok: msa_triton.sparse_attention(q, k, v, blocks, pos, BLOCK, scale, tok=tok)  # noqa: E731
            row[f"attention_ms_tok{tok}"] = _time(fn, device, calls)
    row["indexer_share"] = row["select_ms"] / (row["select_ms"] + row["attention_ms"])
    attn_flops = 4.0 * (HQ // HI) * D * _attended_keys(blocks, pos)
    row["attention_tflops"] = attn_flops / row["attention_ms"] / 1e9
    row["frac_of_gemm"] = row["attention_tflops"] / gemm_tflops
    if seq == 1:  # decode: what the layer must read
        index_bytes = 2.0 * ID * float((pos + 1).sum())
        kv_bytes = 2 * 2.0 * D * HKV * _attended_keys(blocks, pos) / HI
        row["sparse_gbs"] = (index_bytes + kv_bytes) / row["sparse_ms"] / 1e6
        row["frac_of_copy"] = row["sparse_gbs"] / copy_gbs
        row["dense_gbs"] = 2 * 2.0 * D * HKV * float((pos + 1).sum()) / row["dense_ms"] / 1e6
    if slots <= TOPK * BLOCK:  # every block selected: sparse must equal dense
        ref = dense().transpose(1, 2).reshape(q.shape)
        row["check_rel_err"] = ((sparse().float() - ref.float()).norm() / ref.float().norm()).item()
    return row


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--prefill", type=int, nargs="*", default=[2048, 4096, 8192, 16384, 65536])
    p.add_argument("--decode-batch", type=int, nargs="*", default=[1, 16, 64])
    p.add_argument("--context", type=int, nargs="*", default=[8192, 32768, 131072])
    p.add_argument("--keys", nargs="+", choices=["random", "coherent"], default=["random", "coherent"],
                   help="index keys: random (no overlap between neighbours' blocks) or coherent (trained-like)")
    p.add_argument("--tok", type=int, nargs="*", default=[1, 2, 4, 8], help="prefill: also time these tiles")
    p.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    p.add_argument("--smoke", action="store_true", help="tiny shapes (a CPU check of the script)")
    p.add_argument("--json")
    args = p.parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("bench_msa needs a CUDA GPU (--device cpu --smoke checks the script on the CPU)")
    if args.smoke:
        global HQ, HKV, HI, D, ID, BLOCK, TOPK
        HQ, HKV, HI, D, ID, BLOCK, TOPK = 8, 2, 2, 16, 16, 16, 4
        args.prefill, args.decode_batch, args.context = [64, 96], [2], [128]
    gemm, copy = bc.gemm_tflops(device), bc.copy_bandwidth_gbs(device)
    print(f"plain BF16 GEMM {gemm:.0f} TFLOP/s, device copy {copy:.0f} GB/s", flush=True)
    rows = []
    with torch.no_grad():
        for keys in args.keys:
            for s in args.prefill:
                rows.append(_shape(device, 1, s, s, torch.arange(s)[None], gemm, copy, f"prefill {s} {keys}",
                                   seed=s, keys=keys, toks=args.tok))
                print(rows[-1], flush=True)
            for c in args.context:
                for b in args.decode_batch:
                    pos = torch.full((b, 1), c - 1)
                    rows.append(_shape(device, b, 1, c, pos, gemm, copy, f"decode b{b} ctx{c} {keys}",
                                       seed=b + c, keys=keys))
                    print(rows[-1], flush=True)
                    if device.type == "cuda":
                        torch.cuda.empty_cache()
    cols = ["shape", "dense_ms", "sparse_ms", "speedup", "select_ms", "attention_ms", "indexer_share",
            "attention_tflops", "frac_of_gemm", "sparse_gbs", "frac_of_copy", "check_rel_err"]
    cols += [f"attention_ms_tok{t}" for t in args.tok]
    table = bc.print_table(rows, cols, title="MSA layer vs dense flash attention (ms)")
    if args.json:
        bc.write_json(args.json, {"benchmark": "msa", "gemm_tflops": gemm, "copy_gbs": copy, "rows": rows,
                                  "table": table, "shape": dict(HQ=HQ, HKV=HKV, HI=HI, D=D, BLOCK=BLOCK, TOPK=TOPK)})


if __name__ == "__main__":
    main()
