"""The tensors of a model that a checkpoint fills or is written from.

Every parameter and persistent buffer (each once, however many names share
it) with its ``load_plan`` (model/weights.py), which names the checkpoint
tensors, or slices of them, it is made of; and the names of those without a
plan. The loader and the writer both walk this list.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from .weights import LoadPlan, get_plan

__all__ = ["PlanTarget", "plan_targets"]


@dataclass
class PlanTarget:
    name: str  # the model's own name for the tensor
    tensor: torch.Tensor
    plan: LoadPlan


def plan_targets(model: nn.Module) -> tuple[list[PlanTarget], list[str]]:
    """Every parameter and persistent buffer (deduplicated), and those without a plan."""
    targets, no_plan, seen = [], [], set()
    for name, p in model.named_parameters(remove_duplicate=True):
        if id(p) in seen:
            continue
        seen.add(id(p))
        plan = get_plan(p)
        (targets.append(PlanTarget(name, p, plan)) if plan is not None else no_plan.append(name))
    for mod_name, mod in model.named_modules(remove_duplicate=True):
        for bname, b in mod._buffers.items():
            if b is None or bname in mod._non_persistent_buffers_set or id(b) in seen:
                continue
            seen.add(id(b))
            name = f"{mod_name}.{bname}" if mod_name else bname
            plan = get_plan(b)
            (targets.append(PlanTarget(name, b, plan)) if plan is not None else no_plan.append(name))
    return targets, no_plan
