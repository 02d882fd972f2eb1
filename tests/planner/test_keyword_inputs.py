"""A block whose hidden state comes by keyword (``block(temb=e, hidden_states=h)``, as diffusers calls its
down blocks) is measured and planned exactly as the same model calling it by position: the profiler and
regions read every block call through ``blocks.positional_form`` (one mechanism for both)."""

from __future__ import annotations

import gc

import pytest
import torch
from torch import nn

import torchckpt
from torchckpt.planner import block_paths, fingerprint, profile
from torchckpt.planner import solve as solver
from torchckpt.planner.blocks import positional_form
from torchckpt.planner.from_costs import plan_pieces
from torchckpt.planner.plan import PlannedRegion

pytestmark = pytest.mark.usefixtures("one_thread")


class Block(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.fc1, self.fc2, self.emb = nn.Linear(width, 4 * width), nn.Linear(4 * width, width), nn.Linear(8, width)

    def forward(self, hidden_states: torch.Tensor, temb: torch.Tensor | None = None) -> torch.Tensor:
        return hidden_states + self.fc2(torch.relu(self.fc1(hidden_states + self.emb(temb))))


class Net(nn.Module):
    def __init__(self, call: str, width: int = 64, depth: int = 4) -> None:
        super().__init__()
        self.call = call
        self.inp, self.t = nn.Linear(16, width), nn.Linear(1, 8)
        self.layers = nn.ModuleList(Block(width) for _ in range(depth))
        self.head = nn.Linear(width, 1)

    def forward(self, x: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        h, e = self.inp(x), self.t(t)
        for layer in self.layers:
            h = layer(temb=e, hidden_states=h) if self.call == "keyword" else layer(h, e)
        return self.head(h).pow(2).mean()


def _inputs() -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(1)
    return torch.randn(256, 16, generator=generator), torch.randn(256, 1, generator=generator)


def _figures(costs) -> list:  # noqa: ANN001
    return [costs.fixed_bytes, costs.head_bytes, costs.chain] + [
        (b.input_bytes, b.output_bytes, b.saved_bytes, b.input_held_when_plain, b.freed_side_input_bytes,
         [(op.name, op.output_bytes, op.saved) for op in b.ops]) for b in costs.blocks]


def test_positional_form_moves_only_a_keyword_first_parameter() -> None:
    block = Block(4)
    h, e = torch.ones(1, 4), torch.ones(1, 8)
    assert positional_form(block, (), {"temb": e, "hidden_states": h}) == ((h,), {"temb": e})
    assert positional_form(block, (h,), {"temb": e}) == ((h,), {"temb": e})
    assert positional_form(block, (), {"temb": e}) == ((), {"temb": e})  # no first parameter given: as it came
    assert positional_form(nn.Identity(), (), {"input": h}) == ((h,), {})


def test_a_keyword_hidden_state_is_measured_as_a_positional_one() -> None:
    found = {}
    for call in ("position", "keyword"):
        gc.collect()  # earlier tests' garbage freed mid-step would move fixed_bytes
        torch.manual_seed(0)
        found[call] = _figures(profile(Net(call), _inputs()))
    assert found["keyword"] == found["position"]
    assert found["keyword"][2] is True  # a chain: regions allowed


def test_a_region_runs_blocks_called_by_keyword_exactly() -> None:
    torch.manual_seed(0)
    model, inputs = Net("keyword"), _inputs()
    paths = block_paths(model, list(model.layers))
    costs = profile(model, inputs)
    inner = tuple(solver.Single(block=i, option=0) for i in range(2))
    schedule = (solver.Region(0, 2, inner), solver.Region(2, 4, (solver.Single(block=2, option=0),
                                                                 solver.Single(block=3, option=0))))
    predicted, _ = solver.evaluate(costs, schedule)
    menus = [solver.block_menu(block) for block in costs.blocks]
    plan = torchckpt.Plan(budget_bytes=int(predicted), predicted_peak_bytes=int(predicted), predicted_extra_time_s=0.0,
                          schedule=plan_pieces(schedule, menus), block_paths=tuple(paths),
                          fingerprint=fingerprint(model, inputs, paths))
    assert [type(piece) for piece in plan.schedule] == [PlannedRegion, PlannedRegion]
    report = torchckpt.verify_plan(model, plan, inputs)  # the regions call layers 1 and 3 by position
    assert report.within_budget and report.gradients_equal and report.buffers_equal, report.table()
