"""Issue 27, item 2 (outside the blocks): the work before the first block (a CNN's stem) is planned as a block
where that measures lower, bitwise and within budget, and is left alone, saying why, where it does not
(stem.py's rules)."""

from __future__ import annotations

import pytest
import torch
from test_other_blocks import ConvBlock  # a residual block of two 3x3 convolutions (conftest.py: on sys.path)
from torch import nn

import torchckpt
from torchckpt.planner import InfeasibleBudgetError
from torchckpt.planner.runner import StepRunner
from torchckpt.planner.stem import find_stem

pytestmark = pytest.mark.usefixtures("one_thread")


class StemNet(nn.Module):
    """A ResNet's shape: a full-resolution stem (convolution, BatchNorm, ReLU, pooling) whose activations
    outweigh what any one block holds, then residual blocks on the pooled grid."""

    def __init__(self, scale: float = 1.0) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU(), nn.MaxPool2d(2))
        self.layers = nn.ModuleList(ConvBlock(16) for _ in range(4))
        self.head = nn.Linear(16, 10)
        self.scale = scale

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.stem(x)
        if self.scale != 1.0:  # the first block's input is then no module's output
            x = x * self.scale
        for layer in self.layers:
            x = layer(x)
        return self.head(x.mean((2, 3)))


def _loss(out: torch.Tensor) -> torch.Tensor:
    return out.square().mean()


def _batch() -> tuple[torch.Tensor]:
    return (torch.randn(8, 3, 32, 32, generator=torch.Generator().manual_seed(0)),)


def _floor(model: nn.Module, **options: object) -> int:
    with pytest.raises(InfeasibleBudgetError) as error:
        torchckpt.plan(model, _batch(), 1, loss_fn=_loss, **options)
    return error.value.floor_bytes


def test_the_stem_is_found_as_the_outermost_module_making_the_first_blocks_input() -> None:
    model = StemNet()
    runner = StepRunner(model, _batch(), loss_fn=_loss)
    assert find_stem(runner, list(model.layers)) == "stem"
    scaled = StemNet(scale=0.5)
    assert find_stem(StepRunner(scaled, _batch(), loss_fn=_loss), list(scaled.layers)) is None
    with pytest.raises(ValueError, match="needs the blocks"):
        find_stem(runner, [])


def test_a_stem_is_planned_as_the_first_block_lowering_the_floor_bitwise_and_within_budget() -> None:
    torch.manual_seed(0)
    model = StemNet()
    costs = torchckpt.profile(model, _batch(), loss_fn=_loss)
    assert costs.block_paths[0] == "stem" and list(costs.block_paths[1:]) == [f"layers.{i}" for i in range(4)]
    assert costs.notes["stem"].startswith("stem taken as the first block: every block checkpointed"), costs.notes
    assert costs.notes["regions"].startswith("off: the stem"), costs.notes  # regions over a stem are not modelled
    by_hand = _floor(model, blocks=list(model.layers))  # the blocks alone, the stem's activations fixed
    floor = _floor(model)
    assert floor < by_hand, (floor, by_hand)
    plan = costs.plan(floor)
    assert plan.block_paths[0] == "stem" and "\nstem: stem taken as the first block" in str(plan)  # the table says so
    report = torchckpt.verify_plan(model, plan, _batch(), loss_fn=_loss)
    assert report.measured_peak_bytes <= floor, report
    assert report.gradients_equal and report.max_gradient_difference == 0.0 and not report.rounding_only, report
    assert report.buffers_equal, report.first_differing_buffer  # the stem's BatchNorm statistics too


def test_no_stem_where_the_first_blocks_input_is_made_outside_a_module_or_blocks_are_given() -> None:
    model = StemNet(scale=0.5)
    costs = torchckpt.profile(model, _batch(), loss_fn=_loss)
    assert costs.block_paths[0] == "layers.0" and "stem" not in costs.notes, costs.notes
    plain = StemNet()
    given = torchckpt.profile(plain, _batch(), loss_fn=_loss, blocks=list(plain.layers))
    assert "stem" not in given.notes


def test_a_stem_that_would_not_repeat_is_not_taken_and_the_note_says_why() -> None:
    class Counting(nn.Module):  # reads the counter it writes: a second run computes something else
        def __init__(self) -> None:
            super().__init__()
            self.register_buffer("calls", torch.zeros(()))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            self.calls += 1
            return x * self.calls

    model = StemNet()
    model.stem.append(Counting())
    costs = torchckpt.profile(model, _batch(), loss_fn=_loss)
    assert costs.block_paths[0] == "layers.0", costs.block_paths
    assert costs.notes["stem"].startswith("stem (before the first block) not taken: recomputing it would differ")


def test_a_decoder_does_not_pay_for_the_look() -> None:
    from torchckpt.models import gpt

    model = gpt("tiny", dropout=0.0)
    costs = torchckpt.profile(model, model.example_batch(batch_size=2, seq_len=32))
    assert costs.block_paths[0] == "blocks.0" and "stem" not in costs.notes, costs.notes


class Reused(nn.Module):
    """A stem called again after the blocks (T5 runs its dropout before and after them)."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 64))
        self.layers = nn.ModuleList(nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 64)) for _ in range(4))
        self.pre = nn.Identity()  # hands the stem's output on: not the stem

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.pre(self.stem(x))
        for layer in self.layers:
            x = layer(input=x)  # by keyword
        return self.stem(x)


def test_a_stem_called_twice_is_not_taken_and_the_search_reads_the_outermost_module_and_keywords() -> None:
    torch.manual_seed(0)
    model = Reused()
    batch = (torch.ones(256, 64),)
    assert find_stem(StepRunner(model, batch, loss_fn=lambda out: out.sum()), list(model.layers)) == "stem"
    costs = torchckpt.profile(model, batch, loss_fn=lambda out: out.sum())
    assert costs.block_paths[0] == "layers.0", costs.notes
    assert costs.notes["stem"] == "stem (before the first block) not taken: it ran 2 times in one step", costs.notes


def test_a_loop_that_catches_exceptions_does_not_catch_the_search() -> None:
    def step(model: nn.Module, inputs: tuple) -> torch.Tensor:
        try:
            loss = _loss(model(*inputs))
        except Exception as error:  # noqa: BLE001 - a loop that wraps every error
            raise RuntimeError("the forward pass failed") from error
        loss.backward()
        return loss

    torch.manual_seed(0)
    model = StemNet()
    costs = torchckpt.profile(model, _batch(), step_fn=step)  # the repeat check of the BatchNorm stem inside a step
    assert costs.block_paths[0] == "stem", costs.notes
    report = torchckpt.verify_plan(model, costs.plan(int(1.05 * costs.every_block_peak_bytes)), _batch(), step_fn=step)
    assert report.within_budget and report.gradients_equal and report.buffers_equal, report
