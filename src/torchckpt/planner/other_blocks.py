"""When the blocks ``"auto"`` found leave the floor high, measure the other groupings the finder saw.

Rules:

1. **[a much lower floor elsewhere is named]** ``blocks="auto"`` takes the most numerous repeated class
   (blocks.py's rule 3), which on some models covers little of the step: MobileViT's transformer layers run on
   small patch tensors while its high-resolution convolution stages stay outside them, so checkpointing them all
   measured 94% of the no-checkpointing peak at 64 px and its inverted residuals 55%. When checkpointing every
   block found measures above
   ``HIGH_SHARE`` of the plain peak, the profiler measures one more step per other grouping
   (``blocks.other_groupings``, at most ``MAX_GROUPINGS``), with every block of it checkpointed, and names each
   whose peak is at least ``BETTER_BY`` of the plain peak lower, with the ``blocks=`` argument to pass, in the
   plan's notes and the infeasible-budget error. Nothing is chosen for the user: the blocks are theirs to pass.
   What another grouping can win is mostly what lives outside the blocks found: where the fixed bytes
   (``costs.fixed_bytes``) exceed the parameters, their gradients and the optimizer's state by less than
   ``BETTER_BY`` of the plain peak, none is measured.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from torchckpt.executor import checkpoint_modules
from torchckpt.memory import MemoryMeter
from torchckpt.planner.blocks import other_groupings
from torchckpt.planner.runner import StepRunner

__all__ = ["BETTER_BY", "HIGH_SHARE", "MAX_GROUPINGS", "measure_every_block_peak", "other_blocks_note"]

HIGH_SHARE = 0.7  # every block found checkpointed measures above this share of the plain peak: look further
BETTER_BY = 0.1  # another grouping is named when it measures this share of the plain peak lower
MAX_GROUPINGS = 3


def other_blocks_note(runner: StepRunner, chosen: Sequence[str], every_block_peak: int, plain_peak: int,
                      fixed_bytes: int) -> str | None:
    """The note naming the groupings that measure much lower than ``chosen`` ([a much lower floor elsewhere is
    named]); None when the blocks found already do well, or no other grouping does better. Runs at most
    ``MAX_GROUPINGS`` measured steps; the caller restores the model's state (``preserved_state``).

    Example:
        >>> from torchckpt.models import gpt
        >>> model = gpt("tiny")
        >>> runner = StepRunner(model, model.example_batch(batch_size=2, seq_len=16))
        >>> other_blocks_note(runner, ["blocks.0"], every_block_peak=50, plain_peak=100, fixed_bytes=10) is None
        True
    """
    if plain_peak <= 0 or every_block_peak <= HIGH_SHARE * plain_peak:
        return None
    if fixed_bytes - sum(runner.state_bytes().values()) < BETTER_BY * plain_peak:  # little alive outside the blocks
        return None  # found beyond parameters, gradients and optimizer state: no other grouping can win that much
    model = runner.model
    found = []
    for description, paths in other_groupings(model, chosen)[:MAX_GROUPINGS]:
        peak = measure_every_block_peak(runner, [model.get_submodule(path) for path in paths])
        if peak <= every_block_peak - BETTER_BY * plain_peak:
            found.append((peak, description, paths))
    if not found:
        return None
    shown = "; ".join(f"{description}: {peak / plain_peak:.0%} of it, blocks=[model.get_submodule(p) for p in "
                      f"{paths!r}]" for peak, description, paths in sorted(found))
    return (f"the blocks found, every one checkpointed, measured {every_block_peak / plain_peak:.0%} of the "
            f"no-checkpointing peak; other blocks measured lower: {shown}")


def measure_every_block_peak(runner: StepRunner, blocks: list[nn.Module]) -> int:
    """The measured peak of one step with every one of ``blocks`` checkpointed, keeping nothing; the int64
    maximum where the model cannot run so (no advice comes of it). Gradients are cleared before and after.

    Example:
        >>> model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
        >>> runner = StepRunner(model, (torch.ones(2, 4),), loss_fn=lambda output: output.sum())
        >>> 0 < measure_every_block_peak(runner, list(model)) < torch.iinfo(torch.int64).max
        True
    """
    runner.clear_grads()
    try:
        with checkpoint_modules(blocks, policy="nothing_saveable"), MemoryMeter(runner.device) as meter:
            runner.forward_backward()
    except (RuntimeError, ValueError, TypeError):  # a grouping the model cannot run checkpointed is no advice
        return torch.iinfo(torch.int64).max
    finally:
        runner.clear_grads()
    return meter.peak_bytes
