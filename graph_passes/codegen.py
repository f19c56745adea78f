"""Code generation for the rewritten ATen graph: Inductor or a plain FX run.

We own the AOT step (so the passes see the whole functional graph once), so
Inductor is entered one level down, at ``compile_fx_inner``: the function
``compile_fx`` itself calls with the ATen inference graph. Before it we do
the two things ``compile_fx`` would have done for an inference graph: its
joint-graph cleanups and marking which outputs the user sees (so outputs
keep eager strides). Both calls exist in torch 2.11 and 2.13.
"""

from __future__ import annotations

from typing import Any, Sequence

import torch
import torch.fx

from .config import BackendConfig


def generate(gm: torch.fx.GraphModule, example_inputs: Sequence[Any], config: BackendConfig):
    if config.codegen == "fx":
        gm.recompile()
        return gm  # AOT boxes and runs it as is
    return _inductor(gm, example_inputs, config)


def _inductor(gm: torch.fx.GraphModule, example_inputs: Sequence[Any], config: BackendConfig):
    from torch._inductor import config as inductor_config
    from torch._inductor.compile_fx import compile_fx_inner
    from torch._inductor.fx_passes.joint_graph import joint_graph_passes
    from torch._inductor.utils import BoxedBool

    gm = joint_graph_passes(gm)
    out = next(iter(reversed(gm.graph.nodes)))
    outs = out.args[0] if isinstance(out.args[0], (tuple, list)) else (out.args[0],)
    out.meta["user_visible_output_idxs"] = (
        [i for i, a in enumerate(outs) if isinstance(a, torch.fx.Node)] if inductor_config.keep_output_stride else []
    )
    return compile_fx_inner(
        gm,
        example_inputs,
        is_inference=True,
        cudagraphs=BoxedBool(False),  # we capture ourselves (cudagraph_capture.py), per bucket
        static_input_idxs=static_input_idxs(),
    )


def _fw_metadata():
    """AOT's view of the graph being compiled (None outside a compile)."""
    ctx = torch._guards.TracingContext.try_get()
    return getattr(ctx, "fw_metadata", None) if ctx else None


def static_input_idxs() -> list[int]:
    # Parameters/buffers are static for cudagraphs (re-recorded if they move),
    # as compile_fx's get_static_input_idxs does.
    return list(getattr(_fw_metadata(), "static_input_indices", None) or [])


def mutated_input_idxs() -> list[int]:
    """Inputs whose data the graph writes (the KV cache's trailing copy_ ops)."""
    infos = getattr(_fw_metadata(), "input_info", None) or []
    return [i for i, info in enumerate(infos) if getattr(info, "mutates_data", False)]
