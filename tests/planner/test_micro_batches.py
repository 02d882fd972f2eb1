"""Gradient accumulation (issue 28, defect 2): ``plan(..., micro_batches=k)`` holds its budget on every micro-batch.

The second micro-batch of an accumulating loop starts with the first's gradients alive, so a plan measured on one
micro-batch went over its budget there. Each test runs the user's own accumulation loop under the meter and
compares it with the plain loop's accumulated gradients bitwise (Note: [a later micro-batch peaks highest]).
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from torch import nn

import torchckpt
from torchckpt.memory import MemoryMeter
from torchckpt.planner import InfeasibleBudgetError

pytestmark = pytest.mark.usefixtures("one_thread")
CPU = torch.device("cpu")


class Block(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.up, self.down = nn.Linear(width, 4 * width), nn.Linear(4 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.nn.functional.gelu(self.up(x)))


class Stack(nn.Module):
    """Parameters (and so gradients) large beside the activations: accumulation moves the peak most here."""

    def __init__(self, width: int = 128, depth: int = 4) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Block(width) for _ in range(depth))
        self.head = nn.Linear(width, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return self.head(x).square().mean()


def _batches(count: int, width: int = 128) -> list[tuple[torch.Tensor]]:
    generator = torch.Generator().manual_seed(1)
    return [(torch.randn(128, width, generator=generator),) for _ in range(count)]


def _floor(model: nn.Module, batch: tuple, **options: object) -> int:
    with pytest.raises(InfeasibleBudgetError) as error:
        torchckpt.plan(model, batch, "1%", **options)
    return error.value.floor_bytes


def _accumulate(model: nn.Module, batches: list[tuple[torch.Tensor]]) -> tuple[list[int], list[np.ndarray]]:
    """The user's loop: one backward pass per micro-batch, no optimizer step between; each micro-batch's peak, and
    the accumulated gradients as NumPy bytes (the meter counts every live tensor, and these are not the step's)."""
    model.zero_grad(set_to_none=True)
    peaks = []
    for batch in batches:
        with MemoryMeter(CPU) as meter:
            loss = model(*batch)
            loss.backward()
            del loss
        peaks.append(meter.peak_bytes)
    grads = [p.grad.numpy().copy() for p in model.parameters()]
    model.zero_grad(set_to_none=True)
    return peaks, grads


def test_a_plan_for_two_micro_batches_holds_its_budget_on_each_and_accumulates_bitwise() -> None:
    torch.manual_seed(0)
    model = Stack()
    batches = _batches(3)
    _, plain_grads = _accumulate(model, batches)
    one = torchckpt.plan(model, batches[0], _floor(model, batches[0]))
    with torchckpt.apply(model, one):
        one_peaks, _ = _accumulate(model, batches)
    # the defect: planned for one micro-batch, the second goes over (its gradients were not counted)
    assert one_peaks[0] <= one.budget_bytes < one_peaks[1], (one_peaks, one.budget_bytes)

    budget = _floor(model, batches[0], micro_batches=2)
    made = torchckpt.plan(model, batches[0], budget, micro_batches=2)
    assert made.micro_batches == 2 and "2 micro-batches per optimizer step" in made.table()
    assert made.predicted_extra_time_s > 0  # something is recomputed, at the floor
    with torchckpt.apply(model, made):
        peaks, grads = _accumulate(model, batches)
    assert max(peaks) <= budget, (peaks, budget, made.table())
    assert all(np.array_equal(a, b) for a, b in zip(grads, plain_grads))
    report = torchckpt.verify_plan(model, made, batches[0])  # measures a later micro-batch, as planned
    assert report.within_budget and report.gradients_equal and report.buffers_equal, report.table()
    assert report.measured_peak_bytes == max(peaks[1:]), (report.measured_peak_bytes, peaks)


def test_planning_for_micro_batches_leaves_the_accumulated_gradients_as_they_were() -> None:
    torch.manual_seed(0)
    model = Stack(width=64, depth=3)
    batch = _batches(1, 64)[0]
    model(*batch).backward()  # halfway through an accumulation: gradients exist
    before = [p.grad.numpy().copy() for p in model.parameters()]
    made = torchckpt.plan(model, batch, "100%", micro_batches=4)
    torchckpt.verify_plan(model, made, batch)
    assert all(np.array_equal(p.grad.numpy(), g) for p, g in zip(model.parameters(), before))


def test_a_step_fn_that_runs_two_micro_batches_is_told_the_fix_and_the_fix_works() -> None:
    torch.manual_seed(0)
    model = Stack(width=64, depth=3)
    batches = _batches(2, 64)

    def two_micro_batches(model: nn.Module, inputs: tuple) -> torch.Tensor:
        for batch in batches:
            loss = model(*batch)
            loss.backward()
        return loss

    with pytest.raises(ValueError, match=r"micro_batches=2") as error:
        torchckpt.plan(model, batches[0], "100%", step_fn=two_micro_batches)
    assert "run one micro-batch" in str(error.value)

    def one_micro_batch(model: nn.Module, inputs: tuple) -> torch.Tensor:
        loss = model(*inputs)
        loss.backward()
        return loss

    made = torchckpt.plan(model, batches[0], "100%", step_fn=one_micro_batch, micro_batches=2)
    report = torchckpt.verify_plan(model, made, batches[0], step_fn=one_micro_batch)
    assert report.within_budget and report.gradients_equal


@pytest.mark.parametrize("bad", [0, -1, 1.5, True, "2"])
def test_a_bad_micro_batch_count_is_refused_before_measuring(bad: object) -> None:
    model = Stack(width=8, depth=2)
    with pytest.raises(ValueError, match="micro_batches must be an int >= 1"):
        torchckpt.plan(model, _batches(1, 8)[0], "100%", micro_batches=bad)


def test_the_optimizer_in_the_backward_pass_cannot_accumulate() -> None:
    model = Stack(width=8, depth=2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(ValueError, match="cannot accumulate over micro_batches=2"):
        torchckpt.plan(model, _batches(1, 8)[0], "100%", optimizer=optimizer, optimizer_in_backward=True,
                       micro_batches=2)


def test_the_micro_batch_count_survives_the_plans_json() -> None:
    torch.manual_seed(0)
    model = Stack(width=32, depth=2)
    batch = _batches(1, 32)[0]
    made = torchckpt.plan(model, batch, "100%", micro_batches=3)
    text = made.to_json()
    assert json.loads(text)["micro_batches"] == 3 and json.loads(text)["version"] == 2
    assert torchckpt.Plan.from_json(text) == made
    single = torchckpt.plan(model, batch, "100%")
    assert "micro_batches" not in json.loads(single.to_json()) and json.loads(single.to_json())["version"] == 1
