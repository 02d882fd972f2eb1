"""Every example in a public docstring runs and prints what it says: torchckpt's modules and the benchmark's
(bench/harness/ and bench/cuda_check.py, on ``sys.path`` by tests/conftest.py)."""

from __future__ import annotations

import doctest
import importlib
import pkgutil

import pytest

import harness
import torchckpt


def _modules() -> list[str]:
    names = [info.name for info in pkgutil.walk_packages(torchckpt.__path__, "torchckpt.")]
    bench = ["harness", *(info.name for info in pkgutil.walk_packages(harness.__path__, "harness.")), "cuda_check"]
    return sorted(name for name in names if not name.startswith("torchckpt.cli.main")) + bench


@pytest.mark.parametrize("module_name", _modules())
def test_docstring_examples(module_name: str) -> None:
    module = importlib.import_module(module_name)
    result = doctest.testmod(module, optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE, verbose=False)
    assert result.failed == 0, f"{result.failed} docstring example(s) failed in {module_name}"
