"""``torchckpt bench``: the benchmark moved to the source checkout; this says where, in one line, and exits 2.

The harness lives in the repository's ``bench/`` folder (not in the installed package): run it from a
checkout with ``make bench`` or ``python bench/run.py [--quick]`` (bench/README.md).
"""

from __future__ import annotations

import argparse
import sys

from torchckpt.cli import COMMANDS

MOVED = ("torchckpt bench: the benchmark runs from a source checkout of torchckpt: `make bench`, "
         "or `python bench/run.py --quick` (options as before; see bench/README.md)")


def _run(args: argparse.Namespace) -> int:
    """Print where the benchmark runs now; exit code 2."""
    print(MOVED, file=sys.stderr)
    return 2


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add ``torchckpt bench``, which takes any arguments (the old options too) and says where it moved."""
    # prefix_chars="+": the old options (--quick, --models ...) reach the catch-all instead of an argparse error.
    parser = subparsers.add_parser("bench", help=COMMANDS["bench"][1], prefix_chars="+", add_help=False)
    parser.add_argument("ignored", nargs="*", help=argparse.SUPPRESS)
    parser.set_defaults(func=_run)
