"""``torchckpt demo``: the built-in GPT trained a few steps with and without activation checkpointing.

For each method it prints the measured peak memory (exact live tensor bytes), the median step time,
and whether losses and gradients are bitwise equal to the run without checkpointing.
"""

from __future__ import annotations

import argparse
import copy
import statistics
import time
from dataclasses import dataclass

import torch

from torchckpt._units import counted, format_bytes
from torchckpt.cli import COMMANDS, positive_int
from torchckpt.executor import PolicyLike, checkpoint_modules
from torchckpt.memory import MemoryMeter
from torchckpt.models import GPT, gpt

_METHODS: tuple[tuple[str, PolicyLike | str], ...] = (
    ("no checkpointing", "none"),
    ("every block, recompute all", "nothing_saveable"),
    ("every block, keep matmuls", "dots_saveable"),
)


@dataclass(frozen=True, kw_only=True)
class DemoRun:
    """What one method measured: peak and baseline of its last step (optimizer state allocated)."""

    method: str
    peak_bytes: int
    baseline_bytes: int
    step_s: list[float]
    losses: list[float]
    grads: list[torch.Tensor]


def run_method(model: GPT, policy: PolicyLike | str, steps: int, batch_size: int, seq_len: int) -> DemoRun:
    """Train ``steps`` steps of a copy of ``model`` (AdamW), checkpointing every block with ``policy``.

    Example:
        >>> run = run_method(gpt("tiny"), "nothing_saveable", steps=1, batch_size=2, seq_len=16)
        >>> len(run.losses)
        1
    """
    model = copy.deepcopy(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    handle = None if policy == "none" else checkpoint_modules(model.blocks, policy=policy)
    losses, step_s, grads, peak, baseline = [], [], [], 0, 0
    for step in range(steps):
        batch = model.example_batch(batch_size=batch_size, seq_len=seq_len, seed=step)
        torch.manual_seed(1000 + step)  # dropout masks: the same for every method
        start = time.perf_counter()
        with MemoryMeter() as meter:
            loss = model(*batch)
            loss.backward()
        step_s.append(time.perf_counter() - start)
        if step == 0:
            # a parameter the loss does not reach compares as zeros
            grads = [torch.zeros_like(p) if p.grad is None else p.grad.detach().clone() for p in model.parameters()]
        peak, baseline = meter.peak_bytes, meter.baseline_bytes  # the last step: optimizer state exists
        losses.append(loss.item())
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    if handle is not None:
        handle.remove()
    return DemoRun(method=str(policy), peak_bytes=peak, baseline_bytes=baseline, step_s=step_s,
                   losses=losses, grads=grads)


def _run(args: argparse.Namespace) -> int:
    from rich.console import Console
    from rich.table import Table

    console = Console(width=110)
    torch.manual_seed(args.seed)
    model = gpt(args.size)
    params = sum(p.numel() for p in model.parameters())
    console.print(f"[bold]torchckpt demo[/]: gpt({args.size!r}), {params / 1e6:.1f}M parameters, "
                  f"batch {args.batch_size} x {args.seq_len} tokens, dropout {model.config.dropout}, "
                  f"{args.steps} AdamW steps per method, CPU, {counted(torch.get_num_threads(), 'thread')}")
    runs = []
    for label, policy in _METHODS:
        console.print(f"  running: {label} ...")
        runs.append((label, run_method(model, policy, args.steps, args.batch_size, args.seq_len)))
    reference = runs[0][1]
    table = Table(title="Peak memory of one training step (exact live tensor bytes)")
    for column in ("method", "peak", "vs none", "above start", "step time", "losses", "grads"):
        table.add_column(column, justify="left" if column == "method" else "right")
    all_equal = True
    for label, run in runs:
        losses_equal = run.losses == reference.losses
        grads_equal = all(torch.equal(a, b) for a, b in zip(run.grads, reference.grads))
        all_equal &= losses_equal and grads_equal
        table.add_row(label, format_bytes(run.peak_bytes), f"{run.peak_bytes / reference.peak_bytes:.0%}",
                      format_bytes(run.peak_bytes - run.baseline_bytes),
                      f"{statistics.median(run.step_s):.2f} s",
                      "equal" if losses_equal else "DIFFERENT", "equal" if grads_equal else "DIFFERENT")
    console.print(table)
    console.print("peak: parameters, AdamW state, batch, activations, gradients and transients of the last step;\n"
                  "above start: the part of the peak the step itself allocated (activations, gradients, transients);\n"
                  "losses/grads: bitwise equal to no checkpointing (same dropout masks); step time: median.")
    return 0 if all_equal else 1


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add ``torchckpt demo`` to the command line."""
    parser = subparsers.add_parser("demo", help=COMMANDS["demo"][1])
    parser.add_argument("--size", default="small", choices=["tiny", "mini", "small", "medium"],
                        help="built-in GPT size (default: small, 12 layers x 384)")
    parser.add_argument("--batch-size", type=positive_int, default=8)
    parser.add_argument("--seq-len", type=positive_int, default=256)
    parser.add_argument("--steps", type=positive_int, default=3)
    parser.add_argument("--seed", type=int, default=0)
    parser.set_defaults(func=_run)
