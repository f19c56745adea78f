"""GPU path of the MSA ops (kernels/msa.py): Triton kernels for Hopper.

    block_scores   the indexer's block scores [T, Hi, n_blocks] in float32. A program
                   takes a tile of (token, index head) rows of one sequence and a
                   range of key blocks; per block one tl.dot of the tile's queries
                   with the block's index keys, then the max over the block. Blocks
                   after the query's own are -inf and forced blocks +inf without any
                   arithmetic, so only blocks wholly in the past are scored (and
                   need no causal mask). Decode has one token per sequence: the
                   key blocks are split over many programs instead.
    top_blocks     the top-k of each row of block scores: k rounds of argmax over the
                   row held in registers, one program per row (one launch, where
                   torch.topk + masking + a cast took several).
    attention      block-sparse attention. A program takes TOK consecutive tokens of
                   one sequence and one index head: its rows are the TOK x G query
                   heads that share the selection (G = Hq / Hi) and one KV head. It
                   walks the union of the TOK tokens' selected blocks in ascending
                   order (each block's K and V loaded once), masking per row the
                   blocks its token did not select and the keys after its position;
                   exact online softmax in float32.
    decode         one token per sequence and few programs: each (token, index head)
                   splits its selected blocks over SPLIT programs that write partial
                   outputs and log-sum-exps, and a second kernel merges them
                   (flash-decoding).

Everything is shape-static for a given token count, so it captures into CUDA
graphs. This module registers the ops' CUDA kernels (the end of the file);
kernels/msa.py, which defines the ops and their references, never imports it.
Under TRITON_INTERPRET=1 the kernels run on CPU tensors (tests); the
interpreter's bf16 tl.dot is wrong, so they upcast to float32 there.
"""

from __future__ import annotations

import math

import torch

from . import msa as _ops
from .interpreter import triton_interpreting as _interpreting

try:  # optional: CPU installs use the reference only
    import triton
    import triton.language as tl

    HAVE_TRITON = True
except ImportError:  # pragma: no cover
    triton = tl = None
    HAVE_TRITON = False

__all__ = ["HAVE_TRITON", "supported", "block_scores", "top_blocks", "sparse_attention", "attention_plan"]

_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def supported(*tensors: torch.Tensor) -> bool:
    """Whether these tensors can run the Triton kernels (else the reference runs)."""
    if not HAVE_TRITON:
        return False
    return all((t.is_cuda or _interpreting()) for t in tensors) and all(
        t.dtype in _DTYPES for t in tensors if t.is_floating_point())


def _sm_count(device: torch.device) -> int:
    if device.type != "cuda":
        return 8
    return torch.cuda.get_device_properties(device).multi_processor_count


if HAVE_TRITON:

    @triton.jit
    def _block_scores_kernel(
        q_ptr, k_ptr, pos_ptr, out_ptr,
        seq, heads, n_blocks, blocks_per_prog,
        stride_kb, stride_kl,
        BS: tl.constexpr, D: tl.constexpr, BLOCK_R: tl.constexpr,
        LOCAL: tl.constexpr, INIT: tl.constexpr, UPCAST: tl.constexpr, IEEE: tl.constexpr,
    ):
        tile, chunk, b = tl.program_id(0), tl.program_id(1), tl.program_id(2)
        rows = tile * BLOCK_R + tl.arange(0, BLOCK_R)  # (token, head) rows of sequence b
        row_ok = rows < seq * heads
        token = b * seq + rows // heads
        pos = tl.load(pos_ptr + token, mask=row_ok, other=0)
        own = pos // BS
        dims = tl.arange(0, D)
        q = tl.load(q_ptr + (token * heads + rows % heads)[:, None] * D + dims[None, :], mask=row_ok[:, None], other=0.0)
        if UPCAST:
            q = q.to(tl.float32)
        last_scored = tl.max(tl.where(row_ok, own - LOCAL, -1))  # the last block some row scores
        keys = tl.arange(0, BS)
        out_rows = out_ptr + (token * heads + rows % heads) * n_blocks
        for i in range(0, blocks_per_prog):
            blk = chunk * blocks_per_prog + i
            if blk < n_blocks:
                forced = ((blk <= own) & (blk > own - LOCAL)) | ((blk < INIT) & (blk <= own))
                score = tl.where(blk > own, float("-inf"), float("inf"))
                if blk <= last_scored:
                    kt = tl.load(k_ptr + b.to(tl.int64) * stride_kb + (blk * BS + keys)[None, :] * stride_kl + dims[:, None])
                    if UPCAST:
                        kt = kt.to(tl.float32)
                    if IEEE:
                        s = tl.dot(q, kt, input_precision="ieee")
                    else:
                        s = tl.dot(q, kt)
                    score = tl.where((blk < own) & ~forced, tl.max(s, axis=1), score)
                tl.store(out_rows + blk, score, mask=row_ok)

    @triton.jit
    def _sparse_attention_kernel(
        q_ptr, k_ptr, v_ptr, blocks_ptr, pos_ptr, o_ptr, lse_ptr,
        seq, n_tiles, key_slots, qk_scale,
        stride_qt, stride_qh, stride_kb, stride_kh, stride_kl, stride_vb, stride_vh, stride_vl,
        stride_bt, stride_bh, stride_ot, stride_oh, stride_os,
        HQ: tl.constexpr, HI: tl.constexpr, HKV: tl.constexpr, G: tl.constexpr, G_PAD: tl.constexpr,
        TOK: tl.constexpr, K: tl.constexpr, K_PAD: tl.constexpr, SPLIT: tl.constexpr,
        BS: tl.constexpr, D: tl.constexpr, UPCAST: tl.constexpr, IEEE: tl.constexpr,
    ):
        """Rows = TOK tokens x G_PAD heads of index head h. With SPLIT > 1 (decode, TOK = 1)
        program `part` takes slots part, part + SPLIT, ... of the token's block list and
        writes a partial output and its log2-sum-exp; SPLIT == 1 writes the final output."""
        pid, h = tl.program_id(0), tl.program_id(1)
        part = pid % SPLIT
        tile = pid // SPLIT
        b = tile // n_tiles
        t0 = (tile % n_tiles) * TOK
        M: tl.constexpr = TOK * G_PAD
        r = tl.arange(0, M)
        j = r // G_PAD  # token within the tile
        g = r % G_PAD  # head within the index head's group
        row_ok = (t0 + j < seq) & (g < G)
        token = b * seq + t0 + j
        qh = h * G + g  # query head
        kvh = (h * G) // (HQ // HKV)
        dims = tl.arange(0, D)
        q = tl.load(q_ptr + token[:, None] * stride_qt + qh[:, None] * stride_qh + dims[None, :],
                    mask=row_ok[:, None], other=0.0)
        if UPCAST:
            q = q.to(tl.float32)
        pos = tl.load(pos_ptr + token, mask=row_ok, other=-1)

        # The tile's selections [TOK, K_PAD]: -1 and padding become BIG.
        BIG: tl.constexpr = 1 << 30
        tj = tl.arange(0, TOK)
        tk = tl.arange(0, K_PAD)
        t_ok = (t0 + tj < seq)[:, None] & (tk < K)[None, :]
        if SPLIT > 1:
            t_ok = t_ok & ((tk % SPLIT) == part)[None, :]
        ids = tl.load(blocks_ptr + (b * seq + t0 + tj)[:, None] * stride_bt + h * stride_bh + tk[None, :],
                      mask=t_ok, other=-1)
        ids = tl.where(ids < 0, BIG, ids)

        m_i = tl.full([M], float("-inf"), tl.float32)
        l_i = tl.zeros([M], tl.float32)
        acc = tl.zeros([M, D], tl.float32)
        keys = tl.arange(0, BS)
        k_base = k_ptr + b.to(tl.int64) * stride_kb + kvh * stride_kh  # caches pass 2^31 elements
        v_base = v_ptr + b.to(tl.int64) * stride_vb + kvh * stride_vh
        blk = tl.min(tl.min(ids, axis=1), axis=0)
        while blk < BIG:
            chosen = tl.sum((ids == blk).to(tl.int32), axis=1) > 0  # [TOK]: which tokens selected blk
            row_chosen = tl.reshape(tl.broadcast_to(chosen[:, None], [TOK, G_PAD]), [M])
            slot = blk * BS + keys
            kv_ok = slot < key_slots
            kt = tl.load(k_base + slot[None, :] * stride_kl + dims[:, None], mask=kv_ok[None, :], other=0.0)
            v = tl.load(v_base + slot[:, None] * stride_vl + dims[None, :], mask=kv_ok[:, None], other=0.0)
            if UPCAST:
                kt = kt.to(tl.float32)
                v = v.to(tl.float32)
            if IEEE:
                s = tl.dot(q, kt, input_precision="ieee")
            else:
                s = tl.dot(q, kt)
            s = s * qk_scale
            keep = row_chosen[:, None] & (slot[None, :] <= pos[:, None])
            s = tl.where(keep, s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, axis=1))
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # rows with no key yet
            alpha = tl.exp2(m_i - m_safe)
            p = tl.exp2(s - m_safe[:, None])
            l_i = l_i * alpha + tl.sum(p, axis=1)
            if IEEE:
                pv = tl.dot(p.to(v.dtype), v, input_precision="ieee")
            else:
                pv = tl.dot(p.to(v.dtype), v)
            acc = acc * alpha[:, None] + pv
            m_i = m_new
            blk = tl.min(tl.min(tl.where(ids > blk, ids, BIG), axis=1), axis=0)

        o_rows = o_ptr + token[:, None] * stride_ot + qh[:, None] * stride_oh + part * stride_os + dims[None, :]
        if SPLIT == 1:
            out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
            tl.store(o_rows, out.to(o_ptr.dtype.element_ty), mask=row_ok[:, None])
        else:
            tl.store(o_rows, acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None], mask=row_ok[:, None])
            lse = tl.where(l_i == 0.0, float("-inf"), m_i + tl.log2(tl.where(l_i == 0.0, 1.0, l_i)))
            tl.store(lse_ptr + (token * HQ + qh) * SPLIT + part, lse, mask=row_ok)

    @triton.jit
    def _top_blocks_kernel(scores_ptr, out_ptr, n_blocks, K_OUT: tl.constexpr, NB: tl.constexpr):
        """One row of block scores -> its top K_OUT block ids, best first, -1 for -inf (what
        kernels/msa.py's top_blocks does): K_OUT rounds of argmax over the row in registers."""
        row = tl.program_id(0).to(tl.int64)
        blk = tl.arange(0, NB)
        s = tl.load(scores_ptr + row * n_blocks + blk, mask=blk < n_blocks, other=float("-inf"))
        for i in range(K_OUT):
            best = tl.max(s, axis=0)
            idx = tl.min(tl.where(s == best, blk, NB), axis=0)  # the first of equal scores
            tl.store(out_ptr + row * K_OUT + i, tl.where(best == float("-inf"), -1, idx))
            s = tl.where(blk == idx, float("-inf"), s)

    @triton.jit
    def _merge_kernel(part_ptr, lse_ptr, o_ptr, stride_ot, stride_oh,
                      HQ: tl.constexpr, SPLIT: tl.constexpr, D: tl.constexpr):
        """out[t, h] = sum_p w_p part[t, h, p] with w_p = 2^(lse_p - lse) (flash-decoding merge)."""
        t, h = tl.program_id(0), tl.program_id(1)
        sp = tl.arange(0, SPLIT)
        dims = tl.arange(0, D)
        lse = tl.load(lse_ptr + (t * HQ + h) * SPLIT + sp)
        top = tl.max(lse, axis=0)
        top = tl.where(top == float("-inf"), 0.0, top)
        w = tl.exp2(lse - top)
        w = w / tl.maximum(tl.sum(w, axis=0), 1e-30)
        parts = tl.load(part_ptr + ((t * HQ + h) * SPLIT + sp)[:, None] * D + dims[None, :])
        out = tl.sum(parts * w[:, None], axis=0)
        tl.store(o_ptr + t * stride_ot + h * stride_oh + dims, out.to(o_ptr.dtype.element_ty))


def _flags(*tensors: torch.Tensor) -> tuple[bool, bool]:
    """(UPCAST, IEEE): the interpreter's bf16 dot is wrong, so it gets float32; float32
    inputs on the GPU keep full precision (no TF32)."""
    interp = _interpreting()
    fp32 = any(t.dtype == torch.float32 for t in tensors)
    return interp, fp32 and not interp


def block_scores(index_q: torch.Tensor, index_k: torch.Tensor, positions: torch.Tensor, block_size: int,
                 local_blocks: int, init_blocks: int, n_blocks: int) -> torch.Tensor:
    """float32 [T, Hi, n_blocks], as kernels/msa.py's block_scores_reference (flattened)."""
    batch, seq = positions.shape
    tokens, heads, dim = index_q.shape
    q = index_q.contiguous()
    k = index_k if index_k.stride(-1) == 1 else index_k.contiguous()
    pos = positions.contiguous()
    out = torch.empty(tokens, heads, n_blocks, dtype=torch.float32, device=q.device)
    block_r = 64 if seq * heads >= 64 else 16
    row_tiles = triton.cdiv(seq * heads, block_r)
    # Enough programs to fill the GPU: split the key blocks when the rows are few (decode).
    want = 2 * _sm_count(q.device)
    chunks = max(1, min(n_blocks, want // max(1, row_tiles * batch)))
    per_prog = triton.cdiv(n_blocks, chunks)
    chunks = triton.cdiv(n_blocks, per_prog)
    upcast, ieee = _flags(q, k)
    _block_scores_kernel[(row_tiles, chunks, batch)](
        q, k, pos, out, seq, heads, n_blocks, per_prog, k.stride(0), k.stride(1),
        BS=block_size, D=dim, BLOCK_R=block_r, LOCAL=local_blocks, INIT=init_blocks, UPCAST=upcast, IEEE=ieee,
        num_warps=4,
    )
    return out


def top_blocks(scores: torch.Tensor, topk: int) -> torch.Tensor:
    """int32 [..., K] of block scores [..., n_blocks], as kernels/msa.py's top_blocks."""
    n_blocks = scores.shape[-1]
    k = min(topk, n_blocks)
    rows = scores.reshape(-1, n_blocks)
    out = torch.empty(rows.shape[0], k, dtype=torch.int32, device=scores.device)
    _top_blocks_kernel[(rows.shape[0],)](rows, out, n_blocks, K_OUT=k, NB=triton.next_power_of_2(n_blocks),
                                         num_warps=4 if n_blocks > 256 else 1)
    return out.view(*scores.shape[:-1], k)


def attention_plan(tokens_per_seq: int, batch: int, index_heads: int, group: int, topk: int,
                   device: torch.device, tok: int | None = None) -> tuple[int, int]:
    """(TOK tokens per program, SPLIT programs per token). Decode-sized work splits each
    token's blocks over programs until the GPU has about two programs per SM."""
    g_pad = max(16, triton.next_power_of_2(group))
    if tok is None:
        tok = max(1, 64 // g_pad)
    tok = min(tok, triton.next_power_of_2(tokens_per_seq))
    programs = batch * triton.cdiv(tokens_per_seq, tok) * index_heads
    split = 1
    if tok == 1:
        want = 2 * _sm_count(device)
        while split < topk and programs * split * 2 <= want:
            split *= 2
    return tok, split


def sparse_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, blocks: torch.Tensor,
                     positions: torch.Tensor, block_size: int, scale: float,
                     tok: int | None = None, split: int | None = None) -> torch.Tensor:
    """[T, Hq, d] as kernels/msa.py's msa_attention_reference."""
    batch, seq = positions.shape
    tokens, hq, dim = q.shape
    hkv, hi, topk = k.shape[1], blocks.shape[1], blocks.shape[2]
    group = hq // hi
    g_pad = max(16, triton.next_power_of_2(group))
    plan_tok, plan_split = attention_plan(seq, batch, hi, group, topk, q.device, tok)
    tok = plan_tok
    split = plan_split if split is None else split
    if split > 1 and tok != 1:
        raise ValueError("sparse_attention: splitting the blocks needs one token per program")
    q = q if q.stride(-1) == 1 else q.contiguous()
    k = k if k.stride(-1) == 1 else k.contiguous()
    v = v if v.stride(-1) == 1 else v.contiguous()
    blocks = blocks.contiguous()
    pos = positions.contiguous()
    out = torch.empty_like(q)
    n_tiles = triton.cdiv(seq, tok)
    upcast, ieee = _flags(q, k, v)
    qk_scale = scale * math.log2(math.e)
    if split == 1:
        o, so, lse = out, (out.stride(0), out.stride(1), 0), out  # lse unused
    else:
        o = torch.empty(tokens, hq, split, dim, dtype=torch.float32, device=q.device)
        so = (o.stride(0), o.stride(1), o.stride(2))
        lse = torch.empty(tokens, hq, split, dtype=torch.float32, device=q.device)
    _sparse_attention_kernel[(batch * n_tiles * split, hi)](
        q, k, v, blocks, pos, o, lse, seq, n_tiles, k.shape[2], qk_scale,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), k.stride(2), v.stride(0), v.stride(1), v.stride(2),
        blocks.stride(0), blocks.stride(1), *so,
        HQ=hq, HI=hi, HKV=hkv, G=group, G_PAD=g_pad, TOK=tok, K=topk, K_PAD=max(2, triton.next_power_of_2(topk)),
        SPLIT=split, BS=block_size, D=dim, UPCAST=upcast, IEEE=ieee,
        num_warps=4 if tok * g_pad <= 64 else 8,
    )
    if split > 1:
        _merge_kernel[(tokens, hq)](o, lse, out, out.stride(0), out.stride(1), HQ=hq, SPLIT=split, D=dim, num_warps=4)
    return out


# ------------------------------------------------------------ the ops' CUDA kernels
@_ops.msa_select.register_kernel("cuda")
def _msa_select_cuda(index_q, index_k, positions, block_size, topk, local_blocks, init_blocks):
    if not supported(index_q, index_k):
        return _ops.msa_select_reference(index_q, index_k, positions, block_size, topk, local_blocks, init_blocks)
    _ops.check_select(index_q, index_k, positions, block_size, topk, local_blocks, init_blocks)
    scores = block_scores(index_q, index_k, positions, block_size, local_blocks, init_blocks,
                          _ops.num_key_blocks(index_k.shape[1], block_size))
    return top_blocks(scores, topk)


@_ops.msa_attention.register_kernel("cuda")
def _msa_attention_cuda(q, k, v, blocks, positions, block_size, scale):
    if not supported(q, k, v):
        return _ops.msa_attention_reference(q, k, v, blocks, positions, block_size, scale)
    _ops.check_attention(q, k, v, blocks, positions, block_size)
    return sparse_attention(q, k, v, blocks, positions, block_size, scale)
