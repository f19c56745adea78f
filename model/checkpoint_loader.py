"""Loading a Hugging Face safetensors checkpoint into a model: ``load_checkpoint``.

Loading is driven by the ``load_plan`` of every parameter and persistent
buffer (model/weights.py): for each piece, the loader opens the file holding
that checkpoint tensor (memory-mapped by safetensors) and reads just the
slice with ``get_slice(name)[...]``; a rank never materializes a tensor or a
slice it does not hold. The pieces are concatenated along the plan's
``cat_dim``, checked against the parameter's shape, converted and copied in.

A piece concatenation of shape ``[E * n, ...]`` also fills a stacked
parameter of shape ``[E, n, ...]`` (routed experts stored as one 3-D tensor):
the concatenation along dim 0 of per-expert 2-D tensors IS the stacked tensor.

Dtypes:
  * float checkpoint -> float parameter: cast (bf16 / fp16 / fp32).
  * FP8 checkpoint (``X.weight`` float8_e4m3fn + ``X.weight_scale_inv``) ->
    FP8 model: loaded as is (the scale parameters have their own plans).
  * float checkpoint -> FP8 parameter ``w`` with a sibling ``w_scale_inv``
    (``weight`` / ``weight_scale_inv``): quantized at load to 128 x 128 blocks
    with ``kernels.fp8.quantize_weight_fp8``, when ``quantize_fp8=True``.
    Each checkpoint piece is quantized on its own, so the result equals
    quantizing the full tensor and slicing it (the pieces are block aligned;
    ``config.validate_for_parallel`` and the linears check that).
  * FP8 checkpoint -> float parameter: dequantized with its ``weight_scale_inv``.

Every problem found (missing, unexpected, mis-shaped tensors, unsupported
dtypes, parameters without a plan) is collected and raised together in ONE
``CheckpointError`` (model/checkpoint_format.py).
"""

from __future__ import annotations

import fnmatch
import logging
import math
import re
from collections import defaultdict
from pathlib import Path
from typing import Any, Iterable

import torch
from torch import nn

from .checkpoint_format import SCALE_SUFFIX, CheckpointError
from .checkpoint_reader import CheckpointReader
from .config import MiniMaxConfig
from .plan_targets import PlanTarget, plan_targets
from .weights import Shard

__all__ = ["load_checkpoint"]

log = logging.getLogger("minimax")

FP8 = torch.float8_e4m3fn
_FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)
_ST_DTYPES = {
    "F64": torch.float64,
    "F32": torch.float32,
    "BF16": torch.bfloat16,
    "F16": torch.float16,
    "F8_E4M3": FP8,
}


def _fit(t: torch.Tensor, shape: tuple[int, ...], cat_dim: int) -> torch.Tensor | None:
    """t reshaped to `shape` if it is the same tensor (or the dim-0 stacking of it), else None."""
    if tuple(t.shape) == tuple(shape):
        return t
    n = t.dim() - 1
    if (
        cat_dim == 0
        and len(shape) > t.dim()
        and math.prod(shape) == t.numel()
        and (n == 0 or tuple(t.shape[1:]) == tuple(shape[-n:]))
    ):
        return t.reshape(shape)
    return None


def _cat_shape(shapes: list[tuple[int, ...]], cat_dim: int) -> tuple[int, ...] | None:
    first = shapes[0]
    if any(len(s) != len(first) or cat_dim >= len(s) for s in shapes):
        return None
    for s in shapes[1:]:
        if any(a != b for i, (a, b) in enumerate(zip(s, first)) if i != cat_dim):
            return None
    out = list(first)
    out[cat_dim] = sum(s[cat_dim] for s in shapes)
    return tuple(out)


def _scale_name(weight_name: str) -> str:
    return weight_name + SCALE_SUFFIX


def _block_of(config: MiniMaxConfig | None) -> int:
    return config.weight_block_size[0] if config is not None else 128


def _compile_ignore(ignore: Iterable[str]) -> list[re.Pattern]:
    return [re.compile(fnmatch.translate(p)) for p in ignore]


def _expert_family(name: str) -> str | None:
    """`...experts.17.w1.weight` -> `...experts.*.w1.weight` (for the EP-aware unexpected check)."""
    m = re.search(r"\.experts\.(\d+)\.", name)
    return None if m is None else name[: m.start()] + ".experts.*." + name[m.end():]


@torch.no_grad()
def load_checkpoint(
    model: nn.Module,
    path: str | Path,
    *,
    quantize_fp8: bool = False,
    ignore: Iterable[str] = (),
    allow_unexpected: bool = False,
) -> dict[str, Any]:
    """Fill every parameter / persistent buffer of ``model`` from the checkpoint at ``path``.

    ``quantize_fp8``: allow a float (BF16) checkpoint tensor to fill an FP8
    weight, quantized at load to 128 x 128 blocks (with its ``weight_scale_inv``).
    ``ignore``: glob patterns (fnmatch, e.g. ``"model.layers.*.self_attn.index_*"``)
    of checkpoint tensors that may stay unused (layers we don't build).
    ``allow_unexpected``: don't treat unused checkpoint tensors as errors (logged).

    Under expert parallelism a rank holds only its experts: a checkpoint tensor
    ``...experts.E...`` of another rank's expert is not "unexpected" when this rank
    loads some expert E' of the same family and E < config.num_local_experts.

    Returns a small report: {"files", "tensors_loaded", "bytes_read", "quantized", "dequantized", "unused"}.
    """
    from ..kernels.fp8 import dequantize_weight_fp8, quantize_weight_fp8

    reader = CheckpointReader(path)
    config: MiniMaxConfig | None = getattr(model, "config", None)
    if config is not None and not isinstance(config, MiniMaxConfig):
        config = None
    block = _block_of(config)
    targets, no_plan = plan_targets(model)
    problems: list[str] = [f"model tensor {n} has no load_plan (cannot be loaded)" for n in no_plan]
    by_model_name = {t.name: t for t in targets}
    used: set[str] = set()
    # Names some plan wants count as used even when their target fails (reported once, not twice).
    wanted = {p.name for t in targets for p in t.plan.pieces}
    handled: set[str] = set()  # scale targets filled by quantize-at-load
    report = {"files": len(reader.files), "tensors_loaded": 0, "bytes_read": 0, "quantized": 0,
              "dequantized": 0, "unused": []}

    # Order targets by the file of their first piece, so progress goes file by file.
    def first_file(t: PlanTarget) -> str:
        n = t.plan.pieces[0].name
        return str(reader.file_of(n)) if n in reader else ""

    targets.sort(key=first_file)
    file_counts: dict[str, int] = defaultdict(int)
    for t in targets:
        file_counts[first_file(t)] += 1
    current_file = None
    file_no = 0

    # Scales whose weight is FP8: decided per weight below.
    scale_of: dict[str, PlanTarget] = {}
    for t in targets:
        s = by_model_name.get(t.name + SCALE_SUFFIX)
        if s is not None and t.tensor.dtype == FP8:
            scale_of[t.name] = s

    # FP8 weights whose checkpoint tensors are float: their scales come from quantizing
    # at load, not from the checkpoint (filled when the weight is processed).
    for wname, s in scale_of.items():
        first = by_model_name[wname].plan.pieces[0].name
        if first in reader and reader.info(first)[1] != "F8_E4M3":
            handled.add(s.name)

    for t in targets:
        f = first_file(t)
        if f != current_file:
            current_file = f
            file_no += 1
            if f:
                log.info("checkpoint: reading %s (%d/%d files, %d model tensors)",
                         Path(f).name, file_no, len(reader.files), file_counts[f])
        if t.name in handled:
            continue
        plan = t.plan
        # 1. every piece present, inside its tensor, with a supported dtype
        ok = True
        shapes, dtypes = [], []
        for p in plan.pieces:
            if p.name not in reader:
                # A scale the quantize-at-load path will produce is not missing.
                problems.append(f"missing tensor {p.name} (wanted by {t.name}, plan {plan})")
                ok = False
                continue
            shape, st_dtype = reader.info(p.name)
            if st_dtype not in _ST_DTYPES:
                problems.append(f"unsupported dtype {st_dtype} for {p.name} (wanted by {t.name}); "
                                f"supported: {sorted(_ST_DTYPES)}")
                ok = False
                continue
            if not p.fits(shape):
                problems.append(f"mis-shaped tensor {p.name}: checkpoint shape {list(shape)} has no "
                                f"slice {p} (wanted by {t.name}, local shape {list(t.tensor.shape)})")
                ok = False
                continue
            shapes.append(p.piece_shape(shape))
            dtypes.append(_ST_DTYPES[st_dtype])
        if not ok:
            continue
        cat_shape = _cat_shape(shapes, plan.cat_dim)
        if cat_shape is None or _fit(torch.empty(cat_shape, device="meta"), tuple(t.tensor.shape), plan.cat_dim) is None:
            if len(plan.pieces) == 1:
                p = plan.pieces[0]
                problems.append(f"mis-shaped tensor {p.name}: checkpoint shape {list(reader.info(p.name)[0])}"
                                f"{'' if p.dim is None else f', slice {p} -> {list(shapes[0])}'}, "
                                f"expected {list(t.tensor.shape)} (for model tensor {t.name})")
            else:
                detail = ", ".join(f"{p} -> {list(s)}" for p, s in zip(plan.pieces, shapes))
                problems.append(f"mis-shaped tensors for {t.name}: checkpoint pieces give "
                                f"{list(cat_shape) if cat_shape else 'shapes that do not concatenate'} "
                                f"({detail}), expected {list(t.tensor.shape)}")
            continue

        want = t.tensor.dtype
        ck_fp8 = [d == FP8 for d in dtypes]
        if want == FP8 and not all(ck_fp8):
            # 2a. float checkpoint into an FP8 weight: quantize at load (with its scale)
            scale_t = scale_of.get(t.name)
            if not quantize_fp8:
                problems.append(f"{t.name} is float8_e4m3fn but checkpoint {plan.pieces[0].name} is "
                                f"{dtypes[0]}: pass quantize_fp8=True to quantize a BF16 checkpoint at load")
                continue
            if scale_t is None:
                problems.append(f"{t.name}: cannot quantize at load, the model has no {t.name + SCALE_SUFFIX}")
                continue
            qs, ss = [], []
            for p in plan.pieces:
                w = reader.read(p)
                report["bytes_read"] += w.numel() * w.element_size()
                used.add(p.name)
                w2 = w.float().reshape(-1, w.shape[-1]) if w.dim() > 2 else w.float()
                q, s = quantize_weight_fp8(w2, block)
                if w.dim() > 2:
                    q = q.reshape(w.shape)
                qs.append(q)
                ss.append(s)
            q = _fit(torch.cat(qs, plan.cat_dim), tuple(t.tensor.shape), plan.cat_dim)
            s_cat = torch.cat(ss, plan.cat_dim)
            s = _fit(s_cat, tuple(scale_t.tensor.shape), scale_t.plan.cat_dim)
            if s is None:
                problems.append(f"{t.name}: quantized scales have shape {list(s_cat.shape)} but "
                                f"{scale_t.name} is {list(scale_t.tensor.shape)} (pieces not on {block}-blocks)")
                continue
            t.tensor.copy_(q.to(t.tensor.device))
            scale_t.tensor.copy_(s.to(scale_t.tensor.device, scale_t.tensor.dtype))
            handled.add(scale_t.name)
            report["quantized"] += 1
            report["tensors_loaded"] += 2
            continue

        # 2b. plain read (+ cast, or dequantize an FP8 checkpoint into a float tensor)
        parts = []
        for p, d in zip(plan.pieces, dtypes):
            x = reader.read(p)
            report["bytes_read"] += x.numel() * x.element_size()
            used.add(p.name)
            if d == FP8 and want != FP8:
                sname = _scale_name(p.name)
                if sname not in reader or x.dim() != 2:
                    problems.append(f"{p.name} is float8_e4m3fn but {t.name} is {want} and there is "
                                    f"no 2-D {sname} to dequantize it with")
                    x = None
                else:
                    x = _dequantize_piece(reader, p, x, sname, block, dequantize_weight_fp8)
                    used.add(sname)
                    report["dequantized"] += 1
            parts.append(x)
        if any(x is None for x in parts):
            continue
        if want != FP8 and want not in _FLOAT_DTYPES:
            if any(x.dtype != want for x in parts):
                problems.append(f"unsupported dtype conversion for {t.name}: checkpoint {parts[0].dtype}, model {want}")
                continue
        full = parts[0] if len(parts) == 1 else torch.cat([x.to(want) if want != FP8 else x for x in parts], plan.cat_dim)
        full = _fit(full, tuple(t.tensor.shape), plan.cat_dim)
        t.tensor.copy_(full.to(device=t.tensor.device, dtype=want))
        report["tensors_loaded"] += 1

    # 3. unexpected tensors
    ignore_re = _compile_ignore(ignore)
    n_experts = config.num_local_experts if config is not None else None
    families = {fam for fam in (_expert_family(n) for n in used) if fam is not None}
    unused = []
    for name in reader.names():
        if name in used or name in wanted or any(r.match(name) for r in ignore_re):
            continue
        fam = _expert_family(name)
        if fam in families:
            e = int(re.search(r"\.experts\.(\d+)\.", name).group(1))
            if n_experts is None or e < n_experts:
                continue  # another EP rank's expert
        # The scale of a tensor another EP rank owns, handled above via the family.
        unused.append(name)
    report["unused"] = unused
    if unused:
        if allow_unexpected:
            log.warning("checkpoint: %d unused tensors (e.g. %s)", len(unused), unused[:3])
        else:
            problems += [f"unexpected tensor {n} in the checkpoint: no model tensor uses it "
                         "(pass ignore=[...] to allow)" for n in unused]
    reader.close()
    if problems:
        raise CheckpointError(problems, str(path))
    log.info("checkpoint: loaded %d tensors (%.1f MB read) from %d file(s)%s", report["tensors_loaded"],
             report["bytes_read"] / 1e6, report["files"],
             f", {report['quantized']} quantized to FP8 at load" if report["quantized"] else "")
    return report


def _dequantize_piece(reader: CheckpointReader, p: Shard, x: torch.Tensor, sname: str, block: int, dequant) -> torch.Tensor:
    """A float slice of an FP8 checkpoint weight, from the covering blocks of its scales."""
    if p.dim is None:
        return dequant(x, reader.read(Shard(sname)), block)
    b0 = p.start // block
    nb = math.ceil((p.start + p.length) / block) - b0
    s = reader.read(Shard(sname, p.dim, b0, nb))
    off = p.start - b0 * block
    full = s.float().repeat_interleave(block, 0).repeat_interleave(block, 1)
    idx = [slice(0, x.shape[0]), slice(0, x.shape[1])]
    idx[p.dim] = slice(off, off + p.length)
    return x.float() * full[tuple(idx)]
