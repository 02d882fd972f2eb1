"""verify_plan with the optimizer a plan was made with (issue 28, defect 6): its state, which profiling made with one
real step, is alive in both measured steps, so the prediction is the measurement; and it comes back as it was."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import torchckpt
from torchckpt.models import gpt
from torchckpt.planner.runner import StepRunner

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.mark.parametrize("budget", ["80%", pytest.param("100%", marks=pytest.mark.slow)])
def test_adamw_without_state_yet_is_measured_as_planned(budget: str) -> None:
    torch.manual_seed(0)
    model = gpt("tiny", dropout=0.0)
    batch = model.example_batch(batch_size=8, seq_len=128)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)  # no step taken: no state
    made = torchckpt.plan(model, batch, budget, optimizer=optimizer)
    assert len(optimizer.state) == 0
    report = torchckpt.verify_plan(model, made, batch, optimizer=optimizer)
    assert len(optimizer.state) == 0  # the warm-up's step is undone
    assert report.within_budget and report.gradients_equal, report.table()
    # the state (two moments, 8-16% of this step) was the whole "prediction error" before
    assert abs(report.measured_peak_bytes - made.predicted_peak_bytes) <= 0.01 * made.predicted_peak_bytes


def test_an_optimizer_with_state_keeps_it_exactly() -> None:
    torch.manual_seed(0)
    model = gpt("tiny", dropout=0.0)
    batch = model.example_batch(batch_size=4, seq_len=64)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    StepRunner(model, batch).forward_backward()  # a run in progress: the optimizer's state exists
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    before = {id(p): {k: v.clone() for k, v in s.items()} for p, s in optimizer.state.items()}
    made = torchckpt.plan(model, batch, "85%", optimizer=optimizer)
    report = torchckpt.verify_plan(model, made, batch, optimizer=optimizer)
    assert report.within_budget and report.gradients_equal, report.table()
    for param, state in optimizer.state.items():
        assert all(np.array_equal(state[k].numpy(), before[id(param)][k].numpy()) for k in state)
