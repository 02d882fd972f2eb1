"""Entry point of the ``torchckpt`` command.

Each subcommand lives in its own module under ``torchckpt.cli`` and exposes
``register(subparsers)``, which adds its parser and sets ``func`` on it.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence

from torchckpt._version import __version__

# Modules that contribute subcommands, in the order `--help` lists them.
_COMMAND_MODULES: tuple[str, ...] = (
    "torchckpt.cli.train_commands",
    "torchckpt.cli.demo",
    "torchckpt.cli.plan_commands",
    "torchckpt.cli.state_commands",
    "torchckpt.cli.bench_commands",
)


def build_parser() -> argparse.ArgumentParser:
    """Build the argument parser with every registered subcommand.

    Example:
        >>> build_parser().prog
        'torchckpt'
    """
    parser = argparse.ArgumentParser(
        prog="torchckpt",
        description=(
            "torchckpt: fit a training step in an absolute memory budget "
            "(activation checkpointing) and never lose a run (training-state checkpoints)."
        ),
    )
    parser.add_argument("--version", action="version", version=f"torchckpt {__version__}")
    subparsers = parser.add_subparsers(title="commands", metavar="COMMAND")
    for module_name in _COMMAND_MODULES:
        importlib.import_module(module_name).register(subparsers)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the ``torchckpt`` command; returns the process exit code.

    Example:
        >>> main(["--version"])  # doctest: +SKIP
        torchckpt 0.1.0
    """
    parser = build_parser()
    args = parser.parse_args(argv)
    if not hasattr(args, "func"):
        parser.print_help()
        return 0
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
