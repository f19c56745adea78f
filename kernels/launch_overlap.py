"""Programmatic dependent launch (PDL) for the decode MoE's chain of launches.

At decode sizes the MoE layer is five launches back to back (logits + x's quantization,
selection + alignment, gate/up, down, combine) with about a microsecond between each two,
where the GPU drains one grid before it starts the next (docs/kernel-notes.md#decode-moe-launches-overlapped-pdl).
Launched with PDL (sm_90 on), a kernel's programs may be scheduled while its predecessor
still runs. Each program first waits (griddepcontrol.wait: the predecessor has finished and
its writes are visible, so nothing it reads or writes is touched early) and then lets its own
successor be scheduled (griddepcontrol.launch_dependents). Only the launch gap overlaps, no
work. The kernel option moe_overlap=off launches them plainly.
"""

from __future__ import annotations

import torch

from .interpreter import triton_interpreting
from .options import kernel_options

try:
    import triton
    import triton.language as tl

    HAVE_TRITON = True
except ImportError:  # pragma: no cover
    HAVE_TRITON = False
try:
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

    HAVE_GDC = True
except ImportError:  # pragma: no cover - a Triton without grid dependency control
    HAVE_GDC = False


def overlap_launches(device: torch.device) -> bool:
    """Whether the decode MoE's kernels on `device` launch with PDL: moe_overlap=auto on a CUDA
    GPU of sm_90 or later with a Triton that has the instructions (never in the interpreter)."""
    return (kernel_options().moe_overlap == "auto" and HAVE_GDC and device.type == "cuda"
            and not triton_interpreting() and torch.cuda.get_device_capability(device) >= (9, 0))


def pdl_launch(on: bool) -> dict:
    """The launch keywords of a kernel that opens with wait_then_release(PDL): its PDL switch and
    Triton's programmatic dependent launch, always together (a PDL launch of a kernel that does
    not wait first could read its predecessor's output early); nothing when off."""
    return {"PDL": True, "launch_pdl": True} if on else {}


if HAVE_TRITON:

    @triton.jit
    def wait_then_release(PDL: tl.constexpr):
        """A PDL kernel's first step: wait for the predecessor, then let the successor start."""
        if PDL:
            gdc_wait()
            gdc_launch_dependents()
