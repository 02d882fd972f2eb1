"""The ``torchckpt`` command line.

``COMMANDS`` is the one list of commands: the module that registers each and its line in ``torchckpt --help``
(the modules pass it as ``help=``), so that the top-level help needs none of them imported.
``positive_int`` is the one argparse type for options that take a count (``--steps``, ``--batch-size``).
"""

from __future__ import annotations

import argparse

__all__ = ["COMMANDS", "positive_int"]

# command -> (the module whose register() adds it, its line in `torchckpt --help`), in the order listed
COMMANDS: dict[str, tuple[str, str]] = {
    "train": ("torchckpt.cli.train_commands",
              "train a GPT on the Python stdlib's source under a memory budget; resumable"),
    "demo": ("torchckpt.cli.demo",
             "train the built-in GPT with and without checkpointing; print peak memory and gradient equality"),
    "plan": ("torchckpt.cli.plan_commands", "plan activation checkpointing for a model under a memory budget"),
    "frontier": ("torchckpt.cli.plan_commands", "memory/time trade-off: Pareto plans and reference methods"),
    "ls": ("torchckpt.cli.state_commands", "list the checkpoints of a run directory"),
    "verify": ("torchckpt.cli.state_commands", "check checkpoints against their manifests (hashes)"),
    "export": ("torchckpt.cli.state_commands", "write a step's model weights to one safetensors file"),
    "import": ("torchckpt.cli.state_commands",
               "convert a torch.save file (weights_only) or a DCP directory into a checkpoint"),
    "bench": ("torchckpt.cli.bench_commands",
              "moved: run `make bench` or `python bench/run.py` from a source checkout"),
}


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
