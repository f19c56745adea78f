"""Whether Triton runs its interpreter (TRITON_INTERPRET=1): the kernels then take CPU
tensors and avoid what only the compiler supports (tests run them this way on CPU)."""

from __future__ import annotations

import os


def triton_interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
