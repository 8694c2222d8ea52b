"""Fixtures of the CLI tests."""

from __future__ import annotations

from pathlib import Path

import pytest
from tests.cli.bad_input import write_scratch


@pytest.fixture
def scratch(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A scratch directory with the bad-input files (tests/cli/bad_input.py), the working directory."""
    return write_scratch(tmp_path, monkeypatch)
