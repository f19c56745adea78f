"""The minimax torch.compile backend: config, pass frame, pass manager, passes.

    torch.compile(model, backend="minimax", fullgraph=True, options={...})
    minimax_backend.graph_passes.compile(model, codegen="fx", strict=True)
"""

from __future__ import annotations

from typing import Any

if __name__ != "minimax_backend.graph_passes":
    # found as a top-level `graph_passes` (the repository root on sys.path): a second pass registry
    # and backend would not be the ones the "minimax" backend runs (kernels/__init__.py likewise)
    raise ImportError(f"this folder is the package minimax_backend.graph_passes; import it by that name, "
                      f"not as {__name__!r}")

from .backend import compile_reports, last_compile_report, minimax_backend
from .base import GraphPass, PassContext, PassError, PassResult, PassWarning
from .config import BackendConfig, BackendOptionError
from .manager import DEFAULT_ORDER, PassManager, register_pass, registered_passes, unregister_pass

__all__ = [
    "BackendConfig",
    "BackendOptionError",
    "DEFAULT_ORDER",
    "GraphPass",
    "PassContext",
    "PassError",
    "PassManager",
    "PassResult",
    "PassWarning",
    "compile",
    "compile_reports",
    "last_compile_report",
    "minimax_backend",
    "register_pass",
    "registered_passes",
    "unregister_pass",
]


def compile(model, *, fullgraph: bool = True, dynamic: bool | None = False, config: BackendConfig | None = None,
            **options: Any):
    """torch.compile(model, backend=minimax_backend, fullgraph=True, dynamic=False) with the
    options checked now rather than at the first call. Static shapes by default:
    sequence parallelism needs a static token count, and each CUDA-graph bucket
    is its own compile anyway (with dynamic=None, Dynamo would make the token
    count symbolic at the second size and the passes would leave the graph alone)."""
    import torch

    cfg = config.replace(**options) if config is not None else BackendConfig.from_options(options or None)
    return torch.compile(model, backend=minimax_backend, fullgraph=fullgraph, dynamic=dynamic, options=cfg)
