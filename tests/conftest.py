"""Shared pytest setup.

* `tests/` is on sys.path, so tests can `from multirank import run_multirank`
  (the gloo multi-rank launcher, see tests/multirank.py).
* Tests marked `gpu` / `multigpu` skip when CUDA (or enough GPUs) is missing.
* Importing minimax_backend.kernels registers the `minimax::` custom ops once.
* Under TRITON_INTERPRET=1, older Triton interpreters get the NumPy 2 fix of
  tests/interpreted.py (fix_old_interpreter_index).
* Once collected, the tests' background commands start (tests/background.py): the
  interpreter children of the kernel test files (tests/interpreted.py) and the tools'
  dry runs that register one.
"""

from __future__ import annotations

import os
import stat
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import minimax_backend.kernels  # noqa: E402,F401  (registers minimax:: ops)
import background  # noqa: E402
from interpreted import CHILD_TEST, INTERPRETING, fix_old_interpreter_index, register_child  # noqa: E402

if INTERPRETING:
    fix_old_interpreter_index()


def pytest_collection_modifyitems(config, items):
    n_gpu = torch.cuda.device_count() if torch.cuda.is_available() else 0
    for item in items:
        if "gpu" in item.keywords and n_gpu == 0:
            item.add_marker(pytest.mark.skip(reason="needs a CUDA GPU"))
        if "multigpu" in item.keywords and n_gpu < 2:
            item.add_marker(pytest.mark.skip(reason="needs two or more CUDA GPUs"))


def pytest_collection_finish(session):
    if INTERPRETING or session.config.option.collectonly:
        return
    for item in session.items:
        if item.name == CHILD_TEST:
            register_child(item.path)
    background.start(session.items)


def pytest_sessionfinish(session, exitstatus):
    background.stop()


# ------------------------------------------------------------- tiny configs
# Plain functions (not fixtures) so that spawned multi-rank workers can use them too.
def tiny_m3_config(**overrides):
    """A 3-layer MiniMax-M3 in miniature: 1 dense + 2 MoE layers (8 experts, top-2,
    shared expert), per-head Gemma QK norm, SwiGLU-OAI, partial RoPE, sparse-attention
    indexer weights on the MoE layers, one MTP module. head_dim 128 and 256-wide
    intermediates keep FP8 shards block-aligned at TP 2."""
    from minimax_backend.model.config import MiniMaxConfig

    cfg = dict(
        model_type="minimax_m3_text", vocab_size=512, hidden_size=256, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=2, head_dim=128, rotary_dim=64,
        rope_theta=5_000_000.0, max_position_embeddings=4096,
        intermediate_size=256, dense_intermediate_size=512, shared_intermediate_size=256, n_shared_experts=1,
        num_local_experts=8, num_experts_per_tok=2, routed_scaling_factor=2.0,
        mlp_layer_types=("dense", "moe", "moe"), sparse_attention_layers=(1, 2),
        index_n_heads=2, index_head_dim=128, num_mtp_modules=1,
    )
    cfg.update(overrides)
    return MiniMaxConfig(**cfg)


def tiny_m2_config(**overrides):
    """A 2-layer MiniMax-M2 in miniature: plain RMSNorm, QK norm over the whole
    projection (per_layer), SiLU experts, no shared expert, no dense layers."""
    from minimax_backend.model.config import MiniMaxConfig

    cfg = dict(
        model_type="minimax_m2", vocab_size=512, hidden_size=256, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=64, rotary_dim=32,
        rope_theta=5_000_000.0, max_position_embeddings=4096,
        use_gemma_norm=False, qk_norm_type="per_layer", hidden_act="silu",
        intermediate_size=128, dense_intermediate_size=0, shared_intermediate_size=0, n_shared_experts=0,
        num_local_experts=8, num_experts_per_tok=2, routed_scaling_factor=1.0,
        mlp_layer_types=("moe", "moe"), sparse_attention_layers=(), num_mtp_modules=0,
    )
    cfg.update(overrides)
    return MiniMaxConfig(**cfg)


# ------------------------------------------------------- fake process group
@pytest.fixture(scope="module")
def fake_tp2():
    """A 2-rank `fake` process group in this process (rank 0): collectives trace and compile,
    nothing moves. Yields the group's name. Module scope: one per test file."""
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if dist.is_initialized():
        pytest.skip("a process group is already initialized in this process")
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    yield dist.group.WORLD.group_name
    dist.destroy_process_group()


def write_fake_nvidia_smi(folder) -> None:
    """An `nvidia-smi` script in `folder` (put it first on PATH): prints a sample every 20 ms
    (1500 MHz, 690.5 W) until stopped, and records its arguments in folder/args."""
    script = folder / "nvidia-smi"
    script.write_text('#!/bin/sh\necho "$@" > "$(dirname "$0")/args"\n'
                      'while true; do date "+%Y/%m/%d %H:%M:%S.%3N, 1500, 690.5"; sleep 0.02; done\n')
    script.chmod(script.stat().st_mode | stat.S_IEXEC)


@pytest.fixture
def fake_nvidia_smi(tmp_path, monkeypatch):
    """An `nvidia-smi` first on PATH (tools/gpu_power.py tests), see write_fake_nvidia_smi."""
    write_fake_nvidia_smi(tmp_path)
    monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ['PATH']}")
    return tmp_path
