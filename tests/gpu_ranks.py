"""Spawn NCCL ranks on the local GPUs and run one check function in each.

The ranks end with os._exit after reporting: destroy_process_group() hung on
the GPU box once symmetric memory had been used (2026-11-30).
"""

from __future__ import annotations

import importlib
import os
import queue
import socket
import traceback

import torch
import torch.distributed as dist


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank, world, port, module, check_name, results):
    status, payload = "ok", None
    try:
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
        os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")
        torch.cuda.set_device(rank)
        dist.init_process_group("nccl", rank=rank, world_size=world)
        import minimax_backend.kernels  # noqa: F401

        payload = getattr(importlib.import_module(module), check_name)(rank, world, dist.group.WORLD.group_name)
        torch.cuda.synchronize()
        dist.barrier()
    except BaseException:  # noqa: BLE001
        status, payload = "error", traceback.format_exc()
    results.put((rank, status, payload))
    results.close()
    results.join_thread()
    os._exit(0)  # no destroy_process_group (see module docstring)


def run_on_gpus(module: str, check_name: str, world: int = 2, timeout: float = 300.0):
    """Run `module.check_name(rank, world, group_name)` on `world` GPUs over NCCL; the ranks' results."""
    ctx = torch.multiprocessing.get_context("spawn")
    results = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_worker, args=(r, world, port, module, check_name, results), daemon=True)
             for r in range(world)]
    for p in procs:
        p.start()
    out = {}
    try:
        while len(out) < world:
            try:
                rank, status, payload = results.get(timeout=timeout)
            except queue.Empty:
                raise TimeoutError(f"{check_name}: ranks {sorted(set(range(world)) - set(out))} did not report")
            if status == "error":
                raise AssertionError(f"rank {rank} failed:\n{payload}")
            out[rank] = payload
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
    return [out[r] for r in range(world)]
