"""The FP8 block GEMM for a few rows (decode): one pass over the weight at memory speed.

    y = fp8_small_m_gemm(xq, xs, w, ws, out_dtype)     # xq [M <= 64, K], same contract as fp8_block_gemm

At decode a linear layer multiplies 1-64 rows by its whole weight, so its time is
the weight read. cuBLAS blockwise wants M padded to a multiple of 4 (four small
copy / fill kernels around every call) and reads the weight at about 65% of the
copy bandwidth at 1-16 rows, 45-75% at 64 (docs/measurements/2026-12-02.md, -03). Here
each program owns BLOCK_N output columns (and, with SPLIT_K > 1, a slice of K) and
streams their weight rows once; the rows of x ride along in one MMA tile of 16,
32 or 64 rows.

Numerics are those of fp8_block_gemm: per 128-wide K group, the FP8 products
summed, then scaled by the row's activation scale and the block's weight scale
in float32. A 16-row tile widens E4M3 to FP16 for the MMA (exact products,
float32 sums); the 32- and 64-row tiles run Hopper's FP8 MMA, whose accumulator
keeps fewer bits within a K group, exactly as cuBLAS's blockwise GEMM that these
rows ran before (docs/kernel-notes.md#fp8-block-gemm). With SPLIT_K > 1 each slice writes float32
partial sums that a second small kernel adds in a fixed order (no atomics:
the result does not depend on timing).
"""

from __future__ import annotations

import torch

from .fp8 import WEIGHT_BLOCK
from .interpreter import triton_interpreting

try:
    import triton
    import triton.language as tl

    HAVE_TRITON = True
except ImportError:  # pragma: no cover
    triton = None
    tl = None
    HAVE_TRITON = False

__all__ = ["MAX_ROWS", "SmallMConfig", "fp8_small_m_gemm", "row_tile", "small_m_config", "small_m_supports"]

MAX_ROWS = 64  # one MMA tile of rows; more rows go to the regular GEMM


def row_tile(m: int) -> int:
    """The MMA tile's rows for m rows: 16, 32 or 64."""
    return 16 if m <= 16 else 32 if m <= 32 else 64


class SmallMConfig(tuple):
    """(BLOCK_N, SPLIT_K, num_warps, num_stages)."""

    def __new__(cls, block_n: int, split_k: int, warps: int, stages: int):
        return super().__new__(cls, (block_n, split_k, warps, stages))

    block_n = property(lambda self: self[0])
    split_k = property(lambda self: self[1])
    warps = property(lambda self: self[2])
    stages = property(lambda self: self[3])


def small_m_supports(m: int, k: int, group: int) -> bool:
    """Rows and K this kernel takes: at most MAX_ROWS rows, 1 x 128 activation groups."""
    return 0 < m <= MAX_ROWS and group == WEIGHT_BLOCK and k % WEIGHT_BLOCK == 0


def small_m_config(n: int, k: int, sms: int = 132) -> SmallMConfig:
    """BLOCK_N 64 column slices, 4 warps, 4 stages; K split in four where the slices alone
    give fewer than two programs per SM (split counts divide K / 128 and leave >= 8 groups
    per slice). Measured at M3's decode shapes on the H200: docs/measurements/2026-12-02.md."""
    block_n = 64
    groups = k // WEIGHT_BLOCK
    split = 1
    if -(-n // block_n) < 2 * sms:
        split = next((s for s in (4, 2) if groups % s == 0 and groups // s >= 8), 1)
    return SmallMConfig(block_n, split, 4, 4)


if HAVE_TRITON:

    @triton.jit
    def _small_m_kernel(
        a_ptr, as_ptr, w_ptr, ws_ptr, out_ptr,
        M, N,
        stride_am, stride_asm, stride_wn, stride_wsn, stride_os, stride_om,
        GROUPS_PER_SPLIT: tl.constexpr,
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
    ):
        pid_n = tl.program_id(0)
        pid_k = tl.program_id(1)
        offs_m = tl.arange(0, BLOCK_M)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        offs_k = tl.arange(0, 128)
        row_ok = offs_m < M
        rn = tl.minimum(offs_n, N - 1).to(tl.int64)  # clamped, not masked: the weight loads stay unmasked
        g0 = pid_k * GROUPS_PER_SPLIT
        a_ptrs = a_ptr + offs_m[:, None].to(tl.int64) * stride_am + (g0 * 128 + offs_k)[None, :]
        w_ptrs = w_ptr + rn[None, :] * stride_wn + (g0 * 128 + offs_k)[:, None]  # w^T tile [128, BLOCK_N]
        as_ptrs = as_ptr + offs_m.to(tl.int64) * stride_asm + g0
        ws_ptrs = ws_ptr + (rn // 128) * stride_wsn + g0
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for _ in range(GROUPS_PER_SPLIT):
            a = tl.load(a_ptrs, mask=row_ok[:, None], other=0.0)
            w = tl.load(w_ptrs)
            sa = tl.load(as_ptrs, mask=row_ok, other=0.0)
            sb = tl.load(ws_ptrs)
            acc += tl.dot(a, w) * sa[:, None] * sb[None, :]
            a_ptrs += 128
            w_ptrs += 128
            as_ptrs += 1
            ws_ptrs += 1
        out_ptrs = out_ptr + pid_k * stride_os + offs_m[:, None] * stride_om + offs_n[None, :]
        tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & (offs_n[None, :] < N))

    @triton.jit
    def _sum_splits_kernel(part_ptr, out_ptr, total, SPLIT_K: tl.constexpr, BLOCK: tl.constexpr):
        offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        ok = offs < total
        acc = tl.zeros((BLOCK,), dtype=tl.float32)
        for s in range(SPLIT_K):  # a fixed order: the same sum on every run
            acc += tl.load(part_ptr + s * total + offs, mask=ok, other=0.0)
        tl.store(out_ptr + offs, acc.to(out_ptr.dtype.element_ty), mask=ok)


def fp8_small_m_gemm(a: torch.Tensor, sa: torch.Tensor, w: torch.Tensor, ws: torch.Tensor,
                     out_dtype: torch.dtype, config: SmallMConfig | None = None) -> torch.Tensor:
    """a [M, K] float8_e4m3fn with sa [M, K/128] float32, w [N, K] float8_e4m3fn with ws
    [ceil(N/128), K/128] -> [M, N] out_dtype. CUDA, or CPU tensors under TRITON_INTERPRET=1."""
    if not HAVE_TRITON:
        raise RuntimeError("fp8_small_m_gemm needs triton")
    m, k = a.shape
    n = w.shape[0]
    if not small_m_supports(m, k, k // max(sa.shape[-1], 1)):
        raise ValueError(f"fp8_small_m_gemm takes 1-{MAX_ROWS} rows with 1 x 128 activation groups, "
                         f"got a {tuple(a.shape)} input with {sa.shape[-1]} scale groups")
    cfg = config or small_m_config(n, k)
    groups = k // WEIGHT_BLOCK
    if groups % cfg.split_k:
        raise ValueError(f"fp8_small_m_gemm: split_k {cfg.split_k} does not divide the {groups} K groups")
    a, w = a.contiguous(), w.contiguous()
    sa, ws = sa.float().contiguous(), ws.float().contiguous()
    out = torch.empty((m, n), dtype=out_dtype, device=a.device)
    dest = out if cfg.split_k == 1 else torch.empty((cfg.split_k, m, n), dtype=torch.float32, device=a.device)
    launch = {} if triton_interpreting() else {"num_warps": cfg.warps, "num_stages": cfg.stages}
    grid = (triton.cdiv(n, cfg.block_n), cfg.split_k)
    _small_m_kernel[grid](
        a, sa, w, ws, dest, m, n,
        a.stride(0), sa.stride(0), w.stride(0), ws.stride(0), dest.stride(0) if cfg.split_k > 1 else 0, n,
        GROUPS_PER_SPLIT=groups // cfg.split_k, BLOCK_M=row_tile(m), BLOCK_N=cfg.block_n, **launch,
    )
    if cfg.split_k > 1:
        total = m * n
        block = 1024
        _sum_splits_kernel[(triton.cdiv(total, block),)](dest, out, total, SPLIT_K=cfg.split_k, BLOCK=block)
    return out
