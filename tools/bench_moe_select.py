"""The decode MoE layer with its routing launches fused (moe_select=fused) against separate, and with its
launches overlapped (moe_overlap=auto, PDL) against plain (one GPU, ~1 minute).

    python -m minimax_backend.tools.bench_moe_select --json select.json

fused        the router's logits launch also quantizes x for the expert GEMMs (FP8), and the
             top-k selection, the shared expert's slot and the expert alignment run in one
             launch (kernels/moe_select_align.py), up to select_align_fits' token count; on
             sm_90 the five launches are programmatic dependent launches (kernels/launch_overlap.py)
fused_plain  the same with moe_overlap=off: plain launches
separate     a quantization kernel, the selection kernel, two torch.cat and the alignment kernel

Each runs the whole mega_moe op at M3 sizes, each as CUDA-graph replays of `--calls`
back-to-back calls, timed in alternating rounds (interleaved_median_ms), so a drift of the
card's clocks reaches all alike. The outputs must be bit-equal: a difference is an error,
not a column. floor_us is the weight-read floor: the experts the batch touches plus the shared
expert, read once at the copy bandwidth measured in the same run.

`TRITON_INTERPRET=1 python -m minimax_backend.tools.bench_moe_select --dry-run` runs every code
path on the CPU (Triton interpreter, the tiny-m3 preset, host clock) to check the script; its
numbers mean nothing.
"""

from __future__ import annotations

import argparse

import torch

TOKENS = (1, 4, 16, 64)
FORMS = {"separate": {"moe_select": "separate"}, "fused_plain": {"moe_select": "fused", "moe_overlap": "off"},
         "fused": {"moe_select": "fused", "moe_overlap": "auto"}}


def _forms(x, w_args, tokens: int, calls: int, device):
    """{form: a function running `calls` layer calls (CUDA-graph replay on a GPU)} and each form's output."""
    from minimax_backend.kernels.options import override_kernel_options
    from minimax_backend.tools.bench_common import graphed

    forms, outputs = {}, {}
    for form, options in FORMS.items():
        with override_kernel_options(**options):
            def layer():
                return torch.ops.minimax.mega_moe(x, *w_args, "", 1, False, False, tokens, "allgather")

            if device.type == "cuda":
                forms[form] = graphed(layer, calls)  # options are read while capturing
            else:
                def layer_now(layer=layer, options=options):
                    with override_kernel_options(**options):
                        return layer()

                forms[form] = layer_now
            outputs[form] = forms[form]()
    return forms, outputs


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", type=int, nargs="+", default=list(TOKENS))
    p.add_argument("--precisions", nargs="+", choices=["bf16", "fp8"], default=["fp8", "bf16"])
    p.add_argument("--calls", type=int, default=20, help="layer calls per CUDA graph")
    p.add_argument("--repeats", type=int, default=11, help="timed rounds (each form once a round)")
    p.add_argument("--dry-run", action="store_true", help="check the script on the CPU (see above)")
    p.add_argument("--json")
    args = p.parse_args(argv)
    from minimax_backend.tools.bench_common import require_device

    require_device(args.dry_run)
    bad = [t for t in args.tokens if t < 1]
    if bad:
        raise SystemExit(f"--tokens must be at least 1, got {bad}")
    import minimax_backend.kernels  # noqa: F401  (registers the ops)
    from minimax_backend.kernels.moe import block_op_args
    from minimax_backend.kernels.moe_select_align import select_align_fits
    from minimax_backend.tools.bench_common import copy_bandwidth_gbs, interleaved_median_ms, print_table, write_json
    from minimax_backend.tools.bench_moe import _expert_bytes, build_block, touched_weight_bytes

    device = torch.device("cpu" if args.dry_run else "cuda")
    preset = "tiny-m3" if args.dry_run else "m3"
    calls = 1 if args.dry_run else args.calls
    copy_gbs = copy_bandwidth_gbs(device)
    rows = []
    for precision in args.precisions:
        fp8 = precision == "fp8"
        cfg, blk = build_block(preset, 0, 1, fp8, device)
        w_args = block_op_args(blk)
        routed_bytes, shared_bytes = _expert_bytes(w_args, fp8)
        for tokens in args.tokens:
            gen = torch.Generator(device).manual_seed(tokens)
            x = torch.randn(tokens, cfg.hidden_size, device=device, generator=gen).to(torch.bfloat16)
            with torch.no_grad():
                forms, outputs = _forms(x, w_args, tokens, calls, device)
                for form in ("fused_plain", "fused"):
                    if not torch.equal(outputs[form], outputs["separate"]):
                        diff = (outputs[form].float() - outputs["separate"].float()).abs().max().item()
                        raise SystemExit(f"{precision} at {tokens} tokens: {form} and separate outputs differ "
                                         f"(max abs {diff:.3g}); they must be bit-equal")
                ms = interleaved_median_ms(forms, warmup=2, repeats=args.repeats, lead_in=1)
                floor_us = touched_weight_bytes(blk, x, routed_bytes, shared_bytes) / (copy_gbs * 1e3)
            row = {"precision": precision, "tokens": tokens,
                   "fused_taken": select_align_fits(tokens, cfg.num_experts_per_tok, cfg.num_local_experts,
                                                    cfg.n_shared_experts > 0),
                   **{f"{form}_us": ms[form] * 1e3 / calls for form in FORMS}}
            row["fused_over_separate"] = row["fused_us"] / row["separate_us"]
            row["fused_over_plain"] = row["fused_us"] / row["fused_plain_us"]
            row["floor_us"] = floor_us
            row["fused_over_floor"] = row["fused_us"] / floor_us
            rows.append(row)
            print(f"[bench_moe_select] {row}", flush=True)
        del blk, w_args
        if device.type == "cuda":
            torch.cuda.empty_cache()
    cols = ["precision", "tokens", "fused_taken", "separate_us", "fused_plain_us", "fused_us", "fused_over_separate",
            "fused_over_plain", "floor_us", "fused_over_floor"]
    table = print_table(rows, cols, title=f"\nMoE layer at decode sizes, preset {preset}: us per call "
                                          f"(medians of {args.repeats} alternating rounds); outputs bit-equal")
    if args.json:
        write_json(args.json, {"benchmark": "moe_select", "preset": preset, "calls_per_graph": calls,
                               "copy_gbs": copy_gbs, "rows": rows, "table": table})


if __name__ == "__main__":
    main()
