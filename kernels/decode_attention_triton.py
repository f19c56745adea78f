"""GPU path of `minimax::decode_attention` (kernels/decode_attention.py): one Triton kernel
for Hopper, flash-decoding with the query heads of a KV head packed into one tile.

A program takes one sequence, one KV head and one contiguous part of the cache's
slots. Its rows are the S x G query heads that share the KV head (G = Hq / Hkv,
16 in M3), so each K and V tile is read once for all of them and the product is
one tensor-core tile tall. It walks its slots in tiles of BLOCK_N keys in a
software-pipelined loop (the next tiles' loads in flight while one is used),
adds the mask (bool or additive) and keeps an exact online softmax in float32.
Keys no row may see are not loaded (masked loads), so a cache longer than the
context costs only its mask. With SPLIT > 1 parts per (sequence, KV head) the
parts write partial outputs and log2-sum-exps that msa_triton.merge_splits
combines. SPLIT grows while the GPU has at most about two programs per SM.

Shape-static for given shapes, so it captures into CUDA graphs. Under
TRITON_INTERPRET=1 it runs on CPU tensors (tests); the interpreter's bf16 tl.dot
is wrong, so inputs are upcast there.
"""

from __future__ import annotations

import math

import torch

from . import decode_attention as _ops
from .interpreter import triton_interpreting as _interpreting

try:  # optional: CPU installs use the reference only
    import triton
    import triton.language as tl

    HAVE_TRITON = True
except ImportError:  # pragma: no cover
    triton = tl = None
    HAVE_TRITON = False

__all__ = ["HAVE_TRITON", "supported", "decode_attention", "split_plan", "BLOCK_N", "STAGES"]

_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
# Measured on one H200 (docs/kernel-notes.md#decode-attention): 128 keys, 2 stages was the
# best or within 2% of it at batch 16-64; smaller batches differ by a microsecond.
BLOCK_N = 128  # keys per tile
STAGES = 2  # tiles in flight
MAX_SPLIT = 64  # parts per (sequence, KV head): the merge holds them in one vector


def supported(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> bool:
    """Whether the Triton kernel runs these tensors (else the reference does)."""
    if not HAVE_TRITON:
        return False
    d = q.shape[-1]
    return (all(t.is_cuda or _interpreting() for t in (q, k, v)) and all(t.dtype in _DTYPES for t in (q, k, v))
            and d >= 16 and d & (d - 1) == 0 and d <= 256)


def _sm_count(device: torch.device) -> int:
    if device.type != "cuda":
        return 8
    return torch.cuda.get_device_properties(device).multi_processor_count


def split_plan(batch: int, kv_heads: int, slots: int, device: torch.device, block_n: int = BLOCK_N) -> int:
    """Parts per (sequence, KV head): doubled while the GPU keeps at most ~2 programs per SM
    and every part at least one tile (more parts measured slower: each writes and merges a
    float32 partial output)."""
    tiles = -(-slots // block_n)
    programs = batch * kv_heads
    split = 1
    while split * 2 <= MAX_SPLIT and split * 2 <= tiles and programs * split * 2 <= 2 * _sm_count(device):
        split *= 2
    return split


if HAVE_TRITON:

    @triton.jit
    def _decode_attention_kernel(
        q_ptr, k_ptr, v_ptr, mask_ptr, o_ptr, lse_ptr,
        hq, slots, keys_per_part, qk_scale,
        stride_qb, stride_qh, stride_qs,
        stride_kb, stride_kh, stride_kl,
        stride_vb, stride_vh, stride_vl,
        stride_mb, stride_ms, stride_ml,
        stride_ob, stride_oh, stride_os, stride_op,
        S: tl.constexpr, S_PAD: tl.constexpr, G: tl.constexpr, G_PAD: tl.constexpr, SPLIT: tl.constexpr,
        BLOCK_N: tl.constexpr, D: tl.constexpr, BOOL_MASK: tl.constexpr, STAGES: tl.constexpr,
        UPCAST: tl.constexpr, IEEE: tl.constexpr,
    ):
        pid, h = tl.program_id(0), tl.program_id(1)
        b = (pid // SPLIT).to(tl.int64)  # caches pass 2^31 elements
        part = pid % SPLIT
        M: tl.constexpr = S_PAD * G_PAD
        r = tl.arange(0, M)
        s_row = r // G_PAD  # query token
        g = r % G_PAD  # head within the KV head's group
        row_ok = (s_row < S) & (g < G)
        qh = h * G + g
        dims = tl.arange(0, D)
        q = tl.load(q_ptr + b * stride_qb + qh[:, None] * stride_qh + s_row[:, None] * stride_qs + dims[None, :],
                    mask=row_ok[:, None], other=0.0)
        if UPCAST:
            q = q.to(tl.float32)

        m_i = tl.full([M], float("-inf"), tl.float32)
        l_i = tl.zeros([M], tl.float32)
        acc = tl.zeros([M, D], tl.float32)
        keys = tl.arange(0, BLOCK_N)
        sq = tl.arange(0, S_PAD)
        k_base = k_ptr + b * stride_kb + h * stride_kh
        v_base = v_ptr + b * stride_vb + h * stride_vh
        m_base = mask_ptr + b * stride_mb
        lo = part * keys_per_part
        hi = tl.minimum(lo + keys_per_part, slots)
        for start in tl.range(lo, hi, BLOCK_N, num_stages=STAGES):
            slot = start + keys
            in_part = (sq < S)[:, None] & (slot < hi)[None, :]
            mval = tl.load(m_base + sq[:, None] * stride_ms + slot[None, :] * stride_ml, mask=in_part, other=0)
            if BOOL_MASK:
                bias = tl.where(mval != 0, 0.0, float("-inf"))
            else:
                bias = tl.where(in_part, mval.to(tl.float32) * 1.4426950408889634, float("-inf"))
            seen = tl.max(bias, axis=0) > float("-inf")  # [BLOCK_N]: some row attends to the key
            kt = tl.load(k_base + slot[None, :] * stride_kl + dims[:, None], mask=seen[None, :], other=0.0)
            v = tl.load(v_base + slot[:, None] * stride_vl + dims[None, :], mask=seen[:, None], other=0.0)
            if UPCAST:
                kt = kt.to(tl.float32)
                v = v.to(tl.float32)
            if IEEE:
                s = tl.dot(q, kt, input_precision="ieee")
            else:
                s = tl.dot(q, kt)
            s = s * qk_scale + tl.reshape(tl.broadcast_to(bias[:, None, :], [S_PAD, G_PAD, BLOCK_N]), [M, BLOCK_N])
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

        out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]  # rows that saw no key: zeros
        o_rows = o_ptr + b * stride_ob + qh[:, None] * stride_oh + s_row[:, None] * stride_os + part * stride_op
        if SPLIT == 1:
            tl.store(o_rows + dims[None, :], out.to(o_ptr.dtype.element_ty), mask=row_ok[:, None])
        else:
            tl.store(o_rows + dims[None, :], out, mask=row_ok[:, None])
            lse = tl.where(l_i == 0.0, float("-inf"), m_i + tl.log2(tl.where(l_i == 0.0, 1.0, l_i)))
            tl.store(lse_ptr + ((b * S + s_row) * hq + qh) * SPLIT + part, lse, mask=row_ok)


def _unit_last(t: torch.Tensor) -> torch.Tensor:
    return t if t.stride(-1) == 1 else t.contiguous()


def decode_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, scale: float,
                     split: int | None = None, block_n: int = BLOCK_N, stages: int = STAGES) -> torch.Tensor:
    """[B, Hq, S, d] as kernels/decode_attention.py's reference (laid out [B, S, Hq, d])."""
    from .msa_triton import merge_splits

    _ops.check_decode_attention(q, k, v, mask)
    batch, hq, seq, dim = q.shape
    hkv, slots = k.shape[1], k.shape[2]
    group = hq // hkv
    s_pad = triton.next_power_of_2(seq)
    g_pad = max(triton.next_power_of_2(group), 16 // s_pad)  # a tensor-core tile is >= 16 rows
    split = split_plan(batch, hkv, slots, q.device, block_n) if split is None else split
    if split < 1 or split > MAX_SPLIT or split & (split - 1):
        raise ValueError(f"decode_attention: split must be a power of two in 1..{MAX_SPLIT}, got {split}")
    q, k, v = _unit_last(q), _unit_last(k), _unit_last(v)
    if mask.dtype == torch.bool:
        mask = mask.view(torch.uint8)
    # broadcast dims read the same row again
    stride_mb = mask.stride(0) if mask.shape[0] > 1 else 0
    stride_ms = mask.stride(2) if mask.shape[2] > 1 else 0
    interp = _interpreting()
    ieee = q.dtype == torch.float32 and not interp
    tiles = -(-slots // block_n)
    keys_per_part = -(-tiles // split) * block_n
    out = _ops._sdpa_layout(q)
    if split == 1:
        o, so, lse = out, (out.stride(0), out.stride(1), out.stride(2), 0), out  # lse unused
    else:
        o = torch.empty(batch, seq, hq, split, dim, dtype=torch.float32, device=q.device)
        so = (o.stride(0), o.stride(2), o.stride(1), o.stride(3))
        lse = torch.empty(batch, seq, hq, split, dtype=torch.float32, device=q.device)
    _decode_attention_kernel[(batch * split, hkv)](
        q, k, v, mask, o, lse, hq, slots, keys_per_part, scale * math.log2(math.e),
        q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2),
        v.stride(0), v.stride(1), v.stride(2), stride_mb, stride_ms, mask.stride(3), *so,
        S=seq, S_PAD=s_pad, G=group, G_PAD=g_pad, SPLIT=split, BLOCK_N=block_n, D=dim,
        BOOL_MASK=mask.dtype == torch.uint8, STAGES=stages, UPCAST=interp, IEEE=ieee, num_warps=4,
    )
    if split > 1:
        merge_splits(o.view(batch * seq, hq, split, dim), lse.view(batch * seq, hq, split),
                     out.transpose(1, 2).reshape(batch * seq, hq, dim))
    return out


@_ops.decode_attention.register_kernel("cuda")
def _decode_attention_cuda(q, k, v, mask, scale):
    if not supported(q, k, v):
        return _ops.decode_attention_reference(q, k, v, mask, scale)
    return decode_attention(q, k, v, mask, scale)
