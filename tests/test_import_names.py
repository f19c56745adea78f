"""The source folders are subpackages of `minimax_backend`; under their folder names
(`kernels`, `graph_passes`: the repository root on sys.path, as under `python -m pytest`
run there) they must not load a second copy of our code. transformers imports Hugging
Face's `kernels` package (probing for it before 5.25, requiring it since); when that
imported our folder a second time, the copy registered every `minimax::` op again, and the
ops then ran the copy's code, whose kernel options `override_kernel_options` does not
change (the GPU suite's Gluon test saw the switch ignored, 2026-12-02/03). With 5.25 our
empty stand-in broke transformers' import instead (2026-12-03): the name now goes to the
package of that name found elsewhere on sys.path, if any."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


# defined in each child: the modules loaded from our kernels folder under another name (but
# the empty stand-in `kernels` itself, where no other package of that name is installed)
SECOND_COPY = """
import os, sys
def second_copy():
    import minimax_backend.kernels as ours
    folder = os.path.dirname(ours.__file__)
    return [m for m, mod in list(sys.modules.items()) if not m.startswith("minimax_backend")
            and os.path.dirname(getattr(mod, "__file__", None) or "") == folder
            and not (m == "kernels" and getattr(mod, "__path__", None) == [])]
"""


def _run_in_repo_root(code: str) -> subprocess.CompletedProcess:
    # `python -c` puts the working directory first on sys.path, as `python -m pytest` does
    return subprocess.run([sys.executable, "-c", SECOND_COPY + textwrap.dedent(code)], cwd=ROOT,
                          capture_output=True, text=True, timeout=300)


def test_kernels_imported_by_its_folder_name_registers_nothing():
    r = _run_in_repo_root("""
        import sys
        import minimax_backend.kernels
        from torch._library.custom_ops import OPDEFS
        before = {name: op._init_fn.__module__ for name, op in OPDEFS.items() if name.startswith("minimax::")}
        import kernels
        after = {name: op._init_fn.__module__ for name, op in OPDEFS.items() if name.startswith("minimax::")}
        assert after == before, f"ops redefined by the copy: {after}"
        assert not second_copy(), "modules of a second copy"
        try:
            import kernels.options
        except ModuleNotFoundError:
            print("ok")
    """)
    assert r.returncode == 0 and "ok" in r.stdout, r.stdout + r.stderr


def test_kernels_by_its_folder_name_is_hugging_faces_package_where_installed():
    """transformers >= 5.25 imports names from Hugging Face's `kernels` at import time."""
    import importlib.metadata

    try:
        importlib.metadata.distribution("kernels")
    except importlib.metadata.PackageNotFoundError:
        pytest.skip("Hugging Face's kernels package is not installed here")
    r = _run_in_repo_root("""
        import os
        import kernels
        import minimax_backend.kernels as ours
        assert os.path.dirname(kernels.__file__) != os.path.dirname(ours.__file__), kernels.__file__
        import transformers
        transformers.MiniMaxM2ForCausalLM  # imports transformers' activations, which import `kernels`
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
        assert not second_copy(), "a second copy of our kernels"
        print("ok")
    """)
    assert r.returncode == 0 and "ok" in r.stdout, r.stdout + r.stderr
