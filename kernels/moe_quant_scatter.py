"""The MoE's activations straight into the experts' sorted order: quantize once, store k times.

    xg, xsg = quantize_scatter_fp8(x, pair_row, sorted_pair, rows, slots)
    xg = scatter_rows(x, pair_row, sorted_pair, rows, slots)      # BF16: the rows as they are

The warp-specialized gate/up kernel (kernels/moe_gluon.py) loads its activation tiles by TMA,
which cannot gather rows on Hopper, so its input must already be in the experts' sorted layout
(each expert's rows padded to BLOCK_M). Quantizing x and then gathering its FP8 rows with torch
indexing moved the rows twice and gathered them a byte per thread: 200-400 us per layer call at
8192-16384 tokens on the H200 (docs/kernel-notes.md#moe-at-the-power-limit). Here one program
per token quantizes its row (the math of norm_quant_triton.quant_groups, so the FP8 data and
scales equal quantize_fp8_triton's bit for bit) and stores it at the sorted row of each of the
token's pairs (pair_row; -1 = an expert on another rank, skipped); one program per row block
zeroes the block's padding rows (sorted_pair -1), so the GEMM reads zeros there, never stale
memory; blocks of padding only, which no GEMM reads, are left alone where the caller says the
layout is the alignment's (skip_padding_groups). scatter_rows is the same kernel without the
quantization, for the BF16 Gluon GEMMs.
"""

from __future__ import annotations

import torch

from .fp8 import FP8_DTYPE

try:  # optional: CPU installs without Triton never take the Gluon path that needs this
    import triton
    import triton.language as tl

    from .norm_quant_triton import quant_groups

    HAVE_TRITON = True
except ImportError:  # pragma: no cover
    HAVE_TRITON = False

__all__ = ["quantize_scatter_fp8", "scatter_rows"]

GROUP = 128  # the 1 x 128 activation quantization group
CHUNK_GROUPS = 16  # groups per tile: 2048 values, three tiles for M3's 6144-wide rows
ZERO_ROWS = 64  # sorted rows per zeroing program (the Gluon kernel's BLOCK_M)
ZERO_COLUMNS = 512  # FP8 columns per zeroing store

if HAVE_TRITON:

    @triton.jit
    def _quantize_scatter_kernel(x_ptr, pair_row, sorted_pair, q_ptr, s_ptr, T, rows, n_groups,
                                 stride_x, stride_q, stride_s,
                                 SLOTS: tl.constexpr, G: tl.constexpr, NG: tl.constexpr, ZR: tl.constexpr,
                                 ZC: tl.constexpr, SKIP_PADDING_GROUPS: tl.constexpr = False,
                                 QUANT: tl.constexpr = True):
        pid = tl.program_id(0)
        if pid < T:  # a token: its row quantized once, stored at each pair's sorted row
            token = pid.to(tl.int64)
            for g0 in range(0, n_groups, NG):
                col = (g0 + tl.arange(0, NG))[:, None] * G + tl.arange(0, G)[None, :]
                cmask = col < n_groups * G
                y = tl.load(x_ptr + token * stride_x + col, mask=cmask, other=0.0)
                if QUANT:
                    q, scale = quant_groups(y.to(tl.float32))
                    q = q.to(q_ptr.dtype.element_ty)
                else:
                    q = y.to(q_ptr.dtype.element_ty)
                g = g0 + tl.arange(0, NG)
                for j in tl.static_range(SLOTS):
                    r = tl.load(pair_row + token * SLOTS + j).to(tl.int64)
                    ok = (col * 0 + r) >= 0  # the interpreter rejects a scalar & tile mask
                    tl.store(q_ptr + r * stride_q + col, q, mask=cmask & ok)
                    if QUANT:
                        tl.store(s_ptr + r * stride_s + g, scale, mask=(g < n_groups) & ((g * 0 + r) >= 0))
        else:  # a block of sorted rows: zeros in its padding rows
            r = (pid - T) * ZR + tl.arange(0, ZR)
            pad = (tl.load(sorted_pair + r, mask=r < rows, other=0) < 0) & (r < rows)
            if SKIP_PADDING_GROUPS:  # a group of ZR rows that starts with padding is all padding: no GEMM reads it
                first = tl.load(sorted_pair + (pid - T) * ZR)
                pad = pad & ((r * 0 + first) >= 0)  # the interpreter rejects a scalar & tile mask
            if tl.max(pad.to(tl.int32), axis=0) > 0:
                r64 = r.to(tl.int64)
                zeros = tl.zeros((ZR, ZC), tl.float32).to(q_ptr.dtype.element_ty)
                for c0 in range(0, n_groups * G, ZC):
                    cols = c0 + tl.arange(0, ZC)
                    tl.store(q_ptr + r64[:, None] * stride_q + cols[None, :], zeros,
                             mask=pad[:, None] & (cols[None, :] < n_groups * G))
                if QUANT:
                    for g0 in range(0, n_groups, ZC // G):
                        g = g0 + tl.arange(0, ZC // G)
                        tl.store(s_ptr + r64[:, None] * stride_s + g[None, :],
                                 tl.zeros((ZR, ZC // G), tl.float32), mask=pad[:, None] & (g[None, :] < n_groups))


def _outputs(rows: int, k: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Uninitialized: the kernel writes every row (tests swap in garbage-filled ones to show it)."""
    return (torch.empty(rows, k, dtype=FP8_DTYPE, device=device),
            torch.empty(rows, k // GROUP, dtype=torch.float32, device=device))


def _rows_output(rows: int, k: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Uninitialized, as _outputs."""
    return torch.empty(rows, k, dtype=dtype, device=device)


def _check(t: int, k: int, pair_row: torch.Tensor, sorted_pair: torch.Tensor, rows: int, slots: int,
           name: str) -> None:
    if k % GROUP:
        raise ValueError(f"{name}: width {k} is not a multiple of {GROUP}")
    if pair_row.numel() != t * slots:
        raise ValueError(f"{name}: {pair_row.numel()} pair rows for {t} tokens x {slots} slots")
    if sorted_pair.numel() < rows:
        raise ValueError(f"{name}: {rows} rows asked of {sorted_pair.numel()} sorted rows")


def quantize_scatter_fp8(x: torch.Tensor, pair_row: torch.Tensor, sorted_pair: torch.Tensor, rows: int,
                         slots: int, skip_padding_groups: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """x [T, K] (bf16 / fp16, K a multiple of 128) -> (xg [rows, K] FP8, xsg [rows, K / 128] float32):
    token t's quantized row at sorted row pair_row[t * slots + j] for each slot j (skipped where -1),
    zeros where sorted_pair[:rows] is -1 (padding).

    skip_padding_groups: the caller's promise that the layout is the alignment's (each expert's run
    starts on a 64-row boundary, its rows before its padding), so a group of 64 rows that starts with
    padding is all padding; such groups are left unwritten. The Gluon GEMMs never read them (a
    192-row block's 64-row groups without rows are skipped); at 8192 tokens padding is ~38% of the
    sorted rows, most of it in such groups, and zeroing them took a quarter of this kernel
    (docs/kernel-notes.md#moe-quantize-scatter-padding)."""
    t, k = x.shape
    _check(t, k, pair_row, sorted_pair, rows, slots, "quantize_scatter_fp8")
    xg, xsg = _outputs(rows, k, x.device)
    _launch(x, pair_row, sorted_pair, xg, xsg, rows, slots, skip_padding_groups, quant=True)
    return xg, xsg


def scatter_rows(x: torch.Tensor, pair_row: torch.Tensor, sorted_pair: torch.Tensor, rows: int, slots: int,
                 skip_padding_groups: bool = False) -> torch.Tensor:
    """x [T, K] -> xg [rows, K] in x's dtype: quantize_scatter_fp8 without the quantization (token t's
    row at sorted row pair_row[t * slots + j], zeros in padding rows, groups of padding only left
    unwritten under skip_padding_groups), for the BF16 Gluon GEMMs, which load whole tiles by TMA."""
    t, k = x.shape
    _check(t, k, pair_row, sorted_pair, rows, slots, "scatter_rows")
    xg = _rows_output(rows, k, x.dtype, x.device)
    _launch(x, pair_row, sorted_pair, xg, xg, rows, slots, skip_padding_groups, quant=False)
    return xg


def _launch(x: torch.Tensor, pair_row: torch.Tensor, sorted_pair: torch.Tensor, xg: torch.Tensor,
            xsg: torch.Tensor, rows: int, slots: int, skip_padding_groups: bool, quant: bool) -> None:
    """One program per token, then one per ZERO_ROWS sorted rows; xsg unread without quant."""
    t, k = x.shape
    if t + rows == 0:
        return
    if x.stride(1) != 1:
        x = x.contiguous()
    _quantize_scatter_kernel[(t + triton.cdiv(rows, ZERO_ROWS),)](
        x, pair_row, sorted_pair, xg, xsg, t, rows, k // GROUP, x.stride(0), xg.stride(0),
        xsg.stride(0) if quant else 0, SLOTS=slots, G=GROUP, NG=CHUNK_GROUPS, ZR=ZERO_ROWS, ZC=ZERO_COLUMNS,
        SKIP_PADDING_GROUPS=skip_padding_groups, QUANT=quant, num_warps=4)
