"""Tile sweep of the MoE grouped GEMMs: each kernel's time per tile config (one device).

    python -m minimax_backend.tools.tune_moe --tokens 512 4096 16384 --json tune.json      # one H200
    TRITON_INTERPRET=1 python -m minimax_backend.tools.tune_moe --device cpu --preset tiny-m3 --tokens 5 --precisions bf16 \\
        --configs 16,128,64,4,2                                                              # smoke run

The layer is bench_moe's (preset `m3`: 128 experts, top-4, one shared expert,
random weights and routing from its router). For every token count,
precision and tile config (BM,BN,BK,warps,stages[,BN_DOWN[,down_warps,down_stages]], as the kernel
option moe_tiles takes it) the experts' grouped GEMMs
(kernels/moe_triton.py: grouped_gated_mlp with the shared expert merged) run
in a CUDA graph; torch.profiler gives each kernel's time per call, so the
gate/up and down kernels can be tuned apart. TFLOP/s count the useful
multiply-adds (the routed pairs and the shared expert's rows, no padding).
The table tile_config() ships (kernels/moe_plan.py) is chosen from these
runs: docs/kernel-notes.md#moe-tiles. --sustained SECONDS also runs each config
back to back with the SM clock and board power beside it: at prefill sizes the
card sits at its power limit, where a burst's ranking of tiles need not hold
(docs/kernel-notes.md#moe-at-the-power-limit).
"""

from __future__ import annotations

import argparse
import contextlib
import itertools

import torch

from minimax_backend.tools.gpu_power import seconds_arg

FP8_CONFIGS = ["64,128,128,4,3", "64,128,128,4,4", "64,128,128,8,3", "64,128,128,8,4",
               "128,128,128,8,3", "128,128,128,8,4", "128,128,128,4,3"]
BF16_CONFIGS = ["64,128,64,4,3", "64,128,64,4,4", "64,128,64,8,4", "128,128,64,8,3", "128,128,64,8,4",
                "128,128,64,4,3", "128,64,64,4,4"]


def _tiles(config: str, tokens: int, top_k: int, num_experts: int, fp8: bool) -> dict:
    """The launch config of one sweep entry: the kernel option moe_tiles' parsing and checks, and
    tile_config's dict for it."""
    from minimax_backend.kernels.moe_plan import tile_config
    from minimax_backend.kernels.options import override_kernel_options

    try:
        with override_kernel_options(moe_tiles=config):
            return tile_config(tokens, top_k, num_experts, fp8)
    except ValueError as e:
        raise SystemExit(f"--configs: {e}") from e


def _kind(name: str) -> str:
    for key, kind in (("gate_up", "gate_up"), ("down", "down"), ("combine", "combine"), ("quant", "quant")):
        if key in name:
            return kind
    return "other"


def gemm_and_down(gemms: list[str], downs: list[str], fp8: bool) -> list[tuple[str, str]]:
    """The (moe_gemm, moe_down) pairs to run: the down kernel's choice only after the 192-row gate/up;
    BF16 has the Triton kernels and the 192-row Gluon pair (its Gluon down always: moe_down=triton
    keeps a BF16 layer on Triton), no 64-row Gluon form."""
    if not fp8:
        return [(g, "auto" if g == "gluon192" else "triton") for g in gemms if g in ("triton", "gluon192")]
    return [(g, d) for g in gemms for d in (downs if g == "gluon192" else ["triton"])]


def trio_rows_for(gemm: str, trio_rows: list[str]) -> list[str]:
    """The moe_trio_rows values to run with one gate/up kernel: only the 192-row Gluon kernels read it."""
    return trio_rows if gemm == "gluon192" else ["all"]


def bf16_passes_for(gemm: str, fp8: bool, passes: list[str]) -> list[str]:
    """The moe_bf16_passes values to run with one gate/up kernel: only the BF16 192-row Gluon gate/up reads it."""
    return passes if gemm == "gluon192" and not fp8 else ["2"]


def fp8_yield_for(gemm: str, fp8: bool, yields: list[str]) -> list[str]:
    """The moe_fp8_yield values to run with one gate/up kernel: only the FP8 192-row Gluon kernels read it."""
    return yields if gemm == "gluon192" and fp8 else ["off"]


def half_blocks_for(gemm: str, down: str, half_blocks: list[str]) -> list[str]:
    """The moe_half_blocks values to run with one gate/up and down pair: only the Triton kernels read
    it, and the 192-row Gluon gate/up with the Gluon down (moe_down auto) leaves none."""
    return ["off"] if (gemm, down) == ("gluon192", "auto") else half_blocks


def variants(tokens: int, top_k: int, num_experts: int, fp8: bool, gate_up: tuple[str, ...],
             group_m: tuple[int, ...]) -> tuple[tuple[str, ...], tuple[int, ...]]:
    """The products and tile orders to run: those asked for, else tile_config's pick at this size."""
    from minimax_backend.kernels.moe_plan import tile_config

    table = tile_config(tokens, top_k, num_experts, fp8)
    table_order = table["GROUP_M"] if table["GROUP_M"] >= 0 else f"expert:{table['EXPERT_GROUPS']}"
    return (tuple(gate_up) or ("one_dot" if table["ONE_DOT"] else "two_dots",),
            tuple(table_order if g is None else g for g in group_m) or (table_order,))


def _order(group) -> dict:
    """The kernels' GROUP_M (and EXPERT_GROUPS) of one program order: g >= 0 (kernel option
    moe_group_m) or "expert:g" (moe_expert_groups: groups by expert, at most g row blocks)."""
    if isinstance(group, str):
        return {"GROUP_M": -1, "EXPERT_GROUPS": int(group.split(":")[1])}
    return {"GROUP_M": group}


def sweep(blk, cfg, tokens: int, configs: list[str], calls: int, device: torch.device,
          gate_up: tuple[str, ...] = (), group_m: tuple[int, ...] = (), sustained: float = 0.0,
          power=None) -> list[dict]:
    """Rows of timings, one per config x gate_up x group_m; an empty gate_up / group_m:
    what tile_config's table picks at this size. sustained > 0: each config also runs back to
    back for that many seconds (sustained_us), in a window of `power` (tools/gpu_power.py) that
    gives the row its SM clock and power when the sampling ends."""
    from minimax_backend.kernels.moe import block_op_args
    from minimax_backend.kernels.moe_triton import grouped_gated_mlp
    from minimax_backend.tools.bench_common import graphed, kernel_profile, median_ms, sustained_ms
    from minimax_backend.tools.bench_moe import blk_route

    a = block_op_args(blk)
    gen = torch.Generator(device).manual_seed(tokens)
    x = torch.randn(tokens, cfg.hidden_size, device=device, generator=gen).to(torch.bfloat16)
    ids, weights = blk_route(blk, x)
    fp8 = bool(a[4])
    shared = (a[6], a[7], a[8], a[9]) if a[6] is not None else None
    h, n, k = cfg.hidden_size, cfg.intermediate_size, cfg.num_experts_per_tok
    n_sh = cfg.shared_intermediate_size if shared is not None else 0
    flops_gate_up = 2.0 * h * 2 * (tokens * k * n + tokens * n_sh)
    flops_down = 2.0 * h * (tokens * k * n + tokens * n_sh)
    gate_up, group_m = variants(tokens, k, len(a[2]), fp8, gate_up, group_m)
    rows = []
    for c, product, group in [(c, g, m) for c in configs for g in gate_up for m in group_m]:
        tiles = dict(_tiles(c, tokens, k, len(a[2]), fp8), ONE_DOT=product == "one_dot", **_order(group))

        def call():
            return grouped_gated_mlp(x, ids, weights, a[2], a[3], a[4] or None, a[5] or None, a[13], a[14],
                                     a[15], a[16], a[17], len(a[2]), config=tiles, shared=shared)

        try:
            call()
            run = graphed(call) if device.type == "cuda" else call
            ms = median_ms(run, 2, 10)
            kernels, _ = kernel_profile(run, calls, device)
        except Exception as e:  # a config that does not compile or fit: say so, keep sweeping
            rows.append({"tokens": tokens, "config": c, "gate_up": product, "group_m": group,
                         "error": f"{type(e).__name__}: {str(e)[:120]}"})
            print(f"[tune_moe] {tokens} tokens {c} {product} group_m {group}: {rows[-1]['error']}", flush=True)
            continue
        per_kind: dict = {}
        for name, (us, _) in kernels.items():
            per_kind[_kind(name)] = per_kind.get(_kind(name), 0.0) + us / calls
        row = {"tokens": tokens, "config": c, "gate_up": product, "group_m": group, "call_us": ms * 1e3,
               "gate_up_us": per_kind.get("gate_up", 0.0), "down_us": per_kind.get("down", 0.0),
               "rest_us": sum(v for kk, v in per_kind.items() if kk not in ("gate_up", "down"))}
        for kernel, fl in (("gate_up", flops_gate_up), ("down", flops_down)):
            us = row[f"{kernel}_us"]
            row[f"{kernel}_tflops"] = fl / (us * 1e-6) / 1e12 if us else None
        row["layer_tflops"] = (flops_gate_up + flops_down) / (ms * 1e-3) / 1e12
        if sustained:  # tiles chosen by a burst can lose once the card sits at its power limit
            with power.window(row):
                sus = sustained_ms(run, sustained)
            row["sustained_us"] = sus * 1e3
            row["sustained_layer_tflops"] = (flops_gate_up + flops_down) / (sus * 1e-3) / 1e12
        row["fp8"] = fp8
        rows.append(row)
        print(f"[tune_moe] {'fp8' if fp8 else 'bf16'} {tokens} tokens {c} {product} group_m {group}: "
              f"call {row['call_us']:.0f} us, "
              f"gate_up {row['gate_up_us']:.0f} us ({row['gate_up_tflops'] or 0:.0f} TFLOP/s), "
              f"down {row['down_us']:.0f} us ({row['down_tflops'] or 0:.0f} TFLOP/s)", flush=True)
    return rows


def _orders(args) -> tuple:
    """The program orders to run: --group-m's (None: the table's) and --expert-groups' ("expert:g")."""
    return tuple(args.group_m) + tuple(f"expert:{g}" for g in args.expert_groups)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", type=int, nargs="+", default=[64, 512, 4096, 16384])
    p.add_argument("--precisions", nargs="+", choices=["bf16", "fp8"], default=["fp8", "bf16"])
    p.add_argument("--configs", nargs="+", help="tile configs BM,BN,BK,warps,stages[,BN_DOWN[,down_warps,down_stages]] "
                   "(without the last two the down kernel runs with the gate/up's warps and stages; default: a "
                   "sweep per precision)")
    p.add_argument("--gate-up", nargs="+", choices=["two_dots", "one_dot"], default=[],
                   help="the gate/up kernel's product per K step (kernel option moe_gate_up): each config is "
                        "run with each (default: what the tile table picks at each size)")
    p.add_argument("--group-m", type=int, nargs="+", default=[],
                   help="the programs' order (kernel option moe_group_m): 0 = row blocks fastest over all, "
                        "g = groups of g row blocks, each group's column tiles first (default: the tile "
                        "table's pick at each size)")
    p.add_argument("--expert-groups", type=int, nargs="+", default=[],
                   help="also the programs in groups by expert (kernel option moe_expert_groups), at most this many "
                        "row blocks each (kernels/moe_expert_groups.py)")
    p.add_argument("--moe-gemm", nargs="+", choices=["triton", "gluon", "gluon192"], default=["triton"],
                   help="the gate/up kernel (kernel option moe_gemm; gluon: the warp-specialized FP8 kernel of "
                        "kernels/moe_gluon.py, sm_90 only, at its BLOCK_M 64 tiles; gluon192: its 192-row form, "
                        "in BF16 too, there with the BF16 Gluon down; BF16 skips gluon)")
    p.add_argument("--moe-down", nargs="+", choices=["auto", "triton"], default=["auto"],
                   help="the FP8 down kernel after the 192-row gate/up (kernel option moe_down; auto: the Gluon "
                        "kernel over the same blocks); the other gate/up kernels are followed by the Triton one")
    p.add_argument("--trio-rows", nargs="+", choices=["all", "live"], default=["live"],
                   help="the 192-row Gluon GEMMs' row loads under --moe-gemm gluon192 (kernel option moe_trio_rows; "
                        "live: only the 64-row tiles of groups that hold rows)")
    p.add_argument("--bf16-passes", nargs="+", choices=["1", "2"], default=["1"],
                   help="the BF16 192-row Gluon gate/up under --moe-gemm gluon192 (kernel option moe_bf16_passes; "
                        "1: one pass over all 128 columns of h, the activation tiles loaded once, and the BF16 Gluon "
                        "down two column tiles a pass)")
    p.add_argument("--fp8-yield", nargs="+", choices=["off", "1", "2", "4"], default=["off"],
                   help="the FP8 192-row Gluon GEMMs under --moe-gemm gluon192 (kernel option moe_fp8_yield; n: the "
                        "yield hint on every n-th FFMA of their promotion runs, kernels/ffma_yield.py)")
    p.add_argument("--half-blocks", nargs="+", choices=["auto", "off", "on"], default=["auto"],
                   help="the Triton grouped GEMMs' half-block copy (kernel option moe_half_blocks; on: a block whose "
                        "second half is padding multiplies only its first half; auto: the table's choice)")
    p.add_argument("--preset", default="m3")
    p.add_argument("--calls", type=int, default=3, help="profiled calls per config")
    p.add_argument("--sustained", type=seconds_arg, default=0.0, metavar="SECONDS",
                   help="also run each config back to back for SECONDS and report its time with the SM clock and "
                        "board power nvidia-smi reads meanwhile (tools/gpu_power.py)")
    p.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    p.add_argument("--json")
    args = p.parse_args(argv)
    if any(g < 0 for g in args.group_m):
        raise SystemExit("--group-m: 0 (row blocks fastest) or a group size >= 1")
    if any(g < 1 for g in args.expert_groups):
        raise SystemExit("--expert-groups: the most row blocks in a group, >= 1")
    if args.expert_groups and not args.group_m:  # the table's order as well, to compare with
        args.group_m = [None]
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda needs a CUDA GPU (use TRITON_INTERPRET=1 with --device cpu --preset tiny-m3 "
                         "for a smoke run)")
    import minimax_backend.kernels  # noqa: F401  (registers the ops)
    from minimax_backend.kernels.interpreter import triton_interpreting

    for c in args.configs or []:
        _tiles(c, 1, 1, 1, False)  # a malformed config fails here, before anything is built
    if args.device == "cpu" and any(g.startswith("gluon") for g in args.moe_gemm):
        raise SystemExit("--moe-gemm gluon / gluon192 run on an sm_90 GPU only (the interpreter has no Gluon)")
    if args.device == "cpu" and not triton_interpreting():
        raise SystemExit("--device cpu runs the Triton kernels in Triton's interpreter: set TRITON_INTERPRET=1")
    from minimax_backend.kernels.options import override_kernel_options
    from minimax_backend.tools.bench_common import print_table, write_json
    from minimax_backend.tools.bench_moe import build_block
    from minimax_backend.tools.gpu_power import sampler_for

    device = torch.device("cuda", torch.cuda.current_device()) if args.device == "cuda" else torch.device("cpu")
    power = sampler_for(args.sustained, device.index or 0, lambda msg: print(f"[tune_moe] {msg}", flush=True))
    rows = []
    with power or contextlib.nullcontext():  # fills each row's SM clock and power when it ends
        for precision in args.precisions:
            fp8 = precision == "fp8"
            cfg, blk = build_block(args.preset, 0, 1, fp8, device)
            configs = args.configs or (FP8_CONFIGS if fp8 else BF16_CONFIGS)
            for tokens in args.tokens:
                pairs = gemm_and_down(args.moe_gemm, args.moe_down, fp8)
                if not pairs:
                    print(f"[tune_moe] {precision}: none of --moe-gemm {' '.join(args.moe_gemm)} has a {precision} "
                          "form (BF16: triton, gluon192); nothing run", flush=True)
                for gemm, down in pairs:
                    for trio_rows, halves, passes, yields in itertools.product(
                            trio_rows_for(gemm, args.trio_rows), half_blocks_for(gemm, down, args.half_blocks),
                            bf16_passes_for(gemm, fp8, args.bf16_passes), fp8_yield_for(gemm, fp8, args.fp8_yield)):
                        with torch.no_grad(), override_kernel_options(moe_gemm=gemm, moe_down=down,
                                                                      moe_trio_rows=trio_rows,
                                                                      moe_half_blocks=halves,
                                                                      moe_bf16_passes=passes,
                                                                      moe_fp8_yield=yields):
                            found = sweep(blk, cfg, tokens, configs, args.calls, device, tuple(args.gate_up),
                                          _orders(args), args.sustained, power)
                        for r in found:  # tagged in place: the sampler's windows hold these same dicts
                            r.update(precision=precision, moe_gemm=gemm, trio_rows=trio_rows, half_blocks=halves,
                                     bf16_passes=passes, fp8_yield=yields,
                                     moe_down="gluon192" if down == "auto" else down)
                        rows += found
            del blk
    ok = [r for r in rows if "error" not in r]
    print_table(ok, ["precision", "moe_gemm", "moe_down", "trio_rows", "half_blocks", "bf16_passes", "fp8_yield",
                     "tokens", "config", "gate_up", "group_m", "call_us", "gate_up_us", "gate_up_tflops", "down_us", "down_tflops", "rest_us",
                     "layer_tflops",
                     *(["sustained_us", "sustained_layer_tflops", "sm_mhz", "watts"] if args.sustained else [])],
                title="MoE grouped GEMMs per tile config")
    if args.json:
        write_json(args.json, {"benchmark": "moe_tiles", "preset": args.preset, "sustained_s": args.sustained,
                               "rows": rows})


if __name__ == "__main__":
    main()
