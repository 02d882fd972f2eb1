"""Blocks whose forward does not repeat are never recomputed (issue 28, defects 3 and 4; repeat.py's [a block is
recomputed only if it repeats]), and planning leaves NumPy's and Python's random streams as it found them.

Recomputing ``torch.nn.utils.spectral_norm`` runs its power iteration again from the vectors the forward wrote
(torch.utils.checkpoint gives wrong gradients there); a block drawing from NumPy or ``random`` draws other numbers
when recomputed. Each test plans at the floor, where every block that may be recomputed is, and compares with the
plain model bitwise."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch
from torch import nn

import torchckpt
from torchckpt.planner import InfeasibleBudgetError

pytestmark = pytest.mark.usefixtures("one_thread")
WIDTH, DEPTH, ODD, BATCH = 64, 5, (1, 3), 512


class Block(nn.Module):
    def __init__(self, kind: str) -> None:
        super().__init__()
        linear = nn.Linear(WIDTH, WIDTH)
        if kind == "spectral_norm":
            linear = torch.nn.utils.spectral_norm(linear)
        elif kind == "parametrizations.spectral_norm":
            linear = torch.nn.utils.parametrizations.spectral_norm(linear)
        elif kind == "weight_norm":
            linear = torch.nn.utils.parametrizations.weight_norm(linear)
        self.linear, self.kind = linear, kind
        self.norm = nn.BatchNorm1d(WIDTH)  # writes its statistics in forward, reads none of them: it repeats

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        hidden = self.linear(x)
        if self.kind == "numpy":
            hidden = hidden * torch.from_numpy((np.random.rand(*hidden.shape) > 0.2).astype(np.float32))
        elif self.kind == "random":
            hidden = hidden * (0.5 + random.random())
        return x + torch.tanh(self.norm(hidden))


class Stack(nn.Module):
    def __init__(self, kind: str) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Block(kind if i in ODD else "") for i in range(DEPTH))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return x.square().mean()


def _at_floor(model: nn.Module, batch: tuple) -> torchckpt.Plan:
    with pytest.raises(InfeasibleBudgetError) as error:
        torchckpt.plan(model, batch, "1%")
    return torchckpt.plan(model, batch, error.value.floor_bytes)


def _batch() -> tuple[torch.Tensor]:
    return (torch.randn(BATCH, WIDTH, generator=torch.Generator().manual_seed(1)),)


def _verified(model: nn.Module, made: torchckpt.Plan, batch: tuple) -> None:
    """Within budget, gradients and buffers bitwise equal to the model without checkpointing."""
    report = torchckpt.verify_plan(model, made, batch)
    assert report.gradients_equal and report.buffers_equal and report.within_budget, (report.table(), made.table())


def _host_streams() -> tuple:
    state = np.random.get_state()
    return state[1].copy(), state[2], random.getstate()


def _same_streams(a: tuple, b: tuple) -> bool:
    return np.array_equal(a[0], b[0]) and a[1:] == b[1:]


@pytest.mark.parametrize(("kind", "why"), [
    ("spectral_norm", "writes linear.weight_u"),
    pytest.param("parametrizations.spectral_norm", "writes linear.parametrizations.weight.0._u",
                 marks=pytest.mark.slow),
    ("numpy", "draws from NumPy's or Python's random generator"),
    pytest.param("random", "draws from NumPy's or Python's random generator", marks=pytest.mark.slow),
])
def test_a_block_that_does_not_repeat_is_planned_plain_and_the_plan_says_why(kind: str, why: str) -> None:
    torch.manual_seed(0)
    model = Stack(kind)
    batch = _batch()
    np.random.seed(5)
    random.seed(5)
    streams = _host_streams()
    made = _at_floor(model, batch)
    assert _same_streams(streams, _host_streams()), "planning moved NumPy's or Python's random stream"
    plain = [piece.block for piece in made.schedule if getattr(piece, "plain", False)]
    recomputed = [piece.block for piece in made.schedule if not getattr(piece, "plain", True)]
    assert set(ODD) <= set(plain) and recomputed, made.table()  # the others are recomputed at the floor
    for index in ODD:
        assert f"block {index} (blocks.{index}): its forward {why}" in made.notes["not recomputed"], made.notes
    assert "may not be recomputed" in made.notes["regions"]
    report = torchckpt.verify_plan(model, made, batch)
    assert _same_streams(streams, _host_streams()), "verify_plan moved NumPy's or Python's random stream"
    assert report.gradients_equal and report.buffers_equal, report.table()
    assert report.within_budget, (report.table(), made.table())


@pytest.mark.parametrize("kind", ["", "weight_norm"])
def test_blocks_that_repeat_are_recomputed_batch_norm_included(kind: str) -> None:
    torch.manual_seed(0)
    model = Stack(kind)
    batch = _batch()
    made = _at_floor(model, batch)
    assert "not recomputed" not in made.notes
    assert all(not getattr(piece, "plain", False) for piece in made.schedule), made.table()
    _verified(model, made, batch)


def test_what_torch_checkpoint_gets_wrong_here_is_real() -> None:
    """The check above is not vacuous: recomputing a spectral-normed block under torch's own checkpoint changes
    its gradients."""
    torch.manual_seed(0)
    model = Stack("spectral_norm")
    batch = torch.randn(BATCH, WIDTH, generator=torch.Generator().manual_seed(1))
    state = {k: v.clone() for k, v in model.state_dict().items()}
    model(batch).backward()
    plain = [p.grad.clone() for p in model.parameters()]
    model.load_state_dict(state)
    model.zero_grad(set_to_none=True)
    x = batch
    for block in model.blocks:
        x = torch.utils.checkpoint.checkpoint(block, x, use_reentrant=False)
    x.square().mean().backward()
    assert not all(torch.equal(a, p.grad) for a, p in zip(plain, model.parameters()))


class Residual(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear, self.dropout = nn.Linear(WIDTH, WIDTH), nn.Dropout(0.1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.tanh(self.dropout(self.linear(x)))


class DrawsBetween(nn.Module):
    """A random number drawn before each block decides whether it runs (LayerDrop, as HF writes it; here it always
    runs): a region would draw those numbers after its blocks' own dropout masks."""

    def __init__(self, source: str) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Residual() for _ in range(4))
        self.source = source

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            draw = float(torch.rand([])) if self.source == "torch" else float(np.random.rand())
            if draw >= 0.0:
                x = block(x)
        return x.square().mean()


@pytest.mark.parametrize("source", ["torch", "numpy"])
def test_random_numbers_drawn_between_blocks_turn_regions_off(source: str) -> None:
    torch.manual_seed(0)
    model = DrawsBetween(source)
    batch = _batch()
    made = _at_floor(model, batch)
    assert "draws" in made.notes["regions"] and "between blocks 0 and 1" in made.notes["regions"], made.notes
    assert all(not hasattr(piece, "inner") for piece in made.schedule)
    _verified(model, made, batch)


def test_a_forward_that_fails_leaves_no_hook_behind() -> None:
    """The repeat pass hooks every block; a forward that raises midway must not leave a hook on the user's model."""
    from torchckpt._host import preserved_state
    from torchckpt.planner.repeat import unrepeatable_blocks
    from torchckpt.planner.runner import StepRunner

    class Fails(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            raise RuntimeError("the user's bug")

    model = nn.Sequential(Block(""), Fails())
    batch = (torch.randn(8, WIDTH),)
    with preserved_state(model), pytest.raises(RuntimeError, match="the user's bug"):
        unrepeatable_blocks(StepRunner(model, batch, loss_fn=lambda out: out.sum()), list(model))
    assert all(not m._forward_hooks and not m._forward_pre_hooks for m in model.modules())
