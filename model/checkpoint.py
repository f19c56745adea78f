"""Hugging Face safetensors checkpoints: load (each rank reads only its slices) and write.

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
``CheckpointError``.

Writing: ``save_random_checkpoint(config, out_dir)`` builds the model at TP 1,
fills it with deterministic random values and writes every plan piece under its
HF name (splitting fused tensors such as QKV); ``save_model_as_checkpoint``
writes an existing TP-1 model. Files: ``model.safetensors``, or
``model-0000i-of-0000n.safetensors`` + ``model.safetensors.index.json`` when
``max_shard_bytes`` is given and exceeded; plus ``config.json``.
"""

from __future__ import annotations

import fnmatch
import json
import logging
import math
import re
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable

import torch
from torch import nn

from .config import MiniMaxConfig
from .weights import LoadPlan, Shard, get_plan

__all__ = [
    "CheckpointError",
    "CheckpointReader",
    "load_checkpoint",
    "save_random_checkpoint",
    "save_model_as_checkpoint",
    "write_checkpoint",
    "hf_tensor_shape",
    "SCALE_SUFFIX",
]

log = logging.getLogger("minimax")

SCALE_SUFFIX = "_scale_inv"  # weight -> weight_scale_inv (model and checkpoint)
INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
FP8 = torch.float8_e4m3fn
_FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)
_ST_DTYPES = {
    "F64": torch.float64,
    "F32": torch.float32,
    "BF16": torch.bfloat16,
    "F16": torch.float16,
    "F8_E4M3": FP8,
}
_MAX_LISTED = 60


class CheckpointError(RuntimeError):
    """Everything wrong with a checkpoint / model pairing, all at once (``.problems``)."""

    def __init__(self, problems: list[str], where: str = ""):
        self.problems = list(problems)
        head = f"checkpoint {where}: " if where else "checkpoint: "
        shown = self.problems[:_MAX_LISTED]
        more = len(self.problems) - len(shown)
        lines = [f"{head}{len(self.problems)} problem(s)"] + [f"  - {p}" for p in shown]
        if more:
            lines.append(f"  ... and {more} more")
        super().__init__("\n".join(lines))


# ---------------------------------------------------------------- the reader
class CheckpointReader:
    """Name -> file map of an HF safetensors checkpoint, with lazily opened, memory-mapped handles."""

    def __init__(self, path: str | Path):
        from safetensors import safe_open  # noqa: F401  (fail early if missing)

        self.path = Path(path)
        self.name_to_file: dict[str, Path] = {}
        self._handles: dict[Path, Any] = {}
        problems: list[str] = []
        if self.path.is_file():
            files = [self.path]
            self.root = self.path.parent
        elif (self.path / INDEX_FILE).is_file():
            self.root = self.path
            index = json.loads((self.path / INDEX_FILE).read_text())
            weight_map = index.get("weight_map")
            if not isinstance(weight_map, dict):
                raise CheckpointError([f"{INDEX_FILE} has no weight_map"], str(self.path))
            files = []
            for name, fname in weight_map.items():
                f = self.path / fname
                if not f.is_file():
                    problems.append(f"index lists {name} in {fname}, but that file does not exist")
                    continue
                self.name_to_file[name] = f
            files = sorted(set(self.name_to_file.values()))
        elif (self.path / SINGLE_FILE).is_file():
            self.root = self.path
            files = [self.path / SINGLE_FILE]
        elif self.path.is_dir() and sorted(self.path.glob("*.safetensors")):
            self.root = self.path
            files = sorted(self.path.glob("*.safetensors"))
        else:
            raise CheckpointError([f"no {SINGLE_FILE}, {INDEX_FILE} or *.safetensors found"], str(self.path))
        self.files = files
        if not self.name_to_file:
            for f in files:
                for name in self._handle(f).keys():
                    self.name_to_file[name] = f
        if problems:
            raise CheckpointError(problems, str(self.path))

    def _handle(self, f: Path):
        h = self._handles.get(f)
        if h is None:
            from safetensors import safe_open

            h = safe_open(str(f), framework="pt", device="cpu")
            self._handles[f] = h
        return h

    def names(self) -> list[str]:
        return list(self.name_to_file)

    def __contains__(self, name: str) -> bool:
        return name in self.name_to_file

    def info(self, name: str) -> tuple[tuple[int, ...], str]:
        """(shape, safetensors dtype string) without reading data."""
        sl = self._handle(self.name_to_file[name]).get_slice(name)
        return tuple(sl.get_shape()), sl.get_dtype()

    def read(self, shard: Shard) -> torch.Tensor:
        """Only the slice the shard names (memory-mapped read)."""
        h = self._handle(self.name_to_file[shard.name])
        if shard.dim is None:
            return h.get_tensor(shard.name)
        sl = h.get_slice(shard.name)
        return sl[shard.index(len(sl.get_shape()))]

    def file_of(self, name: str) -> Path:
        return self.name_to_file[name]

    def close(self) -> None:
        self._handles.clear()


# ---------------------------------------------------------------- the loader
@dataclass
class _Target:
    name: str  # the model's own name for the tensor
    tensor: torch.Tensor
    plan: LoadPlan


def _model_tensors(model: nn.Module) -> tuple[list[_Target], list[str]]:
    """Every parameter and persistent buffer (deduplicated), and those without a plan."""
    targets, no_plan, seen = [], [], set()
    for name, p in model.named_parameters(remove_duplicate=True):
        if id(p) in seen:
            continue
        seen.add(id(p))
        plan = get_plan(p)
        (targets.append(_Target(name, p, plan)) if plan is not None else no_plan.append(name))
    for mod_name, mod in model.named_modules(remove_duplicate=True):
        for bname, b in mod._buffers.items():
            if b is None or bname in mod._non_persistent_buffers_set or id(b) in seen:
                continue
            seen.add(id(b))
            name = f"{mod_name}.{bname}" if mod_name else bname
            plan = get_plan(b)
            (targets.append(_Target(name, b, plan)) if plan is not None else no_plan.append(name))
    return targets, no_plan


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
    targets, no_plan = _model_tensors(model)
    problems: list[str] = [f"model tensor {n} has no load_plan (cannot be loaded)" for n in no_plan]
    by_model_name = {t.name: t for t in targets}
    used: set[str] = set()
    # Names some plan wants count as used even when their target fails (reported once, not twice).
    wanted = {p.name for t in targets for p in t.plan.pieces}
    handled: set[str] = set()  # scale targets filled by quantize-at-load
    report = {"files": len(reader.files), "tensors_loaded": 0, "bytes_read": 0, "quantized": 0,
              "dequantized": 0, "unused": []}

    # Order targets by the file of their first piece, so progress goes file by file.
    def first_file(t: _Target) -> str:
        n = t.plan.pieces[0].name
        return str(reader.file_of(n)) if n in reader else ""

    targets.sort(key=first_file)
    file_counts: dict[str, int] = defaultdict(int)
    for t in targets:
        file_counts[first_file(t)] += 1
    current_file = None
    file_no = 0

    # Scales whose weight is FP8: decided per weight below.
    scale_of: dict[str, _Target] = {}
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


# ------------------------------------------------------------------ HF shapes
def hf_tensor_shape(config: MiniMaxConfig, name: str) -> tuple[int, ...] | None:
    """The full checkpoint shape of a standard HF tensor name, or None if not known.

    Used by the writer to split a fused tensor whose pieces are whole tensors
    (their sizes are not in the plan). Knows the attention projections, the
    dense MLP, the routed and shared experts (and their FP8 scales).
    """
    c = config
    h, hd = c.hidden_size, c.head_dim
    scale = name.endswith(".weight_scale_inv")
    base = name[: -len("_scale_inv")] if scale else name
    table = [
        (r"\.self_attn\.q_proj\.weight$", (c.num_attention_heads * hd, h)),
        (r"\.self_attn\.k_proj\.weight$", (c.num_key_value_heads * hd, h)),
        (r"\.self_attn\.v_proj\.weight$", (c.num_key_value_heads * hd, h)),
        (r"\.self_attn\.o_proj\.weight$", (h, c.num_attention_heads * hd)),
        (r"\.mlp\.(gate|up)_proj\.weight$", (c.dense_intermediate_size, h)),
        (r"\.mlp\.down_proj\.weight$", (h, c.dense_intermediate_size)),
        (r"\.shared_experts?\.(gate|up)_proj\.weight$", (c.shared_intermediate_size, h)),
        (r"\.shared_experts?\.down_proj\.weight$", (h, c.shared_intermediate_size)),
        (r"\.experts\.\d+\.(w1|w3)\.weight$", (c.intermediate_size, h)),
        (r"\.experts\.\d+\.w2\.weight$", (h, c.intermediate_size)),
    ]
    for pat, shape in table:
        if re.search(pat, base):
            if scale:
                bn, bk = c.weight_block_size
                return (math.ceil(shape[0] / bn), math.ceil(shape[1] / bk))
            return shape
    return None


# ------------------------------------------------------------------ writers
def _split_local(t: _Target, config: MiniMaxConfig | None) -> list[tuple[Shard, torch.Tensor]]:
    """Split a TP-1 local tensor back into its plan pieces."""
    plan = t.plan
    x = t.tensor.detach()
    if len(plan.pieces) == 1:
        return [(plan.pieces[0], x)]
    d = plan.cat_dim
    # Stacked parameters [E, n, ...] are the dim-0 concatenation viewed: undo the view.
    sizes: list[int | None] = []
    for p in plan.pieces:
        if p.dim is not None and p.dim == d:
            sizes.append(p.length)
        elif p.dim is None and p.length:
            sizes.append(p.length)  # a whole piece may carry its size along cat_dim in `length`
        elif p.dim is None and config is not None and hf_tensor_shape(config, p.name) is not None:
            sizes.append(hf_tensor_shape(config, p.name)[d])
        else:
            sizes.append(None)
    total = x.shape[d]
    known = sum(s for s in sizes if s is not None)
    unknown = [i for i, s in enumerate(sizes) if s is None]
    if known != total and d == 0 and x.dim() > 1:
        # Stacked: flatten leading dims until the known sizes fit.
        for k in range(2, x.dim()):
            y = x.reshape(-1, *x.shape[k:])
            if (not unknown and known == y.shape[0]) or (unknown and known < y.shape[0]):
                x, total = y, y.shape[0]
                break
    if unknown:
        rest = total - known
        if rest <= 0 or rest % len(unknown):
            raise CheckpointError([f"cannot split {t.name} into its pieces {plan}: the sizes of whole pieces "
                                   "are unknown (give them a length)"])
        for i in unknown:
            sizes[i] = rest // len(unknown)
    if sum(sizes) != x.shape[d]:
        raise CheckpointError([f"cannot split {t.name} ({list(t.tensor.shape)}) into pieces of sizes "
                               f"{sizes} along dim {d} (plan {plan})"])
    return list(zip(plan.pieces, torch.split(x, sizes, dim=d)))


def _assemble(model: nn.Module) -> dict[str, torch.Tensor]:
    """HF name -> full tensor, from a TP-1 model's plans."""
    config = getattr(model, "config", None)
    config = config if isinstance(config, MiniMaxConfig) else None
    targets, no_plan = _model_tensors(model)
    problems = [f"model tensor {n} has no load_plan (cannot be saved)" for n in no_plan]
    parts: dict[str, list[tuple[Shard, torch.Tensor]]] = defaultdict(list)
    for t in targets:
        try:
            for p, x in _split_local(t, config):
                parts[p.name].append((p, x))
        except CheckpointError as e:
            problems += e.problems
    out: dict[str, torch.Tensor] = {}
    for name, pcs in parts.items():
        wholes = [x for p, x in pcs if p.dim is None]
        if wholes:
            first = wholes[0]
            if any(x.shape != first.shape or not torch.equal(x, first) for x in wholes[1:]):
                problems.append(f"{name} is used whole by several model tensors with different values")
            out[name] = first.contiguous().clone()
            continue
        dim = pcs[0][0].dim
        if any(p.dim != dim for p, _ in pcs):
            problems.append(f"{name} is sliced along different dims; save a TP-1 model")
            continue
        unique: dict[tuple[int, int], torch.Tensor] = {}
        for p, x in pcs:  # the same slice held by several model tensors must agree
            key = (p.start, p.length)
            if key in unique and not torch.equal(unique[key], x):
                problems.append(f"{name}[{p.start}:{p.start + p.length}] is held by several model tensors "
                                "with different values")
            unique.setdefault(key, x)
        pcs = sorted(((Shard(name, dim, a, n), x) for (a, n), x in unique.items()), key=lambda px: px[0].start)
        pos = 0
        for p, x in pcs:
            if p.start != pos:
                problems.append(f"{name}: pieces do not cover it contiguously at {pos} (save a TP-1 model)")
                break
            pos += p.length
        else:
            out[name] = torch.cat([x for _, x in pcs], dim).contiguous()
    if problems:
        raise CheckpointError(problems, "writer")
    return out


def _natural_key(name: str):
    return [int(s) if s.isdigit() else s for s in re.split(r"(\d+)", name)]


def write_checkpoint(
    tensors: dict[str, torch.Tensor],
    out_dir: str | Path,
    config: MiniMaxConfig | None = None,
    *,
    max_shard_bytes: int | None = None,
) -> Path:
    """Write tensors (+ config.json) as an HF safetensors checkpoint; shard with an index if needed."""
    from safetensors.torch import save_file

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    names = sorted(tensors, key=_natural_key)
    total = sum(tensors[n].numel() * tensors[n].element_size() for n in names)
    shards: list[list[str]] = [[]]
    size = 0
    for n in names:
        b = tensors[n].numel() * tensors[n].element_size()
        if max_shard_bytes is not None and shards[-1] and size + b > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(n)
        size += b
    for stale in list(out.glob("model*.safetensors")) + [out / INDEX_FILE]:
        if stale.exists():
            stale.unlink()
    meta = {"format": "pt"}
    if len(shards) == 1:
        save_file({n: tensors[n].contiguous() for n in shards[0]}, str(out / SINGLE_FILE), metadata=meta)
        log.info("checkpoint: wrote %s (%d tensors, %.1f MB)", out / SINGLE_FILE, len(names), total / 1e6)
    else:
        weight_map = {}
        for i, group in enumerate(shards, 1):
            fname = f"model-{i:05d}-of-{len(shards):05d}.safetensors"
            save_file({n: tensors[n].contiguous() for n in group}, str(out / fname), metadata=meta)
            weight_map.update({n: fname for n in group})
            log.info("checkpoint: wrote %s (%d tensors)", fname, len(group))
        (out / INDEX_FILE).write_text(json.dumps(
            {"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2) + "\n")
    if config is not None:
        d = config.to_hf_dict()
        floats = [t.dtype for t in tensors.values() if t.dtype in (torch.bfloat16, torch.float16, torch.float32)]
        if floats:
            d["torch_dtype"] = str(max(set(floats), key=floats.count)).replace("torch.", "")
        (out / "config.json").write_text(json.dumps(d, indent=2) + "\n")
    return out


def save_model_as_checkpoint(model: nn.Module, out_dir: str | Path, *, max_shard_bytes: int | None = None,
                             config: MiniMaxConfig | None = None) -> Path:
    """Write a TP-1 model's tensors under their HF names (fused tensors split back)."""
    ps = getattr(model, "parallel_state", None) or getattr(model, "ps", None)
    if ps is not None and getattr(ps, "tp_size", 1) != 1:
        raise CheckpointError([f"save_model_as_checkpoint needs a TP-1 model, got tp_size {ps.tp_size}"])
    config = config or getattr(model, "config", None)
    return write_checkpoint(_assemble(model), out_dir, config if isinstance(config, MiniMaxConfig) else None,
                            max_shard_bytes=max_shard_bytes)


def save_random_checkpoint(
    config: MiniMaxConfig,
    out_dir: str | Path,
    *,
    seed: int = 0,
    fp8: bool = False,
    max_shard_bytes: int | None = None,
    dtype: torch.dtype = torch.bfloat16,
) -> Path:
    """Build ``config``'s model at TP 1, fill it deterministically (``seed``) and write it.

    Values come from ``model.random_weights.init_random_weights`` (they depend only on
    seed, name and global index, so a TP-N in-memory random model is the same
    model). ``fp8=True`` (or an FP8 config) writes FP8 weights + ``weight_scale_inv`` and a
    ``quantization_config`` in config.json. Returns ``out_dir``.
    """
    from .minimax import build_model
    from .random_weights import init_random_weights
    from .parallel import ParallelState

    if fp8 and not config.is_fp8:
        config = config.replace(quant_method="fp8")
    model = build_model(config, ParallelState.single(), dtype, "cpu")
    # The model's own initializer: the same values as an in-memory random model at any TP.
    init_random_weights(model, seed)
    out = save_model_as_checkpoint(model, out_dir, max_shard_bytes=max_shard_bytes, config=config)
    log.info("checkpoint: random %s checkpoint (seed %d) in %s", config.model_type, seed, out)
    return out
