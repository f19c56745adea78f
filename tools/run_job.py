"""The main job, run once per rank: eager and compiled on the same inputs.

Each rank loads its slice of the checkpoint, runs the eager model, compiles
the same model with `backend="minimax"`, runs it on the same inputs, and
compares. Rank 0 prints the summary and writes the optional JSON report and
logits file. Prefill and (optionally) decode steps after it are compared; the
decode tokens are the eager model's greedy choices, fed to both so the two
runs see identical inputs.
"""

from __future__ import annotations

import json
import logging
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


@dataclass
class RunArgs:
    checkpoint: str
    tp: int = 2
    ep: int = 1
    tokens: int = 37
    batch: int = 1
    dtype: str = "bfloat16"
    decode_steps: int = 2
    options: dict[str, Any] = field(default_factory=dict)
    dump: str | None = None
    save_logits: str | None = None
    json_path: str | None = None
    device: str = "cpu"
    seed: int = 0
    repeats: int = 3
    compile_only: bool = False


class Progress:
    """One line per step on rank 0, with the time since the job started."""

    def __init__(self, enabled: bool):
        self.enabled = enabled
        self.start = time.perf_counter()

    def __call__(self, message: str) -> None:
        if self.enabled:
            print(f"[minimax {time.perf_counter() - self.start:6.1f}s] {message}", flush=True)


def sync_device(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _timed(fn, device: torch.device, repeats: int) -> tuple[Any, float]:
    """Run fn `repeats` times; return the last result and the median seconds."""
    times, out = [], None
    for _ in range(repeats):
        sync_device(device)
        t0 = time.perf_counter()
        out = fn()
        sync_device(device)
        times.append(time.perf_counter() - t0)
    return out, statistics.median(times)


def _logits_of(output):
    return output[0] if isinstance(output, tuple) else output


def compare_logits(eager: torch.Tensor, compiled: torch.Tensor) -> dict[str, float]:
    """Max abs error, error relative to the largest eager logit, argmax agreement, and the
    per-token error (each token's max |difference| over the largest logit) at the median and
    the 90th percentile: in BF16 / FP8 a few tokens whose top-k routing sits on a near-tie pick
    another expert in any two implementations, and one such token sets the maximum."""
    e, c = eager.float(), compiled.float()
    diff = (e - c).abs()
    scale = e.abs().max().clamp_min(1e-12)
    agree = (e.argmax(-1) == c.argmax(-1)).float().mean()
    per_token = diff.reshape(-1, diff.shape[-1]).amax(-1) / scale
    return {
        "max_abs_err": diff.max().item(),
        "max_rel_err": (diff.max() / scale).item(),
        "median_token_rel_err": per_token.median().item(),
        "p90_token_rel_err": per_token.quantile(0.9).item(),
        "argmax_agreement": agree.item(),
        "finite": bool(torch.isfinite(c).all().item()),
    }


def _decode(model, prefill_logits, tokens, steps, batch, device, forced=None):
    """Greedy decode `steps` tokens after a prefill of `tokens`; returns (ids, logits)."""
    ids, outs = [], []
    next_ids = prefill_logits[:, -1].argmax(-1, keepdim=True)
    for s in range(steps):
        if forced is not None:
            next_ids = forced[s]
        pos = torch.full((batch, 1), tokens + s, dtype=torch.long, device=device)
        logits = _logits_of(model(next_ids, pos))
        ids.append(next_ids)
        outs.append(logits)
        next_ids = logits[:, -1].argmax(-1, keepdim=True)
    return ids, outs


def run_job(rank: int, world_size: int, args: RunArgs) -> None:
    from minimax_backend.graph_passes.backend import compile_reports, last_compile_report
    from minimax_backend.graph_passes.config import BackendConfig
    from minimax_backend.graph_passes.bucketing import BucketedRunner, padded_length
    from minimax_backend.model.checkpoint_loader import load_checkpoint
    from minimax_backend.model.config import MiniMaxConfig
    from minimax_backend.model.minimax import build_model
    from minimax_backend.model.parallel import ParallelState

    progress = Progress(rank == 0)
    if rank == 0:
        logging.basicConfig(level=logging.INFO, format="%(message)s")
        logging.getLogger("minimax").setLevel(logging.INFO)
    device = torch.device(f"cuda:{torch.cuda.current_device()}") if args.device == "cuda" else torch.device("cpu")
    dtype = DTYPES[args.dtype]

    config = MiniMaxConfig.from_json_file(Path(args.checkpoint) / "config.json")
    config.validate_for_parallel(world_size, args.ep)
    ps = ParallelState.from_world(args.ep)
    progress(f"building {config.model_type} ({config.num_hidden_layers} layers, hidden {config.hidden_size}) "
             f"at TP {world_size} / EP {args.ep} on {device.type}, {args.dtype}")
    t0 = time.perf_counter()
    model = build_model(config, ps, dtype=dtype, device=device,
                        quantize_fp8=config.quant_method == "fp8")
    load_checkpoint(model, args.checkpoint)
    model.eval()
    options = dict(args.options)
    # The graph shows TP through its collectives but not EP; tell the backend.
    options.setdefault("tp_size", world_size)
    options.setdefault("ep_size", args.ep)
    if args.dump:
        options["dump_dir"] = args.dump
    backend_config = BackendConfig.from_options(options)
    # Compiled calls are padded to a CUDA-graph bucket (a no-op without CUDA
    # graphs is not worth a second code path): room in the cache for the pad.
    prefill_len = padded_length(args.batch, args.tokens, backend_config.cudagraph_buckets, world_size)
    max_len = max(prefill_len, args.tokens + args.decode_steps) + world_size
    model.allocate_kv_cache(args.batch, max_len)
    timings = {"load": time.perf_counter() - t0}
    progress(f"loaded {args.checkpoint} in {timings['load']:.1f}s")

    gen = torch.Generator().manual_seed(args.seed)
    input_ids = torch.randint(0, config.vocab_size, (args.batch, args.tokens), generator=gen).to(device)
    positions = torch.arange(args.tokens, device=device).expand(args.batch, -1).contiguous()

    compiled = BucketedRunner(
        torch.compile(model, backend="minimax", options=backend_config, fullgraph=True, dynamic=False),
        backend_config.cudagraph_buckets, multiple=world_size, max_positions=max_len)

    with torch.no_grad():
        if not args.compile_only:
            progress(f"eager prefill of {args.batch} x {args.tokens} tokens")
            eager_out, timings["eager_prefill"] = _timed(lambda: _logits_of(model(input_ids, positions)), device, args.repeats)

        progress("compiling (capture, passes, code generation)")
        t0 = time.perf_counter()
        compiled_out = _logits_of(compiled(input_ids, positions))
        sync_device(device)
        timings["compile_and_first_run"] = time.perf_counter() - t0
        report = last_compile_report()
        progress(f"compiled in {timings['compile_and_first_run']:.1f}s")
        if args.compile_only:
            if rank == 0:
                print(f"dump written to {report.get('dump_dir')}")
            return

        compiled_out, timings["compiled_prefill"] = _timed(lambda: _logits_of(compiled(input_ids, positions)), device, args.repeats)
        numerics = compare_logits(eager_out, compiled_out)

        decode_numerics = None
        if args.decode_steps:
            progress(f"decoding {args.decode_steps} steps, eager then compiled")
            model(input_ids, positions)  # refill the cache eagerly
            t0 = time.perf_counter()
            ids, eager_dec = _decode(model, eager_out, args.tokens, args.decode_steps, args.batch, device)
            timings["eager_decode_per_step"] = (time.perf_counter() - t0) / args.decode_steps
            compiled(input_ids, positions)
            progress("compiling the decode graph (one token per sequence)")
            t0 = time.perf_counter()
            _decode(compiled, compiled_out, args.tokens, 1, args.batch, device, forced=ids)
            timings["compile_decode"] = time.perf_counter() - t0
            compiled(input_ids, positions)  # the warm-up step wrote the cache: refill it
            t0 = time.perf_counter()
            _, compiled_dec = _decode(compiled, compiled_out, args.tokens, args.decode_steps, args.batch, device, forced=ids)
            timings["compiled_decode_per_step"] = (time.perf_counter() - t0) / args.decode_steps
            decode_numerics = compare_logits(torch.cat(eager_dec, 1), torch.cat(compiled_dec, 1))

    if rank != 0:
        return
    result = {
        "tp": world_size,
        "ep": args.ep,
        "tokens": args.tokens,
        "batch": args.batch,
        "padded_tokens": prefill_len,  # what the compiled prefill ran on (a CUDA-graph bucket)
        "dtype": args.dtype,
        "device": device.type,
        "model_type": config.model_type,
        "checkpoint": str(args.checkpoint),
        "attention": _attention_summary(config),
        "passes": report.get("passes", []),
        "ops_before": report.get("ops_before", {}),
        "ops_after": report.get("ops_after", {}),
        "numerics": numerics,
        "decode_numerics": decode_numerics,
        "timings_s": timings,
        "dump_dir": report.get("dump_dir"),
        "dump_index": report.get("dump_index"),
        "cudagraphs": _cudagraph_summary(compile_reports()),
        "torch": torch.__version__,
    }
    print_summary(result)
    if args.json_path:
        Path(args.json_path).write_text(json.dumps(result, indent=2))
        print(f"report written to {args.json_path}")
    if args.save_logits:
        torch.save({"input_ids": input_ids.cpu(), "eager": eager_out.cpu(), "compiled": compiled_out.cpu()},
                   args.save_logits)
        print(f"logits written to {args.save_logits}")


def _attention_summary(config) -> dict[str, Any]:
    sparse = list(config.sparse_attention_layers)
    return {
        "sparse_layers": sparse,
        "dense_layers": [i for i in range(config.num_hidden_layers) if i not in sparse],
        "block_size": config.index_block_size,
        "topk_blocks": config.index_topk_blocks,
        "index_heads": config.index_n_heads,
    }


def _cudagraph_summary(reports: list[dict[str, Any]]) -> dict[str, Any]:
    """Captured token counts, uncaptured ones and the shared pool size over this job's compiles."""
    infos = [r.get("cudagraphs") or {} for r in reports]
    return {
        "enabled": any(i.get("enabled") for i in infos),
        "skipped": next((i["skipped"] for i in infos if i.get("skipped")), None),
        "captured_tokens": sorted({c["tokens"] for i in infos for c in i.get("captured", [])}),
        "uncaptured_tokens": sorted({c["tokens"] for i in infos for c in i.get("uncaptured", [])}),
        "pool_bytes": max([i.get("pool_bytes", 0) for i in infos] or [0]),
    }


def print_summary(result: dict[str, Any]) -> None:
    print()
    print(f"== minimax run: {result['model_type']} TP {result['tp']} EP {result['ep']}, "
          f"{result['batch']} x {result['tokens']} tokens, {result['dtype']} on {result['device']}")
    padded = result.get("padded_tokens")
    if padded and padded != result["tokens"]:
        print(f"compiled prefill: padded to {result['batch']} x {padded} tokens (a CUDA-graph bucket; "
              f"the pad's logits are dropped), eager on the {result['tokens']} alone")
    a = result.get("attention")
    if a:
        msa = (f"MSA (sparse) on layers {a['sparse_layers']}: top {a['topk_blocks']} blocks of {a['block_size']} keys "
               f"per query, {a['index_heads']} index heads" if a["sparse_layers"] else "no sparse layers")
        print(f"attention: {msa}; dense on layers {a['dense_layers']}")
    print("passes:")
    for p in result["passes"]:
        state = "on " if p.get("enabled") else "off"
        # what the matches were (the non-zero kinds): "matched" may also mean "looked at and kept",
        # e.g. fuse_norm_quant keeps BF16 in front of an all-gather
        kinds = ", ".join(f"{k} {v}" for k, v in (p.get("breakdown") or {}).items() if v)
        why = f"  ({p['skipped']})" if p.get("skipped") else f"  ({kinds})" if kinds else ""
        print(f"  {state} {p['name']:<25} matches {p.get('matches', 0):>3}{why}")
    before, after = result["ops_before"], result["ops_after"]
    changed = sorted(k for k in set(before) | set(after) if before.get(k, 0) != after.get(k, 0))
    interesting = [k for k in sorted(set(before) | set(after))
                   if k.startswith(("_c10d_functional.", "minimax.")) or k in changed]
    if interesting:
        print("ops (captured -> final):")
        for k in interesting:
            print(f"  {k:<40} {before.get(k, 0):>4} -> {after.get(k, 0):>4}")
    for label, n in (("prefill", result["numerics"]), ("decode", result.get("decode_numerics"))):
        if n:
            print(f"{label + ':':<8} compiled vs eager, per token (of the largest logit): median "
                  f"{100 * n['median_token_rel_err']:.2f}%, 90th pct {100 * n['p90_token_rel_err']:.2f}%, "
                  f"max {100 * n['max_rel_err']:.2f}%; argmax agreement {100 * n['argmax_agreement']:.1f}%")
    if result.get("dtype") != "float32":
        print("          (BF16 / FP8: a token whose expert choice is a near-tie can flip; --dtype float32 "
              "compares the rewrites without rounding noise)")
    cg = result.get("cudagraphs") or {}
    if cg.get("enabled"):
        print(f"cuda graphs: captured at {cg['captured_tokens']} tokens, shared pool {cg['pool_bytes'] / 2**20:.1f} MiB"
              + (f", run without a graph at {cg['uncaptured_tokens']}" if cg["uncaptured_tokens"] else ""))
    else:
        print(f"cuda graphs: off ({cg.get('skipped')})")
    t = result["timings_s"]
    print("timings (s, medians): " + ", ".join(f"{k} {v:.3f}" for k, v in t.items()))
    if result.get("dump_index"):
        print(f"graph dump of every stage: {result['dump_index']} (open it in a browser)")
