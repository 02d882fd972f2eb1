"""Fixtures for the training-state tests; helpers live in state_helpers.py."""

from __future__ import annotations

import os
import sys

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
if HERE not in sys.path:
    sys.path.insert(0, HERE)  # state_helpers, state_workers, cli_helpers


@pytest.fixture
def run_dir(tmp_path) -> str:
    """An empty run directory path (not created)."""
    return str(tmp_path / "run")
