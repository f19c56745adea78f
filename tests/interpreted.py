"""Kernel tests that run in Triton's interpreter on the CPU (TRITON_INTERPRET=1).

Triton picks interpreter or compiler when it is imported, and the test process
has imported it long before; so a kernel test file re-runs itself in a child
started with TRITON_INTERPRET=1, where its `in_child` tests run (they skip in
the parent):

    from interpreted import INTERPRETING, in_child, run_this_file_interpreted

    @pytest.mark.skipif(INTERPRETING, reason="this is the child")
    def test_in_interpreter_child():
        run_this_file_interpreted(__file__)

The children of the files a session collects start when collection ends, one at a time on a
background thread (start_children, from conftest.py), so they use the core the parent's tests
leave idle; each test then waits for its file's child. A test collected alone runs its child
itself.
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time

import pytest

__all__ = ["INTERPRETING", "fix_old_interpreter_index", "in_child", "run_this_file_interpreted", "start_children",
           "stop_children"]

INTERPRETING = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
in_child = pytest.mark.skipif(not INTERPRETING, reason="runs in the TRITON_INTERPRET=1 child (test_in_interpreter_child)")


CHILD_TIMEOUT_S = 900
CHILD_TEST = "test_in_interpreter_child"


def _child_cmd(test_file: str) -> list[str]:
    # GPU tests have no place in an interpreter child (and skip on the CPU anyway)
    return [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", "not gpu", os.path.abspath(test_file)]


def _run_child(test_file: str, timeout: float) -> tuple[int | None, str, str]:
    """(return code, or None if it ran past timeout; stdout; stderr) of one file's child."""
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    proc = subprocess.Popen(_child_cmd(test_file), env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    _children.running = proc
    try:
        out, err = proc.communicate(timeout=timeout)
        return proc.returncode, out, err
    except subprocess.TimeoutExpired:
        proc.kill()
        out, err = proc.communicate()
        return None, out, err
    finally:
        _children.running = None


class _Children:
    """The session's children, run in collection order on one background thread."""

    def __init__(self):
        self.files: list[str] = []
        self.results: dict[str, tuple[int | None, str, str]] = {}
        self.done: dict[str, threading.Event] = {}
        self.running: subprocess.Popen | None = None
        self.stopped = False

    def run_all(self) -> None:
        for f in self.files:
            if self.stopped:
                self.results[f] = (None, "", "the session ended before this child ran")
            else:
                self.results[f] = _run_child(f, CHILD_TIMEOUT_S)
            self.done[f].set()


_children = _Children()


def start_children(items) -> None:
    """Start, in the background, the interpreter children of the collected tests among `items`
    (pytest items); nothing in a child itself."""
    if INTERPRETING or _children.files:
        return
    files = [str(item.path) for item in items if item.name == CHILD_TEST]
    if not files:
        return
    _children.files = list(dict.fromkeys(os.path.abspath(f) for f in files))
    _children.done = {f: threading.Event() for f in _children.files}
    threading.Thread(target=_children.run_all, name="interpreter-children", daemon=True).start()


def stop_children() -> None:
    """End of session: run no further child, and stop the one running (a session cut short)."""
    _children.stopped = True
    proc = _children.running
    if proc is not None and proc.poll() is None:
        proc.kill()


def run_this_file_interpreted(test_file: str, timeout: float = CHILD_TIMEOUT_S) -> None:
    """Run the file's tests (but GPU tests) in a TRITON_INTERPRET=1 child, or wait for the one
    started in the background; fail with the child's output if any test failed."""
    pytest.importorskip("triton", reason="the kernels need triton (pip install triton)")
    test_file = os.path.abspath(test_file)
    if test_file in _children.done:
        started = time.monotonic()
        # its own timeout bounds the child; this one only guards against a runner that died
        if not _children.done[test_file].wait(timeout + CHILD_TIMEOUT_S * len(_children.files)):
            pytest.fail(f"the background interpreter child of {test_file} never finished")
        rc, out, err = _children.results[test_file]
        waited = time.monotonic() - started
    else:
        rc, out, err = _run_child(test_file, timeout)
        waited = None
    tail = (out[-6000:] + "\n" + err[-3000:]).strip()
    assert rc is not None, f"the interpreter child ran past {timeout:.0f} s:\n{tail}"
    assert rc == 0, f"interpreter tests failed:\n{tail}"
    assert " passed" in out and " skipped" in out  # ran the real tests, skipped the parent's
    last = out.strip().splitlines()[-1]
    print(last if waited is None else f"{last} (waited {waited:.0f} s for the background child)")


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
