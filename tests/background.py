"""Child processes that tests wait for, started ahead of them.

A test that runs a long command in a child process (a tool's dry run under Triton's interpreter, a
kernel test file's interpreter child) registers the command when its module is imported:

    background.register(__file__, "test_bench_dry_run",
                        lambda out: ([sys.executable, "-m", "...", "--json", str(out / "b.json")], env))

    def test_bench_dry_run():
        run = background.result(__file__, "test_bench_dry_run")
        assert run.returncode == 0, run.tail()
        data = json.loads((run.out / "b.json").read_text())

When collection ends, conftest.py starts the registered commands of the collected tests (`start`),
one at a time on a background thread in collection order, so they use the core the parent's tests
leave idle; each test then waits for its own. A test whose command was not started ahead (it was
collected alone, or the session is a child itself) runs the command when it asks for the result.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

__all__ = ["Run", "register", "result", "start", "stop"]

DEFAULT_TIMEOUT_S = 900

# make(out) -> (command, environment); out: an empty folder of the run's own
MakeCommand = Callable[[Path], "tuple[list[str], dict[str, str]]"]


@dataclass
class Run:
    """One finished command: its return code (None: it ran past its timeout and was killed), its
    output, and the folder it was given for its files."""

    returncode: int | None
    stdout: str
    stderr: str
    out: Path
    timeout: float

    def tail(self) -> str:
        head = f"ran past {self.timeout:.0f} s and was killed\n" if self.returncode is None else ""
        return (head + self.stdout[-6000:] + "\n" + self.stderr[-3000:]).strip()


def _key(test_file, test_name: str) -> tuple[str, str]:
    return os.path.abspath(str(test_file)), test_name


_commands: dict[tuple[str, str], tuple[MakeCommand, float]] = {}


def register(test_file, test_name: str, make: MakeCommand, timeout: float = DEFAULT_TIMEOUT_S) -> None:
    """The command of test `test_name` of file `test_file` (idempotent: the last registration holds)."""
    _commands[_key(test_file, test_name)] = (make, timeout)


def _execute(key: tuple[str, str]) -> Run:
    make, timeout = _commands[key]
    out = Path(tempfile.mkdtemp(prefix="minimax-test-"))
    _runner.folders.append(out)
    cmd, env = make(out)
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    _runner.running = proc
    try:
        stdout, stderr = proc.communicate(timeout=timeout)
        return Run(proc.returncode, stdout, stderr, out, timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        stdout, stderr = proc.communicate()
        return Run(None, stdout, stderr, out, timeout)
    finally:
        _runner.running = None


class _Runner:
    """The session's commands started ahead, run in order on one background thread."""

    def __init__(self):
        self.keys: list[tuple[str, str]] = []
        self.done: dict[tuple[str, str], threading.Event] = {}
        self.results: dict[tuple[str, str], Run] = {}
        self.folders: list[Path] = []
        self.running: subprocess.Popen | None = None
        self.stopped = False

    def run_all(self) -> None:
        for key in self.keys:
            if self.stopped:
                self.results[key] = Run(None, "", "the session ended before this command ran", Path(), 0)
            else:
                self.results[key] = _execute(key)
            self.done[key].set()


_runner = _Runner()


def start(items) -> None:
    """Start, in the background, the registered commands of the collected tests among `items`
    (pytest items; a parametrized test's command once)."""
    if _runner.keys:
        return
    keys = [_key(item.path, getattr(item, "originalname", item.name)) for item in items]
    _runner.keys = [k for k in dict.fromkeys(keys) if k in _commands]
    if not _runner.keys:
        return
    _runner.done = {k: threading.Event() for k in _runner.keys}
    threading.Thread(target=_runner.run_all, name="background-commands", daemon=True).start()


def stop() -> None:
    """End of session: start no further command, stop the one running (a session cut short) and
    remove the commands' folders."""
    _runner.stopped = True
    proc = _runner.running
    if proc is not None and proc.poll() is None:
        proc.kill()
    for folder in _runner.folders:
        shutil.rmtree(folder, ignore_errors=True)


def result(test_file, test_name: str) -> Run:
    """The finished run of the test's registered command: the one started ahead (waited for), else
    run now."""
    key = _key(test_file, test_name)
    if key not in _commands:
        raise KeyError(f"no background command registered for {test_name} of {key[0]}")
    if key in _runner.done:
        # each command's own timeout bounds it; this bound only guards against a runner that died
        bound = sum(timeout for _, timeout in _commands.values()) + DEFAULT_TIMEOUT_S
        if not _runner.done[key].wait(bound):
            raise TimeoutError(f"the background command of {test_name} never finished")
        return _runner.results[key]
    return _execute(key)
