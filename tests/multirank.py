"""Run a function on N CPU ranks joined by a gloo process group (for tests).

    from multirank import run_multirank
    results = run_multirank(fn, world_size=2, args=(...), timeout=120)

`fn(rank, world_size, *args)` must be a module-level function (it is pickled
by name into the rank processes). Each rank gets a gloo default process group
on 127.0.0.1 and a free port, one intra-op thread (the test machine is small)
and the caller's environment variables, and returns a picklable value (tensors
allowed): the list of all ranks' return values comes back in rank order. An exception on any rank is raised
here as RankError naming the rank, with its traceback; a rank that does not
finish within `timeout` seconds kills all ranks and raises TimeoutError, so a
hung collective never hangs the test run.

Ranks start from a forkserver that imported torch and the package once
(a fresh spawned interpreter spends 2-4 s importing them, per rank, per
call, on the 2-core CI machine); they are still fresh processes: nothing
from the test process (compiled graphs, Dynamo caches, threads) reaches them.
"""

from __future__ import annotations

import io
import os
import queue
import socket
import time
import traceback
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

__all__ = ["run_multirank", "RankError", "free_port"]


class RankError(RuntimeError):
    def __init__(self, rank: int, tb: str):
        self.rank = rank
        super().__init__(f"rank {rank} failed:\n{tb}")


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _dumps(obj) -> bytes:
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


# imported once in the forkserver; every rank forks from there
_PRELOAD = ["torch", "torch.distributed", "torch._dynamo", "minimax_backend.model.minimax",
            "minimax_backend.graph_passes"]
_CONTEXT = None


def _context():
    global _CONTEXT
    if _CONTEXT is None:
        if "forkserver" in mp.get_all_start_methods():
            _CONTEXT = mp.get_context("forkserver")
            _CONTEXT.set_forkserver_preload(_PRELOAD)
        else:
            _CONTEXT = mp.get_context("spawn")
    return _CONTEXT


def _worker(rank, world_size, port, fn, args, kwargs, results, pg_timeout, environ):
    try:
        # the forkserver's environment is the one of its start; ranks get the caller's of now
        os.environ.clear()
        os.environ.update(environ)
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        torch.set_num_threads(1)
        dist.init_process_group("gloo", rank=rank, world_size=world_size,
                                timeout=timedelta(seconds=pg_timeout))
        try:
            out = fn(rank, world_size, *args, **kwargs)
        finally:
            dist.destroy_process_group()
        results.put((rank, "ok", _dumps(out)))
    except BaseException:  # noqa: BLE001 - report everything to the parent
        results.put((rank, "error", traceback.format_exc()))


def run_multirank(fn, world_size: int, args: tuple = (), kwargs: dict | None = None, timeout: float = 180.0):
    ctx = _context()
    results = ctx.Queue()
    port = free_port()
    procs = [
        ctx.Process(target=_worker, daemon=True,
                    args=(r, world_size, port, fn, args, kwargs or {}, results, timeout, dict(os.environ)))
        for r in range(world_size)
    ]
    for p in procs:
        p.start()
    outputs: dict[int, object] = {}
    deadline = time.monotonic() + timeout
    try:
        while len(outputs) < world_size:
            left = deadline - time.monotonic()
            if left <= 0:
                missing = sorted(set(range(world_size)) - set(outputs))
                raise TimeoutError(f"run_multirank({fn.__name__}): ranks {missing} did not finish in {timeout}s")
            try:
                rank, status, payload = results.get(timeout=min(left, 1.0))
            except queue.Empty:
                dead = [r for r, p in enumerate(procs) if not p.is_alive() and r not in outputs
                        and p.exitcode not in (0, None)]
                if dead:
                    raise RankError(dead[0], f"process exited with code {procs[dead[0]].exitcode} and no report")
                continue
            if status == "error":
                raise RankError(rank, payload)
            outputs[rank] = torch.load(io.BytesIO(payload), weights_only=False)
    finally:
        for p in procs:
            p.join(timeout=5)
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join(timeout=5)
    return [outputs[r] for r in range(world_size)]
