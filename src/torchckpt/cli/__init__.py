"""The ``torchckpt`` command line.

``positive_int`` is the one argparse type for options that take a count (``--steps``, ``--batch-size``).
"""

from __future__ import annotations

import argparse

__all__ = ["positive_int"]


def positive_int(text: str) -> int:
    """Argparse type for a count >= 1; a bad value becomes argparse's one-line usage error.

    Example:
        >>> positive_int("3")
        3
        >>> positive_int("0")
        Traceback (most recent call last):
        argparse.ArgumentTypeError: must be a positive integer; got 0. Pass a whole number >= 1.
    """
    try:
        value: int | None = int(text)
    except ValueError:
        value = None  # not a whole number: shown quoted below
    if value is None or value < 1:
        shown = text if value is not None else repr(text)
        raise argparse.ArgumentTypeError(f"must be a positive integer; got {shown}. Pass a whole number >= 1.")
    return value
