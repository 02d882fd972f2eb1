"""``torchckpt train``: train the built-in GPT (or your model) on the Python standard library's source,
under a memory budget, resumable bit-exactly. Errors print one line and exit 2; no tracebacks."""

from __future__ import annotations

import argparse
import os
import sys
from typing import TYPE_CHECKING

from torchckpt.cli import positive_int
from torchckpt.models import GPT_SIZES

if TYPE_CHECKING:
    from torchckpt.train import TrainConfig


def _run(args: argparse.Namespace) -> int:
    import torch

    from torchckpt.state import CheckpointError
    from torchckpt.train import TrainConfig, train

    try:
        config = TrainConfig(budget=args.budget, size=args.size, model=args.model, batch_size=args.batch_size,
                             seq_len=args.seq_len, steps=args.steps, save_every=args.save_every, seed=args.seed,
                             lr=args.lr, dir=args.dir, threads=args.threads, save=not args.no_save)
        if args.nproc > 1:
            return _launch(args, config)
        if config.threads is not None:
            torch.set_num_threads(config.threads)
        saving = f"checkpoint every {config.save_every}" if config.save else "no checkpoints (--no-save)"
        if os.environ.get("RANK", "0") == "0":  # under torchrun, rank 0 speaks for the run
            print(f"torchckpt train: {config.run_dir} | budget {config.budget} | batch {config.batch_size} x "
                  f"{config.seq_len} tokens | {config.steps} steps, {saving} | CPU, "
                  f"{torch.get_num_threads()} threads", flush=True)
        train(config, say=lambda text: print(text, flush=True))
    except (ValueError, TypeError, FileNotFoundError, ImportError, CheckpointError) as error:
        print(f"torchckpt train: error: {error}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("torchckpt train: interrupted before training started; nothing was saved", file=sys.stderr)
        return 130
    return 0


def _launch(args: argparse.Namespace, config: TrainConfig) -> int:
    """``--nproc N``: the same command on N processes under torchrun (torchckpt.train.distributed.launch)."""
    from torchckpt.train.distributed import launch

    forwarded = ["--budget", str(config.budget), "--size", config.size, "--batch-size", str(config.batch_size),
                 "--seq-len", str(config.seq_len), "--steps", str(config.steps), "--save-every",
                 str(config.save_every), "--seed", str(config.seed), "--lr", repr(config.lr), "--dir", config.dir]
    forwarded += [] if config.save else ["--no-save"]
    forwarded += ["--model", config.model] if config.model is not None else []
    forwarded += ["--threads", str(config.threads)] if config.threads is not None else []
    return launch(args.nproc, forwarded)


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add ``torchckpt train``."""
    parser = subparsers.add_parser(
        "train", help="train a GPT on the Python stdlib's source under a memory budget; resumable",
        description="Train the built-in GPT (or --model file.py:factory) as a byte-level language model on the "
                    "Python standard library's *.py files. Plans activation checkpointing for --budget, shows "
                    "live progress, saves every --save-every steps and on Ctrl-C/SIGTERM. Running the same "
                    "command again resumes where it stopped; with more --steps a finished run continues.")
    parser.add_argument("--budget", default="45%", help="peak memory of the whole step: bytes, '300MiB', or a "
                                                        "percentage of the peak without checkpointing (default 45%%)")
    parser.add_argument("--size", default="mini", choices=list(GPT_SIZES), help="built-in GPT size (default mini)")
    parser.add_argument("--model", default=None, help="path/to/file.py:factory: your model instead of the "
                                                       "built-in GPT; model(ids, targets) must return the loss")
    parser.add_argument("--batch-size", type=positive_int, default=16)
    parser.add_argument("--seq-len", type=positive_int, default=256)
    parser.add_argument("--steps", type=positive_int, default=100, help="train until this step (default 100)")
    parser.add_argument("--save-every", type=positive_int, default=25, help="checkpoint every N steps (default 25)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--lr", type=float, default=3e-3, help="AdamW learning rate after a 20-step warm-up")
    parser.add_argument("--dir", default="runs/demo", help="run directory (default runs/demo)")
    parser.add_argument("--threads", type=positive_int, default=None,
                        help="CPU threads (default: PyTorch's choice); resume with the same number for bitwise "
                             "equal losses")
    parser.add_argument("--no-save", action="store_true",
                        help="train without saving checkpoints (needed on several processes for now)")
    parser.add_argument("--nproc", type=positive_int, default=1,
                        help="train on N local processes under torchrun, the model sharded with FSDP2; the budget "
                             "is per process (same as: torchrun --nproc-per-node N -m torchckpt train ...)")
    parser.set_defaults(func=_run)
