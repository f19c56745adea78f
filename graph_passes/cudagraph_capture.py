"""CUDA-graph capture of the generated code, one graph per token count.

After the passes and code generation the backend wraps the compiled function
in ``CapturedGraphs``. Each distinct input shape ("token count": the element
count of the first integer input, i.e. ``input_ids``) at or below the largest
of ``cudagraph_buckets`` is captured once, on its first call, and replayed
afterwards (per kernel-switch setting: a call under other kernel options,
kernels/options.py, is captured again); larger ones run the compiled code
directly. Callers pad their inputs to a bucket (``graph_passes/bucketing.py``)
so that a handful of graphs covers every size; a size that is not a bucket is
still captured, with a warning, as each distinct size costs a compile and a graph.

One capture:
  1. inputs that change between calls (ids, positions: not parameters or
     buffers) get static copies; parameters / buffers (weights, the KV cache)
     are used in place, and their addresses are checked at every replay
     (moved: captured again);
  2. two warm-up runs on a side stream, outside the capture: NCCL
     communicators, the GEMM-RS symmetric-memory workspaces and Triton
     autotuning are set up there, so nothing is allocated or rendezvoused
     while capturing;
  3. capture into the pool shared by every graph of the device (buckets
     reuse each other's memory: only one of them runs at a time).
Collectives (NCCL, symmetric memory) are captured with the rest: the whole
forward, attention included, is one graph (our attention is SDPA over a
static cache, which captures; no split is needed).

The graphs write into their own output buffers; by default each replay
returns copies (``cudagraph_copy_outputs``), so results of earlier calls stay
valid. Replays, warm-ups and the first eager run all do the same writes to the
KV cache (the same values at the same slots), so warming up is harmless for
our model; a model whose forward is not repeatable (e.g. a step counter)
must not be captured.
"""

from __future__ import annotations

import logging
import time
import warnings
from typing import Any, Callable, Sequence

import torch

from ..kernels.options import kernel_options
from .bucketing import effective_buckets

log = logging.getLogger("minimax")

__all__ = ["CapturedGraphs", "CudaOps", "capture_available", "pool_bytes", "report_entry", "token_count", "wrap"]

WARMUP_RUNS = 2
_PTRS_EQUAL = getattr(torch._C, "_tensors_data_ptrs_at_indices_equal", None)  # CUDA builds
_POOLS: dict[int, Any] = {}  # device index -> graph pool handle shared by all captures


def report_entry(skipped: str | None = None) -> dict[str, Any]:
    """The compile report's "cudagraphs" record: enabled unless `skipped` says why not."""
    return {"enabled": skipped is None, "skipped": skipped, "captured": [], "uncaptured": [], "pool_bytes": 0}


def capture_available(example_inputs: Sequence[Any]) -> tuple[bool, str | None]:
    """Whether graphs of these inputs can be captured, and if not why (tests on CPU replace this)."""
    if not torch.cuda.is_available():
        return False, "no CUDA device: CUDA graphs not captured, the compiled code runs directly"
    if not any(isinstance(a, torch.Tensor) and a.is_cuda for a in example_inputs):
        return False, "the graph's inputs are not on a CUDA device: CUDA graphs not captured"
    return True, None


def shared_pool(device: torch.device):
    """The device's graph pool, with a tiny anchor graph captured into it and kept for good.

    The allocator drops a pool's use count to zero when every graph captured
    into it is gone (e.g. after torch._dynamo.reset()), and then refuses new
    captures into it (an internal assert); the anchor keeps the count above zero.
    """
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _POOLS:
        pool = torch.cuda.graph_pool_handle()
        anchor = torch.cuda.CUDAGraph()
        with torch.cuda.device(index), torch.cuda.graph(anchor, pool=pool, capture_error_mode="thread_local"):
            torch.zeros(1, device=torch.device("cuda", index)).add_(1)
        _POOLS[index] = (pool, anchor)
    return _POOLS[index][0]


def pool_bytes(device: torch.device) -> int:
    """Bytes of the segments the shared graph pool of `device` holds (0 before any capture)."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _POOLS:
        return 0
    pool = _POOLS[index][0]
    total = 0
    for seg in torch.cuda.memory_snapshot():
        if seg.get("device") == index and tuple(seg.get("segment_pool_id", ())) == tuple(pool):
            total += seg["total_size"]
    return total


def token_count(args: Sequence[Any], dynamic_idxs: Sequence[int]) -> int | None:
    """Element count of the first integer tensor among the per-call inputs (input_ids)."""
    tensors = [args[i] for i in dynamic_idxs if isinstance(args[i], torch.Tensor)]
    for t in tensors:
        if not t.is_floating_point() and not t.is_complex() and t.dtype != torch.bool:
            return t.numel()
    return tensors[0].shape[0] if tensors and tensors[0].dim() else None


class CudaOps:
    """The CUDA side of a capture (tests on CPU put a simulation in its place)."""

    @staticmethod
    def capture(call: Callable[[], Any], device: torch.device):
        side = torch.cuda.Stream(device)
        side.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(side):
            for _ in range(WARMUP_RUNS):
                call()
        torch.cuda.current_stream(device).wait_stream(side)
        torch.cuda.synchronize(device)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=shared_pool(device), capture_error_mode="thread_local"):
            outputs = call()
        torch.cuda.synchronize(device)
        return graph, outputs

    pool_bytes = staticmethod(pool_bytes)


class _Graph:
    """One captured shape: the graph, its static inputs and outputs."""

    def __init__(self, graph, inputs, outputs, static_ptrs, seconds):
        self.graph = graph
        self.inputs = inputs  # per-call inputs' static copies, by argument index
        self.outputs = outputs
        self.static_ptrs = static_ptrs  # by argument index: data_ptr of each parameter / buffer at capture, else None
        self.seconds = seconds
        self.replays = 0


class CapturedGraphs:
    """Boxed callable (takes the argument list) around a compiled function."""

    _boxed_call = True
    device_ops = CudaOps  # the CUDA calls (a simulation in the CPU tests)

    def __init__(self, run: Callable[[list], Any], example_inputs: Sequence[Any], static_idxs: Sequence[int],
                 mutated_idxs: Sequence[int], buckets: Sequence[int], copy_outputs: bool, report: dict):
        self.run = run
        self.static = set(static_idxs)
        self.dynamic = [i for i, a in enumerate(example_inputs)
                        if i not in self.static and isinstance(a, torch.Tensor)]
        self.mutated_dynamic = [i for i in mutated_idxs if i in self.dynamic]
        self.static_list = sorted(i for i in self.static if isinstance(example_inputs[i], torch.Tensor))
        self.buckets = tuple(buckets)
        self.copy_outputs = copy_outputs
        self.graphs: dict[tuple, _Graph] = {}  # by (input shapes, kernel options)
        self.uncaptured: set[tuple] = set()
        self.report = report.setdefault("cudagraphs", report_entry())

    # ------------------------------------------------------------ calling
    def __call__(self, args: list):
        key = tuple(tuple(args[i].shape) for i in self.dynamic)
        # The kernel switches are read while a graph is captured and frozen in it: a call under
        # other switches (override_kernel_options) gets its own graph, not the first one's kernels.
        graph = self.graphs.get((key, kernel_options()))
        if graph is None:
            if key in self.uncaptured or not self._wants_capture(args, key):
                return self.run(args)
            graph = self._capture(args, key)
        elif self._static_moved(args, graph):
            log.warning("minimax: a parameter or buffer moved since capture (tokens %s): capturing again",
                        token_count(args, self.dynamic))
            graph = self._capture(args, key)
        for i, buf in graph.inputs.items():
            if buf.data_ptr() != args[i].data_ptr():
                buf.copy_(args[i])
        graph.graph.replay()
        graph.replays += 1
        for i in self.mutated_dynamic:  # mutations of per-call inputs land in our copy: hand them back
            args[i].copy_(graph.inputs[i])
        args.clear()  # boxed convention: the callee owns the list
        if self.copy_outputs:
            return [o.clone() if isinstance(o, torch.Tensor) else o for o in graph.outputs]
        return list(graph.outputs)

    def _wants_capture(self, args, key) -> bool:
        tokens = token_count(args, self.dynamic)
        if tokens is None or tokens > self.buckets[-1]:
            why = "no per-call tensor input" if tokens is None else f"{tokens} tokens > largest bucket {self.buckets[-1]}"
            log.info("minimax: no CUDA graph for input shapes %s (%s): runs the compiled code directly", key, why)
            self.uncaptured.add(key)
            self.report["uncaptured"].append({"tokens": tokens, "reason": why})
            return False
        if tokens not in self.buckets:
            warnings.warn(
                f"minimax: capturing a CUDA graph for {tokens} tokens, which is not one of cudagraph_buckets "
                f"{list(self.buckets)}; every distinct size costs a compile and a graph: pad inputs to a bucket "
                "(minimax_backend.graph_passes.bucketing)", stacklevel=3)
        return True

    def _static_moved(self, args, graph: _Graph) -> bool:
        # Every replay checks hundreds of weights: torch's C++ check when the build has it.
        if _PTRS_EQUAL is not None:
            return not _PTRS_EQUAL(args, graph.static_ptrs, self.static_list)
        return any(args[i].data_ptr() != graph.static_ptrs[i] for i in self.static_list)

    # ------------------------------------------------------------ capture
    def _capture(self, args: list, key: tuple) -> _Graph:
        tokens = token_count(args, self.dynamic)
        device = next(args[i].device for i in self.dynamic)
        log.info("minimax: capturing a CUDA graph for %s tokens (input shapes %s) ...", tokens, key)
        t0 = time.perf_counter()
        inputs = {i: args[i].clone() for i in self.dynamic}
        frozen = [inputs.get(i, a) for i, a in enumerate(args)]  # the caller's list is cleared after the call

        def call():
            return self.run(list(frozen))

        graph, outputs = self.device_ops.capture(call, device)
        seconds = time.perf_counter() - t0
        static = set(self.static_list)
        ptrs = [args[i].data_ptr() if i in static else None for i in range(len(args))]
        entry = _Graph(graph, inputs, list(outputs), ptrs, seconds)
        self.graphs[(key, kernel_options())] = entry
        pool = self.device_ops.pool_bytes(device)
        self.report["pool_bytes"] = pool
        self.report["captured"].append({"tokens": tokens, "shapes": [list(s) for s in key], "seconds": seconds})
        log.info("minimax: captured %s tokens in %.2fs; shared graph pool now %.1f MiB", tokens, seconds, pool / 2**20)
        return entry


def wrap(compiled, example_inputs: Sequence[Any], static_idxs: Sequence[int], mutated_idxs: Sequence[int],
         config, report: dict, bucket_multiple: int = 1):
    """The compiled function, captured per shape when CUDA is there; else as is (noted in the report)."""
    ok, why = capture_available(example_inputs)
    if not ok:
        report["cudagraphs"] = report_entry(skipped=why)
        log.info("minimax: cudagraphs: %s", why)
        return compiled
    boxed = getattr(compiled, "_boxed_call", False)
    run = compiled if boxed else (lambda args: compiled(*args))
    buckets = effective_buckets(config.cudagraph_buckets, bucket_multiple)
    wrapped = CapturedGraphs(run, example_inputs, static_idxs, mutated_idxs, buckets,
                             config.cudagraph_copy_outputs, report)
    report["cudagraphs"].update(buckets=list(buckets), static_inputs=len(wrapped.static_list),
                                per_call_inputs=len(wrapped.dynamic))
    if wrapped.mutated_dynamic:
        log.warning("minimax: the graph writes %d per-call input(s); each replay copies them back",
                    len(wrapped.mutated_dynamic))
    return wrapped
