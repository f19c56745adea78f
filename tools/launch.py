"""Start the tensor-parallel ranks for a job, or join the ones torchrun started.

`run_on_ranks(job, world_size, device, args)` calls `job(rank, world_size, args)`
once per rank with a process group already initialized:

- under torchrun (RANK / WORLD_SIZE set) the current process is one rank and
  joins torchrun's group, so the same command runs across nodes;
- otherwise it spawns `world_size` local processes on 127.0.0.1 (gloo on CPU,
  NCCL on GPUs), each with its own rank.

A rank that raises ends the whole job with that rank's traceback; the group
is created with a timeout so a broken rank never hangs the others forever.
On GPUs a finished rank exits its process right after the job (see
_run_and_leave): call run_on_ranks last.
"""

from __future__ import annotations

import datetime
import multiprocessing.util
import os
import socket
import sys
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

Job = Callable[[int, int, Any], Any]

# Long enough for a first Inductor compile on a 2-core machine, short enough
# that a rank that died without raising does not keep the others waiting.
GROUP_TIMEOUT = datetime.timedelta(minutes=10)


def under_torchrun() -> bool:
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def backend_for(device: str) -> str:
    return "nccl" if device == "cuda" else "gloo"


def _init_group(rank: int, world_size: int, device: str) -> None:
    if device == "cuda":
        local_rank = int(os.environ.get("LOCAL_RANK", rank))
        if local_rank >= torch.cuda.device_count():
            raise RuntimeError(
                f"rank {rank} wants GPU {local_rank} but only "
                f"{torch.cuda.device_count()} are visible; lower --tp"
            )
        torch.cuda.set_device(local_rank)
    dist.init_process_group(
        backend_for(device), rank=rank, world_size=world_size, timeout=GROUP_TIMEOUT
    )


def _run_and_leave(job: Job, rank: int, world_size: int, device: str, args: Any,
                   spawned_child: bool = False) -> None:
    """Run the job, then leave the group together with the other ranks.

    Ranks meet at a barrier first: a rank tearing the group down while another
    still finishes (rank 0 writes the JSON) crashed gloo once on CI
    ("terminate called without an active exception", 2026-11-30).

    On GPUs the process then exits at once, without destroy_process_group():
    after NCCL ran inside CUDA graphs (or symmetric memory was used) the
    teardown hung on the H200 box (2026-11-30: `run --device cuda` under
    torchrun printed its summary, then never exited). The benchmarks do the
    same. A rank process we spawned on the CPU exits the same way: gloo's
    teardown still aborted a finished rank now and then after the barrier (CI,
    2026-12-02: the job done and its JSON written, then SIGABRT). A rank that
    is the caller's own process (one rank, or torchrun) on the CPU destroys
    the group and returns. On an error the exception propagates as usual (CPU:
    after the group is destroyed; GPU: without destroying it, for the same
    reason)."""
    try:
        job(rank, world_size, args)
    except BaseException:
        if device != "cuda":
            dist.destroy_process_group()
        raise
    if device == "cuda":
        dist.barrier(device_ids=[torch.cuda.current_device()])
        torch.cuda.synchronize()
    else:
        dist.barrier()
    if device == "cuda" or spawned_child:
        sys.stdout.flush()
        sys.stderr.flush()
        # os._exit skips the interpreter's exit hooks: release the multiprocessing semaphores
        # this rank made (the job's compiles make two) as they would, else the parent's resource
        # tracker warns about "leaked semaphore objects" after the job's summary
        getattr(multiprocessing.util, "_run_finalizers", lambda minpriority: None)(0)
        os._exit(0)
    dist.destroy_process_group()


def _spawned_rank(rank: int, world_size: int, port: int, device: str, job: Job, args: Any,
                  spawned_child: bool = True):
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    _init_group(rank, world_size, device)
    _run_and_leave(job, rank, world_size, device, args, spawned_child)


def run_on_ranks(job: Job, world_size: int, device: str, args: Any) -> None:
    if under_torchrun():
        env_world = int(os.environ["WORLD_SIZE"])
        if env_world != world_size:
            raise SystemExit(
                f"torchrun started {env_world} ranks but --tp is {world_size}; "
                "the world size must equal the TP size"
            )
        rank = int(os.environ["RANK"])
        _init_group(rank, world_size, device)
        _run_and_leave(job, rank, world_size, device, args)
        return
    if device == "cuda" and torch.cuda.device_count() < world_size:
        raise SystemExit(
            f"--tp {world_size} needs {world_size} GPUs, "
            f"{torch.cuda.device_count()} are visible"
        )
    port = free_port()
    if world_size == 1:
        # One rank needs no child process; a group of one keeps the code path the same.
        _spawned_rank(0, 1, port, device, job, args, spawned_child=False)
        return
    mp.start_processes(
        _spawned_rank,
        args=(world_size, port, device, job, args),
        nprocs=world_size,
        join=True,
        start_method="spawn",
    )
