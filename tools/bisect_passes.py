"""Which pass moves the numbers: the compiled model against eager, once per pass switched the
other way (one process, TP 1).

    python -m minimax_backend.tools.bisect_passes --preset tiny-m3 --dtype bfloat16 --device cuda
    minimax-compile bisect ...                        (the same, as a subcommand)

Rows: `default` (every option as given), then per pass switch the same with that pass flipped
(`off` where it ran, `on` where `auto` left it off), and the other code generator (`codegen=fx`:
the rewritten ATen graph run op by op instead of Inductor's code, or the reverse). Each row: the
flipped pass's matches, the logits' largest error over the largest eager logit, the per-token
median, the tokens whose MoE routing differs from eager's in some layer and the largest error
without them (tools/routing_flips.py), argmax agreement with eager. A row whose error without
the flipped tokens differs from the default's by much names the pass (or the code generator) to
look at. A largest error that moves alone, with a flipped token, is a routing near-tie: two
correct compiles round differently and one token takes another expert (the BF16 "discrepancy"
of `fuse_norm_rope` on 2026-12-05 was one: docs/measurements/2026-12-05.md).

The model: a preset (`model/presets/`) with random weights (`init_random_weights`: scaled like a
trained model) or a checkpoint directory; random token ids from --seed.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import torch


def _model(args, device, dtype):
    from minimax_backend.model.minimax import build_model

    if args.checkpoint:
        from pathlib import Path

        from minimax_backend.model.checkpoint_loader import load_checkpoint
        from minimax_backend.model.config import MiniMaxConfig

        config = MiniMaxConfig.from_json_file(Path(args.checkpoint) / "config.json")
        model = build_model(config, dtype=dtype, device=device, quantize_fp8=config.quant_method == "fp8")
        load_checkpoint(model, args.checkpoint)
        return config, model.eval()
    from minimax_backend.model.presets import load_preset
    from minimax_backend.model.random_weights import init_random_weights

    config = load_preset(args.preset)
    model = build_model(config, dtype=dtype, device=device, quantize_fp8=config.quant_method == "fp8")
    return config, init_random_weights(model, seed=args.seed).eval()


def _flips(base: dict, report: dict, passes: list[str]) -> list[tuple[str, dict]]:
    """(row name, options) per pass: off where the default compile ran it, on where it did not."""
    ran = {p["name"]: p["enabled"] for p in report["passes"]}
    rows = []
    for name in passes:
        flip = "off" if ran.get(name, False) else "on"
        rows.append((f"{name}={flip}", {**base, name: flip}))
    other = "fx" if base.get("codegen", "inductor") != "fx" else "inductor"
    rows.append((f"codegen={other}", {**base, "codegen": other}))
    return rows


def main(argv=None) -> None:
    from minimax_backend.graph_passes.config import PASS_SWITCHES, BackendConfig, BackendOptionError

    p = argparse.ArgumentParser(prog="bisect_passes", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    src = p.add_mutually_exclusive_group()
    src.add_argument("--preset", default="tiny-m3", help="a built-in preset with random weights (default tiny-m3)")
    src.add_argument("--checkpoint", help="an HF-layout checkpoint directory instead")
    p.add_argument("--tokens", type=int, default=37, help="prompt tokens (default 37)")
    p.add_argument("--dtype", choices=("float32", "bfloat16"), default="bfloat16")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    p.add_argument("--options", default="{}", help="base backend options, JSON (default: every default)")
    p.add_argument("--passes", nargs="+", choices=PASS_SWITCHES, default=list(PASS_SWITCHES),
                   help="the passes to flip (default: every pass switch)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json")
    args = p.parse_args(argv)
    if args.tokens < 1:
        raise SystemExit(f"--tokens must be at least 1, got {args.tokens}")
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda: no CUDA GPU is visible")
    try:
        base = json.loads(args.options)
        if not isinstance(base, dict):
            raise ValueError("not a JSON object")
        BackendConfig.from_options(base)
    except (ValueError, BackendOptionError) as e:
        raise SystemExit(f"--options: {e}") from None

    import minimax_backend.graph_passes as gp
    from minimax_backend.tools.bench_common import hardware, print_table
    from minimax_backend.kernels.moe_probe import watch_router_inputs
    from minimax_backend.tools.routing_flips import eager_router_calls, errors_without, routing_flips
    from minimax_backend.tools.run_job import compare_logits

    device, dtype = torch.device(args.device), getattr(torch, args.dtype)
    config, model = _model(args, device, dtype)
    gen = torch.Generator().manual_seed(args.seed)
    ids = torch.randint(0, config.vocab_size, (1, args.tokens), generator=gen).to(device)
    pos = torch.arange(args.tokens, device=device)[None]
    eager_calls, eager = eager_router_calls(model, ids, pos)
    eager = eager[0] if isinstance(eager, tuple) else eager

    def run(name: str, options: dict) -> tuple[dict, dict]:
        t0 = time.perf_counter()
        torch._dynamo.reset()
        with torch.no_grad(), watch_router_inputs() as calls:
            out = gp.compile(model, **options)(ids, pos)  # the first call runs the ops (no replay yet)
        out = (out[0] if isinstance(out, tuple) else out).clone()
        report = gp.last_compile_report()
        row = {"variant": name, **compare_logits(eager, out)}
        flips, why = None, "no minimax MoE op ran"  # the MoE left as the model's code (moe_canonicalize off)
        if calls or not eager_calls:
            try:
                flips = routing_flips(eager_calls, calls)
            except ValueError as e:
                why = str(e)
        if flips is None:
            row.update(flipped_tokens="-", max_rel_err_unflipped="-", flips=None)
            note = f"routing not compared: {why}"
        else:
            rest = errors_without(eager, out, flips.tokens)
            row.update(flipped_tokens=len(flips.tokens), max_rel_err_unflipped=rest["max_rel_err"],
                       flips=flips.as_dict())
            note = f"{len(flips.tokens)} token(s) routed otherwise than eager, {rest['max_rel_err']:.3g} without them"
        row["seconds"] = time.perf_counter() - t0
        print(f"[bisect] {name}: rel err {row['max_rel_err']:.3g} ({note}), argmax {row['argmax_agreement']:.3f} "
              f"({row['seconds']:.1f}s)", file=sys.stderr, flush=True)
        return row, report

    total = len(args.passes) + 2
    print(f"[bisect] {total} compiles of {args.preset if not args.checkpoint else args.checkpoint}, "
          f"{args.tokens} tokens, {args.dtype} on {args.device}", file=sys.stderr, flush=True)
    default, report = run("default", base)
    default["matches"] = ""
    rows = [default]
    for name, options in _flips(base, report, args.passes):
        row, rep = run(name, options)
        pass_name = name.split("=")[0]
        rec = next((r for r in rep["passes"] if r["name"] == pass_name), None)
        row["matches"] = rec["matches"] if rec is not None and rec["enabled"] else "-"
        rows.append(row)
    cols = ["variant", "matches", "max_rel_err", "median_token_rel_err", "flipped_tokens", "max_rel_err_unflipped",
            "argmax_agreement", "finite", "seconds"]
    print_table(rows, cols, title=f"compiled vs eager per pass flipped ({args.dtype}, {args.device}, "
                                  f"{args.tokens} tokens); max_rel_err over the largest eager logit; "
                                  "flipped_tokens: tokens whose MoE routing differs from eager's in some "
                                  "layer (a near-tie), max_rel_err_unflipped: the largest error without them")
    if args.json:
        from minimax_backend.tools.bench_common import write_json

        write_json(args.json, {"tool": "bisect_passes", "hardware": hardware(), "dtype": args.dtype,
                               "device": args.device, "tokens": args.tokens, "base_options": base, "rows": rows})


if __name__ == "__main__":
    main()
