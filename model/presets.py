"""The named model presets: HF ``config.json`` files in model/presets/, read with ``load_preset``."""

from __future__ import annotations

from pathlib import Path

from .config import MiniMaxConfig
from .config_error import ConfigError

__all__ = ["load_preset", "PRESET_NAMES", "PRESET_DIR"]

PRESET_DIR = Path(__file__).resolve().parent / "presets"
PRESET_NAMES: tuple[str, ...] = ("tiny-m3", "tiny-m3-fp8", "tiny-m2", "m3", "m3-slice")


def load_preset(name: str) -> MiniMaxConfig:
    """One of PRESET_NAMES, read from model/presets/<name>.json (HF format)."""
    if name not in PRESET_NAMES:
        raise ConfigError("preset", f"unknown preset {name!r}; expected one of {list(PRESET_NAMES)}")
    return MiniMaxConfig.from_json_file(PRESET_DIR / f"{name}.json")
