"""Issue 13: one profile serves many budgets (``profile(model, batch).plan(budget)``), and the plans equal
``plan()``'s at the same budgets.

Two of the three budgets decide the schedule whatever the measured times are (no checkpointing at
"100%"; every block checkpointed at its measured peak, which no unmeasured plan reaches with its
margin), so those plans are compared whole; at the third, a timing tie could pick another plan of the
same cost, so only its budget, its fit and its predicted peak (loosely) are compared.
"""

from __future__ import annotations

import gc

import pytest
import torch

import torchckpt
from torchckpt.models import gpt
from torchckpt.planner.from_costs import ChainCosts
from torchckpt.planner.profile import profile


def _same_plan(a: torchckpt.Plan, b: torchckpt.Plan) -> None:
    assert (a.budget_bytes, a.schedule, a.predicted_peak_bytes) == (b.budget_bytes, b.schedule, b.predicted_peak_bytes)
    assert (a.block_paths, a.fingerprint) == (b.block_paths, b.fingerprint)


@pytest.mark.slow  # 21 s; one profile, several plans is checked fast in test_planner.py
def test_plans_from_one_profile_equal_plan_at_three_budgets() -> None:
    torch.manual_seed(0)
    model = gpt("tiny", dropout=0.0)
    batch = model.example_batch(batch_size=4, seq_len=128)
    gc.collect()
    costs = torchckpt.profile(model, batch)
    assert costs.block_paths == ("blocks.0", "blocks.1")
    assert costs.fingerprint == torchckpt.planner.fingerprint(model, batch, list(costs.block_paths))
    every_block = costs.every_block_peak_bytes
    for budget in ("100%", every_block):
        gc.collect()
        _same_plan(costs.plan(budget), torchckpt.plan(model, batch, budget=budget))
    assert all(piece.recomputes for piece in costs.plan(every_block).schedule)
    gc.collect()
    once, again = costs.plan("90%"), torchckpt.plan(model, batch, budget="90%")
    assert once.budget_bytes == again.budget_bytes and once.block_paths == again.block_paths
    for made in (once, again):
        assert made.predicted_peak_bytes + made.reference["margin_bytes"] <= made.budget_bytes
        assert made.reference["margin_bytes"] > 0  # a plan the profiler did not measure
    assert abs(once.predicted_peak_bytes - again.predicted_peak_bytes) <= 0.1 * once.budget_bytes
    report = torchckpt.verify_plan(model, once, batch)  # the plan from the costs applies to the model profiled
    assert report.within_budget and report.gradients_equal


def test_costs_keep_what_a_plan_needs_through_json() -> None:
    model = gpt("tiny", dropout=0.0)
    batch = model.example_batch(batch_size=2, seq_len=16)
    costs = profile(model, batch)
    loaded = ChainCosts.from_json(costs.to_json())
    assert loaded == costs
    assert loaded.plan("100%") == costs.plan("100%")
    made = loaded.plan(costs.every_block_peak_bytes)
    made.check_fits(model, batch)  # the fingerprint came along
    with pytest.raises(ValueError, match="a percentage must be a number followed by %"):
        costs.plan("lots%")
    with pytest.raises(ValueError, match="is not a size"):
        costs.plan("six gigs")
    with pytest.raises(ValueError, match="margin must be"):
        costs.plan("90%", margin=-5)
