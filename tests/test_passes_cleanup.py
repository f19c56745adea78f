"""Cleanup pass on small ATen graphs made with make_fx (fake values in meta)."""

from __future__ import annotations

import torch
from torch.fx.experimental.proxy_tensor import make_fx

from pass_harness import run_pass

from minimax_backend.patterns.fx import op_name


def _run(f, *args):
    gm = make_fx(f, tracing_mode="fake")(*args)
    res = run_pass("cleanup", gm)
    return gm, res, [op_name(n) for n in gm.graph.nodes if n.op == "call_function"]


def test_dead_code_and_noop_views_removed():
    def f(x):
        _unused = x.sin() * 2  # dead
        y = x.view(x.shape).clone()  # both no-ops
        return y.relu().view(-1)  # feeds the output: kept

    x = torch.randn(4, 8)
    gm, res, ops = _run(f, x)
    assert res.matches == 4 and res.graph_changed
    assert res.breakdown == {"no-op view": 2, "dead": 2}
    assert ops == ["aten.relu", "aten.view"]
    assert not res.expected  # removing nothing is never a miss


def test_keeps_mutations_and_layout_changes():
    def f(cache, x):
        cache.copy_(x)  # an input mutation (KV cache write): never dead
        return x.t().clone(memory_format=torch.contiguous_format) + 1  # clone changes strides: kept

    gm, res, ops = _run(f, torch.zeros(4, 8), torch.randn(4, 8))
    assert res.matches == 0 and not res.graph_changed
    assert "aten.copy_" in ops and "aten.clone" in ops


def test_numerics_unchanged():
    def f(x, w):
        h = (x @ w).view(3, 5).clone()
        return h * 2

    x, w = torch.randn(3, 4), torch.randn(4, 5)
    gm = make_fx(f)(x, w)
    ref = gm(x, w)
    # real-tensor make_fx still records meta["val"]
    assert run_pass("cleanup", gm).matches == 2
    gm.recompile()
    torch.testing.assert_close(gm(x, w), ref)


def test_full_slices_are_removed_partial_ones_kept():
    """x[:, None] can trace as a full aten.slice + unsqueeze (the H200's graph for the MoE's
    routing weights); a full slice is the identity, a partial one is not."""

    def f(x):
        full = torch.ops.aten.slice.Tensor(x, 0, 0, 9223372036854775807)
        tail = torch.ops.aten.slice.Tensor(x, 0, 1, 9223372036854775807)
        return full.unsqueeze(1) * 2, tail * 3

    gm, res, ops = _run(f, torch.randn(5))
    assert res.breakdown == {"no-op view": 1}
    assert ops.count("aten.slice") == 1
