"""Environment switches of the kernels: read per call, a bad value is an error naming the valid ones."""

from __future__ import annotations

import os


def env_choice(name: str, default: str, choices: tuple[str, ...]) -> str:
    """os.environ[name] (default if unset), which must be one of `choices`."""
    value = os.environ.get(name, default)
    if value not in choices:
        raise ValueError(f"{name}={value!r}: use one of {', '.join(choices)} (default {default})")
    return value
