"""Triton kernel of `minimax::rms_norm_quant_fp8` (see kernels/norm_quant.py), and of
`minimax::quantize_fp8` (kernels/fp8.py) as the same kernel without the norm.

This module registers both as the ops' CUDA kernels (the op modules never
import it); inputs the kernel does not take (no Triton, other dtypes, empty
tensors) run the ops' plain-torch references.

One program handles ROWS rows (ROWS = 1 at the served width, hidden 6144; more
for narrow rows so a program still moves a useful number of bytes). A row is
held as a [NG, G] tile (NG = next power of two >= K / G groups), so the
per-group amax is a reduction along axis 1 and the row's sum of squares a
reduction over the whole tile; or, with split_tiles, as two exact tiles
(48 groups = 32 + 16) where one padded tile leaves a quarter of the lanes
idle. All math is float32:

    h      = x (+ residual), rounded to x.dtype           (written when asked)
    rstd   = rsqrt(sum(h * h) / K + eps)
    y      = Gemma: round(h * rstd * (1 + w));  plain: round(round(h * rstd) * w)
    scale  = 2 ** ceil(log2(max(amax(|y| per group), 1e-30) / 448))
    q      = fp8_e4m3(clamp(y / scale, -448, 448))

where round() is to x.dtype, as the model's casts do. Two choices keep it
bit-equal to the reference wherever the reference itself is well defined:

* the power-of-two scale is built from the float32 exponent bits (exact),
  not through log2 / exp2 (approximate on the GPU); divisions are IEEE
  (div_rn) and rstd = 1 / sqrt_rn(var), which is what torch's CPU rsqrt gives;
* float32 -> bfloat16 rounding is done with integer ops (round to nearest
  even), which is what the hardware cvt.rn does on the GPU and what the
  Triton interpreter gets wrong (it truncates): the CPU tests under
  TRITON_INTERPRET=1 then check the very code the GPU runs.

What can differ from the CPU reference is the summation order of sum(h * h)
(a tree here, vectorized lanes in torch), so on arbitrary inputs y may
differ by one rounding in rare elements. Tests use
inputs whose sums are exact to check bit equality, and bound the rest.

The reference's scale, exp2(ceil(log2(amax / 448))), can come out one power
of two low when amax / 448 is within an ulp or two above a power of two
(float32 log2 rounds back onto the integer); the exponent-bit scale does not.
That cannot happen when y is bfloat16 (amax / 448 is then never that close
to a power of two), only for float32 y, with odds of about 2**-22 per group.
"""

from __future__ import annotations

from typing import Optional

import torch

from .fp8 import FP8_DTYPE, quantize_fp8, quantize_fp8_reference
from .interpreter import triton_interpreting as _interpreting
from .norm_quant import rms_norm_quant_fp8, rms_norm_quant_fp8_reference

try:  # Triton is optional: CPU installs without it use the reference only.
    import triton
    import triton.language as tl

    HAVE_TRITON = True
except ImportError:  # pragma: no cover - depends on the install
    triton = None
    tl = None
    HAVE_TRITON = False

__all__ = ["HAVE_TRITON", "supported", "rms_norm_quant_fp8_triton", "quantize_fp8_triton", "launch_config",
           "tile_groups"]

_DTYPES = (torch.bfloat16, torch.float32)


def supported(x: torch.Tensor, residual: Optional[torch.Tensor], weight: torch.Tensor, group_size: int) -> bool:
    """Whether the Triton kernel handles these inputs (else the caller uses the reference)."""
    if not HAVE_TRITON:
        return False
    if not (x.is_cuda or _interpreting()):
        return False
    if x.dtype not in _DTYPES or weight.dtype not in _DTYPES:
        return False
    if x.numel() == 0 or x.shape[-1] % group_size:
        return False
    return residual is None or residual.dtype == x.dtype


def tile_groups(n_groups: int, split: bool) -> tuple[int, int]:
    """Groups in the row's first and second tile (0: one tile). Tiles are powers of two:
    one tile of next_power_of_2(groups) leaves lanes idle (6144 / 128 = 48 groups in a
    64-group tile: 25%); split, the row is two exact tiles where it can be (48 = 32 + 16)."""
    one = triton.next_power_of_2(n_groups)
    if not split or one == n_groups:
        return one, 0
    first = one // 2
    rest = n_groups - first
    return (first, rest) if rest & (rest - 1) == 0 else (one, 0)


def launch_config(k: int, group_size: int, m: int, split: bool | None = None) -> dict:
    """Rows per program, warps and tiles (NG, NG_B: tile_groups) for a row of K values (a
    heuristic; the benchmark sweeps). split: None = two exact tiles where the group count
    allows; False = one tile (quantize-only, or forced); True = as None (forced)."""
    ng, ng_b = tile_groups(k // group_size, split is not False)
    tile = triton.next_power_of_2(k // group_size) * group_size
    rows = max(1, min(16, 2048 // tile))  # narrow rows: several per program
    warps = 1 if tile <= 256 else 2 if tile <= 512 else 4 if tile <= 2048 else 8 if tile <= 8192 else 16
    # Two exact tiles instead of one padded one where the group count allows (6144 = 32 + 16
    # groups): faster than the best one-tile launch (measured: docs/kernel-notes.md#norm-quant-launch).
    if ng_b == 0 and 2048 < tile <= 8192 and m >= 4096:
        # one padded tile: 4 warps beat 8 there (measured: docs/kernel-notes.md#norm-quant-launch)
        warps = 4
    return {"ROWS": rows, "NG": ng, "NG_B": ng_b, "num_warps": warps, "SPLIT": ng_b > 0}


if HAVE_TRITON:

    @triton.jit
    def _round_to_bf16(v):
        """float32 -> the nearest bfloat16 value (ties to even), still as float32 (finite inputs)."""
        bits = v.to(tl.int32, bitcast=True)
        lsb = (bits >> 16) & 1
        bits = (bits + 0x7FFF + lsb) & -65536  # -65536 == 0xFFFF0000 as int32
        return bits.to(tl.float32, bitcast=True)

    @triton.jit
    def _columns(g0, n_groups, G: tl.constexpr, NG: tl.constexpr):
        """Columns of the NG groups from group g0 on, as an [NG, G] tile, and which exist."""
        col = (g0 + tl.arange(0, NG))[:, None] * G + tl.arange(0, G)[None, :]
        return col, col < n_groups * G

    @triton.jit
    def _load_row_tile(x_ptr, res_ptr, r_ptr, row, M, stride_x, stride_res, stride_r, col, cmask,
                       HAS_RESIDUAL: tl.constexpr, ROUND_BF16: tl.constexpr):
        """h = x (+ residual, rounded to x.dtype and written back) for one tile of one row."""
        # (the row test is broadcast to the tile explicitly: the interpreter rejects a scalar & tile mask)
        mask = cmask & ((col * 0 + row) < M)
        row64 = row.to(tl.int64)
        h = tl.load(x_ptr + row64 * stride_x + col, mask=mask, other=0.0).to(tl.float32)
        if HAS_RESIDUAL:
            h = h + tl.load(res_ptr + row64 * stride_res + col, mask=mask, other=0.0).to(tl.float32)
            if ROUND_BF16:
                h = _round_to_bf16(h)
            tl.store(r_ptr + row64 * stride_r + col, h.to(r_ptr.dtype.element_ty), mask=mask)
        return h

    @triton.jit
    def scaled_norm(h, rstd, w, GEMMA: tl.constexpr, ROUND_BF16: tl.constexpr):
        """The norm's output in float32, rounded where the model rounds: Gemma round(h * rstd * w)
        (w is 1 + weight here), plain round(round(h * rstd) * w). Shared with kernels/norm_rope_triton.py."""
        normed = h * rstd
        if not GEMMA and ROUND_BF16:
            normed = _round_to_bf16(normed)
        y = normed * w
        if ROUND_BF16:
            y = _round_to_bf16(y)
        return y

    @triton.jit
    def round_e4m3(q):
        """float32 in [-448, 448] -> nearest E4M3 value (ties to even), kept in float32: what the
        GPU's cvt.rn.satfinite does; the interpreter's own cast is off by an ulp at times (a value
        rounded here first casts exactly there). Shared with kernels/moe_triton.py and
        kernels/moe_route_triton.py."""
        bits = q.to(tl.int32, bitcast=True)
        lsb = (bits >> 20) & 1
        normal = ((bits + 0x7FFFF + lsb) & -1048576).to(tl.float32, bitcast=True)  # 3 mantissa bits
        v = q * 512.0  # subnormals (|q| < 2**-6): multiples of 2**-9, rounded by the magic-number add
        sub = ((v + 12582912.0) - 12582912.0) * (1.0 / 512.0)
        return tl.where(tl.abs(q) < 0.015625, sub, normal)

    @triton.jit
    def quant_groups(y):
        """The 1 x G quantization of an [NG, G] float32 tile: (q, clamped to the FP8 range, still
        float32; scale [NG]). One power-of-two scale per group, 2 ** ceil(log2(amax / 448)),
        from the exponent bits. Shared with kernels/moe_quant_scatter.py, which must match it."""
        amax = tl.maximum(tl.max(tl.abs(y), axis=1), 1e-30)  # [NG]
        v = tl.math.div_rn(amax, tl.full(amax.shape, 448.0, tl.float32))
        vb = v.to(tl.int32, bitcast=True)
        e = ((vb >> 23) & 0xFF) + ((vb & 0x7FFFFF) != 0).to(tl.int32)  # biased exponent of the scale
        scale = (e << 23).to(tl.float32, bitcast=True)
        inv = ((254 - e) << 23).to(tl.float32, bitcast=True)  # 1 / scale, exact
        return tl.minimum(tl.maximum(y * inv[:, None], -448.0), 448.0), scale

    @triton.jit
    def _norm_quant_tile(h, rstd, w, q_ptr, s_ptr, y_ptr, row, M, stride_q, stride_s, stride_y, col, cmask,
                         g0, n_groups, NG: tl.constexpr, GEMMA: tl.constexpr, WANT_Y: tl.constexpr,
                         ROUND_BF16: tl.constexpr, NORM: tl.constexpr, QUANT: tl.constexpr):
        """y = norm(h) (NORM) or h, then (QUANT) its 1 x G quantization: the tile's FP8 data and scales."""
        mask = cmask & ((col * 0 + row) < M)
        row64 = row.to(tl.int64)
        y = h
        if NORM:
            y = scaled_norm(h, rstd, w, GEMMA, ROUND_BF16)
        if WANT_Y:
            tl.store(y_ptr + row64 * stride_y + col, y.to(y_ptr.dtype.element_ty), mask=mask)
        if QUANT:
            q, scale = quant_groups(y)
            tl.store(q_ptr + row64 * stride_q + col, q.to(q_ptr.dtype.element_ty), mask=mask)
            g1 = g0 + tl.arange(0, NG)
            tl.store(s_ptr + row64 * stride_s + g1, scale, mask=(g1 < n_groups) & ((g1 * 0 + row) < M))

    @triton.jit
    def _rms_norm_quant_fp8_kernel(
        x_ptr, res_ptr, w_ptr,
        q_ptr, s_ptr, y_ptr, r_ptr,
        M, K_f, n_groups,
        stride_x, stride_res, stride_q, stride_s, stride_y, stride_r,
        eps,
        G: tl.constexpr,
        NG: tl.constexpr,
        NG_B: tl.constexpr,
        ROWS: tl.constexpr,
        HAS_RESIDUAL: tl.constexpr,
        GEMMA: tl.constexpr,
        WANT_Y: tl.constexpr,
        ROUND_BF16: tl.constexpr,
        NORM: tl.constexpr,
    ):
        # The row is one [NG, G] tile, or (NG_B > 0) two: groups 0..NG-1 and NG..NG+NG_B-1.
        # NORM=False: quantization only (minimax::quantize_fp8 of x): y = x.
        pid = tl.program_id(0)
        col_a, cmask_a = _columns(0, n_groups, G, NG)
        col_b, cmask_b = _columns(NG, n_groups, G, NG_B if NG_B > 0 else 1)
        w_a = tl.zeros((NG, G), tl.float32)
        w_b = tl.zeros((NG_B if NG_B > 0 else 1, G), tl.float32)
        if NORM:
            w_a = tl.load(w_ptr + col_a, mask=cmask_a, other=0.0).to(tl.float32)
            if NG_B > 0:
                w_b = tl.load(w_ptr + col_b, mask=cmask_b, other=0.0).to(tl.float32)
            if GEMMA:
                w_a = 1.0 + w_a
                w_b = 1.0 + w_b
        for i in tl.static_range(ROWS):
            row = pid * ROWS + i
            h_a = _load_row_tile(x_ptr, res_ptr, r_ptr, row, M, stride_x, stride_res, stride_r, col_a, cmask_a,
                                 HAS_RESIDUAL, ROUND_BF16)
            if NG_B > 0:
                h_b = _load_row_tile(x_ptr, res_ptr, r_ptr, row, M, stride_x, stride_res, stride_r, col_b,
                                     cmask_b, HAS_RESIDUAL, ROUND_BF16)
            rstd = 1.0
            if NORM:
                ss = tl.sum(tl.sum(h_a * h_a, axis=1), axis=0)
                if NG_B > 0:
                    ss += tl.sum(tl.sum(h_b * h_b, axis=1), axis=0)
                # IEEE division as torch's mean; rsqrt as torch computes it on the CPU: an IEEE
                # sqrt, then an IEEE division (measured equal on 2**20 values), not the GPU's
                # approximate rsqrt. Once per row: free.
                var = tl.math.div_rn(ss, K_f) + eps
                rstd = tl.math.div_rn(tl.full(var.shape, 1.0, tl.float32), tl.math.sqrt_rn(var))
            _norm_quant_tile(h_a, rstd, w_a, q_ptr, s_ptr, y_ptr, row, M, stride_q, stride_s, stride_y, col_a,
                             cmask_a, 0, n_groups, NG, GEMMA, WANT_Y, ROUND_BF16, NORM, True)
            if NG_B > 0:
                _norm_quant_tile(h_b, rstd, w_b, q_ptr, s_ptr, y_ptr, row, M, stride_q, stride_s, stride_y,
                                 col_b, cmask_b, NG, n_groups, NG_B, GEMMA, WANT_Y, ROUND_BF16, NORM, True)


def rms_norm_quant_fp8_triton(x: torch.Tensor, residual: Optional[torch.Tensor], weight: torch.Tensor, eps: float,
                              gemma: bool, group_size: int = 128, want_bf16_output: bool = False,
                              num_warps: int | None = None, rows_per_program: int | None = None,
                              split_tiles: bool | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Launch the kernel (CUDA tensors, or CPU tensors under TRITON_INTERPRET=1).

    split_tiles: the row as two exact power-of-two tiles where its group count allows
    (tile_groups); None: launch_config's choice."""
    if not HAVE_TRITON:
        raise RuntimeError("rms_norm_quant_fp8_triton needs triton (pip install triton)")
    shape, k = x.shape, x.shape[-1]
    x2 = x.reshape(-1, k)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    m = x2.shape[0]
    res2 = None
    if residual is not None:
        res2 = residual.reshape(-1, k)
        if res2.stride(-1) != 1:
            res2 = res2.contiguous()
    weight = weight.contiguous()
    q = torch.empty((m, k), dtype=FP8_DTYPE, device=x.device)
    s = torch.empty((m, k // group_size), dtype=torch.float32, device=x.device)
    y = torch.empty((m, k), dtype=x.dtype, device=x.device) if want_bf16_output else x.new_empty(0)
    r = torch.empty((m, k), dtype=x.dtype, device=x.device) if residual is not None else x.new_empty(0)
    cfg = launch_config(k, group_size, m, split=split_tiles)
    rows = rows_per_program or cfg["ROWS"]
    if m > 0:
        _rms_norm_quant_fp8_kernel[(triton.cdiv(m, rows),)](
            x2, res2 if res2 is not None else x2, weight,
            q, s, y if want_bf16_output else q, r if residual is not None else q,
            m, float(k), k // group_size,
            x2.stride(0), res2.stride(0) if res2 is not None else 0, q.stride(0), s.stride(0),
            y.stride(0) if want_bf16_output else 0, r.stride(0) if residual is not None else 0,
            float(eps),
            G=group_size, NG=cfg["NG"], NG_B=cfg["NG_B"], ROWS=rows,
            HAS_RESIDUAL=residual is not None, GEMMA=bool(gemma), WANT_Y=bool(want_bf16_output),
            ROUND_BF16=x.dtype == torch.bfloat16, NORM=True,
            num_warps=num_warps or cfg["num_warps"],
        )
    q = q.reshape(shape)
    s = s.reshape(*shape[:-1], k // group_size)
    if want_bf16_output:
        y = y.reshape(shape)
    if residual is not None:
        r = r.reshape(shape)
    return q, s, y, r


def quantize_fp8_triton(x: torch.Tensor, group_size: int = 128, num_warps: int | None = None
                        ) -> tuple[torch.Tensor, torch.Tensor]:
    """`minimax::quantize_fp8` by the same kernel without the norm (CUDA, or the interpreter).

    Equal to kernels/fp8.py:quantize_fp8_reference bit for bit (no reduction
    order is involved); for the quantizations the fusion leaves standing (after
    a BF16 all-gather, o_proj / down_proj inputs)."""
    if not HAVE_TRITON:
        raise RuntimeError("quantize_fp8_triton needs triton (pip install triton)")
    shape, k = x.shape, x.shape[-1]
    x2 = x.reshape(-1, k)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    m = x2.shape[0]
    q = torch.empty((m, k), dtype=FP8_DTYPE, device=x.device)
    s = torch.empty((m, k // group_size), dtype=torch.float32, device=x.device)
    cfg = launch_config(k, group_size, m, split=False)
    if m > 0:
        _rms_norm_quant_fp8_kernel[(triton.cdiv(m, cfg["ROWS"]),)](
            x2, x2, x2, q, s, q, q,
            m, float(k), k // group_size,
            x2.stride(0), 0, q.stride(0), s.stride(0), 0, 0,
            0.0,
            G=group_size, NG=cfg["NG"], NG_B=cfg["NG_B"], ROWS=cfg["ROWS"],
            HAS_RESIDUAL=False, GEMMA=False, WANT_Y=False, ROUND_BF16=False, NORM=False,
            num_warps=num_warps or cfg["num_warps"],
        )
    return q.reshape(shape), s.reshape(*shape[:-1], k // group_size)


# ------------------------------------------------------------------ the ops' CUDA kernels
@rms_norm_quant_fp8.register_kernel("cuda")
def _rms_norm_quant_fp8_cuda(x, residual, weight, eps, gemma, group_size=128, want_bf16_output=False):
    if supported(x, residual, weight, group_size):
        return rms_norm_quant_fp8_triton(x, residual, weight, eps, gemma, group_size, want_bf16_output)
    return rms_norm_quant_fp8_reference(x, residual, weight, eps, gemma, group_size, want_bf16_output)


@quantize_fp8.register_kernel("cuda")
def _quantize_fp8_cuda(x, group_size=128):
    if HAVE_TRITON and x.dtype in (torch.bfloat16, torch.float16) and x.numel():
        return quantize_fp8_triton(x, group_size)
    return quantize_fp8_reference(x, group_size)
