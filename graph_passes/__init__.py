"""The minimax torch.compile backend: config, pass frame, pass manager, passes.

    torch.compile(model, backend="minimax", fullgraph=True, options={...})
    minimax_backend.graph_passes.compile(model, codegen="fx", strict=True)
"""

from __future__ import annotations

from typing import Any

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


def compile(model, *, fullgraph: bool = True, dynamic: bool | None = None, config: BackendConfig | None = None,
            **options: Any):
    """torch.compile(model, backend=minimax_backend, fullgraph=True) with the
    options checked now rather than at the first call."""
    import torch

    cfg = config.replace(**options) if config is not None else BackendConfig.from_options(options or None)
    return torch.compile(model, backend=minimax_backend, fullgraph=fullgraph, dynamic=dynamic, options=cfg)
