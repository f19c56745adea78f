"""The strong baseline: the same model as a careful torch user would write it for speed.

What changes against our eager model (model/), everything else shared:

  * the MoE: the router as in model/moe.py, then the (token, expert) pairs
    sorted by expert and the experts run as one grouped GEMM per projection,
    torch._grouped_mm (BF16) or torch._scaled_grouped_mm (FP8 with row-wise
    scales, the only scaling torch's grouped GEMM takes: coarser and cheaper
    than our 128 x 128 blocks), with the activation and the weighted combine
    in torch ops, static shapes (no host sync), so it compiles and captures;
  * FP8 linears quantize their input in plain torch ops (Inductor fuses the
    quantization with the RMSNorm before it) and multiply with
    torch._scaled_mm's block-scaled GEMM (cuBLAS) at every row count, through
    the op `minimax_baseline::scaled_mm_blockwise` below (the row padding and
    scale layout cuBLAS wants, as one graph node: our op minimax::fp8_block_gemm
    may pick our own kernels, which the baseline must not).

`to_torch_baseline(model)` makes a model instance into this one (the experts
re-stacked, FP8 ones re-quantized row-wise), to compile with stock
torch.compile(mode="reduce-overhead"). Sparse attention layers run
the same MSA ops as ours (torch has no sparse-attention kernel of its own).
"""

from __future__ import annotations

import torch
from torch import nn

from minimax_backend.kernels.fp8 import dequantize_weight_fp8, quantize_fp8_reference
from minimax_backend.kernels.moe_reference import activation
from minimax_backend.model.linear import ParallelLinear
from minimax_backend.model.moe import MoE
from minimax_backend.model.parallel import all_reduce
from minimax_backend.tools.bench_common import rowwise_fp8

__all__ = ["TorchGrouped", "GroupedMoE", "TorchFP8Linear", "scaled_mm_blockwise", "to_torch_baseline"]


@torch.library.custom_op("minimax_baseline::scaled_mm_blockwise", mutates_args=())
def scaled_mm_blockwise(xq: torch.Tensor, xs: torch.Tensor, w: torch.Tensor, ws: torch.Tensor,
                        out_dtype: torch.dtype) -> torch.Tensor:
    """torch._scaled_mm with 1 x 128 / 128 x 128 block scales on CUDA; the reference elsewhere."""
    from minimax_backend.kernels.fp8_gemm_cuda import fp8_block_gemm_scaled_mm, scaled_mm_supports

    lead, k = xq.shape[:-1], xq.shape[-1]
    if not xq.is_cuda or not scaled_mm_supports(xq.numel() // k, k, k // xs.shape[-1]):
        return torch.ops.minimax.fp8_block_gemm(xq, xs, w, ws, out_dtype)  # (M3's shapes never come here on CUDA)
    y = fp8_block_gemm_scaled_mm(xq.reshape(-1, k), xs.reshape(-1, xs.shape[-1]), w, ws, out_dtype)
    return y.reshape(*lead, w.shape[0])


@scaled_mm_blockwise.register_fake
def _scaled_mm_blockwise_fake(xq, xs, w, ws, out_dtype):
    return xq.new_empty((*xq.shape[:-1], w.shape[0]), dtype=out_dtype)


class TorchGrouped:
    """Experts as torch._grouped_mm / torch._scaled_grouped_mm over stacked weights (built once)."""

    def __init__(self, w13: list, w2: list, w13_scale, w2_scale, fp8: bool):
        self.fp8 = fp8
        if fp8:  # re-quantize the 128 x 128 block weights per output row (the format torch takes)
            def rows(ws, ss):
                qs, scales = zip(*(rowwise_fp8(dequantize_weight_fp8(w, s)) for w, s in zip(ws, ss)))
                return torch.stack(qs), torch.stack(scales)

            self.w13, self.s13 = rows(w13, w13_scale)
            self.w2, self.s2 = rows(w2, w2_scale)
        else:
            self.w13, self.w2 = torch.stack(list(w13)), torch.stack(list(w2))
            self.s13 = self.s2 = None

    def _mm(self, a, w, s, offs):
        if self.fp8 and a.is_cuda:
            aq, sa = rowwise_fp8(a)
            return torch._scaled_grouped_mm(aq, w.transpose(1, 2), sa, s, offs=offs, out_dtype=torch.bfloat16)
        if self.fp8:  # CPU smoke runs: torch has no FP8 grouped GEMM there
            w = (w.float() * s[..., None]).to(torch.bfloat16)
        return torch._grouped_mm(a, w.transpose(1, 2), offs=offs)

    def __call__(self, x, ids, weights, expert_offset, kind, alpha, limit, beta) -> torch.Tensor:
        """float32 [T, H]: sum over each token's pairs routed to these experts of weight * expert(x)."""
        t, k = ids.shape
        g = self.w13.shape[0]
        flat = ids.reshape(-1) - expert_offset
        local = (flat >= 0) & (flat < g)
        e = torch.where(local, flat, torch.full_like(flat, g))
        order = torch.argsort(e, stable=True)
        counts = torch.zeros(g + 1, dtype=torch.int64, device=x.device).scatter_add_(0, e, torch.ones_like(e))
        offs = torch.cumsum(counts[:g], 0).to(torch.int32)
        tok = order // k
        gate, up = self._mm(x[tok], self.w13, self.s13, offs).chunk(2, dim=-1)
        h = activation(gate, up, kind, alpha, limit, beta).to(x.dtype).contiguous()
        y = self._mm(h, self.w2, self.s2, offs)
        keep = local[order]
        y = torch.where(keep[:, None], y.float() * weights.reshape(-1)[order][:, None], torch.zeros((), device=x.device))
        return torch.zeros(t, x.shape[1], dtype=torch.float32, device=x.device).index_add_(0, tok, y)


class GroupedMoE(nn.Module):
    """model/moe.py's block with its local experts as grouped GEMMs (same router, same sums)."""

    def __init__(self, block: MoE):
        super().__init__()
        self.block = block  # router weights, the shared expert, the parallel layout
        experts = block.experts  # stacked: model/moe.py's LocalExperts
        w13, w2, s13, s2 = experts.per_expert()
        fp8 = experts.gate_up_proj.fp8
        self.grouped = TorchGrouped(w13, w2, s13 if fp8 else None, s2 if fp8 else None, fp8)
        self.act = (experts.act, experts.alpha, experts.limit, experts.beta)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b = self.block
        ids, w = b.route(x)
        out = self.grouped(x, ids, w, b.first_expert, *self.act).to(x.dtype)
        if b.shared_experts is not None:
            out = out + b.shared_experts(x)
        return all_reduce(out, b.ps)


class TorchFP8Linear(nn.Module):
    """An FP8 linear whose activation quantization is plain torch (fusable by Inductor)."""

    def __init__(self, linear: ParallelLinear):
        super().__init__()
        self.linear = linear

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        lin = self.linear
        xq, xs = quantize_fp8_reference(x, lin.act_group_size)
        return scaled_mm_blockwise(xq, xs, lin.weight, lin.weight_scale_inv, x.dtype)


def _replace(root: nn.Module, match, make) -> int:
    n = 0
    for name, child in list(root.named_children()):
        if match(child):
            setattr(root, name, make(child))
            n += 1
        else:
            n += _replace(child, match, make)
    return n


def to_torch_baseline(model: nn.Module) -> nn.Module:
    """Turn `model` (its own instance: it is changed in place) into the baseline:
    grouped-GEMM MoE blocks (the per-expert weights are dropped once stacked) and
    plain-torch FP8 activation quantization in every other FP8 linear."""
    for layer in model.layers:
        if getattr(layer, "is_moe", False):
            grouped = GroupedMoE(layer.block_sparse_moe)
            del grouped.block.experts  # stacked into grouped.grouped; the loop is not run
            layer.block_sparse_moe = grouped
    _replace(model, lambda m: isinstance(m, ParallelLinear) and m.fp8, TorchFP8Linear)
    return model
