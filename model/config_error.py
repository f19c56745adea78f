"""``ConfigError``: the one error type of the model configuration.

Raised for an impossible or unsupported value by the dataclass checks
(model/config.py), the parallel-layout checks (model/parallel_layout.py) and
the Hugging Face ``config.json`` reader (model/hf_config.py); it lives on its
own so that those modules can share it without importing each other.
"""

from __future__ import annotations

__all__ = ["ConfigError"]


class ConfigError(ValueError):
    """An impossible or unsupported configuration value. ``.field`` names the field."""

    def __init__(self, field_name: str, message: str):
        self.field = field_name
        super().__init__(f"{field_name}: {message}")
