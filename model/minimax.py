"""MiniMax-M3 (and M2): the eager, tensor / expert parallel model.

    input_ids [B, S] -> embed (vocab-parallel)              residual stream h [T = B*S, hidden]
    for each of the num_hidden_layers decoder layers:
        h = h + attention(input_layernorm(h))               fused QKV, QK norm, partial RoPE, GQA
        h = h + mlp(post_attention_layernorm(h))            dense MLP (M3's first 3 layers) or MoE
    logits = lm_head(norm(h))                               column-parallel over vocab, all-gathered

Parts (one file each): model/layers.py (norms, RoPE, attention, MLP,
embedding), model/moe.py (router + experts), model/linear.py (parallel and
FP8 linears), model/parallel.py (layout + collectives), model/kv_cache.py.

Not called by forward:
  * MTPModule (`model.mtp[i]`): the multi-token-prediction head for
    speculative decoding, run by a caller as `model.mtp[0](hidden, next_ids, positions)`.

Sparse attention (MSA) on config.sparse_attention_layers: the indexer picks
index_topk_blocks key blocks per query and index head, and attention runs over
those blocks only (model/layers.py: SparseIndexer, Attention; the ops in
kernels/msa.py). The other layers attend densely.

Checkpoint names (HF layout; load plans carry them):
    model.embed_tokens.weight, model.norm.weight, lm_head.weight
    model.layers.N.{input_layernorm, post_attention_layernorm}.weight
    model.layers.N.self_attn.{q,k,v,o}_proj.weight, .self_attn.{q,k}_norm.weight
    model.layers.N.self_attn.index_{q,k}_proj.weight, .self_attn.index_{q,k}_norm.weight   (sparse layers)
    model.layers.N.mlp.{gate,up,down}_proj.weight                                           (dense layers)
    model.layers.N.block_sparse_moe.{gate.weight, e_score_correction_bias}
    model.layers.N.block_sparse_moe.experts.E.{w1,w2,w3}.weight
    model.layers.N.block_sparse_moe.shared_experts.{gate,up,down}_proj.weight
    model.mtp.I.{enorm, hnorm, eh_proj, shared_head.norm}.weight + model.mtp.I.<decoder layer names>
FP8 linears add `<name>.weight_scale_inv` next to each `<name>.weight`.
"""

from __future__ import annotations

from typing import Union

import torch
from torch import nn

from .config import MiniMaxConfig
from .kv_cache import KVCache, cache_mask
from .layers import Attention, GatedMLP, RMSNorm, VocabParallelEmbedding, rope_cos_sin, shard
from .linear import ColumnParallelLinear, ParallelLinear, Piece, ReplicatedLinear
from .moe import MoE
from .parallel import ParallelState, all_gather
from .random_weights import init_random_weights

__all__ = ["MiniMaxForCausalLM", "DecoderLayer", "MTPModule", "build_model", "init_random_weights"]


def _kept_positions(h: torch.Tensor, logits_to_keep: Union[int, torch.Tensor]) -> tuple[int, torch.Tensor]:
    """(positions kept, h [B, kept, hidden]) for forward's logits_to_keep."""
    seq = h.shape[1]
    if isinstance(logits_to_keep, torch.Tensor):
        if logits_to_keep.dim() != 1 or logits_to_keep.dtype not in (torch.int32, torch.int64):
            raise ValueError(f"logits_to_keep: a 1-D integer tensor of positions, got {logits_to_keep.dim()}-D "
                             f"{logits_to_keep.dtype}")
        return logits_to_keep.numel(), h[:, logits_to_keep]
    if not isinstance(logits_to_keep, int) or isinstance(logits_to_keep, bool) or logits_to_keep < 0:
        raise ValueError(f"logits_to_keep: 0 (every position), a count n > 0 or a tensor of positions, "
                         f"got {logits_to_keep!r}")
    if logits_to_keep == 0:
        return seq, h
    if logits_to_keep > seq:
        raise ValueError(f"logits_to_keep={logits_to_keep}: the input has only {seq} positions")
    return logits_to_keep, h[:, seq - logits_to_keep:]


class DecoderLayer(nn.Module):
    """Pre-norm attention and MLP (dense or MoE), each added to the residual stream."""

    def __init__(self, config: MiniMaxConfig, ps: ParallelState, prefix: str, *, moe: bool, sparse: bool,
                 dtype, device, fp8: bool):
        super().__init__()
        eps, gemma = config.rms_norm_eps, config.use_gemma_norm
        self.input_layernorm = RMSNorm(config.hidden_size, eps, gemma, f"{prefix}.input_layernorm.weight",
                                       dtype=dtype, device=device)
        self.self_attn = Attention(config, ps, f"{prefix}.self_attn", dtype=dtype, device=device, fp8=fp8,
                                   sparse=sparse)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, eps, gemma,
                                                f"{prefix}.post_attention_layernorm.weight",
                                                dtype=dtype, device=device)
        if moe:
            self.block_sparse_moe = MoE(config, ps, f"{prefix}.block_sparse_moe", dtype=dtype, device=device, fp8=fp8)
        else:
            names = tuple(f"{prefix}.mlp.{p}_proj" for p in ("gate", "up", "down"))
            self.mlp = GatedMLP(config, ps, names, config.dense_intermediate_size, ps.tp_rank, ps.tp_size,
                                reduce_output=True, dtype=dtype, device=device, fp8=fp8)
        self.is_moe = moe

    def forward(self, h, positions, cos, sin, attn_mask=None):
        h = h + self.self_attn(self.input_layernorm(h), positions, cos, sin, attn_mask)
        ffn = self.block_sparse_moe if self.is_moe else self.mlp
        return h + ffn(self.post_attention_layernorm(h))


class MiniMaxForCausalLM(nn.Module):
    """The causal LM on this rank: embedding, decoder layers, final norm, lm_head.

    `parallel_state` picks this rank's shards (None: one device). `quantize_fp8`
    (or config.quant_method == "fp8") makes the attention, MLP and expert linears
    FP8 block-scaled (the indexer's projections too); embedding, norms, router, MTP eh_proj and lm_head
    stay in `dtype`. Weights are uninitialized: load a checkpoint through the
    load plans (model/checkpoint_loader.py) or call init_random_weights.
    """

    def __init__(self, config: MiniMaxConfig, parallel_state: ParallelState | None = None,
                 dtype: torch.dtype = torch.bfloat16, device: torch.device | str = "cpu",
                 quantize_fp8: bool = False):
        super().__init__()
        ps = parallel_state or ParallelState.single()
        config.validate_for_parallel(ps.tp_size, ps.ep_size)
        self.config, self.ps, self.dtype = config, ps, dtype
        fp8 = quantize_fp8 or config.quant_method == "fp8"
        if fp8 and tuple(config.weight_block_size) != (128, 128):
            raise ValueError(f"weight_block_size {config.weight_block_size}: only 128 x 128 FP8 blocks are supported")
        self.fp8 = fp8
        kw = dict(dtype=dtype, device=device)

        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size, ps,
                                                   "model.embed_tokens.weight", **kw)
        self.layers = nn.ModuleList(
            DecoderLayer(config, ps, f"model.layers.{i}", moe=config.mlp_layer_types[i] == "moe",
                         sparse=i in config.sparse_attention_layers, fp8=fp8, **kw)
            for i in range(config.num_hidden_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, config.use_gemma_norm, "model.norm.weight", **kw)
        v0, v_local = shard(config.vocab_size, ps.tp_rank, ps.tp_size, "vocab_size")
        head_name = "model.embed_tokens" if config.tie_word_embeddings else "lm_head"
        self.lm_head = ColumnParallelLinear([Piece(head_name, config.vocab_size, v0, v_local)],
                                            config.hidden_size, **kw)
        self.mtp = nn.ModuleList(MTPModule(self, i, fp8=fp8) for i in range(config.num_mtp_modules))
        self.aux_layers = tuple(config.aux_hidden_state_layers)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                logits_to_keep: Union[int, torch.Tensor] = 0):
        """input_ids, positions [B, S] -> logits [B, S, vocab]
        (plus aux hidden states [B, S, n_aux, hidden] when config.aux_hidden_state_layers is set).

        logits_to_keep (as in transformers): 0 = every position's logits; n > 0 = the last n
        positions' only ([B, n, vocab]: a prefill that samples one token needs n = 1, and the
        lm_head over every position is a third of an 8k prefill); a 1-D tensor = the positions
        at those indices (a prefill padded to a bucket keeps its last real position)."""
        batch, seq = input_ids.shape
        cos, sin = rope_cos_sin(positions.reshape(-1), self.config.rotary_dim, self.config.rope_theta)
        attn_mask = self._attn_mask(positions)

        h = self.embed_tokens(input_ids.reshape(-1))
        aux = {}
        for i, layer in enumerate(self.layers):
            h = layer(h, positions, cos, sin, attn_mask)
            if i in self.aux_layers:
                aux[i] = h  # the residual stream after layer i (what speculative drafts read)

        kept, h_kept = _kept_positions(h.view(batch, seq, -1), logits_to_keep)
        logits = self.compute_logits(self.norm(h_kept.reshape(batch * kept, -1))).view(batch, kept, -1)
        if not self.aux_layers:
            return logits
        aux_hidden = torch.stack([aux[i] for i in self.aux_layers], dim=1)  # in config order
        return logits, aux_hidden.view(batch, seq, len(self.aux_layers), -1)

    def compute_logits(self, h: torch.Tensor) -> torch.Tensor:
        """[T, hidden] (already normed) -> [T, vocab]: each rank's vocab slice, gathered."""
        return all_gather(self.lm_head(h), self.ps, dim=-1)

    # ------------------------------------------------------------- KV cache
    def allocate_kv_cache(self, batch: int, max_len: int) -> None:
        """Preallocate static K/V buffers (and the index-K buffer of each sparse layer);
        later forwards write at `positions` and attend over the cache (prefill and
        decode share one code path)."""
        for layer in self.layers:
            attn = layer.self_attn
            attn.kv_cache = KVCache(batch, max_len, attn.num_kv_heads, attn.head_dim,
                                    dtype=self.dtype, device=self.embed_tokens.weight.device,
                                    index_head_dim=attn.indexer.head_dim if attn.indexer is not None else 0)

    def free_kv_cache(self) -> None:
        for layer in self.layers:
            layer.self_attn.kv_cache = None

    def _attn_mask(self, positions: torch.Tensor) -> torch.Tensor | None:
        cache = self.layers[0].self_attn.kv_cache if len(self.layers) else None
        if cache is None:
            return None  # plain causal attention over the S tokens given
        if positions.shape[0] != cache.batch:
            raise ValueError(f"batch {positions.shape[0]} != KV cache batch {cache.batch}")
        return cache_mask(positions, cache.max_len)


class MTPModule(nn.Module):
    """One DeepSeek-style multi-token-prediction module (for speculative decoding).

    Predicts token t+2 from the main model's hidden state at t and the embedding
    of token t+1:
        h = eh_proj(cat(enorm(embed(next_ids)), hnorm(hidden)))
        h = decoder_layer(h)                      (causal over S; no KV cache)
        logits = lm_head(shared_head.norm(h))
    `hidden` is the main model's last-layer output BEFORE the final norm (get it
    with config.aux_hidden_state_layers = (num_hidden_layers - 1,)). The
    embedding and lm_head are the main model's (shared, not owned here).
    eh_proj is replicated. Names: model.mtp.I.{enorm,hnorm,eh_proj,shared_head.norm}
    and the decoder layer's names under model.mtp.I (e.g. model.mtp.0.self_attn.q_proj).
    """

    def __init__(self, model: MiniMaxForCausalLM, index: int, *, fp8: bool):
        super().__init__()
        config, ps = model.config, model.ps
        prefix = f"model.mtp.{index}"
        kw = dict(dtype=model.dtype, device=model.embed_tokens.weight.device)
        hidden, eps, gemma = config.hidden_size, config.rms_norm_eps, config.use_gemma_norm
        self.enorm = RMSNorm(hidden, eps, gemma, f"{prefix}.enorm.weight", **kw)
        self.hnorm = RMSNorm(hidden, eps, gemma, f"{prefix}.hnorm.weight", **kw)
        self.eh_proj = ReplicatedLinear(f"{prefix}.eh_proj", 2 * hidden, hidden, **kw)
        self.layer = DecoderLayer(config, ps, prefix, moe=config.mlp_layer_types[-1] == "moe", sparse=False,
                                  fp8=fp8, **kw)
        self.shared_head_norm = RMSNorm(hidden, eps, gemma, f"{prefix}.shared_head.norm.weight", **kw)
        self._main = (model,)  # a tuple, so the main model is not registered as a submodule (no cycle)

    def forward(self, hidden: torch.Tensor, next_input_ids: torch.Tensor, positions: torch.Tensor):
        """hidden [B, S, hidden], next_input_ids / positions [B, S] -> (logits [B, S, vocab], h [B, S, hidden])."""
        main = self._main[0]
        batch, seq = next_input_ids.shape
        cos, sin = rope_cos_sin(positions.reshape(-1), main.config.rotary_dim, main.config.rope_theta)
        e = self.enorm(main.embed_tokens(next_input_ids.reshape(-1)))
        h = self.eh_proj(torch.cat([e, self.hnorm(hidden.reshape(batch * seq, -1))], dim=-1))
        attn = self.layer.self_attn
        cache, attn.kv_cache = attn.kv_cache, None
        h = self.layer(h, positions, cos, sin)
        attn.kv_cache = cache
        logits = main.compute_logits(self.shared_head_norm(h))
        return logits.view(batch, seq, -1), h.view(batch, seq, -1)


# ------------------------------------------------------------------ building
def build_model(config: MiniMaxConfig, parallel_state: ParallelState | None = None,
                dtype: torch.dtype = torch.bfloat16, device: torch.device | str = "cpu",
                quantize_fp8: bool = False) -> MiniMaxForCausalLM:
    """The model with uninitialized weights (load a checkpoint or call init_random_weights)."""
    return MiniMaxForCausalLM(config, parallel_state, dtype, device, quantize_fp8).eval()
