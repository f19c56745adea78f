"""The building blocks of a MiniMax decoder layer, each tensor-parallel.

    RMSNorm                  Gemma form x / rms(x) * (1 + w) (M3), or plain x / rms(x) * w (M2)
    rope_cos_sin, apply_rope NeoX rotary embedding on the first rotary_dim dims of each head
    Attention                fused QKV -> QK norm -> RoPE -> GQA SDPA (or MSA) -> o_proj -> all_reduce
    SparseIndexer            M3's MSA indexer: picks the key blocks each query attends to
    GatedMLP                 fused gate/up -> SwiGLU-OAI or SiLU -> down (-> all_reduce)
    VocabParallelEmbedding   each rank holds a slice of the vocab -> all_reduce

Activations are 2-D [T, hidden] (T = batch * seq); attention reshapes to
[B, heads, S, head_dim] only around scaled_dot_product_attention.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..kernels.norm_rope import rope_reference
from .linear import ColumnParallelLinear, Piece, ReplicatedLinear, RowParallelLinear, ShardingError, place_adjacent
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
    "head_group_range",
    "kv_head_range",
]


def shard(full: int, rank: int, size: int, what: str) -> tuple[int, int]:
    """(start, length) of `rank`'s equal share of `full` things."""
    if full % size:
        raise ShardingError(f"{what}: {full} is not divisible by {size} ranks")
    return rank * (full // size), full // size


def head_group_range(num_heads: int, ps: ParallelState, what: str) -> tuple[int, int]:
    """(first head, count) on this rank of heads that each serve a group of query
    heads (KV heads, index heads). Fewer heads than ranks: each rank keeps the one
    head of its query heads, replicated on tp_size // num_heads ranks."""
    if num_heads >= ps.tp_size:
        return shard(num_heads, ps.tp_rank, ps.tp_size, what)
    if ps.tp_size % num_heads:
        raise ShardingError(f"{what}: {num_heads} does not divide tp_size {ps.tp_size}")
    return ps.tp_rank * num_heads // ps.tp_size, 1


def kv_head_range(num_kv_heads: int, ps: ParallelState) -> tuple[int, int]:
    """(first KV head, count) on this rank (see head_group_range)."""
    return head_group_range(num_kv_heads, ps, "num_key_value_heads")


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
    interleaved); the dims after rotary_dim pass through unchanged. The math is
    kernels/norm_rope.py:rope_reference, written once there: it is also the
    reference of the fused norm + RoPE op (minimax::rms_norm_rope)."""
    return rope_reference(x, cos, sin)


# ----------------------------------------------------------------- attention
class SparseIndexer(nn.Module):
    """M3's MSA "lightning indexer": which key blocks each query attends to.

    Per token: index queries iq = rope(q_norm(x Wq)) [index heads, D] and ONE
    index key ik = rope(k_norm(x Wk)) [D] (Gemma norms, the main branch's
    partial RoPE). minimax::msa_select scores iq . ik in float32 against every
    earlier key, max-pools the scores into blocks of index_block_size key
    slots, forces in the query's own block (and the local / init blocks), and
    keeps the top index_topk_blocks per index head (kernels/msa.py has the
    exact rule). Index head j serves query heads j * H/Hi ... (j+1) * H/Hi - 1,
    which lie in one KV group, so index heads are split over ranks like the KV
    heads (replicated when there are fewer than ranks); the key head is
    replicated. No value or output projection: the indexer only selects.

    Checkpoint names: `<attn>.index_q_proj.weight` [Hi * D, hidden],
    `<attn>.index_k_proj.weight` [D, hidden], `<attn>.index_q_norm.weight`,
    `<attn>.index_k_norm.weight` [D]. FP8 models keep the two projections in
    FP8 like q/k/v (so they can share QKV's quantized input and GEMM).
    """

    def __init__(self, config, ps: ParallelState, prefix: str, *, dtype, device, fp8: bool):
        super().__init__()
        dim, heads = config.index_head_dim, config.index_n_heads
        i0, self.num_heads = head_group_range(heads, ps, "index_n_heads")
        self.head_dim = dim
        self.block_size = config.index_block_size
        self.topk_blocks = config.index_topk_blocks
        self.local_blocks = config.index_local_blocks
        self.init_blocks = config.index_init_blocks
        self.index_q_proj = ColumnParallelLinear([Piece(f"{prefix}.index_q_proj", heads * dim, i0 * dim,
                                                        self.num_heads * dim)],
                                                 config.hidden_size, dtype=dtype, device=device, fp8=fp8)
        self.index_k_proj = ReplicatedLinear(f"{prefix}.index_k_proj", config.hidden_size, dim,
                                             dtype=dtype, device=device, fp8=fp8)
        self.index_q_norm = RMSNorm(dim, config.rms_norm_eps, True, f"{prefix}.index_q_norm.weight",
                                    dtype=dtype, device=device)
        self.index_k_norm = RMSNorm(dim, config.rms_norm_eps, True, f"{prefix}.index_k_norm.weight",
                                    dtype=dtype, device=device)

    def extra_repr(self) -> str:
        return (f"heads={self.num_heads}, dim={self.head_dim}, block={self.block_size}, top-{self.topk_blocks}, "
                f"local={self.local_blocks}, init={self.init_blocks}")

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [T, hidden] -> (index queries [T, heads, D], index keys [T, D])."""
        iq = self.index_q_norm(self.index_q_proj(x).view(-1, self.num_heads, self.head_dim))
        ik = self.index_k_norm(self.index_k_proj(x).view(-1, 1, self.head_dim))
        return apply_rope(iq, cos, sin), apply_rope(ik, cos, sin)[:, 0]

    def select(self, index_q: torch.Tensor, index_k: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """int32 [T, heads, K] key blocks per query (index_k [B, L, D]: every key slot so far)."""
        return torch.ops.minimax.msa_select(index_q, index_k, positions, self.block_size, self.topk_blocks,
                                            self.local_blocks, self.init_blocks)


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

    Sparse layers (M3's MSA) run the indexer on the same input and attend,
    per query head, only to the key blocks its index head selected
    (minimax::msa_attention); the others run dense causal SDPA.
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
        self.indexer = None
        if sparse:
            self.indexer = SparseIndexer(config, ps, prefix, dtype=dtype, device=device, fp8=fp8)
            # The indexer reads QKV's input: keep its projections' rows right after QKV's,
            # so the compiled model runs the three as one GEMM (graph_passes/fuse_indexer_qkv.py).
            place_adjacent(self.qkv_proj, self.indexer.index_q_proj, self.indexer.index_k_proj)
        self.kv_cache = None  # a KVCache while model.allocate_kv_cache(...) is on

    def _apply(self, fn, recurse=True):
        # .to() / .cuda() move each parameter on its own: stack the QKV + indexer rows again.
        super()._apply(fn, recurse)
        if self.indexer is not None:
            place_adjacent(self.qkv_proj, self.indexer.index_q_proj, self.indexer.index_k_proj)
        return self

    def forward(self, x, positions, cos, sin, attn_mask=None):
        """x [T, hidden]; positions [B, S]; cos/sin [T, rotary_dim/2]; attn_mask [B, 1, S, L] or None (causal)."""
        d = self.head_dim
        q, k, v = self.qkv_proj(x).split([self.num_heads * d, self.num_kv_heads * d, self.num_kv_heads * d], dim=-1)
        q = q.reshape(-1, self.num_heads, d)
        k = k.reshape(-1, self.num_kv_heads, d)
        v = v.reshape(-1, self.num_kv_heads, d)
        if self.use_qk_norm:
            q, k = self.qk_norm(q, k)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        if self.indexer is not None:
            out = self._sparse_attention(x, q, k, v, positions, cos, sin)
        else:
            out = self._dense_attention(q, k, v, positions, attn_mask)
        return all_reduce(self.o_proj(out), self.ps)

    def _dense_attention(self, q, k, v, positions, attn_mask):
        batch, seq = positions.shape
        # [T, h, d] -> [B, h, S, d] for SDPA
        q, k, v = (t.reshape(batch, seq, -1, self.head_dim).transpose(1, 2) for t in (q, k, v))
        if self.kv_cache is not None:
            k, v = self.kv_cache.update(k, v, positions)
        out = F.scaled_dot_product_attention(
            q, k, v,
            attn_mask=attn_mask,
            is_causal=attn_mask is None,
            enable_gqa=self.num_heads != self.num_kv_heads,
        )
        return out.transpose(1, 2).reshape(batch * seq, self.num_heads * self.head_dim)

    def _sparse_attention(self, x, q, k, v, positions, cos, sin):
        batch, seq = positions.shape
        index_q, index_k = self.indexer(x, cos, sin)
        index_k = index_k.reshape(batch, seq, -1)
        k, v = (t.reshape(batch, seq, -1, self.head_dim).transpose(1, 2) for t in (k, v))
        if self.kv_cache is not None:
            k, v = self.kv_cache.update(k, v, positions)
            index_k = self.kv_cache.update_index(index_k, positions)
        blocks = self.indexer.select(index_q, index_k, positions)
        out = torch.ops.minimax.msa_attention(q, k, v, blocks, positions, self.indexer.block_size,
                                              self.head_dim ** -0.5)
        return out.reshape(batch * seq, self.num_heads * self.head_dim)

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


def gated_activation(act: str, gate: torch.Tensor, up: torch.Tensor, alpha: float, limit: float,
                     beta: float) -> torch.Tensor:
    """The gated MLP's activation: SwiGLU-OAI (M3) or SiLU(gate) * up (M2)."""
    if act == "swigluoai":
        return swiglu_oai(gate, up, alpha, limit, beta)
    return F.silu(gate) * up


class GatedMLP(nn.Module):
    """down(act(gate(x), up(x))), the dense MLP and the shared expert (routed experts: model/moe.py's LocalExperts).

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
        out = self.down_proj(gated_activation(self.act, gate, up, self.alpha, self.limit, self.beta))
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
