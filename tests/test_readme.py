"""The README's options table names every backend option (docs don't drift)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

from minimax_backend.graph_passes.config import BackendConfig

README = Path(__file__).resolve().parents[1] / "README.md"


def test_every_option_is_documented():
    text = README.read_text()
    missing = [f.name for f in dataclasses.fields(BackendConfig) if f"`{f.name}`" not in text]
    assert not missing, f"options missing from README.md: {missing}"


def test_ci_runs_the_readme_test_command():
    ci = (README.parent / ".ci" / "run").read_text()
    assert "python -m pytest -q" in README.read_text() and "python -m pytest -q" in ci
    assert "pip install -q torch==2.13.0" in ci and "pip install -q -e '.[test]'" in ci
