"""Prefill latency of an M3-shaped slice, with and without sequence parallelism.

    python -m minimax_backend.tools.bench_sequence_parallel --tp 2 --ep 2 \
        --tokens 1024 4096 8192 --json sp.json

Runs on `tp` GPUs (NCCL). The model is the `m3-slice` preset at real width
(hidden 6144, 64 query / 4 KV heads, the 3 dense layers and `--moe-layers`
MoE layers), random BF16 weights. For every token count it times, in the
same process: the eager model, the compiled model with the pass off, and
with it on; and checks that the compiled logits agree with eager.
"""

from __future__ import annotations

import argparse
import os

import torch
import torch.distributed as dist


def _variant(model, sp: str, codegen: str, tp: int, ep: int):
    options = {"sequence_parallel": sp, "codegen": codegen, "tp_size": tp, "ep_size": ep}
    return torch.compile(model, backend="minimax", options=options, fullgraph=True, dynamic=False)


def job(rank: int, world: int, args) -> None:
    from minimax_backend.graph_passes.backend import last_compile_report
    from minimax_backend.model.presets import load_preset
    from minimax_backend.model.minimax import build_model
    from minimax_backend.model.parallel import ParallelState
    from minimax_backend.model.random_weights import fast_random_weights
    from minimax_backend.tools.bench_common import median_ms, print_table, write_json
    from minimax_backend.tools.run_job import compare_logits

    torch._dynamo.config.cache_size_limit = 64
    base = load_preset(args.preset)
    dense = len(base.dense_layers)
    config = base.replace(num_hidden_layers=dense + args.moe_layers,
                          mlp_layer_types=("dense",) * dense + ("moe",) * args.moe_layers)
    config.validate_for_parallel(world, args.ep)
    device = torch.device("cuda", torch.cuda.current_device()) if args.device == "cuda" else torch.device("cpu")
    model = build_model(config, ParallelState.from_world(args.ep), dtype=torch.bfloat16, device=device)
    fast_random_weights(model, seed=0)
    model.eval()
    barrier = dist.barrier
    variants = {"off": _variant(model, "off", args.codegen, world, args.ep),
                "on": _variant(model, "on", args.codegen, world, args.ep)}
    rows, reports = [], {}
    with torch.no_grad():
        for tokens in args.tokens:
            ids = torch.randint(0, config.vocab_size, (1, tokens), device=device,
                                generator=torch.Generator(device).manual_seed(tokens))
            pos = torch.arange(tokens, device=device)[None]
            row = {"tokens": tokens}
            eager = model(ids, pos)
            row["eager_ms"] = median_ms(lambda: model(ids, pos), args.warmup, args.repeats, barrier)
            for name, compiled in variants.items():
                out = compiled(ids, pos)
                reports[f"{tokens}_{name}"] = {k: last_compile_report().get(k) for k in ("passes", "ops_after")}
                num = compare_logits(eager, out)
                row[f"sp_{name}_ms"] = median_ms(lambda: compiled(ids, pos), args.warmup, args.repeats, barrier)
                row[f"sp_{name}_rel_err"] = num["max_rel_err"]
                row[f"sp_{name}_argmax"] = num["argmax_agreement"]
                del out
            row["speedup_sp"] = row["sp_off_ms"] / row["sp_on_ms"]
            row["speedup_vs_eager"] = row["eager_ms"] / row["sp_on_ms"]
            rows.append(row)
            del eager
            if device.type == "cuda":
                torch.cuda.empty_cache()
    if rank == 0:
        print_table(rows, ["tokens", "eager_ms", "sp_off_ms", "sp_on_ms", "speedup_sp", "speedup_vs_eager",
                           "sp_on_rel_err", "sp_on_argmax"],
                    title=f"prefill, {args.preset} {dense} dense + {args.moe_layers} MoE layers, TP {world} EP {args.ep}, "
                          f"codegen {args.codegen}, medians of {args.repeats}")
        if args.json:
            write_json(args.json, {"benchmark": "sequence_parallel_prefill", "tp": world, "ep": args.ep,
                                   "moe_layers": args.moe_layers, "codegen": args.codegen,
                                   "rows": rows, "compile_reports": reports})


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tp", type=int, default=2)
    p.add_argument("--ep", type=int, default=2)
    p.add_argument("--moe-layers", type=int, default=2)
    p.add_argument("--tokens", type=int, nargs="+", default=[1024, 4096, 8192])
    p.add_argument("--codegen", choices=["fx", "inductor"], default="inductor")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--repeats", type=int, default=10)
    p.add_argument("--preset", default="m3-slice", help="model shape (tiny-m3 for a CPU smoke run)")
    p.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    p.add_argument("--json")
    args = p.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("this benchmark needs CUDA GPUs (--device cpu for a smoke run)")
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    from minimax_backend.tools.launch import run_on_ranks

    run_on_ranks(job, args.tp, args.device, args)


if __name__ == "__main__":
    main()
