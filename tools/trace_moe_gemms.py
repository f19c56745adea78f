"""Where the 192-row FP8 expert GEMMs' time goes, from timers inside them (one Hopper GPU).

    python -m minimax_backend.tools.trace_moe_gemms --tokens 4096 8192 16384 --json trace.json

The gate/up and down kernels of M3's MoE layer (bench_moe's `m3` block, FP8; kernels/moe_gluon.py)
are captured from one layer call at each token count (their inputs exactly as the layer makes
them) and launched alone: as built, then the build with its timers compiled in
(kernels/gluon_trace.py), whose records say per program when it started and ended on which SM, when
its first stage landed, when its last product was done, and how many cycles its producer waited for
free stages and its consumer warp groups for loaded ones. Printed per kernel and token count, as
shares of the kernel's SM time (SMs used x the kernel's span):

    head, between, tail   no program on the SM: before its first, between two (the next one's
                          launch), after its last until the kernel's last program ends
    fill                  a program's set-up and the ring's first loads (entry to first stage landed)
    K loop                first stage landed to last product done (group 0); in the down, whose
                          programs cover several column tiles, with the stores of all but the last
    epilogue              last product to the program's last store
    idle blocks           programs whose block holds no rows

and for the K loops: us per K step, how much of them the live consumer groups spent waiting for
loaded stages (loads behind) and the producer spent waiting for free stages (products behind),
and how much of them the live groups' products take at the tensor cores' dense rate.
The weight tiles' rate into the SMs (each program loads its own; blocks of one expert share them
through the L2, so this is not the HBM rate) over the plain kernel's time and over the K loops,
both as a fraction of the same run's copy bandwidth. The traced kernel's time beside the plain one's says what
the timers cost. The layer takes the 192-row kernels from 128 rows per expert (4096 tokens at EP 1,
kernel option moe_gemm=auto); MINIMAX_MOE_GEMM=gluon192 forces them at fewer.
"""

from __future__ import annotations

import argparse
import inspect
import statistics

import torch

from minimax_backend.kernels import gluon_trace

WEIGHT_BYTES_PER_STEP = 128 * 128  # one stacked [128, 128] FP8 weight tile per K step
# one live group's product of a K step, a [64, 128] x 128 FP8 wgmma: 256 cycles of an SM's tensor
# cores at Hopper's 8192 dense FP8 FLOP a cycle
PRODUCT_CYCLES = 2 * 64 * 128 * 128 // 8192


def summarize(records: torch.Tensor, passes: int) -> dict:
    """The shares and rates above from a traced launch's records ([programs, RECORD_SLOTS] int64) of a
    kernel whose programs walk K `passes` times (the gate/up: its two 64-column halves; the down: its
    column tiles)."""
    if records.dim() != 2 or records.shape[1] != gluon_trace.RECORD_SLOTS or records.shape[0] == 0:
        raise ValueError(f"trace records must be [programs, {gluon_trace.RECORD_SLOTS}], got {tuple(records.shape)}")
    r = {name: records[:, i].tolist() for name, i in gluon_trace.SLOT.items()}
    programs = records.shape[0]
    if any(e <= 0 or s <= 0 for e, s in zip(r["end_ns"], r["entry_ns"])):
        raise ValueError("a program left no record (entry or end time 0): the launch did not run every program "
                         "with the timers on")
    start, end = min(r["entry_ns"]), max(r["end_ns"])
    span = end - start
    # cycles per ns of each program from its own span (the SM clock moves under the power limit)
    rates = [(ec - c0) / (e - s) for c0, ec, s, e in zip(r["entry_cycle"], r["end_cycle"], r["entry_ns"], r["end_ns"])
             if e - s > 1000]
    ghz = statistics.median(rates) if rates else 1.0
    live = [i for i in range(programs) if r["work"][i] & 1]
    idle = [i for i in range(programs) if not r["work"][i] & 1]

    def ns(cycles: float) -> float:
        return cycles / ghz

    fill = sum(ns(r["first_ready_cycle"][i] - r["entry_cycle"][i]) for i in live)
    loop = sum(ns(r["last_product_cycle"][i] - r["first_ready_cycle"][i]) for i in live)
    epilogue = sum(ns(r["end_cycle"][i] - r["last_product_cycle"][i]) for i in live)
    idle_ns = sum(r["end_ns"][i] - r["entry_ns"][i] for i in idle)
    by_sm: dict[int, list[int]] = {}
    for i in range(programs):
        by_sm.setdefault(r["sm"][i], []).append(i)
    head = tail = between = 0
    for progs in by_sm.values():
        progs.sort(key=lambda i: r["entry_ns"][i])
        head += r["entry_ns"][progs[0]] - start
        tail += end - max(r["end_ns"][i] for i in progs)
        between += sum(max(r["entry_ns"][b] - r["end_ns"][a], 0) for a, b in zip(progs, progs[1:]))
    sm_time = len(by_sm) * span
    steps = {i: passes * (r["work"][i] >> 3) for i in live}
    loop_cycles = {i: r["last_product_cycle"][i] - r["first_ready_cycle"][i] for i in live}
    all_steps, all_loop_cycles = sum(steps.values()), sum(loop_cycles.values())
    groups = [(i, g) for i in live for g in range(3) if r["work"][i] >> g & 1]
    ready_wait = sum(r[f"ready_wait_{g}"][i] for i, g in groups)
    ready_span = sum(loop_cycles[i] for i, _ in groups)
    producer_span = sum(r["last_issue_cycle"][i] - r["producer_entry_cycle"][i] for i in live)
    return {
        "programs": programs,
        "live_programs": len(live),
        "sms": len(by_sm),
        "programs_per_sm": programs / len(by_sm),
        "span_us": span / 1e3,
        "sm_ghz": ghz,
        "share": {
            "head": head / sm_time, "between": between / sm_time, "tail": tail / sm_time,
            "fill": fill / sm_time, "k_loop": loop / sm_time, "epilogue": epilogue / sm_time,
            "idle_blocks": idle_ns / sm_time,
        },
        "program_us_median": statistics.median(r["end_ns"][i] - r["entry_ns"][i] for i in live) / 1e3 if live else 0.0,
        "fill_us_median": statistics.median(ns(r["first_ready_cycle"][i] - r["entry_cycle"][i]) for i in live) / 1e3
        if live else 0.0,
        "epilogue_us_median": statistics.median(ns(r["end_cycle"][i] - r["last_product_cycle"][i]) for i in live) / 1e3
        if live else 0.0,
        "us_per_k_step": ns(all_loop_cycles) / max(all_steps, 1) / 1e3,
        "consumer_ready_wait": ready_wait / ready_span if ready_span else 0.0,
        "tensor_core_busy": sum(steps[i] for i, _ in groups) * PRODUCT_CYCLES / all_loop_cycles
        if all_loop_cycles else 0.0,
        "producer_empty_wait": sum(r["empty_wait"][i] for i in live) / producer_span if producer_span else 0.0,
        # weight tiles over the K loops of all SMs at once: each SM streams one program's tiles at a time
        "k_loop_weight_tiles_gbs": all_steps * WEIGHT_BYTES_PER_STEP / ns(all_loop_cycles) * len(by_sm)
        if all_loop_cycles else 0.0,
    }


KERNELS = {"gate_up": "gate_up_act_trio", "down": "down_trio"}  # name -> its launcher in moe_gluon


def capture_launches(layer_call) -> dict[str, dict]:
    """The arguments of the 192-row gate/up and down launches in one call of the layer, by name."""
    from minimax_backend.kernels import moe_gluon

    reals = {name: getattr(moe_gluon, fn) for name, fn in KERNELS.items()}
    seen: dict[str, list[inspect.BoundArguments]] = {name: [] for name in KERNELS}

    def recorder(name):
        def record(*args, **kwargs):
            seen[name].append(inspect.signature(reals[name]).bind(*args, **kwargs))
            return reals[name](*args, **kwargs)
        return record

    for name, fn in KERNELS.items():
        setattr(moe_gluon, fn, recorder(name))
    try:
        layer_call()
    finally:
        for name, fn in KERNELS.items():
            setattr(moe_gluon, fn, reals[name])
    counts = {name: len(calls) for name, calls in seen.items()}
    if set(counts.values()) != {1}:
        raise SystemExit(f"the layer launched the 192-row kernels {counts} times, expected once each: they run from "
                         "128 rows per expert (kernel option moe_gemm=auto, moe_down=auto); "
                         "MINIMAX_MOE_GEMM=gluon192 forces them")
    return {name: dict(calls[0].arguments) for name, calls in seen.items()}


def _launch(name: str, kw: dict, trace: torch.Tensor | None = None):
    from minimax_backend.kernels import moe_gluon

    return getattr(moe_gluon, KERNELS[name])(**kw, trace=trace)


def _trace_setup(name: str, kw: dict) -> tuple[int, int, int]:
    """(int64 values of the records, K passes per program, K steps per pass) of a launch."""
    from minimax_backend.kernels import moe_gluon

    if name == "gate_up":
        return moe_gluon.trio_trace_slots(kw["num_m"], kw["n"]), 2, kw["xg"].shape[1] // 128
    tiles = moe_gluon.col_tiles_per_program(kw["n_out"] // 128, moe_gluon.DOWN_TRIO_COL_TILES)
    return moe_gluon.down_trace_slots(kw["num_m"], kw["n_out"]), tiles, kw["h"].shape[1] // 128


def trace_tokens(w_args, hidden: int, tokens: int, repeats: int, device: torch.device) -> list[dict]:
    from minimax_backend.tools.bench_common import median_ms

    x = torch.randn(tokens, hidden, device=device, generator=torch.Generator(device).manual_seed(tokens))
    x = x.to(torch.bfloat16)
    sp = ("", 1, False, False, tokens, "allgather")  # one device: the block on its tokens
    launches = capture_launches(lambda: torch.ops.minimax.mega_moe(x, *w_args, *sp))
    rows = []
    for name, kw in launches.items():
        slots, passes, steps = _trace_setup(name, kw)
        buf = torch.zeros(slots, dtype=torch.int64, device=device)
        plain_ms = median_ms(lambda: _launch(name, kw), 3, repeats)
        traced_ms = median_ms(lambda: _launch(name, kw, buf), 3, repeats)
        summary = summarize(buf.view(-1, gluon_trace.RECORD_SLOTS).cpu(), passes)
        # every live program loads its passes' weight tiles once
        tiles = summary["live_programs"] * passes * steps * WEIGHT_BYTES_PER_STEP
        rows.append({"kernel": name, "tokens": tokens, "blocks": kw["num_m"], "plain_us": plain_ms * 1e3,
                     "traced_us": traced_ms * 1e3, "weight_tiles_gbs": tiles / (plain_ms * 1e-3) / 1e9, **summary})
    return rows


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", type=int, nargs="+", default=[4096, 8192, 16384])
    p.add_argument("--preset", default="m3")
    p.add_argument("--repeats", type=int, default=10, help="timed launches of each build, median")
    p.add_argument("--json")
    args = p.parse_args(argv)
    if min(args.tokens) < 1 or args.repeats < 1:
        raise SystemExit("--tokens and --repeats must be at least 1")
    import minimax_backend.kernels  # noqa: F401  (registers the ops)
    from minimax_backend.kernels import moe_gluon

    device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    if not moe_gluon.gluon_available(device):
        raise SystemExit("trace_moe_gemms needs triton's Gluon and an sm_90 GPU (H100 / H200)")
    from minimax_backend.kernels.moe import block_op_args
    from minimax_backend.tools.bench_common import copy_bandwidth_gbs, print_table, write_json
    from minimax_backend.tools.bench_moe import build_block

    cfg, blk = build_block(args.preset, 0, 1, True, device)
    w_args = block_op_args(blk)
    copy = copy_bandwidth_gbs(device)
    rows = []
    for tokens in args.tokens:
        print(f"tracing the gate/up and down at {tokens} tokens ...", flush=True)
        for row in trace_tokens(w_args, cfg.hidden_size, tokens, args.repeats, device):
            row["weight_tiles_over_copy"] = row["weight_tiles_gbs"] / copy
            rows.append(row)
            shares = ", ".join(f"{k} {v:.3f}" for k, v in row["share"].items())
            print(f"  {row['kernel']}: {row['plain_us']:.0f} us ({row['traced_us']:.0f} traced); {shares}; "
                  f"ready wait {row['consumer_ready_wait']:.3f}, empty wait {row['producer_empty_wait']:.3f}",
                  flush=True)
    table = [{"kernel": r["kernel"], "tokens": r["tokens"], "plain_us": r["plain_us"], "traced_us": r["traced_us"],
              "programs_per_sm": r["programs_per_sm"], "program_us": r["program_us_median"],
              **{k: r["share"][k] for k in ("head", "between", "tail", "fill", "k_loop", "epilogue", "idle_blocks")},
              "us_per_step": r["us_per_k_step"], "ready_wait": r["consumer_ready_wait"],
              "empty_wait": r["producer_empty_wait"], "tensor_busy": r["tensor_core_busy"],
              "tiles/copy": r["weight_tiles_over_copy"], "k_loop_tiles/copy": r["k_loop_weight_tiles_gbs"] / copy}
             for r in rows]
    print_table(table, list(table[0]), f"192-row FP8 expert GEMMs, shares of SM time (copy {copy:.0f} GB/s)")
    if args.json:
        write_json(args.json, {"benchmark": "trace_moe_gemms", "preset": args.preset,
                               "copy_gbs": copy, "repeats": args.repeats, "rows": rows})


if __name__ == "__main__":
    main()
