"""The floor is told in parts (solve/floor_parts.py): on a measured model the parts sum to the floor exactly,
the training state is counted analytically, the levers named are the ones that apply, and a budget below the
floor says all of it while a budget at the floor plans."""

from __future__ import annotations

import pytest
import torch

from torchckpt.models import gpt
from torchckpt.planner.from_costs import plan_from_costs
from torchckpt.planner.profile import profile
from torchckpt.planner.solve import InfeasibleBudgetError

_PART_KEYS = ("parameters_bytes", "optimizer_state_bytes", "outside_bytes", "checkpoint_bytes", "other_held_bytes",
              "own_bytes", "margin_bytes")


def _model_batch_optimizer() -> tuple[torch.nn.Module, tuple, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = gpt("tiny")
    return model, model.example_batch(batch_size=4, seq_len=64), torch.optim.AdamW(model.parameters(), lr=1e-3)


@pytest.fixture(scope="module")
def measured() -> tuple:
    model, batch, optimizer = _model_batch_optimizer()
    costs = profile(model, batch, optimizer=optimizer)
    return model, costs


def _below_floor(costs, **options) -> InfeasibleBudgetError:
    with pytest.raises(InfeasibleBudgetError) as caught:
        plan_from_costs(costs, 1, block_paths=costs.block_paths, model_fingerprint="test",
                        **options)
    return caught.value


def test_the_parts_sum_to_the_floor_and_the_state_is_counted_analytically(measured: tuple) -> None:
    model, costs = measured
    error = _below_floor(costs)
    parts = error.breakdown
    assert sum(parts[key] for key in _PART_KEYS) == parts["floor_bytes"] == error.floor_bytes
    parameters = sum(p.numel() * p.element_size() for p in model.parameters())
    assert parts["parameters_bytes"] == parameters == costs.state_bytes["parameters"]
    assert costs.state_bytes["gradients"] == parameters  # every parameter trains, in float32
    # AdamW: two moments per parameter plus a float32 step counter per parameter tensor
    assert parts["optimizer_state_bytes"] == 2 * parameters + 4 * len(list(model.parameters()))
    assert parts["outside_bytes"] > 0 and parts["own_bytes"] > 0


def test_the_message_names_the_parts_the_binding_block_and_the_levers(measured: tuple) -> None:
    _, costs = measured
    message = str(_below_floor(costs))
    assert "is below the smallest feasible peak" in message
    for part in ("parameters ", "optimizer state ", "more alive outside the blocks", "itself ("):
        assert part in message, (part, message)
    assert "(blocks." in message and "('" not in message, message  # blocks named by module path
    for lever in ("optimizer_in_backward=True", "micro_batches=k", "(FSDP/ZeRO)", "optimizer_offload=True",
                  "offload=True"):
        assert lever in message, (lever, message)
    assert f"Any budget >= {_below_floor(costs).floor_bytes} bytes is feasible" in message


def test_a_budget_at_the_told_floor_plans_and_its_table_tells_the_same_floor(measured: tuple) -> None:
    _, costs = measured
    floor = _below_floor(costs).floor_bytes
    plan = plan_from_costs(costs, floor, block_paths=costs.block_paths, model_fingerprint="test")
    assert plan.predicted_peak_bytes <= floor
    note = plan.notes["floor"]
    assert "the least budget any plan fits" in note and "optimizer_in_backward=True" in note, note
    assert "floor: " in plan.table() and "('" not in note, note
    with pytest.raises(InfeasibleBudgetError):
        plan_from_costs(costs, floor - 1, block_paths=costs.block_paths, model_fingerprint="test")


def test_a_lever_already_pulled_is_not_offered() -> None:
    model, batch, optimizer = _model_batch_optimizer()
    costs = profile(model, batch, optimizer=optimizer, optimizer_in_backward=True)
    message = str(_below_floor(costs))
    assert "optimizer_in_backward=True" not in message and "micro_batches=k" in message, message


def test_without_an_optimizer_no_optimizer_state_is_claimed() -> None:
    torch.manual_seed(0)
    model = gpt("tiny")
    costs = profile(model, model.example_batch(batch_size=4, seq_len=64))
    error = _below_floor(costs)
    assert error.breakdown["optimizer_state_bytes"] == 0 and "+ optimizer state " not in str(error)
    assert sum(error.breakdown[key] for key in _PART_KEYS) == error.floor_bytes
