"""Kernel tests that run in Triton's interpreter on the CPU (TRITON_INTERPRET=1).

Triton picks interpreter or compiler when it is imported, and the test process
has imported it long before; so a kernel test file re-runs itself in a child
started with TRITON_INTERPRET=1, where its `in_child` tests run (they skip in
the parent):

    from interpreted import INTERPRETING, in_child, run_this_file_interpreted

    @pytest.mark.skipif(INTERPRETING, reason="this is the child")
    def test_in_interpreter_child():
        run_this_file_interpreted(__file__)

The child is the test's background command (tests/background.py): the children of the files a
session collects start when collection ends, one at a time on a background thread, so they use the
core the parent's tests leave idle; each test then waits for its file's child. A test collected
alone runs its child itself.
"""

from __future__ import annotations

import os
import sys

import pytest

import background

__all__ = ["CHILD_TEST", "INTERPRETING", "fix_old_interpreter_index", "in_child", "register_child",
           "run_this_file_interpreted"]

INTERPRETING = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
in_child = pytest.mark.skipif(not INTERPRETING, reason="runs in the TRITON_INTERPRET=1 child (test_in_interpreter_child)")


CHILD_TEST = "test_in_interpreter_child"


def register_child(test_file) -> None:
    """The file's interpreter child as its test's background command (tests/background.py)."""
    def make(out):
        # GPU tests have no place in an interpreter child (and skip on the CPU anyway)
        cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", "not gpu",
               os.path.abspath(str(test_file))]
        return cmd, {**os.environ, "TRITON_INTERPRET": "1"}

    background.register(test_file, CHILD_TEST, make)


def run_this_file_interpreted(test_file: str) -> None:
    """Run the file's tests (but GPU tests) in a TRITON_INTERPRET=1 child, or wait for the one
    started in the background; fail with the child's output if any test failed."""
    pytest.importorskip("triton", reason="the kernels need triton (pip install triton)")
    register_child(test_file)
    run = background.result(test_file, CHILD_TEST)
    assert run.returncode == 0, f"interpreter tests failed:\n{run.tail()}"
    assert " passed" in run.stdout and " skipped" in run.stdout  # ran the real tests, skipped the parent's
    print(run.stdout.strip().splitlines()[-1])


def fix_old_interpreter_index() -> None:
    """Triton 3.6's interpreter (the GPU box's Triton) turns a runtime int argument into a
    one-element array, and its `__index__` (used by `range(0, n, step)` in a kernel) calls
    int() on it, which NumPy 2 refuses for a 1-D array. Triton 3.9 squeezes it first; give
    older interpreters the same. Only the interpreter is touched, never a compiled kernel."""
    try:
        from triton.runtime import interpreter as ti
    except ImportError:
        return
    original = getattr(ti, "_patch_lang_tensor", None)
    if original is None or getattr(original, "_squeezes_index", False):
        return

    def patch_lang_tensor(tensor, scope):
        original(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.squeeze()))

    patch_lang_tensor._squeezes_index = True
    ti._patch_lang_tensor = patch_lang_tensor
