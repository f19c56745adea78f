"""SM clock and board power sampled beside a benchmark (nvidia-smi): is the card at its power limit?

    with PowerSampler(smi_device_id(0)) as power:
        with power.window(row, "ours_"):       # a loop of the work, a few seconds
            ...
    row["ours_sm_mhz"], row["ours_watts"]      # filled when the sampling block ends (None: no reading)

Run back to back for seconds, M3's MoE layer at 4096-16384 tokens and a plain FP8
GEMM both draw the H200's 700 W and the SM clock drops to 1450-1650 of 1980 MHz
(docs/measurements/2026-12-03.md, eleventh session). A rate measured there is set by
energy per FLOP as much as by the kernel's schedule, so the benchmarks report the clock
and power beside the time. nvidia-smi writes its samples to a file (a pipe would fill
and stall it on a long run); they are read when the block ends.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import shutil
import statistics
import subprocess
import tempfile
from typing import Callable, Iterable, NamedTuple, Optional

__all__ = ["PowerSample", "PowerSampler", "parse_samples", "sampler_for", "seconds_arg", "smi_device_id",
           "summarize"]

QUERY = "timestamp,clocks.sm,power.draw"
TIME_FORMAT = "%Y/%m/%d %H:%M:%S.%f"
MIN_SAMPLES = 3  # fewer in a window: no reading (the window was shorter than a few periods)


class PowerSample(NamedTuple):
    time: datetime.datetime
    sm_mhz: float
    watts: float


def parse_samples(lines: Iterable[str]) -> list[PowerSample]:
    """nvidia-smi's `--query-gpu=timestamp,clocks.sm,power.draw --format=csv,noheader,nounits`
    lines; lines that do not parse (a header, "[N/A]", an error message) are left out."""
    samples = []
    for line in lines:
        parts = [p.strip() for p in line.split(",")]
        if len(parts) != 3:
            continue
        try:
            samples.append(PowerSample(datetime.datetime.strptime(parts[0], TIME_FORMAT),
                                       float(parts[1]), float(parts[2])))
        except ValueError:
            continue
    return samples


def summarize(samples: Iterable[PowerSample], start: datetime.datetime, end: datetime.datetime) -> dict | None:
    """Median SM clock and power of the samples in [start, end], or None with fewer than MIN_SAMPLES."""
    inside = [s for s in samples if start <= s.time <= end]
    if len(inside) < MIN_SAMPLES:
        return None
    return {"sm_mhz": statistics.median(s.sm_mhz for s in inside),
            "watts": statistics.median(s.watts for s in inside), "samples": len(inside)}


def smi_device_id(cuda_index: int) -> str:
    """nvidia-smi's name for CUDA device `cuda_index`: its UUID where torch knows it (CUDA's order
    and CUDA_VISIBLE_DEVICES need not match nvidia-smi's numbering), else the index."""
    try:
        import torch

        if torch.cuda.is_available():
            uuid = getattr(torch.cuda.get_device_properties(cuda_index), "uuid", None)
            if uuid is not None:
                return f"GPU-{uuid}"
    except (ImportError, RuntimeError, AssertionError):
        pass
    return str(cuda_index)


class PowerSampler:
    """nvidia-smi sampling one GPU every `period_ms` while the block runs (`device`: what
    nvidia-smi -i takes, e.g. smi_device_id(torch index)). Without nvidia-smi `available` is
    False, `why` says so, and every reading is None."""

    def __init__(self, device: int | str = 0, period_ms: int = 50):
        self.device, self.period_ms = str(device), period_ms
        self.available = shutil.which("nvidia-smi") is not None
        self.why = None if self.available else "nvidia-smi not found: SM clock and power not sampled"
        self.samples: list[PowerSample] = []
        self._windows: list[tuple[dict, str, datetime.datetime, datetime.datetime]] = []
        self._proc = None
        self._log = None

    @staticmethod
    def now() -> datetime.datetime:
        """The local wall clock, as nvidia-smi stamps its samples."""
        return datetime.datetime.now()

    def __enter__(self) -> "PowerSampler":
        if self.available:
            self._log = tempfile.TemporaryFile(mode="w+")
            self._proc = subprocess.Popen(
                ["nvidia-smi", f"--query-gpu={QUERY}", "--format=csv,noheader,nounits", "-i", self.device,
                 "-lms", str(self.period_ms)], stdout=self._log, stderr=subprocess.STDOUT)
        return self

    @contextlib.contextmanager
    def window(self, row: dict, prefix: str = ""):
        """The block is one window: when sampling stops, row gets f"{prefix}sm_mhz" and
        f"{prefix}watts", the medians of its samples (None without a reading)."""
        start = self.now()
        yield
        self._windows.append((row, prefix, start, self.now()))

    def __exit__(self, *exc) -> None:
        self._stop()
        for row, prefix, start, end in self._windows:
            reading = self.reading(start, end)
            row[f"{prefix}sm_mhz"] = reading["sm_mhz"] if reading else None
            row[f"{prefix}watts"] = reading["watts"] if reading else None

    def _stop(self) -> None:
        if self._proc is None:
            return
        self._proc.terminate()
        try:
            self._proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            self._proc.wait()
        self._log.seek(0)
        text = self._log.read()
        self._log.close()
        self.samples = parse_samples(text.splitlines())
        if not self.samples:
            said = text.strip().splitlines()[0][:200] if text.strip() else "nothing"
            self.available = False
            self.why = f"nvidia-smi -i {self.device} gave no samples (it said: {said}): SM clock and power not read"

    def reading(self, start: datetime.datetime, end: datetime.datetime) -> dict | None:
        """Median SM MHz and W between start and end (read after the block has ended)."""
        return summarize(self.samples, start, end) if self.available else None


def seconds_arg(text: str) -> float:
    """argparse type of the benchmarks' --sustained SECONDS: a number >= 0 (0 = off)."""
    try:
        seconds = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds") from None
    if seconds < 0:
        raise argparse.ArgumentTypeError(f"{text}: seconds must be >= 0")
    return seconds


def sampler_for(seconds: float, cuda_index: int, say: Optional[Callable[[str], None]] = print) -> Optional[PowerSampler]:
    """The sampler beside a --sustained run of `seconds` (None when it is 0) on CUDA device
    `cuda_index`; where it will read nothing, `say` (None: quiet, e.g. on ranks > 0) is told why."""
    if not seconds:
        return None
    power = PowerSampler(smi_device_id(cuda_index))
    if not power.available and say is not None:
        say(f"--sustained: {power.why}")
    return power
