"""Reading a Hugging Face safetensors checkpoint: ``CheckpointReader``.

A checkpoint is a single ``model.safetensors``, a sharded set with
``model.safetensors.index.json``, any ``*.safetensors`` in a folder, or one
file. The reader maps every tensor name to its file, opens the files lazily
(memory-mapped by safetensors) and reads only the slice a ``Shard`` names,
with ``get_slice(name)[...]``.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from .checkpoint_format import INDEX_FILE, SINGLE_FILE, CheckpointError
from .weights import Shard

__all__ = ["CheckpointReader"]


class CheckpointReader:
    """Name -> file map of an HF safetensors checkpoint, with lazily opened, memory-mapped handles."""

    def __init__(self, path: str | Path):
        from safetensors import safe_open  # noqa: F401  (fail early if missing)

        self.path = Path(path)
        self.name_to_file: dict[str, Path] = {}
        self._handles: dict[Path, Any] = {}
        problems: list[str] = []
        if self.path.is_file():
            files = [self.path]
            self.root = self.path.parent
        elif (self.path / INDEX_FILE).is_file():
            self.root = self.path
            index = json.loads((self.path / INDEX_FILE).read_text())
            weight_map = index.get("weight_map")
            if not isinstance(weight_map, dict):
                raise CheckpointError([f"{INDEX_FILE} has no weight_map"], str(self.path))
            files = []
            for name, fname in weight_map.items():
                f = self.path / fname
                if not f.is_file():
                    problems.append(f"index lists {name} in {fname}, but that file does not exist")
                    continue
                self.name_to_file[name] = f
            files = sorted(set(self.name_to_file.values()))
        elif (self.path / SINGLE_FILE).is_file():
            self.root = self.path
            files = [self.path / SINGLE_FILE]
        elif self.path.is_dir() and sorted(self.path.glob("*.safetensors")):
            self.root = self.path
            files = sorted(self.path.glob("*.safetensors"))
        else:
            raise CheckpointError([f"no {SINGLE_FILE}, {INDEX_FILE} or *.safetensors found"], str(self.path))
        self.files = files
        if not self.name_to_file:
            for f in files:
                for name in self._handle(f).keys():
                    self.name_to_file[name] = f
        if problems:
            raise CheckpointError(problems, str(self.path))

    def _handle(self, f: Path):
        h = self._handles.get(f)
        if h is None:
            from safetensors import safe_open

            h = safe_open(str(f), framework="pt", device="cpu")
            self._handles[f] = h
        return h

    def names(self) -> list[str]:
        return list(self.name_to_file)

    def __contains__(self, name: str) -> bool:
        return name in self.name_to_file

    def info(self, name: str) -> tuple[tuple[int, ...], str]:
        """(shape, safetensors dtype string) without reading data."""
        sl = self._handle(self.name_to_file[name]).get_slice(name)
        return tuple(sl.get_shape()), sl.get_dtype()

    def read(self, shard: Shard) -> torch.Tensor:
        """Only the slice the shard names (memory-mapped read)."""
        h = self._handle(self.name_to_file[shard.name])
        if shard.dim is None:
            return h.get_tensor(shard.name)
        sl = h.get_slice(shard.name)
        return sl[shard.index(len(sl.get_shape()))]

    def file_of(self, name: str) -> Path:
        return self.name_to_file[name]

    def close(self) -> None:
        self._handles.clear()
