"""Random weights scaled like a trained model's, for tests, benchmarks and make-checkpoint.

A model whose layers amplify their input (as naive random weights do) turns
BF16 rounding into logit errors of tens of percent, so a compiled-vs-eager
comparison in BF16 or FP8 can no longer tell a bug from noise. These weights
keep every layer close to what training leaves:

  * every linear has std 1 / sqrt(fan_in) (unit-variance outputs for unit
    inputs); the projections that write into the residual stream (o_proj,
    the MLP and expert down projections) are scaled down by sqrt(2 L) for L
    layers, so the stream grows slowly through the depth;
  * RMSNorm weights sit near their neutral value (Gemma 0 +- 0.05, plain 1 +- 0.05);
  * router logits have a spread of about 1 (sigmoid scores that differ), the
    correction bias +- 0.05;
  * the embedding has unit variance and lm_head gives logits of std about 3;
  * every linear's weight is scaled per 128 x 128 block by a factor drawn
    log-uniformly from [1/2, 2] (normalized to keep the variance), so FP8
    block scales differ by up to 4x between blocks and a kernel or a TP
    slice that reads the wrong block's scale changes the result.

`init_random_weights` draws each element from a hash of (seed, checkpoint
name, global index): the same full weights at every TP / EP layout, so
layouts can be compared. `fast_random_weights` uses the same scales with
torch's generator on the tensors' own device (fast at real width; each rank
draws its own shards, which benchmarks do not mind).
"""

from __future__ import annotations

import hashlib
import math
import zlib
from typing import Iterable

import torch
from torch import nn

from ..kernels.fp8 import WEIGHT_BLOCK
from .linear import ParallelLinear
from .weights import Shard, get_plan

__all__ = ["init_random_weights", "fast_random_weights", "init_std", "BLOCK_AMPLITUDE_RANGE"]

BLOCK_AMPLITUDE_RANGE = (0.5, 2.0)  # per 128 x 128 block: a 4x spread of FP8 scales
# E[m^2] of m = 2^u, u uniform in [-1, 1]: (4 - 1/4) / (2 ln 4); dividing by its root keeps the variance.
_AMPLITUDE_RMS = math.sqrt((4 - 0.25) / (2 * math.log(4)))
_RESIDUAL_WRITERS = (".o_proj", ".down_proj", ".w2", ".eh_proj")


def init_std(name: str, fan_in: int, config) -> tuple[float, float]:
    """(mean, std) of checkpoint tensor `name`; `fan_in` is a linear's full input width."""
    if name.endswith("norm.weight"):
        return (0.0, 0.05) if config.use_gemma_norm else (1.0, 0.05)
    if name.endswith("e_score_correction_bias"):
        return 0.0, 0.05
    if name.endswith("embed_tokens.weight") and not config.tie_word_embeddings:
        return 0.0, 1.0
    if name.endswith("gate.weight"):  # the router: logits of std ~1 on a unit-RMS input
        return 0.0, 1.0 / math.sqrt(fan_in)
    if name.endswith("lm_head.weight") or name.endswith("embed_tokens.weight"):
        return 0.0, 3.0 / math.sqrt(fan_in)
    std = 1.0 / math.sqrt(fan_in)
    if any(f"{w}.weight" in name for w in _RESIDUAL_WRITERS):
        std /= math.sqrt(2 * max(config.num_hidden_layers, 1))
    return 0.0, std


def _is_linear_weight(name: str) -> bool:
    return name.endswith(".weight") and not name.endswith("norm.weight") and "embed_tokens" not in name


# -------------------------------------------------------- hash-based (layout-independent)
def _hash_uniform(name: str, seed: int, index: torch.Tensor) -> torch.Tensor:
    """Deterministic values in [-1, 1) from (seed, name, integer index): an int64 mixing hash."""
    mask = 0xFFFFFFFF
    x = (index * 0x9E3779B1 + zlib.crc32(f"{seed}:{name}".encode())) & mask
    x = ((x ^ (x >> 15)) * 0x2C1B3C6D) & mask
    x = ((x ^ (x >> 12)) * 0x297A2D39) & mask
    x = x ^ (x >> 15)
    return (x & 0xFFFFFF).float() * (2.0 / 2**24) - 1.0


def _block_amplitude(name: str, seed: int, rows: torch.Tensor, cols: torch.Tensor) -> torch.Tensor:
    """[len(rows), len(cols)] factor of each element's 128 x 128 block, log-uniform in BLOCK_AMPLITUDE_RANGE."""
    lo, hi = (math.log2(b) for b in BLOCK_AMPLITUDE_RANGE)
    br, bc = rows // WEIGHT_BLOCK, cols // WEIGHT_BLOCK
    u = _hash_uniform(f"{name}:block", seed, br[:, None] * 1_000_003 + bc[None, :])
    return torch.exp2(lo + (u + 1) * 0.5 * (hi - lo)) / _AMPLITUDE_RMS


_PIECE_CACHE: dict[tuple, torch.Tensor] = {}


def _random_piece(p: Shard, local_shape: tuple[int, ...], seed: int, mean: float, std: float,
                  blocks: bool) -> torch.Tensor:
    """This rank's slice of checkpoint tensor p.name: each element depends only on its global index."""
    key = (p.name, p.dim, p.start, local_shape, seed, mean, std, blocks)
    if key in _PIECE_CACHE:
        return _PIECE_CACHE[key]
    idx = [torch.arange(n, dtype=torch.int64) for n in local_shape]
    if p.dim is not None:
        idx[p.dim] = idx[p.dim] + p.start
    flat = idx[0] if len(idx) == 1 else idx[0][:, None] * 1_000_003 + idx[1][None, :]
    values = _hash_uniform(p.name, seed, flat) * (std * math.sqrt(3.0))  # uniform with this std
    if blocks and len(idx) == 2:
        values = values * _block_amplitude(p.name, seed, idx[0], idx[1])
    values = values + mean
    if values.numel() <= 1 << 20:  # tests build the same small weights many times; big ones are not kept
        if len(_PIECE_CACHE) > 4096:
            _PIECE_CACHE.clear()
        _PIECE_CACHE[key] = values
    return values


@torch.no_grad()
def init_random_weights(model: nn.Module, seed: int = 0) -> nn.Module:
    """Fill every parameter / persistent buffer from its load plan (see the module doc);
    FP8 linears are drawn in float and quantized per 128 x 128 block."""
    config = model.config
    done = set()
    for m in model.modules():
        if not isinstance(m, ParallelLinear):
            continue
        parts = []  # a fused linear stacks its pieces' rows; each piece has a known local size
        for source, piece in zip(get_plan(m.weight).pieces, m.pieces):
            mean, std = init_std(source.name, m.in_full, config)
            parts.append(_random_piece(source, (piece.size, m.in_features), seed, mean, std,
                                       blocks=_is_linear_weight(source.name)))
        _set_weight(m, parts)
        done.update({id(m.weight), id(m.weight_scale_inv)})
    for _, t in list(model.named_parameters()) + list(model.named_buffers()):
        plan = get_plan(t)
        if plan is None or id(t) in done:
            continue
        if len(plan.pieces) != 1:
            raise ValueError(f"init_random_weights: no rule for a fused non-linear tensor {plan}")
        name = plan.pieces[0].name
        mean, std = init_std(name, t.shape[-1], config)
        t.copy_(_random_piece(plan.pieces[0], tuple(t.shape), seed, mean, std, blocks=False).to(t.dtype))
    return model


def _by_piece(m: ParallelLinear) -> bool:
    """Fill a linear piece by piece: many pieces (stacked experts), each FP8 piece whole blocks."""
    return len(m.pieces) > 8 and (not m.fp8 or all(p.size % WEIGHT_BLOCK == 0 for p in m.pieces[:-1]))


def _set_weight(m: ParallelLinear, parts: Iterable[torch.Tensor]) -> None:
    """The linear's weight from its pieces' rows, in order: concatenated, or one piece at a
    time where _by_piece says so (`parts` may then be a generator: one piece in memory)."""
    if not _by_piece(m):
        m.set_weight(torch.cat(list(parts), dim=0).float())
        return
    start = 0
    for part in parts:
        m.set_rows(start, part.float())
        start += part.shape[0]


# ------------------------------------------------------------ on-device (fast)
def _seed_of(name: str, seed: int) -> int:
    return int.from_bytes(hashlib.sha256(f"{seed}:{name}".encode()).digest()[:8], "little") & ((1 << 62) - 1)


def _device_blocks(shape, gen, device) -> torch.Tensor:
    lo, hi = (math.log2(b) for b in BLOCK_AMPLITUDE_RANGE)
    nb = [math.ceil(n / WEIGHT_BLOCK) for n in shape]
    u = torch.rand(nb, generator=gen, device=device)
    amp = torch.exp2(lo + u * (hi - lo)) / _AMPLITUDE_RMS
    return amp.repeat_interleave(WEIGHT_BLOCK, 0)[:shape[0]].repeat_interleave(WEIGHT_BLOCK, 1)[:, :shape[1]]


@torch.no_grad()
def fast_random_weights(model: nn.Module, seed: int = 0, config=None) -> nn.Module:
    """The same scales as init_random_weights, drawn with torch's generator on each tensor's
    device, one linear at a time (FP8 linears quantized per block from float32). A part of a
    model (e.g. one MoE block) passes the model's `config`."""
    config = config or model.config
    done = set()
    for name, m in model.named_modules():
        if not isinstance(m, ParallelLinear):
            continue
        gen = torch.Generator(device=m.weight.device).manual_seed(_seed_of(name, seed))
        blocks = _is_linear_weight(get_plan(m.weight).pieces[0].name)

        def draw(source, piece, gen=gen, m=m):
            _, std = init_std(source.name, m.in_full, config)
            return torch.randn(piece.size, m.in_features, generator=gen, device=m.weight.device) * std

        def blocked(w, gen=gen, blocks=blocks):
            return w * _device_blocks(tuple(w.shape), gen, w.device) if blocks else w

        if _by_piece(m):  # stacked experts: one expert's rows at a time (the whole is GBs in float32)
            _set_weight(m, (blocked(draw(src, pc)) for src, pc in zip(get_plan(m.weight).pieces, m.pieces)))
        else:
            w = torch.cat([draw(src, pc) for src, pc in zip(get_plan(m.weight).pieces, m.pieces)], dim=0)
            m.set_weight(blocked(w))  # blocks over the whole: the same draws as before stacking
            del w
        done.update({id(m.weight), id(m.weight_scale_inv)})
    for name, t in list(model.named_parameters()) + list(model.named_buffers()):
        plan = get_plan(t)
        if plan is None or id(t) in done or not t.is_floating_point():
            continue
        mean, std = init_std(plan.pieces[0].name, t.shape[-1], config)
        gen = torch.Generator(device=t.device).manual_seed(_seed_of(name, seed))
        t.copy_((mean + std * torch.randn(t.shape, generator=gen, device=t.device)).to(t.dtype))
    return model
