"""``torchckpt train``: train the built-in GPT (or your model) on the Python standard library's source,
under a memory budget, resumable bit-exactly. Errors print one line and exit 2; no tracebacks."""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable
from typing import Any

from torchckpt.cli import COMMANDS, positive_int
from torchckpt.train.config import TrainOption, train_options

# How each kind of option reads its value (torchckpt.train.config.TrainOption.kind); "switch" takes none.
_READERS: dict[str, Callable[[str], Any]] = {"count": positive_int, "int": int, "float": float, "text": str}


def _run(args: argparse.Namespace) -> int:
    import torch

    from torchckpt._units import counted
    from torchckpt.state import CheckpointError
    from torchckpt.train import TrainConfig, train

    try:
        config = TrainConfig.from_options(vars(args))
        if args.nproc > 1:
            from torchckpt.train.distributed import launch

            return launch(args.nproc, config)
        if config.threads is not None:
            torch.set_num_threads(config.threads)
        saving = f"checkpoint every {config.save_every}" if config.save else "no checkpoints (--no-save)"
        if os.environ.get("RANK", "0") == "0":  # under torchrun, rank 0 speaks for the run
            print(f"torchckpt train: {config.run_dir} | budget {config.budget} | batch {config.batch_size} x "
                  f"{config.seq_len} tokens | {config.steps} steps, {saving} | CPU, "
                  f"{counted(torch.get_num_threads(), 'thread')}", flush=True)
        train(config, say=lambda text: print(text, flush=True))
    except (ValueError, TypeError, FileNotFoundError, ImportError, CheckpointError) as error:
        print(f"torchckpt train: error: {error}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("torchckpt train: interrupted before training started; nothing was saved", file=sys.stderr)
        return 130
    return 0


def add_option(parser: argparse.ArgumentParser, option: TrainOption) -> None:
    """Add one TrainConfig field's option to ``parser`` (dest: the field's name).

    Example:
        >>> parser = argparse.ArgumentParser()
        >>> for option in train_options():
        ...     add_option(parser, option)
        >>> args = parser.parse_args(["--steps", "8", "--no-save"])
        >>> args.steps, args.save, args.budget  # no --budget: the size's default (TrainConfig)
        (8, False, 'auto')
    """
    text = option.help.replace("%", "%%")  # argparse formats help with %
    if option.kind == "switch":
        action = "store_false" if option.default else "store_true"
        parser.add_argument(option.flag, dest=option.name, action=action, help=text)
        return
    parser.add_argument(option.flag, dest=option.name, type=_READERS[option.kind], default=option.default,
                        choices=None if option.choices is None else list(option.choices), help=text)


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add ``torchckpt train``."""
    parser = subparsers.add_parser(
        "train", help=COMMANDS["train"][1],
        description="Train the built-in GPT (or --model file.py:factory) as a byte-level language model on the "
                    "Python standard library's *.py files. Plans activation checkpointing for --budget, shows "
                    "live progress, saves every --save-every steps and on Ctrl-C/SIGTERM. Running the same "
                    "command again resumes where it stopped; with more --steps a finished run continues.")
    for option in train_options():  # one per TrainConfig field (torchckpt.train.config)
        add_option(parser, option)
    parser.add_argument("--nproc", type=positive_int, default=1,
                        help="train on N local processes under torchrun, the model sharded with FSDP2; the budget "
                             "is per process (same as: torchrun --nproc-per-node N -m torchckpt train ...)")
    parser.set_defaults(func=_run)
