"""The planner-accuracy helpers live in planner_helpers.py beside the tests; ``one_thread`` is for test files of tiny
models (``pytestmark = pytest.mark.usefixtures("one_thread")``)."""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator

import pytest
import torch

HERE = os.path.dirname(os.path.abspath(__file__))
if HERE not in sys.path:
    sys.path.insert(0, HERE)  # planner_helpers


@pytest.fixture
def one_thread() -> Iterator[None]:
    """One OpenMP thread: tiny models' ops run ~10x slower with 2 on a shared 2-core machine."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
