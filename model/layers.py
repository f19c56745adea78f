"""The building blocks of a MiniMax decoder layer, each tensor-parallel.

    RMSNorm                  Gemma form x / rms(x) * (1 + w) (M3), or plain x / rms(x) * w (M2)
    rope_cos_sin, apply_rope NeoX rotary embedding on the first rotary_dim dims of each head
    Attention                fused QKV -> QK norm -> RoPE -> GQA SDPA -> o_proj -> all_reduce
    SparseIndexer            M3's key-only indexer weights (kept, not used yet)
    GatedMLP                 fused gate/up -> SwiGLU-OAI or SiLU -> down (-> all_reduce)
    VocabParallelEmbedding   each rank holds a slice of the vocab -> all_reduce

Activations are 2-D [T, hidden] (T = batch * seq); attention reshapes to
[B, heads, S, head_dim] only around scaled_dot_product_attention.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .linear import ColumnParallelLinear, Piece, ReplicatedLinear, RowParallelLinear, ShardingError
from .parallel import ParallelState, all_reduce
from .weights import LoadPlan, attach_plan, rows, whole

__all__ = [
    "RMSNorm",
    "rope_cos_sin",
    "apply_rope",
    "Attention",
    "SparseIndexer",
    "GatedMLP",
    "VocabParallelEmbedding",
    "shard",
    "kv_head_range",
]


def shard(full: int, rank: int, size: int, what: str) -> tuple[int, int]:
    """(start, length) of `rank`'s equal share of `full` things."""
    if full % size:
        raise ShardingError(f"{what}: {full} is not divisible by {size} ranks")
    return rank * (full // size), full // size


def kv_head_range(num_kv_heads: int, ps: ParallelState) -> tuple[int, int]:
    """(first KV head, count) on this rank. Fewer KV heads than ranks: each rank
    keeps one head, replicated on tp_size // num_kv_heads ranks."""
    if num_kv_heads >= ps.tp_size:
        return shard(num_kv_heads, ps.tp_rank, ps.tp_size, "num_key_value_heads")
    if ps.tp_size % num_kv_heads:
        raise ShardingError(f"num_key_value_heads: {num_kv_heads} does not divide tp_size {ps.tp_size}")
    return ps.tp_rank * num_kv_heads // ps.tp_size, 1


# --------------------------------------------------------------------- norms
class RMSNorm(nn.Module):
    """RMSNorm over the last dim, computed in float32.

    Gemma form (M3): (x / rms(x) * (1 + w)) in float32, then cast; w starts at 0.
    Plain form (M2): (x / rms(x)) cast to x.dtype, then * w (HF MiniMaxM2RMSNorm order).
    """

    def __init__(self, dim: int, eps: float, gemma: bool, plan: LoadPlan | str, *, dtype, device):
        super().__init__()
        self.eps = eps
        self.gemma = gemma
        self.weight = nn.Parameter(torch.empty(dim, dtype=dtype, device=device), requires_grad=False)
        attach_plan(self.weight, plan)

    def extra_repr(self) -> str:
        return f"{self.weight.shape[0]}, eps={self.eps}, {'gemma (1 + w)' if self.gemma else 'plain (w)'}"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        return self.scale(x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps), x.dtype)

    def scale(self, normed: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """Apply the learned scale to an already normalized float32 tensor."""
        if self.gemma:
            return (normed * (1.0 + self.weight.float())).to(dtype)
        return normed.to(dtype) * self.weight


# ---------------------------------------------------------------------- RoPE
def rope_cos_sin(positions: torch.Tensor, rotary_dim: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin [T, rotary_dim // 2] in float32 for flat positions [T]."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, rotary_dim, 2, dtype=torch.int64, device=positions.device).float()
                                / rotary_dim))
    freqs = positions.float()[:, None] * inv_freq[None, :]
    return freqs.cos(), freqs.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """NeoX rotation of the first 2 * cos.shape[-1] dims of each head; x [T, heads, head_dim].

    The first half of the rotary dims pairs with the second half (not
    interleaved); the dims after rotary_dim pass through unchanged."""
    half = cos.shape[-1]
    x1 = x[..., :half].float()
    x2 = x[..., half:2 * half].float()
    c, s = cos[:, None, :], sin[:, None, :]
    rotated = torch.cat([x1 * c - x2 * s, x2 * c + x1 * s], dim=-1).to(x.dtype)
    return torch.cat([rotated, x[..., 2 * half:]], dim=-1)


# ----------------------------------------------------------------- attention
class SparseIndexer(nn.Module):
    """M3's sparse-attention "lightning indexer": index_n_heads query heads and ONE key
    head of index_head_dim, each with a Gemma RMSNorm. It picks the top-k key blocks
    per query. Its weights are loaded and kept, but NOT used: with top-16 blocks of
    128 tokens, sparse attention equals dense attention up to 2048 tokens, and the
    sparse kernel is a later issue. Replicated on every rank (small).

    Checkpoint names: `<attn>.index_q_proj.weight` [n_heads * dim, hidden],
    `<attn>.index_k_proj.weight` [dim, hidden], `<attn>.index_q_norm.weight` [dim],
    `<attn>.index_k_norm.weight` [dim] (HF transformers' minimax_m3_vl names).
    """

    def __init__(self, config, prefix: str, *, dtype, device):
        super().__init__()
        dim, heads = config.index_head_dim, config.index_n_heads
        self.index_q_proj = ReplicatedLinear(f"{prefix}.index_q_proj", config.hidden_size, heads * dim,
                                             dtype=dtype, device=device)
        self.index_k_proj = ReplicatedLinear(f"{prefix}.index_k_proj", config.hidden_size, dim,
                                             dtype=dtype, device=device)
        self.index_q_norm = RMSNorm(dim, config.rms_norm_eps, True, f"{prefix}.index_q_norm.weight",
                                    dtype=dtype, device=device)
        self.index_k_norm = RMSNorm(dim, config.rms_norm_eps, True, f"{prefix}.index_k_norm.weight",
                                    dtype=dtype, device=device)


class Attention(nn.Module):
    """Grouped-query attention with QK norm and partial NeoX RoPE.

    TP: query heads split over ranks; KV heads split too, or replicated when
    there are fewer KV heads than ranks (rank r keeps head r * num_kv // tp).
    q/k/v are one fused column-parallel GEMM; o_proj is row-parallel and its
    partial sums are all-reduced here.

    QK norm (config.qk_norm_type):
      per_head  (M3) RMSNorm over head_dim of every q and k head.
      per_layer (M2) RMSNorm over the whole q (k) projection. That projection
                     is split over ranks, so the sum of squares is all-reduced
                     before dividing by the full width.
    """

    def __init__(self, config, ps: ParallelState, prefix: str, *, dtype, device, fp8: bool, sparse: bool = False):
        super().__init__()
        self.ps = ps
        d = config.head_dim
        hq, hkv = config.num_attention_heads, config.num_key_value_heads
        q0, self.num_heads = shard(hq, ps.tp_rank, ps.tp_size, f"{prefix}: num_attention_heads")
        kv0, self.num_kv_heads = kv_head_range(hkv, ps)
        self.head_dim = d
        self.rotary_dim = config.rotary_dim
        self.use_qk_norm = config.use_qk_norm
        self.per_layer_qk_norm = config.qk_norm_type == "per_layer"
        self.eps = config.rms_norm_eps

        self.qkv_proj = ColumnParallelLinear(
            [Piece(f"{prefix}.q_proj", hq * d, q0 * d, self.num_heads * d),
             Piece(f"{prefix}.k_proj", hkv * d, kv0 * d, self.num_kv_heads * d),
             Piece(f"{prefix}.v_proj", hkv * d, kv0 * d, self.num_kv_heads * d)],
            config.hidden_size, dtype=dtype, device=device, fp8=fp8,
        )
        if self.use_qk_norm:
            gemma = config.use_gemma_norm
            if self.per_layer_qk_norm:
                q_plan = _rows_or_whole(f"{prefix}.q_norm.weight", q0 * d, self.num_heads * d, hq * d)
                k_plan = _rows_or_whole(f"{prefix}.k_norm.weight", kv0 * d, self.num_kv_heads * d, hkv * d)
                self.q_norm = RMSNorm(self.num_heads * d, self.eps, gemma, q_plan, dtype=dtype, device=device)
                self.k_norm = RMSNorm(self.num_kv_heads * d, self.eps, gemma, k_plan, dtype=dtype, device=device)
            else:
                self.q_norm = RMSNorm(d, self.eps, gemma, f"{prefix}.q_norm.weight", dtype=dtype, device=device)
                self.k_norm = RMSNorm(d, self.eps, gemma, f"{prefix}.k_norm.weight", dtype=dtype, device=device)
        self.o_proj = RowParallelLinear(f"{prefix}.o_proj", q0 * d, self.num_heads * d, hq * d, config.hidden_size,
                                        dtype=dtype, device=device, fp8=fp8)
        self.indexer = SparseIndexer(config, prefix, dtype=dtype, device=device) if sparse else None
        self.kv_cache = None  # a KVCache while model.allocate_kv_cache(...) is on

    def forward(self, x, positions, cos, sin, attn_mask=None):
        """x [T, hidden]; positions [B, S]; cos/sin [T, rotary_dim/2]; attn_mask [B, 1, S, L] or None (causal)."""
        batch, seq = positions.shape
        d = self.head_dim
        q, k, v = self.qkv_proj(x).split([self.num_heads * d, self.num_kv_heads * d, self.num_kv_heads * d], dim=-1)
        q = q.reshape(-1, self.num_heads, d)
        k = k.reshape(-1, self.num_kv_heads, d)
        v = v.reshape(-1, self.num_kv_heads, d)
        if self.use_qk_norm:
            q, k = self.qk_norm(q, k)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)

        # [T, h, d] -> [B, h, S, d] for SDPA
        q, k, v = (t.reshape(batch, seq, -1, d).transpose(1, 2) for t in (q, k, v))
        if self.kv_cache is not None:
            k, v = self.kv_cache.update(k, v, positions)
        out = F.scaled_dot_product_attention(
            q, k, v,
            attn_mask=attn_mask,
            is_causal=attn_mask is None,
            enable_gqa=self.num_heads != self.num_kv_heads,
        )
        out = out.transpose(1, 2).reshape(batch * seq, self.num_heads * d)
        return all_reduce(self.o_proj(out), self.ps)

    def qk_norm(self, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if not self.per_layer_qk_norm:
            return self.q_norm(q), self.k_norm(k)
        # M2: one RMS over each whole projection, whose heads are spread over ranks.
        # Replicated KV heads are held by tp/num_kv ranks each, so in both cases the
        # all-reduced sum of squares covers local_width * tp_size values.
        q32, k32 = q.flatten(1).float(), k.flatten(1).float()
        sumsq = all_reduce(torch.stack([q32.pow(2).sum(-1), k32.pow(2).sum(-1)], dim=-1), self.ps)
        tp = self.ps.tp_size
        q_rms = torch.rsqrt(sumsq[:, 0:1] / (q32.shape[-1] * tp) + self.eps)
        k_rms = torch.rsqrt(sumsq[:, 1:2] / (k32.shape[-1] * tp) + self.eps)
        q = self.q_norm.scale(q32 * q_rms, q.dtype).view_as(q)
        k = self.k_norm.scale(k32 * k_rms, k.dtype).view_as(k)
        return q, k


def _rows_or_whole(name: str, start: int, length: int, full: int) -> LoadPlan:
    return whole(name) if (start, length) == (0, full) else LoadPlan((rows(name, start, length),))


# ----------------------------------------------------------------------- MLP
def swiglu_oai(gate: torch.Tensor, up: torch.Tensor, alpha: float, limit: float, beta: float) -> torch.Tensor:
    """SwiGLU-OAI (M3): g = min(gate, limit), u = clamp(up, +-limit), g * sigmoid(alpha g) * (u + beta)."""
    gate = gate.clamp(max=limit)
    up = up.clamp(min=-limit, max=limit)
    return (up + beta) * (gate * torch.sigmoid(gate * alpha))


class GatedMLP(nn.Module):
    """down(act(gate(x), up(x))), the dense MLP, the shared expert and each routed expert.

    gate and up are one fused column-parallel GEMM over this rank's slice of
    the intermediate dim; down is row-parallel over the same slice. With
    `reduce_output` the partial sums are all-reduced here (dense layers);
    without, the caller adds them to other partials first (MoE: one all-reduce).
    """

    def __init__(self, config, ps: ParallelState, names: tuple[str, str, str], intermediate: int,
                 shard_rank: int, shard_size: int, *, reduce_output: bool, dtype, device, fp8: bool):
        super().__init__()
        gate_name, up_name, down_name = names
        i0, n = shard(intermediate, shard_rank, shard_size, f"{down_name}: intermediate size")
        self.ps = ps
        self.reduce_output = reduce_output
        self.act = config.hidden_act
        self.alpha, self.limit, self.beta = config.swiglu_alpha, config.swiglu_limit, config.swiglu_beta
        self.gate_up_proj = ColumnParallelLinear(
            [Piece(gate_name, intermediate, i0, n), Piece(up_name, intermediate, i0, n)],
            config.hidden_size, dtype=dtype, device=device, fp8=fp8,
        )
        self.down_proj = RowParallelLinear(down_name, i0, n, intermediate, config.hidden_size,
                                           dtype=dtype, device=device, fp8=fp8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        if self.act == "swigluoai":
            h = swiglu_oai(gate, up, self.alpha, self.limit, self.beta)
        else:
            h = F.silu(gate) * up
        out = self.down_proj(h)
        return all_reduce(out, self.ps) if self.reduce_output else out


# ----------------------------------------------------------------- embedding
class VocabParallelEmbedding(nn.Module):
    """Rank r holds rows [r * V/tp, (r+1) * V/tp) of the embedding; ids outside
    the slice look up zeros, and the all-reduce assembles the full embedding."""

    def __init__(self, vocab: int, hidden: int, ps: ParallelState, name: str, *, dtype, device):
        super().__init__()
        self.ps = ps
        self.start, n = shard(vocab, ps.tp_rank, ps.tp_size, "vocab_size")
        self.end = self.start + n
        self.weight = nn.Parameter(torch.empty(n, hidden, dtype=dtype, device=device), requires_grad=False)
        attach_plan(self.weight, _rows_or_whole(name, self.start, n, vocab))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.ps.tp_size == 1:
            return F.embedding(ids, self.weight)
        inside = (ids >= self.start) & (ids < self.end)
        local = torch.where(inside, ids - self.start, torch.zeros_like(ids))
        out = F.embedding(local, self.weight) * inside.unsqueeze(-1).to(self.weight.dtype)
        return all_reduce(out, self.ps)
