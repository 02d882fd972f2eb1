"""The HF model builders live in hf_models.py beside the tests."""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator

import pytest
import torch

HERE = os.path.dirname(os.path.abspath(__file__))
if HERE not in sys.path:
    sys.path.insert(0, HERE)  # hf_models


@pytest.fixture(autouse=True)
def one_thread() -> Iterator[None]:
    """These models are tiny: with 2 OpenMP threads on a shared 2-core machine their ops run ~10x slower."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
