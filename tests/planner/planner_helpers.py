"""Shared by the planner-accuracy tests: a schedule's predicted peak against the meter's."""

from __future__ import annotations

from torch import nn

import torchckpt
from torchckpt.planner import solve as solver
from torchckpt.planner.from_costs import ChainCosts, plan_pieces
from torchckpt.planner.plan import fingerprint


def prediction_error(model: nn.Module, batch: tuple, costs: ChainCosts, schedule: tuple) -> int:
    """predicted peak - measured peak of ``schedule`` on ``model.blocks`` (``fixed_bytes`` holds no headroom;
    the margin is kept by the solver, not the prediction); gradients must equal the plain model's."""
    paths = [f"blocks.{i}" for i in range(len(costs.blocks))]
    menus = [solver.block_menu(block) for block in costs.blocks]
    predicted, _ = solver.evaluate(costs, schedule)
    plan = torchckpt.Plan(budget_bytes=int(predicted), predicted_peak_bytes=int(predicted), predicted_extra_time_s=0.0,
                          schedule=plan_pieces(schedule, menus), block_paths=tuple(paths),
                          fingerprint=fingerprint(model, batch, paths))
    report = torchckpt.verify_plan(model, plan, batch)
    assert report.gradients_equal, plan.table()
    return int(predicted) - report.measured_peak_bytes
