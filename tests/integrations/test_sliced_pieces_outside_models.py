"""Issue 27, item 2 on models nobody here wrote: with ``batch_slices``, a block refused for running in slices (dropout
between or inside its pieces, LoRA's dropout in its attention) may still run its exact pieces in slices of the batch
(planner/batch_slices.py's [a refused block's pieces may run in slices]); the plan at the floor measures within its
budget, as predicted, with every gradient of no checkpointing bitwise but the sliced pieces' parameters (to
rounding), buffers bitwise."""

from __future__ import annotations

import pytest
from outside_models import case_for

import torchckpt
from torchckpt.planner import InfeasibleBudgetError
from torchckpt.planner.verify import loss_head_parameters, sliced_modules, sliced_parameters

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.mark.parametrize("name", ["gpt2", "roberta", pytest.param("lora_llama", marks=pytest.mark.slow),
                                  pytest.param("vit", marks=pytest.mark.slow)])
def test_exact_pieces_of_refused_blocks_plan_within_budget(name: str) -> None:
    case = case_for(name)
    model = case.model
    costs = torchckpt.profile(model, case.inputs, loss_fn=case.loss_fn, batch_slices=2)
    with_pieces = [block for block in costs.blocks if block.nested_sliced_pieces]
    assert with_pieces and all(block.nested_slices == 1 for block in with_pieces), costs.notes.get("batch slices")
    assert "of those may (their pieces nested)" in costs.notes["batch slices"]
    with pytest.raises(InfeasibleBudgetError) as told:
        costs.plan(1)
    plan = costs.plan(told.value.floor_bytes)
    report = torchckpt.verify_plan(model, plan, case.inputs, loss_fn=case.loss_fn)
    assert report.within_budget and abs(report.prediction_error) <= 0.01, report
    assert report.gradients_equal and report.buffers_equal, (report, report.first_differing_buffer)
    named = sliced_parameters(model, sliced_modules(model, plan)) + loss_head_parameters(model, plan)
    allowed = {name for _, name in named}
    assert set(report.rounding_only) <= allowed, (report.rounding_only, allowed)
