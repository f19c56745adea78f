"""Norm + quant fusion: RMSNorm followed by FP8 quantization becomes one kernel.

    (residual add) -> RMSNorm -> minimax.quantize_fp8      =>   minimax.rms_norm_quant_fp8

The search side is patterns/norm_quant.py. Per RMSNorm whose output is
quantized (the FP8 linears call `quantize_fp8` then `fp8_block_gemm`):

* local quantizations (no collective in between) are replaced by the fused
  op's FP8 data and scales; every quantization of the same output (the MoE
  runs one per expert) reads the one fused result;
* when the norm output has other consumers (the MoE router reads BF16, the
  experts FP8; a KV-cache write; another group size) the fused op also
  writes the BF16 output and those consumers read it ("fused_with_bf16_output");
* when the norm's input is a residual add, the add moves into the kernel too
  and its other readers (the next residual add) read the kernel's copy;
* where the norm output reaches an all-gather BEFORE the quantization
  (sequence parallelism ran: norm on the token shard -> all_gather -> wait
  -> slice -> quantize_fp8), the pass does NOT fuse across the gather: BF16
  is gathered and quantized after it ("kept_bf16_before_gather"). Fusing
  there is the bug that crashed the source engine at start-up.
* with `fp8_allgather=True`, such a gather whose consumers are all FP8
  quantizations instead gets the fused op on the shard, and gathers the FP8
  data (as bytes: gloo has no float8) and the row-major float32 scales: about
  half the bytes of BF16. Quantization groups lie inside one token's row, so
  this equals gather-then-quantize bit for bit; the padding rows of the
  sequence-parallel pass are sliced off both after the gathers. The GEMM's
  own layout of the scales (column-major for cuBLAS) is made by its kernel
  after the gather (kernels/fp8_gemm_cuda.py). A gather whose consumers also
  read BF16 (the MoE router) stays BF16: gathering both would cost more.

Two gathers rather than one gather of a packed [T, K + 4K/G] byte buffer: the
packed form needs a copy after the gather to unpack the data for the GEMM
(the fused kernel could write the packed layout, but not unpack it), which
costs more HBM time than the second collective's launch at large token
counts; tools/bench_norm_quant.py measures both.

Auto rule: on when the graph has `minimax.quantize_fp8` nodes (an FP8 model).
A BF16 graph has nothing to fuse, and that is no failure.
"""

from __future__ import annotations

import operator
from collections import Counter

import torch
import torch.fx as fx

from ..patterns import is_op, set_fake_val, val
from ..patterns.norm_quant import (
    QUANT,
    GatherSite,
    QuantSite,
    find_quant_sites,
    follows_a_norm,
    match_rms_norm,
)
from .base import GraphPass, PassContext, PassResult
from .manager import register_pass

aten = torch.ops.aten
c10d = torch.ops._c10d_functional

NO_FP8 = "no minimax.quantize_fp8 in the graph (a BF16 model): nothing to fuse"
NO_NORM_QUANT = "no minimax.quantize_fp8 follows an RMSNorm: nothing to fuse"
CATEGORIES = ("fused", "fused_with_bf16_output", "kept_bf16_before_gather")


def _graph_has_quant(graph: fx.Graph) -> bool:
    return any(is_op(n, QUANT) for n in graph.nodes)


@register_pass
class FuseNormQuantPass(GraphPass):
    name = "fuse_norm_quant"
    switch = "fuse_norm_quant"
    config_fields = ("fp8_allgather", "quant_format")
    hash_modules = (
        "minimax_backend.patterns.norm_quant",
        "minimax_backend.patterns.collectives",
        "minimax_backend.kernels.norm_quant",
    )

    def __init__(self, config):
        super().__init__(config)
        self._expect = True  # set by apply: whether finding nothing is a miss

    def auto_rule(self, ctx: PassContext) -> str | None:
        # The manager does not hand the graph to decide(); where a caller leaves it
        # in ctx.shared["graph_module"], a BF16 graph is skipped here already,
        # otherwise apply() finds it and says so in the record.
        gm = ctx.shared.get("graph_module")
        if gm is not None and not _graph_has_quant(gm.graph):
            return NO_FP8
        return None

    def expects_matches(self, ctx: PassContext) -> bool:
        return self._expect and self.is_enabled(ctx)

    def apply(self, gm: torch.fx.GraphModule, ctx: PassContext) -> PassResult:
        graph = gm.graph
        quants = [n for n in graph.nodes if is_op(n, QUANT)]
        if not quants:
            self._expect = False
            return self.result(matches=0, skipped=NO_FP8)
        self._expect = any(follows_a_norm(q) for q in quants)
        if not self._expect:
            return self.result(matches=0, skipped=NO_NORM_QUANT)

        rewriter = _Rewriter(graph, ctx, fp8_allgather=self.config.fp8_allgather)
        for node in list(graph.nodes):
            if node.graph is graph and not getattr(node, "_erased", False):
                rewriter.visit(node)
        if rewriter.needs_toposort:
            from .sequence_parallel_rewrite import stable_toposort

            stable_toposort(graph)
        graph.lint()
        gm.recompile()

        counts = rewriter.counts
        breakdown = {k: counts.get(k, 0) for k in CATEGORIES}
        if self.config.fp8_allgather or counts.get("fp8_allgather"):
            breakdown["fp8_allgather"] = counts.get("fp8_allgather", 0)
        breakdown["with_residual_add"] = counts.get("with_residual_add", 0)
        matches = sum(counts.get(k, 0) for k in (*CATEGORIES, "fp8_allgather"))
        skipped = None
        if matches == 0:
            skipped = "quantize_fp8 follows a norm, but no norm -> quantize pair was recognized"
        return self.result(
            matches=matches,
            graph_changed=rewriter.changed,
            breakdown=breakdown,
            details=rewriter.details,
            skipped=skipped,
        )


class _Rewriter:
    """Rewrites one norm at a time, in graph order."""

    def __init__(self, graph: fx.Graph, ctx: PassContext, fp8_allgather: bool):
        self.graph = graph
        self.fake_mode = ctx.fake_mode
        self.fp8_allgather = fp8_allgather
        self.counts: Counter = Counter()
        self.details: list[str] = []
        self.changed = False
        self.needs_toposort = False

    # ---- helpers ----------------------------------------------------------
    def _call(self, target, args, kwargs=None) -> fx.Node:
        n = self.graph.call_function(target, tuple(args), kwargs or {})
        set_fake_val(n, self.fake_mode)
        return n

    def _reshaped(self, src: fx.Node, shape) -> fx.Node:
        if tuple(val(src).shape) == tuple(shape):
            return src
        return self._call(aten.view.default, (src, list(shape)))

    def _replace_quant(self, site: QuantSite, q: fx.Node, s: fx.Node) -> None:
        """Make the readers of site.quant's (data, scales) read q / s, reshaped like the site."""
        shape = tuple(val(site.quant.args[0]).shape)
        groups = shape[-1] // site.group_size
        outs = {}
        for g in list(site.quant.users):
            idx = g.args[1]
            if idx not in outs:
                outs[idx] = self._reshaped(q, shape) if idx == 0 else self._reshaped(s, (*shape[:-1], groups))
            g.replace_all_uses_with(outs[idx])

    def _erase_dead(self, nodes) -> None:
        """Erase the given nodes that nothing reads any more (repeat until stable)."""
        alive = [n for n in nodes if n is not None]
        changed = True
        while changed:
            changed = False
            for n in list(alive):
                if not n.users and not getattr(n, "_erased", False):
                    self.graph.erase_node(n)
                    alive.remove(n)
                    changed = True

    # ---- one norm ---------------------------------------------------------
    def visit(self, node: fx.Node) -> None:
        match = match_rms_norm(node)
        if match is None:
            return
        uses = find_quant_sites(match.output)
        name = match.output.name
        groups = [s.group_size for s in uses.quants] + [s.group_size for gs in uses.gathers for s in gs.quants]
        if not groups:
            return  # a norm that feeds no FP8 quantization (BF16 linear, QK norm, lm_head)
        group = groups[0]
        local = [s for s in uses.quants if s.group_size == group]
        fp8_gathers: list[GatherSite] = []
        kept: list[GatherSite] = []
        for gs in uses.gathers:
            if not gs.quants:
                continue  # a gather of the BF16 output with no quantization behind it
            if self.fp8_allgather and not gs.others and all(s.group_size == group for s in gs.quants):
                fp8_gathers.append(gs)
            else:
                kept.append(gs)
                why = ("fp8_allgather is off" if not self.fp8_allgather else
                       "consumers after the gather also read BF16 (" +
                       ", ".join(o.name for o in gs.others[:3]) + ")" if gs.others else
                       "mixed group sizes after the gather")
                self.details.append(f"{name}: kept BF16 in front of {gs.gather.name}, quantized after it ({why})")
        self.counts["kept_bf16_before_gather"] += len(kept)
        if not local and not fp8_gathers:
            return
        self._fuse(match, local, fp8_gathers, group)

    def _fuse(self, match, local: list[QuantSite], fp8_gathers: list[GatherSite], group: int) -> None:
        graph = self.graph
        order = {n: i for i, n in enumerate(graph.nodes)}
        residual = match.residual
        if residual is not None:
            x, res = residual[1], residual[0]  # h = res + x: the residual stream plus the new output
            anchor = match.x
        else:
            x, res = match.x, None
            anchor = min(match.nodes, key=order.__getitem__)
        inputs = [a for a in (x, res, match.weight) if isinstance(a, fx.Node)]
        if any(order[a] >= order[anchor] for a in inputs):
            self.needs_toposort = True

        with graph.inserting_before(anchor):
            fused = self._call(
                torch.ops.minimax.rms_norm_quant_fp8.default,
                (x, res, match.weight, match.eps, match.gemma, group, False),
            )
            q = self._call(operator.getitem, (fused, 0))
            s = self._call(operator.getitem, (fused, 1))
            for site in local:
                self._replace_quant(site, q, s)
            for gs in fp8_gathers:
                self._gather_fp8(gs, q, s)

        dead: list[fx.Node] = []
        for site in local:
            dead += [site.quant, *reversed(site.chain)]
        for gs in fp8_gathers:
            for site in gs.quants:
                dead += [site.quant, *reversed(site.chain)]
            dead += [gs.row_slice, gs.wait, gs.gather, *reversed(gs.pre_chain)]
        self._erase_dead([u for site in local for u in site.quant.users] +
                         [u for gs in fp8_gathers for site in gs.quants for u in site.quant.users] + dead)

        want_y = len(match.output.users) > 0
        if want_y:
            fused.update_arg(6, True)
            set_fake_val(fused, self.fake_mode)
            with graph.inserting_after(s):
                y = self._call(operator.getitem, (fused, 2))
            match.output.replace_all_uses_with(y)
        if residual is not None:
            with graph.inserting_after(s):
                r = self._call(operator.getitem, (fused, 3))
            match.x.replace_all_uses_with(r, delete_user_cb=lambda u: u is not fused)
        self._erase_dead(list(reversed(match.nodes)) + ([match.x] if residual is not None else []))

        kind = "fp8_allgather" if fp8_gathers else ("fused_with_bf16_output" if want_y else "fused")
        self.counts[kind] += 1
        if residual is not None:
            self.counts["with_residual_add"] += 1
        n_q = len(local) + sum(len(gs.quants) for gs in fp8_gathers)
        extras = [f"{n_q} quantization(s), G={group}"]
        if want_y:
            extras.append("BF16 output kept for " + ", ".join(u.name for u in list(y.users)[:3]))
        if residual is not None:
            extras.append("residual add fused")
        if fp8_gathers:
            extras.append(f"FP8 data + scales gathered ({len(fp8_gathers)} gather(s))")
        self.details.append(f"{match.output.name} -> {fused.name}: " + "; ".join(extras))
        self.changed = True

    def _gather_fp8(self, gs: GatherSite, q: fx.Node, s: fx.Node) -> None:
        """Gather the shard's FP8 data (as bytes) and scales; slice the padding; feed the quant sites."""
        shard_shape = tuple(val(gs.gather.args[0]).shape)  # [T / tp, K]
        k = shard_shape[-1]
        groups = k // gs.quants[0].group_size
        q2 = self._reshaped(q, shard_shape)
        s2 = self._reshaped(s, (shard_shape[0], groups))
        q_bytes = self._call(aten.view.dtype, (q2, torch.uint8))
        ag_q = self._call(c10d.all_gather_into_tensor.default, (q_bytes, gs.world, gs.group_name))
        ag_s = self._call(c10d.all_gather_into_tensor.default, (s2, gs.world, gs.group_name))
        q_full = self._call(aten.view.dtype, (self._call(c10d.wait_tensor.default, (ag_q,)), torch.float8_e4m3fn))
        s_full = self._call(c10d.wait_tensor.default, (ag_s,))
        if gs.row_slice is not None:
            rest = tuple(gs.row_slice.args[1:])
            q_full = self._call(aten.slice.Tensor, (q_full, *rest))
            s_full = self._call(aten.slice.Tensor, (s_full, *rest))
        for site in gs.quants:
            self._replace_quant(site, q_full, s_full)
