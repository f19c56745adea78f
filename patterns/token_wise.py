"""Which ATen ops act on each token (row) independently.

Sequence parallelism keeps the residual stream split by token across the TP
ranks. That is only correct for ops whose output row i depends on input row i
alone: pointwise math, reductions over the hidden dimension (the RMSNorm's
mean), casts, and concatenation along a non-token dimension. Anything else
(matmuls are fine per row too, but their weights are TP-sharded on the wrong
axis for this; views that fold the token dimension; indexing) gets the full
tokens back through an all-gather first. Being conservative here costs an
extra gather, never a wrong answer.
"""

from __future__ import annotations

import torch
import torch.fx as fx

aten = torch.ops.aten
prims = torch.ops.prims

# Reductions that keep the token dimension when they reduce other dims only.
_REDUCTIONS = {
    aten.mean.dim,
    aten.sum.dim_IntList,
    aten.amax.default,
    aten.amin.default,
}
# Concatenations: fine along any dim but the token one.
_CONCATS = {aten.cat.default, aten.stack.default}
_CASTS = {aten._to_copy.default, prims.convert_element_type.default}


def _val(node) -> torch.Tensor | None:
    v = node.meta.get("val") if isinstance(node, fx.Node) else None
    return v if isinstance(v, torch.Tensor) else None


def _dims(node: fx.Node) -> list[int] | None:
    """The reduced / concatenated dims of node, normalized to be non-negative."""
    out = _val(node.args[0] if node.target not in _CONCATS else node.args[0][0])
    if out is None:
        return None
    ndim = out.dim()
    if node.target in _CONCATS:
        d = node.args[1] if len(node.args) > 1 else node.kwargs.get("dim", 0)
        return [d % (ndim + (1 if node.target is aten.stack.default else 0))]
    dims = node.args[1] if len(node.args) > 1 else node.kwargs.get("dim")
    if dims is None:
        return list(range(ndim))  # a full reduction mixes tokens
    if isinstance(dims, int):
        dims = [dims]
    return [d % ndim for d in dims]


def is_token_wise(node: fx.Node) -> bool:
    """True when row i of the output depends only on row i of its token inputs."""
    if node.op != "call_function" or not isinstance(node.target, torch._ops.OpOverload):
        return False
    target = node.target
    if target in _CASTS:
        # A cast that moves the tensor to another device or layout is not ours to shard.
        return set(node.kwargs) <= {"dtype"}
    if torch.Tag.pointwise in target.tags:
        return True
    if target in _REDUCTIONS or target in _CONCATS:
        dims = _dims(node)
        return dims is not None and 0 not in dims
    return False


def broadcasts_over_tokens(arg, sharded_ndim: int) -> bool:
    """Can `arg` meet a token-sharded operand of `sharded_ndim` dims in a pointwise op?

    Yes when it is not a tensor, or when broadcasting lines up a size-1 (or
    missing) dim against the token dim, e.g. a norm weight of shape [hidden].
    """
    v = _val(arg) if isinstance(arg, fx.Node) else None
    if v is None:
        return not isinstance(arg, fx.Node) or not isinstance(arg.meta.get("val"), torch.Tensor)
    lead = v.dim() - sharded_ndim
    return lead < 0 or v.shape[lead] == 1
