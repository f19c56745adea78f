"""The residual stream of a tensor-parallel model graph, and its sequence-parallel rewrite.

Tensor parallelism leaves the residual stream replicated: every row-parallel
projection (o_proj, the dense down_proj, the MoE's summed partials, the
vocab-parallel embedding) ends in an all-reduce of [tokens, hidden]. Sequence
parallelism keeps the stream split by token instead:

1. each residual all-reduce becomes a reduce-scatter (rank r keeps rows
   r*T/tp ... of the sum), with the rows padded to a multiple of tp first;
2. sharding flows forward through every op that treats tokens independently
   (the residual adds, the RMSNorms, casts; see patterns/token_wise.py);
3. where a sharded value meets anything else (QKV, the MoE, lm_head), it is
   all-gathered once and the padding rows dropped;
4. the gathers that only feed the graph's end (final hidden states and the
   auxiliary hidden states) are merged into ONE all-gather, then split.

reduce-scatter + all-gather computes what all-reduce did, and token-wise ops
commute with splitting rows, so the rewrite is exact up to summation order.

Search side: ``find_residual_stream(graph)`` (raises ``NotRecognized`` with the
reason for a graph it does not know); replace side: ``ResidualStream.replace``.
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass, field

import torch
import torch.fx as fx

from .collectives import Collective, find_all_reduces, group_size, insert_all_gather, insert_reduce_scatter
from .fx import stable_toposort, tensor_val
from .token_wise import broadcasts_over_tokens, is_token_wise

aten = torch.ops.aten
c10d = torch.ops._c10d_functional


class NotRecognized(Exception):
    """The graph is not one this pass knows how to shard; the message says why."""


@dataclass
class ShardingRecord:
    tokens: int = 0
    padded_tokens: int = 0
    tp: int = 0
    replaced: Counter = field(default_factory=Counter)  # all-reduces by region kind
    stream_gathers: int = 0
    end_gathers: int = 0
    end_gathered_tensors: int = 0

    @property
    def matches(self) -> int:
        return sum(self.replaced.values())

    def details(self) -> list[str]:
        kinds = ", ".join(f"{k} {v}" for k, v in sorted(self.replaced.items()))
        lines = [
            f"all-reduce -> reduce-scatter: {self.matches} ({kinds})",
            f"all-gathers inserted: {self.stream_gathers} in the stream, "
            f"{self.end_gathers} at the end carrying {self.end_gathered_tensors} tensor(s)",
        ]
        if self.padded_tokens != self.tokens:
            lines.append(f"tokens padded {self.tokens} -> {self.padded_tokens} (tp {self.tp}) and sliced after each gather")
        return lines


def _nbytes(node: fx.Node) -> int:
    v = tensor_val(node)
    return v.numel() * v.element_size() if v is not None else 0


def residual_all_reduces(graph: fx.Graph) -> tuple[list[Collective], int, int, str]:
    """The [tokens, hidden] all-reduces of the residual stream, and (T, H, group).

    The first all-reduce of a model graph is the embedding's; its shape fixes
    [T, H]. Other all-reduces (e.g. the QK-norm variance of MiniMax-M2, shape
    [T, 1]) are not on the residual stream and stay as they are.
    """
    found = find_all_reduces(graph)
    if not found:
        raise NotRecognized("no all-reduce in the graph: nothing is tensor-parallel here")
    first = tensor_val(found[0].input)
    if first is None or first.dim() != 2:
        raise NotRecognized(
            f"the first all-reduce ({found[0].start.name}) is not a 2-D [tokens, hidden] tensor "
            f"(shape {None if first is None else tuple(first.shape)}): not a model graph this pass knows"
        )
    tokens, hidden = first.shape
    if not isinstance(tokens, int) or not isinstance(hidden, int):
        raise NotRecognized("the token count is symbolic; sequence parallelism needs static shapes (dynamic=False)")
    stream = [c for c in found if (v := tensor_val(c.input)) is not None and tuple(v.shape) == (tokens, hidden)]
    groups = {c.group_name for c in stream}
    if len(groups) != 1:
        raise NotRecognized(f"residual all-reduces span several process groups: {sorted(groups)}")
    return stream, tokens, hidden, groups.pop()


def _region_kind(rs_input: fx.Node, stop: set[fx.Node]) -> str:
    """Name what produced a reduce-scatter's input: embedding, attention, moe or dense_mlp."""
    seen, todo, targets = set(), [rs_input], set()
    while todo:
        n = todo.pop()
        if n in seen or n in stop or n.op != "call_function":
            continue
        seen.add(n)
        targets.add(n.target)
        todo.extend(n.all_input_nodes)
    if aten.embedding.default in targets:
        return "embedding"
    if aten.topk.default in targets or any(str(t).startswith("minimax.moe") for t in targets):
        return "moe"
    if any("scaled_dot_product" in str(t) or "msa_attention" in str(t) for t in targets):
        return "attention"
    return "dense_mlp"


def _token_wise_on_shards(node: fx.Node, sharded: set[fx.Node]) -> bool:
    """Can `node` run on the token shards of its sharded inputs as is?"""
    if not is_token_wise(node):
        return False
    ndim = max(tensor_val(a).dim() for a in node.all_input_nodes if a in sharded and tensor_val(a) is not None)
    for a in node.all_input_nodes:
        if a not in sharded and not broadcasts_over_tokens(a, ndim):
            return False  # a full-token operand would need slicing per rank; gather instead
    return True


def _propagate(graph: fx.Graph, sharded: set[fx.Node]) -> None:
    for node in graph.nodes:
        if node in sharded or node.op != "call_function":
            continue
        if any(a in sharded for a in node.all_input_nodes) and _token_wise_on_shards(node, sharded):
            sharded.add(node)


def _prune_leaves(sharded: set[fx.Node], pinned: set[fx.Node]) -> None:
    """Compute cheap tails (e.g. the router's fp32 cast of the normed input) after the gather.

    A sharded leaf with a single sharded input moves back to the full side when
    gathering its input costs fewer bytes, or the same bytes and that input is
    gathered anyway: one gather instead of two, never more bytes on the wire.
    """
    changed = True
    while changed:
        changed = False
        for n in list(sharded):
            if n in pinned or any(u in sharded for u in n.users):
                continue
            ins = [a for a in n.all_input_nodes if a in sharded]
            if len(ins) != 1:
                continue
            p = ins[0]
            p_gathered = any(u not in sharded and u is not n for u in p.users)
            if _nbytes(p) < _nbytes(n) or (_nbytes(p) == _nbytes(n) and p_gathered):
                sharded.discard(n)
                changed = True


def _ancestors(nodes: list[fx.Node]) -> set[fx.Node]:
    seen, todo = set(), list(nodes)
    while todo:
        n = todo.pop()
        if n in seen:
            continue
        seen.add(n)
        todo.extend(n.all_input_nodes)
    return seen


def _unpad(graph: fx.Graph, x: fx.Node, tokens: int, padded: int) -> fx.Node:
    if padded == tokens:
        return x
    return graph.call_function(aten.slice.Tensor, (x, 0, 0, tokens))


@dataclass
class ResidualStream:
    """The [tokens, hidden] all-reduces of a model graph; `replace()` shards the stream."""

    all_reduces: list[Collective]
    tokens: int
    group: str
    tp: int

    def replace(self, graph: fx.Graph) -> ShardingRecord:
        return _shard(graph, self.all_reduces, self.tokens, self.group, self.tp)


def find_residual_stream(graph: fx.Graph) -> ResidualStream:
    """The graph's residual stream; raises NotRecognized (graph untouched) if it has none."""
    stream, tokens, _, group = residual_all_reduces(graph)
    return ResidualStream(stream, tokens, group, group_size(group))


def _shard(graph: fx.Graph, stream: list[Collective], tokens: int, group: str, tp: int) -> ShardingRecord:
    padded = math.ceil(tokens / tp) * tp
    record = ShardingRecord(tokens=tokens, padded_tokens=padded, tp=tp)

    # 1. all-reduce -> pad + reduce-scatter.
    sharded: set[fx.Node] = set()
    scatters: list[fx.Node] = []
    stop: set[fx.Node] = set()
    for pair in stream:
        with graph.inserting_before(pair.start):
            x = pair.input
            if padded != tokens:
                x = graph.call_function(aten.constant_pad_nd.default, (x, [0, 0, 0, padded - tokens], 0.0))
            out = insert_reduce_scatter(graph, x, tp, group)
        record.replaced[_region_kind(pair.input, stop)] += 1
        stop.add(out)
        # Until meta is refreshed, shapes are read in full-token terms; keep the old ones.
        out.meta.update(pair.wait.meta)
        pair.wait.replace_all_uses_with(out)
        graph.erase_node(pair.wait)
        graph.erase_node(pair.start)
        sharded.add(out)
        scatters.append(out)

    # 2. let sharding flow through token-wise ops; 3. keep cheap tails unsharded.
    _propagate(graph, sharded)
    _prune_leaves(sharded, pinned=set(scatters))

    # 4. gather where sharded values meet the rest of the graph.
    feeds_stream = _ancestors([s.args[0] for s in scatters])
    stream_sources, end_sources = [], []
    for s in graph.nodes:
        if s not in sharded:
            continue
        outside = [u for u in s.users if u not in sharded]
        if not outside:
            continue
        (stream_sources if any(u in feeds_stream for u in outside) else end_sources).append(s)

    for s in stream_sources:
        users = [u for u in s.users if u not in sharded]
        with graph.inserting_after(s):
            full = insert_all_gather(graph, s, tp, group)
        with graph.inserting_after(full):
            full = _unpad(graph, full, tokens, padded)
        for u in users:
            u.replace_input_with(s, full)
    record.stream_gathers = len(stream_sources)

    if end_sources:
        record.end_gathers, record.end_gathered_tensors = _gather_at_end(graph, end_sources, sharded, tokens, padded, tp, group)
    stable_toposort(graph)
    graph.lint()
    return record


def _gather_at_end(graph, sources, sharded, tokens, padded, tp, group) -> tuple[int, int]:
    """One all-gather for every value the graph's end needs (per dtype), then split."""
    by_dtype: dict[torch.dtype, list[fx.Node]] = {}
    for s in sources:
        by_dtype.setdefault(tensor_val(s).dtype, []).append(s)
    order = {n: i for i, n in enumerate(graph.nodes)}
    last = max(sources, key=order.__getitem__)
    # Who reads each source now; the nodes built below must not be rewired.
    readers = {s: [u for u in s.users if u not in sharded] for s in sources}
    for dtype, group_sources in by_dtype.items():
        with graph.inserting_after(last):
            flat, widths = [], []
            for s in group_sources:
                shape = tuple(tensor_val(s).shape)
                width = math.prod(shape[1:])
                flat.append(graph.call_function(aten.view.default, (s, [padded // tp, width])) if len(shape) != 2 else s)
                widths.append(width)
            cat = graph.call_function(aten.cat.default, (flat, 1)) if len(flat) > 1 else flat[0]
            full = _unpad(graph, insert_all_gather(graph, cat, tp, group), tokens, padded)
            offset = 0
            for s, width in zip(group_sources, widths):
                piece = full
                if len(flat) > 1:
                    piece = graph.call_function(aten.slice.Tensor, (full, 1, offset, offset + width))
                shape = tuple(tensor_val(s).shape)
                if len(shape) != 2:
                    piece = graph.call_function(aten.clone.default, (piece,), {"memory_format": torch.contiguous_format})
                    piece = graph.call_function(aten.view.default, (piece, [tokens, *shape[1:]]))
                offset += width
                for u in readers[s]:
                    u.replace_input_with(s, piece)
    return len(by_dtype), len(sources)


def shard_residual_stream(graph: fx.Graph) -> ShardingRecord:
    """find_residual_stream + replace in one call (for tests and tools)."""
    return find_residual_stream(graph).replace(graph)
