"""The source folders are subpackages of `minimax_backend`; under their folder names
(`kernels`, `graph_passes`: the repository root on sys.path, as under `python -m pytest`
run there) they must stay empty. transformers probes for Hugging Face's `kernels`
package by importing `kernels`; when that imported our folder a second time, the copy
registered every `minimax::` op again, and the ops then ran the copy's code, whose
kernel options `override_kernel_options` does not change (the GPU suite's Gluon
test saw the switch ignored, 2026-12-02/03)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _run_in_repo_root(code: str) -> subprocess.CompletedProcess:
    # `python -c` puts the working directory first on sys.path, as `python -m pytest` does
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], cwd=ROOT, capture_output=True,
                          text=True, timeout=300)


def test_kernels_imported_by_its_folder_name_registers_nothing():
    r = _run_in_repo_root("""
        import sys
        import minimax_backend.kernels
        from torch._library.custom_ops import OPDEFS
        before = {name: op._init_fn.__module__ for name, op in OPDEFS.items() if name.startswith("minimax::")}
        import kernels
        after = {name: op._init_fn.__module__ for name, op in OPDEFS.items() if name.startswith("minimax::")}
        assert after == before, f"ops redefined by the copy: {after}"
        assert not [m for m in sys.modules if m.startswith("kernels.")], "modules of a second copy"
        try:
            import kernels.options
        except ModuleNotFoundError:
            print("ok")
    """)
    assert r.returncode == 0 and "ok" in r.stdout, r.stdout + r.stderr


def test_graph_passes_imported_by_its_folder_name_is_a_clear_error():
    r = _run_in_repo_root("import graph_passes")
    assert r.returncode != 0 and "import it by that name" in r.stderr and "minimax_backend.graph_passes" in r.stderr, \
        r.stderr


def test_transformers_probe_leaves_the_ops_alone():
    pytest.importorskip("transformers")
    r = _run_in_repo_root("""
        import sys
        import minimax_backend.kernels
        from torch._library.custom_ops import OPDEFS
        import transformers
        transformers.MiniMaxM2ForCausalLM  # its modeling module probes for `kernels`
        owners = {op._init_fn.__module__ for name, op in OPDEFS.items() if name.startswith("minimax::")}
        assert all(o.startswith("minimax_backend.kernels.") for o in owners), owners
        assert not [m for m in sys.modules if m.startswith("kernels.")], "a second copy of our kernels"
        print("ok")
    """)
    assert r.returncode == 0 and "ok" in r.stdout, r.stdout + r.stderr
