"""Scaled-dot-product attention nodes with few query rows: what `minimax::decode_attention` replaces.

AOTAutograd turns F.scaled_dot_product_attention into the kernel the device
would run (the CPU flash kernel, cuDNN or memory-efficient attention on CUDA,
or the composite op itself). Each takes q [B, Hq, S, d], k and v
[B, Hkv, L, d] and an optional mask; the tuple-returning ones are read
through getitem 0 (the output). A node matches when it is decode-shaped
(S <= MAX_QUERY_ROWS), has a mask of one row per sequence or per query
([B or 1, 1, S or 1, L], bool or additive), no dropout, no causal flag
(with a mask a decode step over a KV cache is never flagged causal), and
only its output is read.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass

import torch
import torch.fx as fx

from ..kernels.decode_attention import MAX_QUERY_ROWS
from .fx import expect, op_arg, op_name, set_fake_val, tensor_val

__all__ = ["SDPA_MASK_ARG", "is_sdpa", "query_rows", "DecodeAttentionMatch", "match_decode_attention"]

# the ATen attention ops and the name of their mask argument
SDPA_MASK_ARG = {
    "aten.scaled_dot_product_attention": "attn_mask",
    "aten._scaled_dot_product_flash_attention_for_cpu": "attn_mask",
    "aten._scaled_dot_product_efficient_attention": "attn_bias",
    "aten._scaled_dot_product_cudnn_attention": "attn_bias",
}
_TUPLE_OUTPUT = set(SDPA_MASK_ARG) - {"aten.scaled_dot_product_attention"}
_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def is_sdpa(node: fx.Node) -> bool:
    return op_name(node) in SDPA_MASK_ARG


def query_rows(node: fx.Node) -> int | None:
    """S of an attention node's query [B, Hq, S, d], or None when unknown."""
    q = tensor_val(node.args[0]) if node.args else None
    return int(q.shape[2]) if q is not None and q.dim() == 4 and isinstance(q.shape[2], int) else None


@dataclass
class DecodeAttentionMatch:
    sdpa: fx.Node
    output: fx.Node  # what the graph reads: the node itself or its getitem 0
    q: fx.Node
    k: fx.Node
    v: fx.Node
    mask: fx.Node
    scale: float
    kind: str = "decode"

    def describe(self) -> str:
        q, k, m = tensor_val(self.q), tensor_val(self.k), tensor_val(self.mask)
        return (f"{op_name(self.sdpa)} q {tuple(q.shape)} over k {tuple(k.shape)}, "
                f"{'bool' if m.dtype == torch.bool else 'additive'} mask {tuple(m.shape)} -> minimax.decode_attention")

    def replace(self, graph: fx.Graph, fake_mode=None) -> fx.Node:
        with graph.inserting_before(self.sdpa):
            node = graph.call_function(torch.ops.minimax.decode_attention.default,
                                       (self.q, self.k, self.v, self.mask, self.scale))
        set_fake_val(node, fake_mode)
        self.output.replace_all_uses_with(node)
        if self.output is not self.sdpa:
            graph.erase_node(self.output)
        graph.erase_node(self.sdpa)
        return node


def _sdpa_layout(t: torch.Tensor) -> bool:
    """Whether t [B, Hq, S, d] lies in memory as a contiguous [B, S, Hq, d] (the op's output
    layout), comparing strides only where a dimension has more than one element."""
    batch, hq, seq, dim = t.shape
    want = (seq * hq * dim, dim, hq * dim, 1)
    return all(n == 1 or got == w for n, got, w in zip(t.shape, t.stride(), want))


def match_decode_attention(node: fx.Node) -> DecodeAttentionMatch:
    """The match for an attention node, or Mismatch saying why it stays."""
    name = op_name(node)
    expect(name in SDPA_MASK_ARG, f"{name} is not scaled-dot-product attention", node)
    q, k, v = node.args[0], node.args[1], node.args[2]
    qv, kv, vv = tensor_val(q), tensor_val(k), tensor_val(v)
    expect(qv is not None and kv is not None and vv is not None, "q, k or v has no fake value", node)
    expect(qv.dim() == 4 and kv.dim() == 4 and vv.shape == kv.shape, "q, k, v are not [B, H, S, d]", node)
    batch, hq, seq, dim = qv.shape
    expect(seq <= MAX_QUERY_ROWS, f"{seq} query rows per sequence (prefill: SDPA keeps it)", node)
    expect(kv.shape[0] == batch and kv.shape[3] == dim and hq % kv.shape[1] == 0,
           f"k {tuple(kv.shape)} does not fit q {tuple(qv.shape)}", node)
    expect(dim >= 16 and dim <= 256 and dim & (dim - 1) == 0, f"head_dim {dim} is not a power of two in 16..256", node)
    expect(qv.dtype in _DTYPES and kv.dtype == qv.dtype and vv.dtype == qv.dtype, f"dtype {qv.dtype}", node)
    expect(op_arg(node, "dropout_p", 0.0) == 0.0, "dropout", node)
    expect(not op_arg(node, "is_causal", False), "is_causal=True (a mask-free causal query)", node)
    mask = op_arg(node, SDPA_MASK_ARG[name])
    mv = tensor_val(mask)
    expect(mv is not None, "no attention mask (the op reads the cache's mask)", node)
    expect(mv.dim() == 4 and mv.shape[0] in (1, batch) and mv.shape[1] == 1 and mv.shape[2] in (1, seq)
           and mv.shape[3] == kv.shape[2], f"mask {tuple(mv.shape)} is not [B or 1, 1, S or 1, L]", node)
    expect(mv.dtype == torch.bool or mv.is_floating_point(), f"mask dtype {mv.dtype}", node)
    if name == "aten.scaled_dot_product_attention":
        expect(hq == kv.shape[1] or op_arg(node, "enable_gqa", False), "grouped heads without enable_gqa", node)
        output = node
    else:
        users = list(node.users)
        expect(all(u.op == "call_function" and u.target is operator.getitem for u in users),
               "its outputs are read other than by index", node)
        outs = [u for u in users if u.args[1] == 0]
        expect(len(outs) == 1 and len(users) == 1, "more than the attention output (0) is read", node)
        output = outs[0]
    scale = op_arg(node, "scale")
    scale = float(dim ** -0.5 if scale is None else scale)
    ov = tensor_val(output)
    expect(ov is not None and tuple(ov.shape) == tuple(qv.shape) and _sdpa_layout(ov),
           f"output strides {tuple(ov.stride()) if ov is not None else None} are not [B, S, Hq, d] memory", node)
    return DecodeAttentionMatch(node, output, q, k, v, mask, scale)

