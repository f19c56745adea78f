"""The file layout of a Hugging Face safetensors checkpoint, and ``CheckpointError``.

Shared by the reader (model/checkpoint_reader.py), the loader
(model/checkpoint_loader.py) and the writer (model/checkpoint_writer.py): the
file names of a single-file and of a sharded checkpoint, the suffix that names
an FP8 weight's block scales, and the one error type, which lists every
problem found at once.
"""

from __future__ import annotations

__all__ = ["CheckpointError", "SCALE_SUFFIX", "INDEX_FILE", "SINGLE_FILE"]

SCALE_SUFFIX = "_scale_inv"  # weight -> weight_scale_inv (model and checkpoint)
INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
_MAX_LISTED = 60


class CheckpointError(RuntimeError):
    """Everything wrong with a checkpoint / model pairing, all at once (``.problems``)."""

    def __init__(self, problems: list[str], where: str = ""):
        self.problems = list(problems)
        head = f"checkpoint {where}: " if where else "checkpoint: "
        shown = self.problems[:_MAX_LISTED]
        more = len(self.problems) - len(shown)
        lines = [f"{head}{len(self.problems)} problem(s)"] + [f"  - {p}" for p in shown]
        if more:
            lines.append(f"  ... and {more} more")
        super().__init__("\n".join(lines))
