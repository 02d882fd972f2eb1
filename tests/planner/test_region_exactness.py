"""A region must never change a loss or a gradient (profile's [a region must be exact]).

A U-Net-style encoder whose blocks return ``(h, skip)`` and are called as ``h, s = blk(h)``, the skips
summed into the output after the loop: the blocks pass their first output on as a chain, but a region's
blocks after its first return the region output's skip instead of their own, which changed the loss
(0.4517 -> 0.5602 here) and the gradients (max difference 0.042) before the profiler checked every
output a block returns and every read of it.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import torchckpt
from torchckpt.planner import solve as solver
from torchckpt.planner.plan import PlannedRegion
from torchckpt.planner.profile import profile

WIDTH, BATCH, TOKENS, DEPTH = 32, 8, 256, 6


class _SkipBlock(nn.Module):
    def __init__(self, skip: bool = True) -> None:
        super().__init__()
        self.up, self.down = nn.Linear(WIDTH, 4 * WIDTH), nn.Linear(4 * WIDTH, WIDTH)
        self.skip = nn.Linear(WIDTH, WIDTH)
        self.drop = nn.Dropout(0.1)
        self.returns_skip = skip

    def forward(self, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        h2 = h + self.drop(self.down(nn.functional.gelu(self.up(h))))
        return h2, (self.skip(h2) if self.returns_skip else None)


class _Encoder(nn.Module):
    """``mode``: "skips" (the U-Net pattern), "none" (blocks return ``(h, None)``: a true chain), or
    "hidden" (every block's output is also collected and read after the loop)."""

    def __init__(self, mode: str) -> None:
        super().__init__()
        self.mode = mode
        self.embed = nn.Linear(WIDTH, WIDTH)
        self.blocks = nn.ModuleList(_SkipBlock(skip=mode == "skips") for _ in range(DEPTH))
        self.head = nn.Linear(WIDTH, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x)
        kept = []
        for block in self.blocks:
            h, s = block(h)
            kept.append(s if self.mode == "skips" else h)
        if self.mode != "none":
            for s in reversed(kept[:-1]):
                h = h + s
        return self.head(h).pow(2).mean()


def _model(mode: str) -> tuple[nn.Module, tuple]:
    torch.manual_seed(0)
    model = _Encoder(mode).train()
    return model, (torch.randn(BATCH, TOKENS, WIDTH, generator=torch.Generator().manual_seed(1)),)


def _loss(model: nn.Module, batch: tuple) -> torch.Tensor:
    torch.manual_seed(3)
    with torch.no_grad():
        return model(*batch)


@pytest.mark.parametrize("mode", ["skips", pytest.param("hidden", marks=pytest.mark.slow)])  # 20 s each
def test_plans_with_block_outputs_read_elsewhere_keep_losses_and_gradients(mode: str) -> None:
    model, batch = _model(mode)
    costs = profile(model, batch)
    assert not costs.chain and "read by code outside the blocks" in costs.notes["chain"], costs.notes
    floor = solver.floor_bytes(costs)
    top, _ = solver.evaluate(costs, tuple(solver.Single(block=i, option=0) for i in range(DEPTH)))
    plain_loss = _loss(model, batch)
    # From (just above: each plan profiles anew) the floor up; the old planner chose regions at the lower three.
    for k, share in enumerate((0.02, 0.25, 0.5, 0.75)):
        plan = torchckpt.plan(model, batch, budget=int(floor + (top - floor) * share))
        assert not any(isinstance(piece, PlannedRegion) for piece in plan.schedule), plan.table()
        assert "read by code outside the blocks" in plan.notes["regions"] and "regions:" in plan.table()
        report = torchckpt.verify_plan(model, plan, batch)
        assert report.gradients_equal, (k, report.max_gradient_difference, plan.table())
        assert report.within_budget, (k, report.table(), plan.table())
        with torchckpt.apply(model, plan):
            planned_loss = _loss(model, batch)
        assert torch.equal(planned_loss, plain_loss), (k, planned_loss.item(), plain_loss.item(), plan.table())


def test_blocks_returning_a_tuple_without_other_tensors_still_nest() -> None:
    model, batch = _model("none")
    costs = profile(model, batch)
    assert costs.chain and costs.notes["chain"].startswith("yes"), costs.notes
    floor = solver.floor_bytes(costs)
    top, _ = solver.evaluate(costs, tuple(solver.Single(block=i, option=0) for i in range(DEPTH)))
    plan = torchckpt.plan(model, batch, budget=int(floor + (top - floor) * 0.02))
    assert any(isinstance(piece, PlannedRegion) for piece in plan.schedule), plan.table()
    report = torchckpt.verify_plan(model, plan, batch)
    assert report.gradients_equal and report.within_budget, report.table()
    plain_loss = _loss(model, batch)
    with torchckpt.apply(model, plan):
        assert torch.equal(_loss(model, batch), plain_loss)


def test_regions_false_plans_single_blocks_only() -> None:
    model, batch = _model("none")
    costs = profile(model, batch)
    # A budget that regions reach and single blocks barely do.
    floor = solver.floor_bytes(costs, allow_regions=False)
    assert solver.floor_bytes(costs) < floor
    plan = torchckpt.plan(model, batch, budget=int(floor * 1.01), regions=False)
    assert not any(isinstance(piece, PlannedRegion) for piece in plan.schedule), plan.table()
    assert plan.notes["regions"] == "off (regions=False)"
    assert torchckpt.Plan.from_json(plan.to_json()) == plan
    front = torchckpt.frontier(model, batch, points=3, regions=False)
    assert all(not any(isinstance(piece, PlannedRegion) for piece in point.plan.schedule)
               for point in front.points if point.plan is not None)
