"""The one harness of the pass tests (like vLLM's TestBackend).

    res = run_pass("moe_lower", gm, tp_size=2)          one pass on an ATen graph, through the PassManager
                                                         (lint, recompile, fake values refreshed, the miss
                                                         rules), with BackendConfig options
    out, rep = compile_with(model, args, **options)      the whole backend on a model: output and compile report
    assert_ops(rep, before={...}, after={...})           op counts of the captured and the final graph
    assert_close_to_eager(model, args, out, rtol)        the compiled output against the eager model's

Passes are always run the way the backend runs them: a test that called
``apply`` directly would skip what the manager does after it.
"""

from __future__ import annotations

import torch

from minimax_backend.graph_passes.base import PassContext, PassResult
from minimax_backend.graph_passes.config import BackendConfig
from minimax_backend.graph_passes.manager import PassManager

__all__ = ["run_pass", "compile_with", "assert_ops", "assert_close_to_eager"]


def run_pass(name: str, gm: torch.fx.GraphModule, ctx: PassContext | None = None, **options) -> PassResult:
    """Run pass `name` on `gm` as the backend would; the context comes from the graph unless given
    (options tp_size / ep_size set the sizes the graph cannot tell)."""
    config = BackendConfig(**options)
    if ctx is None:
        ctx = PassContext.from_graph(config, gm)
    elif ctx.config is not config:
        ctx = PassContext(**{**ctx.__dict__, "config": config})
    (res,) = PassManager(config, order=(name,)).run(gm, ctx)
    return res


def compile_with(model, args, **options):
    """(output, compile report) of `model(*args)` under the minimax backend with these options
    (FX codegen and no CUDA graphs unless given)."""
    import minimax_backend.graph_passes as gp

    options = {"codegen": "fx", "cudagraphs": False, **options}
    with torch.no_grad():
        out = gp.compile(model, **options)(*args)
    return out, gp.last_compile_report()


def assert_ops(report: dict, before: dict | None = None, after: dict | None = None) -> None:
    """Each named op occurs this many times in the captured (before) / final (after) graph (0: absent)."""
    for stage, want in (("ops_before", before or {}), ("ops_after", after or {})):
        got = {k: report[stage].get(k, 0) for k in want}
        assert got == want, f"{stage}: {got} != {want}"


def assert_close_to_eager(model, args, out, rtol: float) -> float:
    """max |out - eager| over the largest eager value <= rtol; returns that error."""
    with torch.no_grad():
        ref = model(*args)
    ref, out = (t[0] if isinstance(t, tuple) else t for t in (ref, out))
    err = ((out.float() - ref.float()).abs().max() / ref.float().abs().max()).item()
    assert err <= rtol, f"compiled vs eager: {err:.3g} > {rtol:.3g}"
    return err
