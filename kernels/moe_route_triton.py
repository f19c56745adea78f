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
rows, summed in float32) come from cuBLAS on x.float(), or, at decode sizes
(up to LOGITS_MAX_TOKENS rows), from `_logits_kernel`, which reads the bf16 rows
as they are: one launch instead of cuBLAS's cast, GEMM and split-K reduction
(docs/kernel-notes.md#moe-routing). Its sums run in another order than cuBLAS's,
so a logit may differ from torch's in the last bits.

Differences from torch, all within what torch itself leaves open: the slot
order (torch.topk(sorted=False) promises none; the combine sums the slots in
float32), which of exactly tied experts wins (torch's choice is unspecified
on CUDA; random inputs have no ties), and the sigmoid and the four-term sum
may differ from torch's CUDA kernels in the last bit.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .interpreter import triton_interpreting
from .options import kernel_options

try:
    import triton
    import triton.language as tl

    HAVE_TRITON = True
except ImportError:  # pragma: no cover
    triton = tl = None
    HAVE_TRITON = False

MAX_EXPERTS = 1024  # one [experts] vector per program in registers
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
    def _select_kernel(logits_ptr, bias_ptr, ids_ptr, w_ptr, E, stride_l, scaling,
                       HAS_BIAS: tl.constexpr, NORM: tl.constexpr, K: tl.constexpr, BE: tl.constexpr):
        t = tl.program_id(0).to(tl.int64)
        offs = tl.arange(0, BE)
        ok = offs < E
        scores = tl.sigmoid(tl.load(logits_ptr + t * stride_l + offs, mask=ok, other=0.0))
        choice = scores
        if HAS_BIAS:
            choice = scores + tl.load(bias_ptr + offs, mask=ok, other=0.0)
        choice = tl.where(ok, choice, float("-inf"))
        # K rounds of argmax; each winner's slot (rank) is kept per expert lane
        slot = tl.full((BE,), -1, tl.int32)
        for j in tl.static_range(K):
            best = tl.max(choice, axis=0)
            winner = tl.min(tl.where(choice == best, offs, BE), axis=0)  # ties: the lower id
            slot = tl.where(offs == winner, j, slot)
            choice = tl.where(offs == winner, float("-inf"), choice)
        picked = slot >= 0
        w = tl.where(picked, scores, 0.0)
        if NORM:
            w = w / tl.sum(w, axis=0)
        w = w * scaling
        dst = t * K + tl.where(picked, slot, 0)
        tl.store(ids_ptr + dst, offs.to(tl.int64), mask=picked)
        tl.store(w_ptr + dst, w, mask=picked)


    @triton.jit
    def _logits_kernel(x_ptr, w_ptr, out_ptr, T, E, H, stride_x, stride_w, stride_o,
                       BT: tl.constexpr, BE: tl.constexpr, BH: tl.constexpr):
        """logits[BT tokens, BE experts] = x . w in float32, products summed per lane over H
        in steps of BH, then across the lanes."""
        rt = tl.program_id(0) * BT + tl.arange(0, BT)
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


def logits_tiles(tokens: int) -> tuple[int, int, int]:
    """(BT, BE, BH) of _logits_kernel: every token in one block, one expert per program (128
    programs for M3), long K steps (measured on the H200: docs/kernel-notes.md#moe-routing)."""
    bt = triton.next_power_of_2(tokens)
    return bt, 1, 2048 if bt == 1 else 512


def router_logits(x: torch.Tensor, router_weight: torch.Tensor) -> torch.Tensor:
    """float32 [T, E] = x.float() @ router_weight.float().T; at decode sizes in one Triton launch."""
    t, h = x.shape
    e = router_weight.shape[0]
    if t > LOGITS_MAX_TOKENS or x.stride(1) != 1 or router_weight.stride(1) != 1:
        return F.linear(x.float(), router_weight.float())
    bt, be, bh = logits_tiles(t)
    out = torch.empty(t, e, dtype=torch.float32, device=x.device)
    _logits_kernel[(triton.cdiv(t, bt), triton.cdiv(e, be))](
        x, router_weight, out, t, e, h, x.stride(0), router_weight.stride(0), out.stride(0),
        BT=bt, BE=be, BH=bh, num_warps=4,
    )
    return out


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
