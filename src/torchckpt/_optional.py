"""Optional libraries: one place knows which pip extra installs each, so every error for a missing one names
the command that fixes it (``pip install 'torchckpt[hf]'``). The extras are in pyproject.toml's
``[project.optional-dependencies]``, each named after what it enables (``tests/test_packaging.py`` checks that
each library here is in its extra).
"""

from __future__ import annotations

import importlib
from types import ModuleType

__all__ = ["EXTRAS", "install_hint", "require"]

# importable module -> the extra that installs it
EXTRAS: dict[str, str] = {
    "transformers": "hf",
    "accelerate": "hf",
    "torchdata": "train",
    "matplotlib": "plot",
    "lightning": "lightning",
    "fsspec": "remote",
}


def install_hint(module: str) -> str:
    """The pip command that installs ``module`` with torchckpt.

    Example:
        >>> install_hint("transformers")
        "pip install 'torchckpt[hf]' (or pip install transformers)"
    """
    if module not in EXTRAS:
        raise ValueError(f"install_hint: {module!r} is not an optional library of torchckpt; one of {sorted(EXTRAS)}")
    return f"pip install 'torchckpt[{EXTRAS[module]}]' (or pip install {module})"


def require(module: str, what: str) -> ModuleType:
    """Import the optional ``module`` (a top-level name in ``EXTRAS``), or raise an ImportError that says
    ``what`` needs it and the pip command that installs it.

    Example:
        >>> require("json_not_optional", "x")
        Traceback (most recent call last):
        ValueError: install_hint: 'json_not_optional' is not an optional library of torchckpt; one of [...]
    """
    hint = install_hint(module)
    try:
        return importlib.import_module(module)
    except ImportError:
        raise ImportError(f"{what} needs {module}, which is not installed: {hint}") from None
