"""verify_plan and plan_without_side_effects hand the caller's RNG streams back exactly as they were."""

from __future__ import annotations

import torch

import torchckpt
from torchckpt.models import gpt
from torchckpt.planner import plan_without_side_effects


def test_verify_plan_and_planning_leave_the_rng_streams_alone() -> None:
    model = gpt("tiny")  # dropout on: every measured step draws random numbers
    batch = model.example_batch(batch_size=4, seq_len=128)
    torch.manual_seed(1234)
    before = torch.get_rng_state()
    plan = plan_without_side_effects(model, batch, "90%")
    assert torch.equal(torch.get_rng_state(), before)
    report = torchckpt.verify_plan(model, plan, batch, seed=7)
    assert report.gradients_equal
    assert torch.equal(torch.get_rng_state(), before)
    expected = torch.rand(3)
    torch.set_rng_state(before)
    assert torch.equal(torch.rand(3), expected)
