"""Run the state subcommands in-process, as the ``torchckpt`` command would."""

from __future__ import annotations

import argparse

from torchckpt.cli import state_commands


def run_cli(argv: list[str]) -> int:
    """Parse ``argv`` with the state subcommands registered and run the chosen one."""
    parser = argparse.ArgumentParser(prog="torchckpt")
    state_commands.register(parser.add_subparsers())
    args = parser.parse_args(argv)
    return args.func(args)
