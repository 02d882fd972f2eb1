"""The examples in the docstrings of torchckpt.state run and print what they claim."""

from __future__ import annotations

import doctest
import importlib

import pytest

MODULES = [
    "torchckpt.state.format", "torchckpt.state.codec", "torchckpt.state.storage", "torchckpt.state.capture",
    "torchckpt.state.snapshot", "torchckpt.state.catalog", "torchckpt.state.reader", "torchckpt.state.retention",
    "torchckpt.state.preemption", "torchckpt.state.checkpointer", "torchckpt.state.interchange",
    "torchckpt.state.errors", "torchckpt.cli.state_commands", "torchckpt.state.local_files",
    "torchckpt.state.lockfile", "torchckpt.state.lifecycle", "torchckpt.state.branches", "torchckpt.state.hashed_write",
    "torchckpt.state.preempt_points",
]


@pytest.mark.parametrize("module_name", MODULES)
def test_docstring_examples(module_name):
    module = importlib.import_module(module_name)
    result = doctest.testmod(module, optionflags=doctest.ELLIPSIS)
    assert result.failed == 0, f"{result.failed} docstring example(s) failed in {module_name}"
