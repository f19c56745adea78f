"""Recompute node.meta["val"] after a rewrite changed shapes.

Passes that change shapes (sequence parallelism shrinks the residual stream
to its token shard) leave stale fake tensors behind; later passes, the graph
dump and Inductor all read them. Re-running fake propagation over the whole
graph is cheap and cannot disagree with what the graph computes.
"""

from __future__ import annotations

import torch.fx as fx
from torch._guards import detect_fake_mode
from torch.fx.passes.fake_tensor_prop import FakeTensorProp


def refresh_fake_meta(gm: fx.GraphModule) -> None:
    inputs = [n.meta.get("val") for n in gm.graph.nodes if n.op == "placeholder"]
    fake_mode = detect_fake_mode(inputs)
    if fake_mode is None or any(v is None for v in inputs):
        return  # nothing to refresh from: the graph carried no fake values
    gm.recompile()
    with fake_mode:
        FakeTensorProp(gm, mode=fake_mode).propagate_dont_convert_inputs(*inputs)
