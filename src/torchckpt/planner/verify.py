"""verify_plan(): run one step with a plan and one without; compare measured peak and gradients.

This is the proof a plan carries: the measured peak (MemoryMeter) against the budget and the
prediction, and gradients bitwise against the uncheckpointed model (same RNG, so the same dropout).
The reference gradients are kept as NumPy byte arrays, outside tensor memory, so that keeping them
does not inflate the measured peak of the planned step.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import nn

from torchckpt._host import host_bytes, preserved_rng
from torchckpt._units import format_bytes
from torchckpt.memory import MemoryMeter
from torchckpt.planner.apply import apply_plan
from torchckpt.planner.plan import Plan
from torchckpt.planner.runner import StepRunner

__all__ = ["VerifyReport", "verify_plan"]


@dataclass(frozen=True, kw_only=True)
class VerifyReport:
    """Measured against predicted for one training step under a plan."""

    budget_bytes: int
    predicted_peak_bytes: int
    measured_peak_bytes: int
    no_checkpointing_peak_bytes: int
    gradients_equal: bool
    max_gradient_difference: float
    step_time_s: float
    no_checkpointing_step_time_s: float

    @property
    def within_budget(self) -> bool:
        """Measured peak <= budget."""
        return self.measured_peak_bytes <= self.budget_bytes

    @property
    def prediction_error(self) -> float:
        """(predicted - measured) / measured."""
        return (self.predicted_peak_bytes - self.measured_peak_bytes) / max(self.measured_peak_bytes, 1)

    def table(self) -> str:
        """A short human-readable report."""
        return "\n".join([
            f"budget {format_bytes(self.budget_bytes)}; measured peak {format_bytes(self.measured_peak_bytes)} "
            f"({'within' if self.within_budget else 'OVER'} budget); "
            f"predicted {format_bytes(self.predicted_peak_bytes)} ({self.prediction_error:+.1%})",
            f"no checkpointing: {format_bytes(self.no_checkpointing_peak_bytes)}; saving "
            f"{1 - self.measured_peak_bytes / max(self.no_checkpointing_peak_bytes, 1):.0%}",
            f"gradients {'bitwise equal' if self.gradients_equal else 'DIFFER'} "
            f"(max |difference| {self.max_gradient_difference:.3g}); step {self.step_time_s:.3f} s vs "
            f"{self.no_checkpointing_step_time_s:.3f} s without checkpointing",
        ])

    def __str__(self) -> str:
        return self.table()


def _measured_step(runner: StepRunner, seed: int) -> tuple[int, float, list[tuple[np.ndarray | None, torch.dtype]]]:
    runner.clear_grads()
    # The caller's RNG streams (CPU and CUDA) are kept as NumPy bytes, which the meter does not count,
    # and come back however the step ends; every measured step draws from the same seed.
    with preserved_rng():
        torch.manual_seed(seed)
        start = time.perf_counter()
        with MemoryMeter() as meter:
            runner.forward_backward()
        elapsed = time.perf_counter() - start
    grads = [(None if p.grad is None else host_bytes(p.grad), p.dtype) for p in runner.model.parameters()]
    runner.clear_grads()
    return meter.peak_bytes, elapsed, grads


def _compare(grads: list, reference: list) -> tuple[bool, float]:
    """Bitwise equality of all gradients, and the largest absolute difference (as float64)."""
    equal, difference = True, 0.0
    for (a, dtype), (b, _) in zip(grads, reference):
        if a is None or b is None:
            equal &= a is None and b is None
            continue
        if np.array_equal(a, b):
            continue
        equal = False
        values = [torch.from_numpy(x).view(dtype).double() for x in (a, b)]
        difference = max(difference, (values[0] - values[1]).abs().max().item())
    return equal, difference


def verify_plan(model: nn.Module, plan: Plan, example_inputs: tuple | dict, *,
           loss_fn: Callable[[Any], torch.Tensor] | None = None, seed: int = 0) -> VerifyReport:
    """Measure one step with ``plan`` applied and one without; gradients are cleared afterwards.

    Example:
        >>> import torchckpt
        >>> from torchckpt.models import gpt
        >>> model = gpt("tiny")
        >>> batch = model.example_batch(batch_size=4, seq_len=128)
        >>> plan = torchckpt.plan(model, batch, budget="75%")
        >>> report = verify_plan(model, plan, batch)
        >>> report.within_budget, report.gradients_equal
        (True, True)
    """
    plan.check_fits(model, example_inputs)
    runner = StepRunner(model, example_inputs, loss_fn)
    _measured_step(runner, seed)  # warm-up: first-call costs out of the way
    plain_peak, plain_time, plain_grads = _measured_step(runner, seed)
    with apply_plan(model, plan):
        peak, step_time, grads = _measured_step(runner, seed)
    equal, difference = _compare(grads, plain_grads)
    return VerifyReport(budget_bytes=plan.budget_bytes, predicted_peak_bytes=plan.predicted_peak_bytes,
                        measured_peak_bytes=peak, no_checkpointing_peak_bytes=plain_peak, gradients_equal=equal,
                        max_gradient_difference=difference, step_time_s=step_time,
                        no_checkpointing_step_time_s=plain_time)
