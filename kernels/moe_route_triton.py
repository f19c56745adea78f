"""The MoE router's selection in one Triton program per token, for the GPU path.

kernels/moe.py:route is the model's router op for op: float32 logits, sigmoid,
+ correction bias, top-k, gather, renormalize, x routed scaling. After the
logits GEMM that is about eight small launches, which at decode cost more than
the work (measured: docs/kernel-notes.md#moe-routing). Here one kernel does the
selection after the logits:

    scores  = sigmoid(logits)                       float32
    choice  = scores + bias                         (bias optional)
    ids     = the top_k choices, highest first      ties: the lower expert id
    weights = scores[ids] / sum (if normalized) * routed_scaling

The logits (float32 products of the float32 router weight and the activation
rows, summed in float32) come from one of three places:

* at decode sizes (up to LOGITS_MAX_TOKENS rows), `_logits_kernel`, which reads
  the bf16 rows as they are: one launch instead of cuBLAS's cast, GEMM and
  split-K reduction (docs/kernel-notes.md#moe-routing);
* above that, for bf16 rows, `logits_three_bf16`: the float32 weight is the
  exact sum of three bf16 parts (hi + mid + lo: 8 significant bits each cover
  float32's 24; `_split_bf16_kernel`, once per call), and a bf16 row value times
  a bf16 part is exact in float32, so three tensor-core products give the
  float32 GEMM's exact products. The tensor cores' own accumulation is not IEEE
  float32 (it drops low bits), so each K step's products start in a fresh
  accumulator that is added to a float32 sum; K is split into shares where the
  row blocks alone would leave SMs idle. cuBLAS's float32 path instead casts
  the rows to float32 (a copy twice their size) and runs a SIMT GEMM: 4.5-6x
  slower at 4096-16384 tokens on the H200, and less accurate
  (docs/kernel-notes.md#router-logits-at-prefill);
* otherwise (float32 rows, or moe_router_logits=cublas) cuBLAS on x.float().

Both kernels sum in another order than cuBLAS, so a logit may differ from
torch's in the last bits, as cuBLAS's own split-K choices already make it differ
between sizes.

Differences from torch, all within what torch itself leaves open: the slot
order (torch.topk(sorted=False) promises none; the combine sums the slots in
float32), which of exactly tied experts wins (torch's choice is unspecified
on CUDA; random inputs have no ties), and the sigmoid and the four-term sum
may differ from torch's CUDA kernels in the last bit.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .fp8 import FP8_DTYPE
from .interpreter import triton_interpreting
from .launch_overlap import pdl_launch
from .options import kernel_options

try:
    import triton
    import triton.language as tl

    from .launch_overlap import wait_then_release
    from .norm_quant_triton import quant_groups, round_e4m3

    HAVE_TRITON = True
except ImportError:  # pragma: no cover
    triton = tl = None
    HAVE_TRITON = False

MAX_EXPERTS = 1024  # one [experts] vector per program in registers
FP8_GROUP = 128  # the expert GEMMs' activation groups (1 x 128)
LOGITS_MAX_TOKENS = 16  # rows up to which _logits_kernel computes the logits (faster than cuBLAS there)


def route_mode() -> str:
    """The kernel option moe_route (MINIMAX_MOE_ROUTE): triton (default) or torch (the op-for-op path,
    to compare)."""
    return kernel_options().moe_route


def route_fits(x: torch.Tensor, num_experts: int, top_k: int) -> bool:
    return (HAVE_TRITON and (x.is_cuda or triton_interpreting()) and x.shape[0] > 0
            and 0 < top_k <= num_experts <= MAX_EXPERTS)


if HAVE_TRITON:

    @triton.jit
    def _select_rows(logits_ptr, bias_ptr, ids_ptr, w_ptr, row0, T, E, stride_l, stride_out, scaling,
                     HAS_BIAS: tl.constexpr, NORM: tl.constexpr, K: tl.constexpr, BT: tl.constexpr,
                     BE: tl.constexpr):
        """The selection of rows row0 .. row0 + BT - 1 (those < T): ids and weights into slots
        0 .. K - 1 of rows stride_out apart (K, or K + 1 with the shared expert's slot after them)."""
        rt = row0 + tl.arange(0, BT)
        offs = tl.arange(0, BE)
        ok = offs[None, :] < E
        rows_ok = (rt < T)[:, None]
        scores = tl.sigmoid(tl.load(logits_ptr + rt[:, None].to(tl.int64) * stride_l + offs[None, :],
                                    mask=rows_ok & ok, other=0.0))
        choice = scores
        if HAS_BIAS:
            choice = scores + tl.load(bias_ptr + offs, mask=offs < E, other=0.0)[None, :]
        choice = tl.where(ok, choice, float("-inf"))
        # K rounds of argmax per row; each winner's slot (rank) is kept per expert lane
        slot = tl.full((BT, BE), -1, tl.int32)
        for j in tl.static_range(K):
            best = tl.max(choice, axis=1)
            winner = tl.min(tl.where(choice == best[:, None], offs[None, :], BE), axis=1)  # ties: the lower id
            won = offs[None, :] == winner[:, None]
            slot = tl.where(won, j, slot)
            choice = tl.where(won, float("-inf"), choice)
        picked = slot >= 0
        w = tl.where(picked, scores, 0.0)
        if NORM:
            w = w / tl.sum(w, axis=1)[:, None]
        w = w * scaling
        dst = rt[:, None].to(tl.int64) * stride_out + tl.where(picked, slot, 0)
        stored = picked & rows_ok
        tl.store(ids_ptr + dst, (offs[None, :] + tl.zeros((BT, BE), tl.int32)).to(tl.int64), mask=stored)
        tl.store(w_ptr + dst, w, mask=stored)

    @triton.jit
    def _select_kernel(logits_ptr, bias_ptr, ids_ptr, w_ptr, E, stride_l, scaling,
                       HAS_BIAS: tl.constexpr, NORM: tl.constexpr, K: tl.constexpr, BE: tl.constexpr):
        _select_rows(logits_ptr, bias_ptr, ids_ptr, w_ptr, tl.program_id(0), tl.program_id(0) + 1, E, stride_l, K,
                     scaling, HAS_BIAS, NORM, K, 1, BE)


    @triton.jit
    def _logits_kernel(x_ptr, w_ptr, out_ptr, q_ptr, s_ptr, T, E, H, stride_x, stride_w, stride_o, stride_q,
                       stride_s, BT: tl.constexpr, BE: tl.constexpr, BH: tl.constexpr, QUANT: tl.constexpr = False,
                       G: tl.constexpr = 128, INTERP: tl.constexpr = False, PDL: tl.constexpr = False):
        """logits[BT tokens, BE experts] = x . w in float32, products summed per lane over H
        in steps of BH, then across the lanes, by the first cdiv(E, BE) programs of axis 1.
        QUANT: H / G more programs there, each writing one 1 x G group of x's FP8
        quantization for the expert GEMMs (q, scales). Programs of their own rather than a
        tail of the logits programs, so the launch lasts as long as its logits, not logits
        plus a group. PDL: kernels/launch_overlap.py."""
        wait_then_release(PDL)
        rt = tl.program_id(0) * BT + tl.arange(0, BT)
        expert_programs = tl.cdiv(E, BE)
        if tl.program_id(1) < expert_programs:
            re = tl.program_id(1) * BE + tl.arange(0, BE)
            acc = tl.zeros((BT, BE, BH), tl.float32)
            for h0 in range(0, H, BH):
                rh = h0 + tl.arange(0, BH)
                x = tl.load(x_ptr + rt[:, None].to(tl.int64) * stride_x + rh[None, :],
                            mask=(rt[:, None] < T) & (rh[None, :] < H), other=0.0).to(tl.float32)
                w = tl.load(w_ptr + re[:, None].to(tl.int64) * stride_w + rh[None, :],
                            mask=(re[:, None] < E) & (rh[None, :] < H), other=0.0).to(tl.float32)
                acc += x[:, None, :] * w[None, :, :]
            tl.store(out_ptr + rt[:, None] * stride_o + re[None, :], tl.sum(acc, axis=2),
                     mask=(rt[:, None] < T) & (re[None, :] < E))
        elif QUANT:
            g = tl.program_id(1) - expert_programs
            rows = (rt < T)[:, None]
            col = g * G + tl.arange(0, G)
            v = tl.load(x_ptr + rt[:, None].to(tl.int64) * stride_x + col[None, :], mask=rows,
                        other=0.0).to(tl.float32)
            q, scale = quant_groups(v)
            if INTERP:
                q = round_e4m3(q)  # the interpreter's cast rounds wrongly; an E4M3 value casts exactly
            tl.store(q_ptr + rt[:, None].to(tl.int64) * stride_q + col[None, :],
                     q.to(q_ptr.dtype.element_ty), mask=rows)
            tl.store(s_ptr + rt.to(tl.int64) * stride_s + g, scale, mask=rt < T)


    @triton.jit
    def _split_bf16_kernel(w_ptr, parts_ptr, N, BLOCK: tl.constexpr):
        """parts [3, N] bf16 with parts[0] + parts[1] + parts[2] == w exactly (float32 sums): each
        part is the remainder's leading bits, and each remainder is exact (Sterbenz), whether the
        cast rounds (the GPU) or truncates (the interpreter)."""
        offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        ok = offs < N
        w = tl.load(w_ptr + offs, mask=ok, other=0.0).to(tl.float32)
        hi = w.to(tl.bfloat16)
        rest = w - hi.to(tl.float32)
        mid = rest.to(tl.bfloat16)
        lo = (rest - mid.to(tl.float32)).to(tl.bfloat16)
        tl.store(parts_ptr + offs, hi, mask=ok)
        tl.store(parts_ptr + N + offs, mid, mask=ok)
        tl.store(parts_ptr + 2 * N + offs, lo, mask=ok)

    @triton.jit
    def _logits_three_bf16_kernel(x_ptr, p_ptr, out_ptr, T, E, H, stride_x, stride_o, steps_per_split,
                                  BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, UPCAST: tl.constexpr):
        """logits[BM tokens, BN experts] = x . (lo + mid + hi) (the weight's parts, [3, E, H]) over
        this program's share of K (program_id(2): one of the split's shares, each its own [T, E]
        slab of out). Each K step's three bf16 products go into a fresh accumulator that is then
        added to the float32 sum, so the tensor cores' accumulation (not IEEE float32: it drops low
        bits) covers BK products only. UPCAST (the interpreter, whose bf16 tl.dot is wrong): the
        same exact values multiplied as float32."""
        rm = tl.program_id(0) * BM + tl.arange(0, BM)
        rn = tl.program_id(1) * BN + tl.arange(0, BN)
        split = tl.program_id(2)
        part = E * H
        acc = tl.zeros((BM, BN), tl.float32)
        k_begin = split * steps_per_split * BK
        for k0 in range(k_begin, tl.minimum(k_begin + steps_per_split * BK, H), BK):
            rk = k0 + tl.arange(0, BK)
            x = tl.load(x_ptr + rm[:, None].to(tl.int64) * stride_x + rk[None, :],
                        mask=(rm[:, None] < T) & (rk[None, :] < H), other=0.0)
            w_at = p_ptr + rn[None, :].to(tl.int64) * H + rk[:, None]
            w_ok = (rn[None, :] < E) & (rk[:, None] < H)
            lo = tl.load(w_at + 2 * part, mask=w_ok, other=0.0)
            mid = tl.load(w_at + part, mask=w_ok, other=0.0)
            hi = tl.load(w_at, mask=w_ok, other=0.0)
            if UPCAST:
                x = x.to(tl.float32)
                step = tl.dot(x, lo.to(tl.float32), input_precision="ieee")
                step = tl.dot(x, mid.to(tl.float32), step, input_precision="ieee")
                step = tl.dot(x, hi.to(tl.float32), step, input_precision="ieee")
            else:
                step = tl.dot(x, lo)
                step = tl.dot(x, mid, step)
                step = tl.dot(x, hi, step)
            acc += step
        out_ptr += split.to(tl.int64) * T * stride_o
        tl.store(out_ptr + rm[:, None].to(tl.int64) * stride_o + rn[None, :], acc,
                 mask=(rm[:, None] < T) & (rn[None, :] < E))


# _logits_three_bf16_kernel's tiles (BM, BN, BK, warps, stages) from THREE_BF16_WIDE_FROM rows on,
# and below (more shares of K, one warp group), measured on one H200
# (docs/kernel-notes.md#router-logits-at-prefill).
THREE_BF16_TILES = (128, 128, 64, 8, 3)
THREE_BF16_NARROW_TILES = (64, 128, 64, 4, 3)
THREE_BF16_WIDE_FROM = 1024


SPLIT_BLOCK = 1024  # weight values per program of _split_bf16_kernel


def three_bf16_tiles(tokens: int) -> tuple[int, int, int, int, int]:
    return THREE_BF16_TILES if tokens >= THREE_BF16_WIDE_FROM else THREE_BF16_NARROW_TILES


def router_logits_mode() -> str:
    """The kernel option moe_router_logits (MINIMAX_MOE_ROUTER_LOGITS): auto (default) or cublas."""
    return kernel_options().moe_router_logits


def three_bf16_fits(x: torch.Tensor, router_weight: torch.Tensor) -> bool:
    """Whether _logits_three_bf16_kernel computes these logits: bf16 rows (a float32 row value would
    need splitting too), a float32 or bf16 weight, unit column strides."""
    return (HAVE_TRITON and (x.is_cuda or triton_interpreting()) and x.dtype == torch.bfloat16
            and router_weight.dtype in (torch.float32, torch.bfloat16)
            and x.stride(1) == 1 and router_weight.stride(1) == 1)


def split_bf16(w: torch.Tensor) -> torch.Tensor:
    """[3, *w.shape] bf16 parts whose float32 sum is w exactly (see _split_bf16_kernel)."""
    w = w.contiguous()
    parts = torch.empty((3, *w.shape), dtype=torch.bfloat16, device=w.device)
    _split_bf16_kernel[(triton.cdiv(w.numel(), SPLIT_BLOCK),)](w, parts, w.numel(), BLOCK=SPLIT_BLOCK, num_warps=4)
    return parts


def k_splits(tokens: int, experts: int, hidden: int, tiles: tuple[int, ...], sms: int) -> int:
    """Shares of K for _logits_three_bf16_kernel: enough programs for every SM where the row
    blocks alone are fewer (a program streams the whole weight through one SM: ~85 us at M3's
    size on the H200, docs/kernel-notes.md#router-logits-at-prefill), each share at least 4 K steps."""
    bm, bn, bk = tiles[:3]
    blocks = triton.cdiv(tokens, bm) * triton.cdiv(experts, bn)
    steps = triton.cdiv(hidden, bk)
    return max(1, min(sms // blocks, steps // 4))


def _sm_count(device: torch.device) -> int:
    # off the GPU (the interpreter) the H200's 132, so the tests take the splits the GPU takes
    return torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 132


def logits_three_bf16(x: torch.Tensor, router_weight: torch.Tensor,
                      tiles: tuple[int, int, int, int, int] | None = None,
                      splits: int | None = None) -> torch.Tensor:
    """float32 [T, E] = x @ router_weight.float().T of bf16 rows: the weight split into three bf16
    parts (split_bf16, one small launch), then _logits_three_bf16_kernel with `tiles` (default
    three_bf16_tiles) over `splits` shares of K (default k_splits), whose float32 slabs are then
    summed (deterministic)."""
    if not three_bf16_fits(x, router_weight):
        raise ValueError(f"logits_three_bf16: rows {x.dtype} (stride {tuple(x.stride())}), weight "
                         f"{router_weight.dtype} (stride {tuple(router_weight.stride())}): needs bf16 rows, a float32 "
                         "or bf16 weight, unit column strides, and Triton on the rows' device")
    t, h = x.shape
    e = router_weight.shape[0]
    parts = split_bf16(router_weight)
    tiles = tiles or three_bf16_tiles(t)
    bm, bn, bk, warps, stages = tiles
    steps = triton.cdiv(h, bk)
    if splits is None:
        splits = k_splits(t, e, h, tiles, _sm_count(x.device))
    per_split = triton.cdiv(steps, max(1, min(splits, steps)))
    splits = triton.cdiv(steps, per_split)  # no empty share
    out = torch.empty(splits, t, e, dtype=torch.float32, device=x.device)
    _logits_three_bf16_kernel[(triton.cdiv(t, bm), triton.cdiv(e, bn), splits)](
        x, parts, out, t, e, h, x.stride(0), out.stride(1), per_split,
        BM=bm, BN=bn, BK=bk, UPCAST=triton_interpreting(), num_warps=warps, num_stages=stages,
    )
    return out[0] if splits == 1 else out.sum(0)


def logits_tiles(tokens: int) -> tuple[int, int, int]:
    """(BT, BE, BH) of _logits_kernel: every token in one block, one expert per program (128
    programs for M3), long K steps (measured on the H200: docs/kernel-notes.md#moe-routing)."""
    bt = triton.next_power_of_2(tokens)
    return bt, 1, 2048 if bt == 1 else 512


def router_logits(x: torch.Tensor, router_weight: torch.Tensor) -> torch.Tensor:
    """float32 [T, E] = x.float() @ router_weight.float().T: at decode sizes in one Triton launch,
    above them as three bf16 tensor-core products where the rows are bf16, else by cuBLAS."""
    return router_logits_and_fp8(x, router_weight, quantize=False)[0]


def logits_kernel_fits(x: torch.Tensor, router_weight: torch.Tensor) -> bool:
    """Whether the decode logits kernel takes these rows (else router_logits goes to the GEMMs)."""
    return x.shape[0] <= LOGITS_MAX_TOKENS and x.stride(1) == 1 and router_weight.stride(1) == 1


def router_logits_and_fp8(x: torch.Tensor, router_weight: torch.Tensor, quantize: bool = True, overlap: bool = False):
    """(logits, (x_fp8, scales) or None): router_logits, and where the decode logits kernel runs and
    `quantize` asks, x's 1 x 128 FP8 quantization for the expert GEMMs written by the same launch
    (bit for bit minimax::quantize_fp8's reference; kernels/norm_quant_triton.py:quant_groups).
    overlap: the decode kernel as a programmatic dependent launch (kernels/launch_overlap.py)."""
    t, h = x.shape
    e = router_weight.shape[0]
    if not logits_kernel_fits(x, router_weight):
        if router_logits_mode() == "auto" and three_bf16_fits(x, router_weight):
            return logits_three_bf16(x, router_weight), None
        return F.linear(x.float(), router_weight.float()), None
    quantize = quantize and h % FP8_GROUP == 0 and x.dtype in (torch.bfloat16, torch.float16)
    bt, be, bh = logits_tiles(t)
    out = torch.empty(t, e, dtype=torch.float32, device=x.device)
    if quantize:
        q = torch.empty(t, h, dtype=FP8_DTYPE, device=x.device)
        s = torch.empty(t, h // FP8_GROUP, dtype=torch.float32, device=x.device)
    else:
        q = s = out  # not written
    groups = h // FP8_GROUP if quantize else 0  # one program each, after the experts'
    _logits_kernel[(triton.cdiv(t, bt), triton.cdiv(e, be) + groups)](
        x, router_weight, out, q, s, t, e, h, x.stride(0), router_weight.stride(0), out.stride(0),
        q.stride(0), s.stride(0), BT=bt, BE=be, BH=bh, QUANT=quantize, G=FP8_GROUP, INTERP=triton_interpreting(),
        num_warps=4, **pdl_launch(overlap),
    )
    return out, ((q, s) if quantize else None)


def route_triton(x: torch.Tensor, router_weight: torch.Tensor, correction_bias, top_k: int,
                 norm_topk_prob: bool, routed_scaling: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(ids int64 [T, k], weights float32 [T, k]) as kernels/moe.py:route: at decode sizes in two
    launches (logits, selection)."""
    logits = router_logits(x, router_weight)
    t, e = logits.shape
    ids = torch.empty(t, top_k, dtype=torch.int64, device=x.device)
    weights = torch.empty(t, top_k, dtype=torch.float32, device=x.device)
    bias = correction_bias.float().contiguous() if correction_bias is not None else logits
    _select_kernel[(t,)](
        logits, bias, ids, weights, e, logits.stride(0), float(routed_scaling),
        HAS_BIAS=correction_bias is not None, NORM=bool(norm_topk_prob), K=top_k,
        BE=triton.next_power_of_2(e), num_warps=1 if e <= 256 else 4,
    )
    return ids, weights
