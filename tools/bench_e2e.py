"""End to end: an M3-shaped model, our backend against the strongest torch
alternative and the plain model, an ablation that turns each of our passes
off in turn, and the hardware floor.

    python -m minimax_backend.tools.bench_e2e --tp 1 --ep 1 --json e2e.json     # one H200

The model is the `m3-slice` preset at real width (hidden 6144, 64 query / 4
KV heads, 128 experts top-4, the 3 dense layers and `--moe-layers` MoE
layers), FP8 block-scaled weights, random. Workloads: prefill of
`--prefill` tokens (one sequence, no KV cache; the last position's logits, as a
serving engine samples, or `--prefill-logits all`) and one decode step for each
`--decode-batch` size with a `--context`-token KV cache (filled with random
values: the attention cost does not depend on them). Variants:

  torch-grouped    THE BASELINE: the model as a careful torch user writes it for
                   speed (tools/torch_baseline.py: grouped-GEMM experts, plain-torch
                   FP8 quantization) under torch.compile(mode="reduce-overhead")
  minimax          backend="minimax", every default (passes + CUDA graphs), except that
                   replays return the graph's own outputs, valid until the next call
                   (cudagraph_copy_outputs off), as the baseline's graphs do
  minimax-no-X     the same with X off (moe = no MoE rewrite at all, sp, normquant,
                   normrope, gemmrs, megamoe, cudagraphs)
  minimax-moe-triton  ours with kernel option moe_gemm=triton (the Triton gate/up
                   loop instead of the default's warp-specialized Gluon kernel on sm_90)
  minimax-moe-gluon  ours with kernel option moe_gemm=gluon (the Gluon gate/up GEMM
                   at FP8 prefill sizes required: an error without sm_90)
  minimax-moe-gluon192  ours with kernel option moe_gemm=gluon192 (its 192-row form)
  minimax-moe-triton-down  ours with kernel option moe_down=triton (the Triton down GEMM
                   after the 192-row gate/up instead of the Gluon one over the same blocks)
  minimax-router-cublas  ours with kernel option moe_router_logits=cublas (the router's
                   float32 logits by cuBLAS on the rows cast to float32, not three bf16 products)
  minimax-align-torch  ours with kernel option moe_align=torch (the experts' sorted
                   layout from the torch sort, not the Triton programs)
  eager            the plain model as written (the numerics reference)
  inductor         torch.compile(plain model); reduce-overhead: with CUDA graphs.
                   Under tracing the plain model's MoE runs every local expert on
                   every token (static shapes), so these measure that loop; they are
                   the "plain model" rows, not the baseline to beat.

Floors, from the same run: the device-to-device copy bandwidth and a plain
GEMM's rate (FP8 block-scaled torch._scaled_mm and BF16 torch.mm, 8192^3) are
measured first; decode rows give the step's bytes (tools/roofline.py: every
weight the batch touches, the routed experts counted in eager's call, and the
KV it attends to) over that bandwidth
(`floor_ms`, and ours over it), prefill rows the matrix FLOPs over our time as
TFLOP/s and as a fraction of the plain GEMM's rate.

Each variant is compiled on its first call at each size (timed: first_call_s),
then all are timed together in rounds of one timed call each, the order rotated
per round, so a drift of the GPU's clocks over the run reaches them alike; each
timed call comes right after an untimed call of the same variant, so what the
card ran just before is the same model, as in a server (CUDA events, medians of
--repeats, a barrier before each call so the ranks start together). On a GPU each compiled variant's call is also
split into host ms (Python until the call returns) and device ms (the call
issued behind a busy GPU, so only its GPU work and the gaps between its
kernels count); --profile adds the kernel time and launches per call. Every
variant's logits are compared with eager's (each token's largest
|difference| over the largest logit: the worst token, the median one, the 90th
percentile; argmax agreement) and, at one rank, for the variants that run our MoE op, the
tokens whose routing differs from eager's in some layer (a near-tie that rounding tipped:
tools/routing_flips.py) and the largest error without them. --sustained SECONDS (one GPU) also runs each
compiled variant back to back for that long, with the SM clock and board power
nvidia-smi reads meanwhile (tools/gpu_power.py): a server under load keeps the
card at its power limit, where a single call's timing does not. Rank 0 prints one
table per workload kind and writes the JSON after every workload, so a run cut
short keeps what it measured.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import time

import torch
import torch.distributed as dist

from minimax_backend.tools.gpu_power import seconds_arg

ABLATIONS = {
    "minimax-no-moe": {"moe_canonicalize": "off"},
    "minimax-no-sp": {"sequence_parallel": "off"},
    "minimax-no-normquant": {"fuse_norm_quant": "off"},
    "minimax-no-normrope": {"fuse_norm_rope": "off"},
    "minimax-no-gemmrs": {"gemm_reduce_scatter": "off"},
    "minimax-no-megamoe": {"moe_lower": "off"},
    "minimax-no-cudagraphs": {"cudagraphs": False},
}
# Our compile with a kernel switch changed (kernels/options.py) for every call, the captures included
KERNEL_VARIANTS = {
    "minimax-moe-triton": {"moe_gemm": "triton"},
    "minimax-moe-gluon": {"moe_gemm": "gluon"},
    "minimax-moe-gluon192": {"moe_gemm": "gluon192"},
    "minimax-moe-triton-down": {"moe_down": "triton"},
    "minimax-router-cublas": {"moe_router_logits": "cublas"},
    "minimax-align-torch": {"moe_align": "torch"},
}
VARIANTS = ("eager", "torch-grouped", "inductor", "reduce-overhead", "minimax", *ABLATIONS, *KERNEL_VARIANTS)
DEFAULT_VARIANTS = ("eager", "torch-grouped", "minimax", *ABLATIONS)
# compare_logits' figures -> the row's column suffix. The largest error is usually one token
# whose top-k routing sat on a near-tie; the per-token median and 90th percentile show the rest.
_NUMERICS = {"max_rel_err": "rel_err", "median_token_rel_err": "token_err_median",
             "p90_token_rel_err": "token_err_p90", "argmax_agreement": "argmax"}


PROFILED = ("minimax", "torch-grouped", *KERNEL_VARIANTS)  # the variants --profile looks into


def make_variant(name: str, model, tp: int, ep: int, baseline_model=None):
    if name == "eager":
        return model
    if name == "torch-grouped":
        return torch.compile(baseline_model, mode="reduce-overhead", fullgraph=True, dynamic=False)
    if name == "inductor":
        return torch.compile(model, fullgraph=True, dynamic=False)
    if name == "reduce-overhead":
        return torch.compile(model, mode="reduce-overhead", fullgraph=True, dynamic=False)
    import minimax_backend.graph_passes as gp

    # Outputs valid until the next call, the contract of the baseline's reduce-overhead graphs
    # (our default copies them out of the graph: at prefill 8k that is 3.3 GB of logits, ~1.5 ms)
    options = {"tp_size": tp, "ep_size": ep, "cudagraph_copy_outputs": False, **ABLATIONS.get(name, {})}
    compiled = gp.compile(model, dynamic=False, **options)
    if name not in KERNEL_VARIANTS:
        return compiled
    from minimax_backend.kernels.options import override_kernel_options

    def with_switches(*args, **kwargs):
        with override_kernel_options(**KERNEL_VARIANTS[name]):
            return compiled(*args, **kwargs)

    return with_switches


def _logits(out):
    return out[0] if isinstance(out, tuple) else out


def _workloads(args):
    for tokens in args.prefill:
        yield {"kind": "prefill", "tokens": tokens, "batch": 1}
    for batch in args.decode_batch:
        yield {"kind": "decode", "tokens": batch, "batch": batch}


def _inputs(work, config, device, context):
    gen = torch.Generator(device).manual_seed(work["tokens"] * 31 + work["batch"])
    if work["kind"] == "prefill":
        ids = torch.randint(0, config.vocab_size, (1, work["tokens"]), device=device, generator=gen)
        return ids, torch.arange(work["tokens"], device=device)[None]
    ids = torch.randint(0, config.vocab_size, (work["batch"], 1), device=device, generator=gen)
    return ids, torch.full((work["batch"], 1), context, device=device, dtype=torch.long)


def _fill_cache(model, batch: int, context: int, seed: int) -> None:
    model.allocate_kv_cache(batch, context + 8)
    gen = torch.Generator(model.lm_head.weight.device).manual_seed(seed)
    for layer in model.layers:
        cache = layer.self_attn.kv_cache
        for buf in (cache.k, cache.v, cache.index_k):
            if buf.numel() == 0:  # a dense layer has no index-K cache
                continue
            buf.copy_(torch.randn(buf.shape, generator=gen, device=buf.device, dtype=torch.float32).to(buf.dtype))


def _experts_touched(model, call):
    """(call(), the distinct local experts each MoE layer's router picked during it), in
    eager: the routed weights a decode step must read, for the floor. A random model's
    batch may share experts more (or less) than uniform routing would."""
    from minimax_backend.model.moe import MoE

    touched, hooks = [], []

    def count(moe, args, _out):
        ids = moe.route(args[0])[0]
        first, n_local = moe.first_expert, len(moe.experts)
        touched.append(int(ids[(ids >= first) & (ids < first + n_local)].unique().numel()))

    for m in model.modules():
        if isinstance(m, MoE):
            hooks.append(m.register_forward_hook(count))
    try:
        return call(), touched
    finally:
        for h in hooks:
            h.remove()


def job(rank: int, world: int, args) -> None:
    from minimax_backend.graph_passes.backend import compile_reports
    from minimax_backend.model.presets import load_preset
    from minimax_backend.model.minimax import build_model
    from minimax_backend.model.parallel import ParallelState
    from minimax_backend.model.random_weights import fast_random_weights
    from minimax_backend.tools.bench_common import (call_timeline, host_and_device_ms, idle_gaps,
                                                    interleaved_median_ms, kernel_profile, sustained_ms, top_kernels,
                                                    write_json)
    from minimax_backend.tools.gpu_power import sampler_for
    from minimax_backend.kernels.moe_probe import watch_router_inputs
    from minimax_backend.tools.routing_flips import eager_router_calls, errors_without, logit_rows, routing_flips
    from minimax_backend.tools.run_job import compare_logits, sync_device

    for name in ("recompile_limit", "cache_size_limit"):
        if hasattr(torch._dynamo.config, name):
            setattr(torch._dynamo.config, name, 64)
    # Every variant's guards check parameters per module tree, as our backend sets it
    # (BackendConfig.module_dict_guards): the baseline gets the same Dynamo setting.
    if hasattr(torch._dynamo.config, "use_recursive_dict_tags_for_guards"):
        torch._dynamo.config.use_recursive_dict_tags_for_guards = True
    t_start = time.perf_counter()

    def progress(msg):
        if rank == 0:
            print(f"[e2e {time.perf_counter() - t_start:6.1f}s] {msg}", flush=True)

    base = load_preset(args.preset)
    dense = len(base.dense_layers)
    config = base.replace(num_hidden_layers=dense + args.moe_layers,
                          mlp_layer_types=("dense",) * dense + ("moe",) * args.moe_layers)
    if args.attention == "dense":  # the model before MSA: every layer attends densely (not M3 past 2048 keys)
        config = config.replace(sparse_attention_layers=())
    config.validate_for_parallel(world, args.ep)
    device = torch.device("cuda", torch.cuda.current_device()) if args.device == "cuda" else torch.device("cpu")
    def new_model():
        m = build_model(config, ParallelState.from_world(args.ep), dtype=torch.bfloat16, device=device,
                        quantize_fp8=not args.bf16)
        return fast_random_weights(m, seed=0).eval()

    model = new_model()
    baseline_model = None
    if "torch-grouped" in args.variants:  # its own instance (changed in place), the same weights
        from minimax_backend.tools.torch_baseline import to_torch_baseline

        baseline_model = to_torch_baseline(new_model())
    floors = _measure_floors(device)
    progress(f"floors: copy {floors['copy_gbs']:.0f} GB/s, plain GEMM FP8 {floors['fp8_tflops']:.0f} / "
             f"BF16 {floors['bf16_tflops']:.0f} TFLOP/s")
    progress(f"built {args.preset}: {dense} dense + {args.moe_layers} MoE layers, "
             f"attention: {'MSA on layers ' + str(list(config.sparse_attention_layers)) if config.sparse_attention_layers else 'dense everywhere'}, "
             f"{'BF16' if args.bf16 else 'FP8'} weights, TP {world} / EP {args.ep}")
    variants = {name: make_variant(name, model, world, args.ep, baseline_model) for name in args.variants}
    barrier = dist.barrier if dist.is_initialized() else None
    rows, compile_info = [], {}
    power = sampler_for(args.sustained, device.index or 0, progress)  # progress prints on rank 0

    def payload():
        return {"benchmark": "e2e", "tp": world, "ep": args.ep, "preset": args.preset,
                "attention": args.attention, "prefill_logits": args.prefill_logits,
                "sparse_layers": list(config.sparse_attention_layers),
                "moe_layers": args.moe_layers, "fp8": not args.bf16, "context": args.context,
                "dynamo_module_dict_guards": getattr(torch._dynamo.config, "use_recursive_dict_tags_for_guards", None),
                "repeats": args.repeats, "timing": "interleaved, each timed call after an untimed one of its own",
                "sustained_s": args.sustained, "variants": list(args.variants), "rows": rows, "floors": floors,
                "compiles": compile_info}

    # the sampler, when it stops, fills in each row's clock and power (PowerSampler.window)
    with torch.no_grad(), (power or contextlib.nullcontext()):
        for work in _workloads(args):
            label = f"{work['kind']} {work['tokens'] if work['kind'] == 'prefill' else 'batch ' + str(work['batch'])}"
            for m in (model, baseline_model):
                if m is None:
                    continue
                if work["kind"] == "decode":
                    _fill_cache(m, work["batch"], args.context, seed=work["batch"])
                else:
                    m.free_kv_cache()
            ids, pos = _inputs(work, config, device, args.context)
            kw = {"logits_to_keep": 1} if work["kind"] == "prefill" and args.prefill_logits == "last" else {}
            row = {"workload": work["kind"], "tokens": work["tokens"], "batch": work["batch"]}
            reference, eager_calls = None, []
            for name, fn in variants.items():  # compile (the first call) and compare with eager
                n_reports = len(compile_reports())
                sync_device(device)
                t0 = time.perf_counter()
                moe_calls = []
                if name == "eager" and work["kind"] == "decode":  # count the experts the step reads (floor)
                    (eager_calls, out), row["experts_touched"] = _experts_touched(
                        model, lambda: eager_router_calls(fn, ids, pos, **kw))
                    out = _logits(out)
                elif name == "eager":
                    eager_calls, out = eager_router_calls(fn, ids, pos, **kw)
                    out = _logits(out)
                else:
                    watch = watch_router_inputs() if world == 1 else contextlib.nullcontext([])
                    with watch as moe_calls:  # the first call runs the ops: which tokens routed otherwise
                        out = _logits(fn(ids, pos, **kw))
                sync_device(device)
                first = time.perf_counter() - t0
                row[f"{name}_first_call_s"] = first
                extra = ""
                if name == "eager":
                    reference = out.clone()
                elif reference is not None:
                    num = compare_logits(reference, out)
                    for key, col in _NUMERICS.items():
                        row[f"{name}_{col}"] = num[key]
                    extra = (f", rel err {num['max_rel_err']:.2e} (token median {num['median_token_rel_err']:.1e}), "
                             f"argmax {num['argmax_agreement']:.3f}")
                    if moe_calls and eager_calls:
                        try:
                            flips = routing_flips(eager_calls, moe_calls)
                            rows_flipped = logit_rows(flips.tokens, eager_calls[0].x.shape[0],
                                                      reference.reshape(-1, reference.shape[-1]).shape[0],
                                                      work["batch"])
                        except ValueError as e:  # e.g. the op saw other rows than eager's MoE: say so, time on
                            extra += f", routing not compared ({e})"
                        else:
                            row[f"{name}_flipped_tokens"] = len(flips.tokens)
                            row[f"{name}_rel_err_unflipped"] = errors_without(reference, out,
                                                                              rows_flipped)["max_rel_err"]
                            extra += f", {len(flips.tokens)} token(s) routed otherwise than eager"
                del out
                new = compile_reports()[n_reports:]
                if new:
                    compile_info[f"{label}/{name}"] = {
                        "passes": [{k: p.get(k) for k in ("name", "enabled", "matches", "skipped")} for p in new[-1]["passes"]],
                        "cudagraphs": new[-1].get("cudagraphs"), "timings_s": new[-1].get("timings_s")}
                progress(f"{label}: {name:<22} compiled, first call {first:5.1f}s{extra}")
            calls = {name: (lambda fn=fn: fn(ids, pos, **kw)) for name, fn in variants.items()}
            samples: dict[str, list[float]] = {}
            for name, ms in interleaved_median_ms(calls, args.warmup, args.repeats, barrier, samples=samples).items():
                row[f"{name}_ms"] = ms
                row[f"{name}_samples_ms"] = [round(t, 4) for t in samples[name]]  # in timing order
                progress(f"{label}: {name:<22} {ms:8.3f} ms (median of {args.repeats}, interleaved)")
            for name, call in calls.items():
                if device.type == "cuda" and name != "eager":  # where the step goes: host work vs GPU work
                    split = host_and_device_ms(call, args.repeats, barrier)
                    row[f"{name}_host_ms"], row[f"{name}_device_ms"] = split["host_ms"], split["device_ms"]
                if args.profile and name in PROFILED:
                    kernels, total_us = kernel_profile(call, args.profile, device)
                    row[f"{name}_kernels"] = top_kernels(kernels, total_us, args.profile, 25)
                    row[f"{name}_kernel_us"] = total_us / args.profile
                    row[f"{name}_launches"] = sum(n for _, n in kernels.values()) / args.profile
                    if device.type == "cuda":  # where the GPU idles inside one call
                        gaps = idle_gaps(call_timeline(call))
                        row[f"{name}_idle_us"], row[f"{name}_gaps"] = gaps["idle_us"], gaps["gaps"]
            for name in args.variants:
                if name != "eager" and "eager" in variants:
                    row[f"x_vs_eager_{name}"] = row["eager_ms"] / row[f"{name}_ms"]
            _floor_columns(row, work, config, world, args, floors)
            if "minimax" in variants:
                for name in ("torch-grouped", "inductor", "reduce-overhead", *ABLATIONS):
                    if name in variants:
                        row[f"minimax_x_vs_{name}"] = row[f"{name}_ms"] / row["minimax_ms"]
                # the GPU work alone: the stable figure (wall ratios move with the host, ~0.1 run to run)
                if "minimax_device_ms" in row and "torch-grouped_device_ms" in row:
                    row["minimax_device_x_vs_torch-grouped"] = row["torch-grouped_device_ms"] / row["minimax_device_ms"]
            if "torch-grouped" in variants:
                for name in KERNEL_VARIANTS:
                    if name in variants:
                        row[f"{name}_x_vs_torch-grouped"] = row["torch-grouped_ms"] / row[f"{name}_ms"]
            if args.sustained:  # back to back, as a server under load runs: the card at its power limit
                for name, call in calls.items():
                    if name == "eager":
                        continue
                    with power.window(row, f"{name}_"):
                        row[f"{name}_sustained_ms"] = sustained_ms(call, args.sustained)
                if "minimax" in variants and "torch-grouped" in variants:
                    row["minimax_sustained_x_vs_torch-grouped"] = (row["torch-grouped_sustained_ms"]
                                                                   / row["minimax_sustained_ms"])
            rows.append(row)
            del reference
            if rank == 0 and args.json:
                write_json(args.json, payload())
            if device.type == "cuda":
                torch.cuda.empty_cache()
    if rank == 0 and args.json and args.sustained:  # again, with the clocks and power
        write_json(args.json, payload())
    if rank == 0:
        _tables(rows, args.variants)
    # leaving the group (and, on GPUs, the process without teardown): tools/launch.py


def _measure_floors(device) -> dict:
    """The copy bandwidth and plain GEMM rates of this card, measured now."""
    from minimax_backend.tools.bench_common import copy_bandwidth_gbs, gemm_tflops

    return {"copy_gbs": copy_bandwidth_gbs(device), "bf16_tflops": gemm_tflops(device, fp8=False),
            "fp8_tflops": gemm_tflops(device, fp8=True)}


def _floor_columns(row, work, config, world, args, floors) -> None:
    from minimax_backend.tools.roofline import decode_bytes, prefill_flops

    if "minimax_ms" not in row:
        return
    if work["kind"] == "decode":
        floor_ms = decode_bytes(config, work["batch"], args.context, world, args.ep, not args.bf16,
                                touched_experts=row.get("experts_touched")) / floors["copy_gbs"] / 1e6
        row["floor_ms"] = floor_ms
        row["minimax_over_floor"] = row["minimax_ms"] / floor_ms
        if "minimax_device_ms" in row:  # the GPU work alone against the same floor
            row["minimax_device_over_floor"] = row["minimax_device_ms"] / floor_ms
    else:
        kept = 1 if args.prefill_logits == "last" else None
        tflops = prefill_flops(config, work["tokens"], world, logits_positions=kept) / row["minimax_ms"] / 1e9
        row["minimax_tflops"] = tflops
        row["minimax_frac_of_gemm"] = tflops / floors["bf16_tflops" if args.bf16 else "fp8_tflops"]


def _tables(rows, variants) -> None:
    from minimax_backend.tools.bench_common import print_table

    for kind in ("prefill", "decode"):
        part = [r for r in rows if r["workload"] == kind]
        if not part:
            continue
        key = "tokens" if kind == "prefill" else "batch"
        print_cols = [key] + [f"{v}_ms" for v in variants]
        print_table(part, print_cols, title=f"\n{kind}: median ms")
        ratio_cols = [key] + [c for c in part[0] if c.startswith("minimax_x_vs_") or c == "x_vs_eager_minimax"
                                      or c.endswith("_x_vs_torch-grouped")
                              or c in ("floor_ms", "minimax_over_floor", "minimax_device_over_floor", "minimax_tflops",
                                       "minimax_frac_of_gemm")]
        print_table(part, ratio_cols, title=f"{kind}: speed-up of minimax (other / minimax)")
        split_cols = [key] + [c for c in part[0]
                              if c.endswith(("_host_ms", "_device_ms", "_kernel_us", "_launches", "_idle_us"))]
        if len(split_cols) > 1:
            print_table(part, split_cols, title=f"{kind}: host ms per call, device ms (issued behind a busy GPU), "
                                                "kernel us and launches per call (--profile)")
        sustained_cols = [key] + [c for c in part[0] if c.endswith(("_sustained_ms", "_sm_mhz", "_watts"))
                                  or c == "minimax_sustained_x_vs_torch-grouped"]
        if len(sustained_cols) > 1:
            print_table(part, sustained_cols, title=f"{kind}: each variant back to back (the card at its power "
                                                    "limit): median ms, SM clock, board power")
        err_cols = [key] + [c for c in part[0] if c.endswith(tuple("_" + col for col in _NUMERICS.values())
                                                               + ("_flipped_tokens", "_rel_err_unflipped"))]
        print_table(part, err_cols, title=f"{kind}: logits vs eager (max |diff| per token / largest logit: "
                                          "the worst token, the median token, the 90th percentile; argmax agreement)")
        for r in part:
            for name in PROFILED:
                if f"{name}_kernels" in r:
                    print_table(r[f"{name}_kernels"][:12], ["us_per_call", "launches_per_call", "share", "name"],
                                title=f"{kind} {r[key]}: {name}, top kernels "
                                      f"({r[f'{name}_kernel_us']:.0f} us of kernels per call)")
                if f"{name}_gaps" in r:
                    print_table(r[f"{name}_gaps"], ["us", "at", "after", "before"],
                                title=f"{kind} {r[key]}: {name}, longest idle gaps inside one call "
                                      f"({r[f'{name}_idle_us']:.0f} us idle in all)")


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tp", type=int, default=1)
    p.add_argument("--ep", type=int, default=1)
    p.add_argument("--moe-layers", type=int, default=2)
    p.add_argument("--prefill", type=int, nargs="*", default=[1024, 4096, 8192])
    p.add_argument("--decode-batch", type=int, nargs="*", default=[1, 4, 16, 64])
    p.add_argument("--context", type=int, default=8192, help="KV-cache length before the decode step")
    p.add_argument("--prefill-logits", choices=["last", "all"], default="last",
                   help="prefill computes the last position's logits (what a serving engine samples from; "
                        "logits_to_keep=1) or every position's")
    p.add_argument("--variants", nargs="+", default=list(DEFAULT_VARIANTS), choices=VARIANTS)
    p.add_argument("--bf16", action="store_true", help="BF16 weights instead of FP8")
    p.add_argument("--attention", choices=["msa", "dense"], default="msa",
                   help="msa: M3's sparse layers as the config says; dense: every layer dense (the pre-MSA model)")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--repeats", type=int, default=10)
    p.add_argument("--preset", default="m3-slice", help="model shape (tiny-m3 for a CPU smoke run)")
    p.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    p.add_argument("--profile", type=int, default=0, metavar="CALLS",
                   help="also profile CALLS calls of minimax and torch-grouped (and of the kernel variants "
                        "minimax-moe-*): their top kernels in the JSON and tables, and on a GPU the idle gaps "
                        "inside one call")
    p.add_argument("--sustained", type=seconds_arg, default=0.0, metavar="SECONDS",
                   help="also run each compiled variant back to back for SECONDS per workload, with the SM clock "
                        "and board power nvidia-smi reads meanwhile (one GPU: --tp 1)")
    p.add_argument("--json")
    args = p.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("this benchmark needs CUDA GPUs (--device cpu --preset tiny-m3 for a smoke run)")
    if args.sustained and args.tp > 1:  # a loop bounded by time would give the ranks different call counts
        raise SystemExit("--sustained times one GPU: use it with --tp 1 (the ranks' collectives need the same "
                         "number of calls on every rank)")
    if "eager" not in args.variants:
        args.variants = ["eager", *args.variants]  # the numerics reference
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")
    from minimax_backend.tools.launch import run_on_ranks

    run_on_ranks(job, args.tp, args.device, args)


if __name__ == "__main__":
    main()
