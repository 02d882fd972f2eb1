"""Entry point of the ``torchckpt`` command.

Each subcommand lives in its own module under ``torchckpt.cli`` and exposes
``register(subparsers)``, which adds its parser and sets ``func`` on it. ``torchckpt.cli.COMMANDS`` names
each command's module and its line in ``torchckpt --help``: only the module of the command given is imported,
so ``torchckpt --help`` (and a mistyped command) answers without importing PyTorch.

Exit codes, the same for every command: 0 success; 1 the command ran and found a problem (a corrupt
checkpoint, gradients that differ); 2 bad usage or input (a bad option, a missing path, an infeasible
budget); 130 interrupted.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Collection, Sequence

from torchckpt._version import __version__
from torchckpt.cli import COMMANDS

EXIT_CODES = "exit codes: 0 success, 1 a problem found (e.g. a corrupt checkpoint), 2 bad usage or input"


def build_parser(commands: Collection[str] | None = None) -> argparse.ArgumentParser:
    """Build the argument parser: every command listed, those in ``commands`` (default: all) with their options
    (and the other commands of their modules).

    Example:
        >>> build_parser().prog
        'torchckpt'
        >>> "--full" in build_parser(commands=["ls"]).format_help()  # the top level lists commands only
        False
    """
    parser = argparse.ArgumentParser(
        prog="torchckpt",
        description=(
            "torchckpt: fit a training step in an absolute memory budget "
            "(activation checkpointing) and never lose a run (training-state checkpoints)."
        ),
        epilog=EXIT_CODES,
    )
    parser.add_argument("--version", action="version", version=f"torchckpt {__version__}")
    subparsers = parser.add_subparsers(title="commands", metavar="COMMAND")
    wanted = {module for name, (module, _) in COMMANDS.items() if commands is None or name in commands}
    for name, (module_name, help_text) in COMMANDS.items():
        if module_name not in wanted:
            subparsers.add_parser(name, help=help_text)  # listed; its options come when it is the command given
        elif name not in subparsers.choices:  # a module registers all of its commands at once
            importlib.import_module(module_name).register(subparsers)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the ``torchckpt`` command; returns the process exit code.

    Example:
        >>> main(["--version"])  # doctest: +SKIP
        torchckpt 0.1.0
    """
    arguments = list(sys.argv[1:] if argv is None else argv)
    command = next((text for text in arguments if not text.startswith("-")), None)
    parser = build_parser(commands=[command] if command in COMMANDS else [])
    args = parser.parse_args(arguments)
    if not hasattr(args, "func"):
        parser.print_help()
        return 0
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
