"""The ``minimax`` torch.compile backend.

    torch.compile(model, backend="minimax", fullgraph=True, options={...})

Dynamo hands us its captured graph (``options`` arrive as the ``options=``
keyword when non-empty). We then
  1. trace it with AOTAutograd into a functional ATen inference graph
     (Inductor's decompositions, so both codegens see the same ops; input
     mutations such as the KV-cache writes stay in the graph as trailing
     ``copy_`` ops),
  2. run the PassManager on the whole graph, recording a dump stage per pass,
  3. generate code: Inductor (``compile_fx_inner``) or the plain GraphModule.

The report of each compile is kept (``last_compile_report()``) and put on the
graph modules as ``gm.meta["minimax_report"]``.
"""

from __future__ import annotations

import copy
import logging
import time
import warnings
from typing import Any, Sequence

import torch
import torch.fx

from . import cudagraph_capture
from ..kernels.options import kernel_options
from .base import PassContext, PassError
from .codegen import generate, mutated_input_idxs, static_input_idxs
from .config import BackendConfig, BackendOptionError
from .manager import PassManager, make_dumper
from .op_counts import op_counts

log = logging.getLogger("minimax")

_REPORTS: list[dict[str, Any]] = []


def last_compile_report() -> dict[str, Any] | None:
    """The report of the latest compile in this process (None before any)."""
    return copy.deepcopy(_REPORTS[-1]) if _REPORTS else None


def compile_reports() -> list[dict[str, Any]]:
    """Every compile of this process, oldest first (recompiles add entries)."""
    return copy.deepcopy(_REPORTS)


def minimax_backend(gm: torch.fx.GraphModule, example_inputs: Sequence[Any], options=None, **kwargs):
    """torch.compile backend: AOT ATen graph -> passes -> Inductor / FX."""
    mode = kwargs.pop("mode", None)
    if kwargs:
        raise BackendOptionError(f"minimax backend got unexpected arguments {sorted(kwargs)}; pass options={{...}}")
    if mode is not None:
        warnings.warn(f"minimax backend ignores mode={mode!r}; use options={{...}}", stacklevel=2)
    config = BackendConfig.from_options(options)
    manager = PassManager(config)  # fails early on 'on' for a pass not implemented yet
    if config.cudagraphs:
        _allow_one_compile_per_bucket(config)
    if config.module_dict_guards:
        _module_dict_guards()
    compile_index = len(_REPORTS)

    def inference_compiler(aten_gm: torch.fx.GraphModule, aten_inputs: Sequence[Any]):
        report = _run_pipeline(aten_gm, aten_inputs, config, manager, compile_index)
        t0 = time.perf_counter()
        compiled = generate(aten_gm, aten_inputs, config)
        report["timings_s"]["codegen"] = time.perf_counter() - t0
        log.info("minimax: %s codegen done in %.2fs", config.codegen, report["timings_s"]["codegen"])
        if not config.cudagraphs:
            report["cudagraphs"] = cudagraph_capture.report_entry(skipped="cudagraphs=False")
            return compiled
        return cudagraph_capture.wrap(compiled, aten_inputs, static_input_idxs(), mutated_input_idxs(), config,
                                      report, _bucket_multiple(report))

    def training_compiler(aten_gm, aten_inputs):
        raise PassError("the minimax backend compiles inference graphs only")

    from torch._dynamo.backends.common import aot_autograd
    from torch._inductor.decomposition import select_decomp_table

    t0 = time.perf_counter()
    # no_grad: always take AOT's inference path (no joint graph), even when the
    # caller forgot torch.no_grad() and the parameters require grad.
    with torch.no_grad():
        compiled = aot_autograd(
            fw_compiler=training_compiler,
            inference_compiler=inference_compiler,
            decompositions=select_decomp_table(),
            keep_inference_input_mutations=True,
        )(gm, example_inputs)
    if len(_REPORTS) > compile_index:
        _REPORTS[-1]["timings_s"]["total"] = time.perf_counter() - t0
        gm.meta["minimax_report"] = _REPORTS[-1]
    return compiled


def _allow_one_compile_per_bucket(config: BackendConfig) -> None:
    """Each bucket size is a recompile (static shapes); Dynamo's default limit (8)
    would silently run the sizes after the 8th uncompiled. Raise it once."""
    need = len(config.cudagraph_buckets) + 8
    for name in ("recompile_limit", "cache_size_limit"):  # the newer name first
        current = getattr(torch._dynamo.config, name, None)
        if current is None:
            continue
        if current < need:
            setattr(torch._dynamo.config, name, need)
            log.info("minimax: torch._dynamo.config.%s %d -> %d (one compile per CUDA-graph bucket)",
                     name, current, need)
        return


def _module_dict_guards() -> None:
    """Guards on parameters by module dict tags (BackendConfig.module_dict_guards). Dynamo
    reads the flag when it builds this compile's guards, after the backend returns."""
    flag = "use_recursive_dict_tags_for_guards"
    if getattr(torch._dynamo.config, flag, None) is False:
        setattr(torch._dynamo.config, flag, True)
        log.info("minimax: torch._dynamo.config.%s -> True (parameters checked per module tree, "
                 "not per tensor: module_dict_guards)", flag)


def _bucket_multiple(report: dict[str, Any]) -> int:
    """Under sequence parallelism buckets are rounded up to a multiple of the TP size."""
    sp = next((p for p in report["passes"] if p["name"] == "sequence_parallel"), None)
    return report["tp_size"] if sp and sp.get("enabled") and sp.get("matches") else 1


def _run_pipeline(aten_gm, aten_inputs, config: BackendConfig, manager: PassManager, index: int) -> dict[str, Any]:
    t0 = time.perf_counter()
    ctx = PassContext.from_graph(config, aten_gm, aten_inputs)
    # The dumper claims its own folder under dump_dir (one per compile and rank).
    dumper = make_dumper(config.dump_dir, f"compile{index}")
    dump_dir = getattr(dumper, "dir", None) or config.dump_dir
    ops_before = op_counts(aten_gm)
    dumper.record("captured", aten_gm, note=f"{ctx.describe()}, codegen={config.codegen}")
    n_nodes = len(aten_gm.graph.nodes)
    log.info("minimax: compile %d: %d-node ATen graph, %s, codegen=%s", index, n_nodes, ctx.describe(), config.codegen)
    report: dict[str, Any] = {
        "index": index,
        "passes": [],
        "ops_before": ops_before,
        "ops_after": {},
        "dump_dir": str(dump_dir) if dump_dir else None,
        "dump_index": None,
        "config": config.to_dict(),
        "config_hash": config.stable_hash(),
        "pipeline_hash": manager.stable_hash(),
        "kernel_options": kernel_options().to_dict(),
        "tp_size": ctx.tp_size,
        "ep_size": ctx.ep_size,
        "rank": ctx.rank,
        "world_size": ctx.world_size,
        "codegen": config.codegen,
        "torch_version": torch.__version__,
        "timings_s": {},
    }
    _REPORTS.append(report)
    aten_gm.meta["minimax_report"] = report
    results = manager.run(aten_gm, ctx, dumper)
    report["passes"] = [r.to_dict() for r in results]
    dumper.record("final", aten_gm)
    report["ops_after"] = op_counts(aten_gm)
    index_path = dumper.finish()
    report["dump_index"] = str(index_path) if index_path else None
    report["timings_s"]["passes"] = time.perf_counter() - t0
    return report
