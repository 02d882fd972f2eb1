"""Blocks with no backward pass (frozen leading blocks fed an input that needs no gradient, or run under
torch.no_grad()): the profiler must not count their input as held, and no schedule may be under-predicted
(issue 28, defect 1: a region over the frozen blocks was credited with a hidden state that nothing held, and the
plan at the floor measured one hidden state over its budget; costs.py's [what a piece holds])."""
from __future__ import annotations

import pytest
import torch
from planner_helpers import prediction_error
from torch import nn

import torchckpt
from torchckpt.planner import InfeasibleBudgetError
from torchckpt.planner import solve as solver
from torchckpt.planner.from_costs import ChainCosts
from torchckpt.planner.profile import profile

WIDTH, BATCH, DEPTH, FROZEN = 64, 512, 6, 2


class _Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up, self.down = nn.Linear(WIDTH, 2 * WIDTH), nn.Linear(2 * WIDTH, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.nn.functional.gelu(self.up(x)))


class _Stack(nn.Module):
    def __init__(self, no_grad_section: bool) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(_Block() for _ in range(DEPTH))
        self.no_grad_section = no_grad_section

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for i, block in enumerate(self.blocks):
            with torch.set_grad_enabled(not (self.no_grad_section and i < FROZEN)):
                x = block(x)
        return x.pow(2).mean()


def _model(how: str) -> tuple[nn.Module, tuple]:
    torch.manual_seed(0)
    model = _Stack(no_grad_section=how == "no_grad")
    if how == "frozen":
        for block in model.blocks[:FROZEN]:
            block.requires_grad_(False)
    return model, (torch.randn(BATCH, WIDTH, generator=torch.Generator().manual_seed(1)),)


@pytest.mark.parametrize("how", ["frozen", "no_grad"])
def test_leading_blocks_without_backward(how: str) -> None:
    model, batch = _model(how)
    costs = profile(model, batch, blocks=list(model.blocks))
    if how == "no_grad":  # a region would run the blocks after the section without gradients too: none is made
        assert not costs.chain and "gradients off" in costs.notes["chain"], costs.notes
    else:
        # block 0's input is the batch (alive); block 1's is freed in the forward pass: nothing saves it
        assert [b.input_held_when_plain for b in costs.blocks[:FROZEN]] == [True, False]
        _regions_predicted_safely(model, batch, costs)
    with pytest.raises(InfeasibleBudgetError) as error:
        costs.plan(1)
    plan = costs.plan(error.value.floor_bytes)
    report = torchckpt.verify_plan(model, plan, batch)
    assert report.within_budget and report.gradients_equal, report.table()


def _regions_predicted_safely(model: nn.Module, batch: tuple, costs: ChainCosts) -> None:
    menus = [solver.block_menu(b) for b in costs.blocks]
    last = [len(m) - 1 for m in menus]
    region = solver.Region(0, FROZEN, tuple(solver.Single(i, 0) for i in range(FROZEN)))
    for rest in (0, "last"):
        schedule = (region, *(solver.Single(i, 0 if rest == 0 else last[i]) for i in range(FROZEN, DEPTH)))
        assert prediction_error(model, batch, costs, schedule) >= -1024, schedule
