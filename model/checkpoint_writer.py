"""Writing a model as a Hugging Face safetensors checkpoint.

``save_random_checkpoint(config, out_dir)`` builds the model at TP 1,
fills it with deterministic random values and writes every plan piece under its
HF name (splitting fused tensors such as QKV); ``save_model_as_checkpoint``
writes an existing TP-1 model. Files: ``model.safetensors``, or
``model-0000i-of-0000n.safetensors`` + ``model.safetensors.index.json`` when
``max_shard_bytes`` is given and exceeded; plus ``config.json``.

``write_checkpoint`` writes a name -> tensor dict (and ``config.json``);
``hf_tensor_shape`` knows the full shapes of the standard HF tensors, to
split fused tensors whose pieces are whole tensors.
"""

from __future__ import annotations

import json
import logging
import math
import re
from collections import defaultdict
from pathlib import Path

import torch
from torch import nn

from .checkpoint_format import INDEX_FILE, SINGLE_FILE, CheckpointError
from .config import MiniMaxConfig
from .plan_targets import PlanTarget, plan_targets
from .weights import Shard

__all__ = ["write_checkpoint", "save_model_as_checkpoint", "save_random_checkpoint", "hf_tensor_shape"]

log = logging.getLogger("minimax")


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
def _split_local(t: PlanTarget, config: MiniMaxConfig | None) -> list[tuple[Shard, torch.Tensor]]:
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
    targets, no_plan = plan_targets(model)
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
