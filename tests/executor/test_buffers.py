"""Recomputation leaves buffers alone: BatchNorm statistics and any other buffer end as after the forward.

checkpoint.py's [recomputation leaves buffers alone]. Each checkpointed step is compared bitwise, buffers and
gradients, with the same step run on an uncheckpointed deep copy of the same model.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import torchckpt
from torchckpt.executor import checkpoint
from torchckpt.loops import checkpointed_loop


class CallCounter(nn.Module):
    """Counts its calls in a buffer, in place; its output does not depend on the count."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("calls", torch.zeros((), dtype=torch.int64))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        return x


class ConvBlock(nn.Module):
    def __init__(self, channels: int) -> None:
        super().__init__()
        self.conv = nn.Conv2d(channels, channels, 3, padding=1)
        self.norm = nn.BatchNorm2d(channels)
        self.counter = CallCounter()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.relu(self.counter(self.norm(self.conv(x))))


class LinearBlock(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.linear = nn.Linear(width, width)
        self.norm = nn.BatchNorm1d(width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.tanh(self.norm(self.linear(x)))


class ConvNet(nn.Module):
    def __init__(self, channels: int = 4, depth: int = 4) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.blocks = nn.ModuleList([ConvBlock(channels) for _ in range(depth)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return x.square().mean()


class MLP(nn.Module):
    def __init__(self, width: int = 16, depth: int = 4) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.blocks = nn.ModuleList([LinearBlock(width) for _ in range(depth)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return x.square().mean()


def _batch(model: nn.Module) -> torch.Tensor:
    generator = torch.Generator().manual_seed(1)
    shape = (8, 4, 12, 12) if isinstance(model, ConvNet) else (32, 16)
    return torch.randn(shape, generator=generator)


def _state(model: nn.Module) -> dict[str, torch.Tensor]:
    state = {f"buffer {name}": b.detach().clone() for name, b in model.named_buffers()}
    state.update({f"grad {name}": p.grad.detach().clone() for name, p in model.named_parameters()
                  if p.grad is not None})
    return state


def _assert_same(found: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> None:
    assert found.keys() == expected.keys()
    for name, value in expected.items():
        assert torch.equal(found[name], value), f"{name} differs: {found[name]} vs {value}"


def _budget(model: nn.Module, batch: torch.Tensor, where: str) -> int:
    """The smallest feasible budget (every block recomputed), or halfway from it to no checkpointing."""
    with pytest.raises(torchckpt.InfeasibleBudgetError) as error:
        torchckpt.plan(model, (batch,), budget=1)
    floor = error.value.floor_bytes
    if where == "floor":
        return floor
    return (floor + torchckpt.plan(model, (batch,), budget="100%").predicted_peak_bytes) // 2


def _plain_step(model: nn.Module, batch: torch.Tensor) -> dict[str, torch.Tensor]:
    reference = copy.deepcopy(model)
    reference(batch).backward()
    return _state(reference)


@pytest.mark.parametrize("make", [ConvNet, MLP])
@pytest.mark.parametrize("policy", ["nothing_saveable", "dots_saveable"])
def test_checkpoint_modules_leaves_buffers_as_the_plain_step(make: type[nn.Module], policy: str) -> None:
    model = make()
    batch = _batch(model)
    expected = _plain_step(model, batch)
    with torchckpt.checkpoint_modules(model.blocks, policy=policy):
        model(batch).backward()
    _assert_same(_state(model), expected)
    tracked = [b for name, b in model.named_buffers() if name.endswith("num_batches_tracked")]
    assert tracked and all(int(t) == 1 for t in tracked)


def test_nested_checkpoints_leave_buffers_as_the_plain_step() -> None:
    model = ConvNet()
    batch = _batch(model)
    expected = _plain_step(model, batch)

    def pair(x: torch.Tensor, first: nn.Module, second: nn.Module) -> torch.Tensor:
        return checkpoint(second, checkpoint(first, x))

    x = batch
    blocks = list(model.blocks)
    for first, second in zip(blocks[::2], blocks[1::2]):
        x = checkpoint(pair, x, first, second)
    x.square().mean().backward()
    _assert_same(_state(model), expected)


@pytest.mark.parametrize("make", [ConvNet, MLP])
@pytest.mark.parametrize("where", ["floor", "midway"])
def test_planned_step_leaves_buffers_as_the_plain_step(make: type[nn.Module], where: str) -> None:
    model = make()
    batch = _batch(model)
    plan = torchckpt.plan(model, (batch,), budget=_budget(model, batch, where))
    assert plan.predicted_extra_time_s > 0  # something is recomputed
    expected = _plain_step(model, batch)
    with torchckpt.apply(model, plan):
        model(batch).backward()
    _assert_same(_state(model), expected)


def test_checkpointed_loop_leaves_buffers_as_the_plain_loop() -> None:
    torch.manual_seed(0)
    block = LinearBlock(8)
    reference = copy.deepcopy(block)
    x = torch.randn(16, 8)
    h = x
    for _ in range(6):
        h = reference(h)
    h.square().mean().backward()
    expected = _state(reference)
    out = checkpointed_loop(block, x, steps=6, checkpoints=2)
    out.square().mean().backward()
    _assert_same(_state(block), expected)
    assert int(block.norm.num_batches_tracked) == 6


def test_verify_plan_compares_buffers_and_leaves_them_alone() -> None:
    model = ConvNet()
    batch = _batch(model)
    plan = torchckpt.plan(model, (batch,), budget=_budget(model, batch, "midway"))
    before = {name: b.clone() for name, b in model.named_buffers()}
    report = torchckpt.verify_plan(model, plan, (batch,))
    assert report.gradients_equal
    assert report.buffers_equal and report.first_differing_buffer is None
    assert "buffers bitwise equal" in report.table()
    for name, buffer in model.named_buffers():
        assert torch.equal(buffer, before[name]), name
