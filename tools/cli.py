"""`minimax-compile`: make checkpoints, run eager vs compiled, dump graphs.

    minimax-compile run                      # tiny built-in FP8 model, TP 2 / EP 2 on CPU, every pass
    minimax-compile run --tp 2 --ep 2 --json report.json
    minimax-compile make-checkpoint --config tiny-m3 --out /tmp/ckpt [--fp8]
    minimax-compile dump --dump /tmp/dump    # compile only, write the graph dump
    minimax-compile summarize /tmp/dump      # op-count table of a dump
"""

from __future__ import annotations

import argparse
import json
import hashlib
import os
import shutil
import sys
from pathlib import Path

DEFAULT_PRESET = "tiny-m3-fp8"
# `run` without --options: sequence parallelism forced on, so the 37-token demo shows every
# rewrite (its auto rule keeps it off below sequence_parallel_min_tokens = 1024 tokens).
DEMO_OPTIONS = {"sequence_parallel": "on"}


def cache_dir() -> Path:
    root = os.environ.get("MINIMAX_CACHE_DIR") or Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "minimax_backend"
    return Path(root)


def load_config(spec: str):
    """A preset name or a path to an HF config.json (or a checkpoint directory)."""
    from minimax_backend.model.config import MiniMaxConfig
    from minimax_backend.model.presets import PRESET_NAMES, load_preset

    path = Path(spec)
    if path.is_dir():
        path = path / "config.json"
    if path.is_file():
        return MiniMaxConfig.from_json_file(path)
    if spec in PRESET_NAMES:
        return load_preset(spec)
    raise SystemExit(f"--config {spec!r} is neither a config file nor a preset ({', '.join(PRESET_NAMES)})")


def default_checkpoint() -> Path:
    """The tiny preset's random checkpoint, written once into the cache.

    The folder name carries a hash of the preset, so editing the preset makes
    a new checkpoint instead of loading a stale one.
    """
    from minimax_backend.model.checkpoint_writer import save_random_checkpoint

    config = load_config(DEFAULT_PRESET)
    digest = hashlib.sha256(json.dumps(config.to_hf_dict(), sort_keys=True, default=str).encode()).hexdigest()[:10]
    out = cache_dir() / "checkpoints" / f"{DEFAULT_PRESET}-{digest}"
    if not (out / "config.json").exists():
        print(f"[minimax] writing the built-in {DEFAULT_PRESET} checkpoint to {out} (first use only)", flush=True)
        tmp = out.with_name(f"{out.name}.tmp{os.getpid()}")
        save_random_checkpoint(config, tmp, seed=0)
        try:
            tmp.rename(out)
        except OSError:  # another process wrote it first
            shutil.rmtree(tmp, ignore_errors=True)
    return out


def _options(text: str | None) -> dict:
    if not text:
        return {}
    try:
        options = json.loads(text)
    except json.JSONDecodeError as e:
        raise SystemExit(f"--options is not valid JSON: {e}") from None
    if not isinstance(options, dict):
        raise SystemExit("--options must be a JSON object, e.g. '{\"strict\": true}'")
    return options  # its keys and values: checked against the ranks in _run_args


def cmd_make_checkpoint(a) -> None:
    from minimax_backend.model.checkpoint_writer import save_random_checkpoint

    config = load_config(a.config)
    save_random_checkpoint(config, Path(a.out), seed=a.seed, fp8=a.fp8 or config.is_fp8)
    print(f"wrote a random {config.model_type} checkpoint ({'fp8' if a.fp8 else 'bf16'}) to {a.out}")


def _run_args(a, compile_only: bool):
    """The job's arguments, every check a user can fail done here, before any rank starts,
    each as its message alone (no traceback)."""
    from minimax_backend.graph_passes.config import BackendConfig, BackendOptionError
    from minimax_backend.model.config import MiniMaxConfig
    from minimax_backend.model.config_error import ConfigError
    from minimax_backend.tools.run_job import RunArgs

    options = _options(a.options)
    if a.tokens < 1 or a.batch < 1:
        raise SystemExit("--tokens and --batch must be at least 1")
    if a.ep is None:
        a.ep = a.tp  # expert parallelism over every rank, as the fused MoE is built for
    if a.tp < 1 or a.ep < 1 or a.tp % a.ep:
        raise SystemExit(f"--ep {a.ep} must be >= 1 and divide --tp {a.tp}")
    demo = a.options is None and not compile_only
    if demo:
        options = dict(DEMO_OPTIONS)
    try:  # unknown keys, bad values, and the options against these ranks (an ep_size that does not divide --tp)
        BackendConfig.from_options({"tp_size": a.tp, "ep_size": a.ep, **options})
    except BackendOptionError as e:
        raise SystemExit(f"--options: {e}") from None
    if a.device == "cuda":
        import torch

        if not torch.cuda.is_available():
            raise SystemExit("--device cuda: no CUDA GPU is visible")
    checkpoint = Path(a.checkpoint) if a.checkpoint else default_checkpoint()
    if not (checkpoint / "config.json").is_file():
        raise SystemExit(f"--checkpoint {checkpoint}: no config.json there")
    try:
        MiniMaxConfig.from_json_file(checkpoint / "config.json").validate_for_parallel(a.tp, a.ep)
    except ConfigError as e:  # a model these ranks cannot shard
        raise SystemExit(f"--tp {a.tp} / --ep {a.ep}: {e}") from None
    if demo:
        print(f"[minimax] no --options: using {json.dumps(DEMO_OPTIONS)} so that every pass has work at "
              f"{a.tokens} tokens", flush=True)
    return RunArgs(
        checkpoint=str(checkpoint), tp=a.tp, ep=a.ep, tokens=a.tokens, batch=a.batch,
        dtype=a.dtype, decode_steps=0 if compile_only else a.decode_steps,
        options=options, dump=a.dump or ("minimax_dumps" if not compile_only else None), save_logits=getattr(a, "save_logits", None),
        json_path=getattr(a, "json", None), device=a.device, seed=a.seed,
        repeats=getattr(a, "repeats", 1), compile_only=compile_only,
    )


def _launch(run_args) -> None:
    from minimax_backend.tools.launch import run_on_ranks
    from minimax_backend.tools.run_job import run_job

    run_on_ranks(run_job, run_args.tp, run_args.device, run_args)


def cmd_run(a) -> None:
    _launch(_run_args(a, compile_only=False))


def cmd_dump(a) -> None:
    if not a.dump:
        a.dump = "minimax_dumps"
    _launch(_run_args(a, compile_only=True))


def cmd_summarize(a) -> None:
    from minimax_backend.tools.graph_dump import main as dump_main

    sys.exit(dump_main(["summarize", a.dir]))


def _add_run_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--checkpoint", help="HF-layout safetensors directory (default: tiny built-in preset)")
    p.add_argument("--tp", type=int, default=2, help="tensor-parallel ranks (default 2)")
    p.add_argument("--ep", type=int, default=None, help="expert-parallel ranks, divides --tp (default: --tp)")
    p.add_argument("--tokens", type=int, default=37, help="prompt tokens per sequence (default 37)")
    p.add_argument("--batch", type=int, default=1, help="sequences (default 1)")
    p.add_argument("--dtype", choices=sorted(__import__("minimax_backend.tools.run_job", fromlist=["DTYPES"]).DTYPES),
                   default="float32", help="activations (default float32: the comparison with eager then shows "
                   "the rewrites, not BF16 rounding; FP8 weights stay FP8)")
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    p.add_argument("--options", help="backend options as a JSON object")
    p.add_argument("--dump", help="write the graph dump of every stage here (run: default ./minimax_dumps)")
    p.add_argument("--seed", type=int, default=0)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="minimax-compile", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("make-checkpoint", help="write a random HF-format checkpoint")
    p.add_argument("--config", required=True, help="config.json path or preset name")
    p.add_argument("--out", required=True)
    p.add_argument("--fp8", action="store_true", help="FP8 E4M3 weights with 128x128 block scales")
    p.add_argument("--seed", type=int, default=0)
    p.set_defaults(func=cmd_make_checkpoint)

    p = sub.add_parser("run", help="run eager and compiled on the same inputs and compare")
    _add_run_flags(p)
    p.add_argument("--decode-steps", type=int, default=2)
    p.add_argument("--repeats", type=int, default=3, help="timed repeats (medians are reported)")
    p.add_argument("--save-logits", help="torch file with input_ids, eager, compiled")
    p.add_argument("--json", help="write the run report as JSON")
    p.set_defaults(func=cmd_run)

    p = sub.add_parser("dump", help="compile once and write the graph dump, no comparison")
    _add_run_flags(p)
    p.set_defaults(func=cmd_dump, decode_steps=0)

    p = sub.add_parser("bisect", add_help=False,
                       help="compiled vs eager once per pass switched the other way (tools/bisect_passes.py; "
                            "`minimax-compile bisect --help`)")
    # (main() hands everything after "bisect" to the tool's own parser)

    p = sub.add_parser("summarize", help="print the op-count table of a dump directory")
    p.add_argument("dir")
    p.set_defaults(func=cmd_summarize)
    return parser


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["bisect"]:
        from minimax_backend.tools.bisect_passes import main as bisect_main

        return bisect_main(argv[1:])
    args = build_parser().parse_args(argv)
    args.func(args)


if __name__ == "__main__":
    main(sys.argv[1:])
