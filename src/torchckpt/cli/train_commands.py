"""``torchckpt train``: train the built-in GPT (or your model) on the Python standard library's source,
under a memory budget, resumable bit-exactly. Errors print one line and exit 2; no tracebacks."""

from __future__ import annotations

import argparse
import sys

from torchckpt.cli import positive_int
from torchckpt.models import GPT_SIZES


def _run(args: argparse.Namespace) -> int:
    import torch

    from torchckpt.state import CheckpointError
    from torchckpt.train import TrainConfig, train

    try:
        config = TrainConfig(budget=args.budget, size=args.size, model=args.model, batch_size=args.batch_size,
                             seq_len=args.seq_len, steps=args.steps, save_every=args.save_every, seed=args.seed,
                             lr=args.lr, dir=args.dir, threads=args.threads)
        if config.threads is not None:
            torch.set_num_threads(config.threads)
        print(f"torchckpt train: {config.run_dir} | budget {config.budget} | batch {config.batch_size} x "
              f"{config.seq_len} tokens | {config.steps} steps, checkpoint every {config.save_every} | CPU, "
              f"{torch.get_num_threads()} threads", flush=True)
        train(config, say=lambda text: print(text, flush=True))
    except (ValueError, TypeError, FileNotFoundError, ImportError, CheckpointError) as error:
        print(f"torchckpt train: error: {error}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("torchckpt train: interrupted before training started; nothing was saved", file=sys.stderr)
        return 130
    return 0


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
    parser.set_defaults(func=_run)
