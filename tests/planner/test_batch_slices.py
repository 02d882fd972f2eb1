"""Blocks recomputed in slices of the batch (``plan(..., batch_slices=k)``): only blocks measured exact are
sliced, the floor falls below every block's, and a plan there keeps its budget with every gradient bitwise but
the sliced blocks' parameters (equal to rounding), buffers bitwise."""

from __future__ import annotations

import dataclasses
import itertools
import json

import pytest
import torch
from torch import nn

import torchckpt
from torchckpt.executor.batch_slices import run_in_slices, sliced_checkpoint
from torchckpt.memory import MemoryMeter
from torchckpt.models import gpt
from torchckpt.planner.batch_slices import sliceable_blocks
from torchckpt.planner.blocks import block_pieces
from torchckpt.planner.from_costs import floor_over_options, plan_pieces
from torchckpt.planner.plan import Plan, PlanMismatchError
from torchckpt.planner.runner import StepRunner
from torchckpt.planner.solve import Single, block_menu, evaluate
from torchckpt.planner.verify import compare_gradients, loss_head_parameters


def _floor(costs) -> int:
    return floor_over_options(costs, allow_regions=True, margin_bytes=costs.margin_bytes)


@pytest.fixture(scope="module")
def tiny() -> tuple:
    torch.manual_seed(0)
    model = gpt("tiny", dropout=0.0)
    return model, model.example_batch(batch_size=8, seq_len=64)


def test_a_sliced_recomputation_holds_one_slice_at_a_time() -> None:
    torch.manual_seed(0)
    mlp = nn.Sequential(nn.Linear(64, 512), nn.GELU(), nn.Linear(512, 64))
    x = torch.randn(8, 32, 64)
    peaks = {}
    for slices in (1, 4):
        for p in mlp.parameters():
            p.grad = None
        inputs = x.clone().requires_grad_()
        with MemoryMeter() as meter:
            sliced_checkpoint(mlp, inputs, slices=slices).sum().backward()
        peaks[slices] = meter.peak_bytes
    hidden = 8 * 32 * 512 * 4  # one 512-wide activation of the whole batch
    assert peaks[1] >= 2 * hidden and peaks[4] <= peaks[1] - hidden, peaks


def test_outputs_that_cannot_be_joined_are_refused() -> None:
    x = torch.randn(4, 3)
    with pytest.raises(ValueError, match="without a batch dimension"):
        run_in_slices(lambda t: t.sum(), x, slices=2)
    with pytest.raises(ValueError, match="differs between slices"):
        run_in_slices(lambda t: (t, object()), x, slices=2)
    with pytest.raises(ValueError, match="first positional argument must be a tensor"):
        run_in_slices(lambda t: t, "text", slices=2)
    assert run_in_slices(lambda t: (t, None, 3), x, slices=2)[1:] == (None, 3)


@pytest.mark.parametrize("bad", [0, -1, True, 2.0, "4"])
def test_a_bad_number_of_slices_is_refused_before_profiling(tiny: tuple, bad: object) -> None:
    model, batch = tiny
    with pytest.raises(ValueError, match="batch_slices="):
        torchckpt.plan(model, batch, budget="50%", batch_slices=bad)


def test_with_the_optimizer_in_the_backward_pass_slices_are_refused(tiny: tuple) -> None:
    model, batch = tiny
    optimizer = torch.optim.AdamW(model.parameters())
    with pytest.raises(ValueError, match="plan with one of the two"):
        torchckpt.plan(model, batch, budget="50%", optimizer=optimizer, optimizer_in_backward=True, batch_slices=2)


def test_a_batch_not_divisible_by_the_slices_runs_in_as_many() -> None:
    torch.manual_seed(0)
    layer = nn.Sequential(nn.Linear(8, 16), nn.GELU())
    x = torch.randn(6, 5, 8)
    calls = []
    run_in_slices(lambda t: calls.append(t.shape[0]) or t, x, slices=4)  # 6 in 4: tensor_split gives 2, 2, 1, 1
    assert calls == [2, 2, 1, 1]
    assert sliced_checkpoint(layer, x, slices=4).shape == (6, 5, 16)


def test_another_batch_than_the_planned_one_runs_unsliced_and_says_so() -> None:
    scale = torch.randn(4, 1)  # no batch dimension, but as long as a batch of 4
    x = torch.randn(4, 4, 3)
    with pytest.warns(UserWarning, match="planned to run in slices of a batch of 8 got a batch of 4"):
        out = sliced_checkpoint(lambda t, s: t * s, x, scale, slices=2, batch=8)
    assert torch.equal(out, x * scale)


class _Shared(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
        return self.linear(x) + table


class _Counting(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(8, 8)
        self.register_buffer("calls", torch.zeros(()))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        return self.linear(x)


def test_shared_inputs_that_need_a_gradient_and_blocks_that_write_buffers_are_not_sliced() -> None:
    class Model(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.table = nn.Parameter(torch.randn(5, 8))  # a shared position table: not split, needs a gradient
            self.blocks = nn.ModuleList([_Shared(), _Shared()])
            self.counting = nn.ModuleList([_Counting(), _Counting()])

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            for block in self.blocks:
                x = block(x, self.table)
            for block in self.counting:
                x = block(x)
            return x.square().mean()

    torch.manual_seed(0)
    model = Model()
    runner = StepRunner(model, (torch.randn(4, 5, 8),))
    shared = sliceable_blocks(runner, list(model.blocks), 2)
    assert all("needs a gradient" in reason for reason in shared), shared
    counting = sliceable_blocks(runner, list(model.counting), 2)
    assert all("buffers or the random number generator" in reason for reason in counting), counting
    assert float(model.counting[0].calls) == 0  # the checks put the buffer back


class _BatchSizedBackward(torch.autograd.Function):
    """Identity forward; a backward that depends on how many samples it sees (as a kernel that sums in another
    order for fewer samples may, at rounding scale)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:  # noqa: ANN001
        ctx.samples = x.shape[0]
        return x.clone()

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:  # noqa: ANN001
        return grad * (1 + 1e-3 * ctx.samples)


class _OddBackward(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(_BatchSizedBackward.apply(x))


def test_a_block_whose_backward_is_not_exact_in_slices_is_not_sliced() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(_OddBackward(), _OddBackward())
    runner = StepRunner(model, (torch.randn(4, 5, 8),), loss_fn=lambda out: out.square().mean())
    reasons = sliceable_blocks(runner, list(model), 2)
    assert all("inputs' gradients differ" in reason for reason in reasons), reasons


def test_rounding_is_judged_against_the_sliced_block_not_a_zero_gradient() -> None:
    reference = [(torch.tensor([1.0, -2.0]).numpy().view("uint8"), torch.float32),
                 (torch.tensor([1e-12]).numpy().view("uint8"), torch.float32)]
    noisy = [(torch.tensor([1.0, -2.0]).numpy().view("uint8"), torch.float32),
             (torch.tensor([3e-12]).numpy().view("uint8"), torch.float32)]  # a zero bias's rounding noise
    assert not compare_gradients(noisy, reference, {0, 1})[0]  # against itself: 200% off
    assert compare_gradients(noisy, reference, {0, 1}, groups=[[0, 1]])[0]  # against its block's largest: 1e-12


def test_only_blocks_measured_exact_are_sliced() -> None:
    torch.manual_seed(0)
    with_dropout = gpt("tiny", dropout=0.1)
    runner = StepRunner(with_dropout, with_dropout.example_batch(batch_size=4, seq_len=32))
    assert all("outputs differ" in reason for reason in sliceable_blocks(runner, list(with_dropout.blocks), 2))
    norm = nn.Sequential(*[nn.Sequential(nn.Conv2d(3, 3, 3, padding=1), nn.BatchNorm2d(3)) for _ in range(2)])
    images = StepRunner(norm, (torch.randn(4, 3, 8, 8),), loss_fn=lambda out: out.square().mean())
    assert all("outputs differ" in reason for reason in sliceable_blocks(images, list(norm), 2))
    before = {name: value.clone() for name, value in norm.state_dict().items()}
    sliceable_blocks(images, list(norm), 2)
    assert all(torch.equal(before[name], value) for name, value in norm.state_dict().items())  # put back
    one = StepRunner(norm, (torch.randn(1, 3, 8, 8),), loss_fn=lambda out: out.square().mean())
    assert sliceable_blocks(one, list(norm), 2) == ["a batch of one sample"] * 2


def test_the_floor_falls_and_a_plan_there_keeps_its_budget(tiny: tuple) -> None:
    model, batch = tiny
    whole = torchckpt.profile(model, batch)
    sliced = torchckpt.profile(model, batch, batch_slices=4)
    assert sliced.notes["batch slices"].startswith("2 of 2 blocks"), sliced.notes
    assert _floor(sliced) < 0.75 * _floor(whole), (_floor(sliced), _floor(whole))
    plan = sliced.plan(_floor(sliced))
    assert any(piece.slices == 4 for piece in plan.schedule) and "in 4 slices of the batch" in plan.table()
    report = torchckpt.verify_plan(model, plan, batch)
    assert report.within_budget and abs(report.prediction_error) <= 0.01, report
    assert report.gradients_equal and report.buffers_equal, report
    sliced = tuple(f"blocks.{piece.block}." for piece in plan.schedule if piece.slices > 1)
    head = {name for _, name in loss_head_parameters(model, plan)}  # a chunked head's weight (tied: wte's)
    assert report.rounding_only and all(name.startswith(sliced) or name in head for name in report.rounding_only)
    assert any(name.startswith(sliced) for name in report.rounding_only), report.rounding_only
    text = plan.to_json()
    assert json.loads(text)["version"] == 3 and Plan.from_json(text) == plan


def test_without_slices_the_floor_names_them_and_nothing_changes(tiny: tuple) -> None:
    model, batch = tiny
    costs = torchckpt.profile(model, batch)
    assert all(block.nested_slices == 1 for block in costs.blocks) and "batch slices" not in costs.notes
    with pytest.raises(torchckpt.InfeasibleBudgetError, match=r"batch_slices=k"):
        costs.plan(1)


@pytest.mark.slow  # 48 s loaded per case; test_the_floor_falls_and_a_plan_there_keeps_its_budget is fast
@pytest.mark.parametrize("dropout", [0.0, 0.1])  # 0.1: the blocks are refused, their pieces run in slices
def test_every_schedule_mixing_sliced_checkpointed_and_plain_blocks_is_predicted_from_above(dropout: float) -> None:
    """Sliced blocks (or pieces) are measured all sliced at once; each mix with plain and keep-nothing neighbours
    must still be predicted at or above its measured peak (a budget is a promise), and within 1% of it."""
    torch.manual_seed(0)
    model = gpt("tiny", dropout=dropout)
    batch = model.example_batch(batch_size=8, seq_len=64)
    costs = torchckpt.profile(model, batch, batch_slices=4, loss_head=False)
    menus = [block_menu(block) for block in costs.blocks]
    choices = [[0, next(i for i, option in enumerate(menu) if option.slices > 1 or option.sliced_pieces),
                len(menu) - 1] for menu in menus]
    base = costs.plan("100%")
    for combo in itertools.product(*choices):
        schedule = tuple(Single(block=b, option=o) for b, o in enumerate(combo))
        predicted, _ = evaluate(costs, schedule)
        plan = dataclasses.replace(base, schedule=plan_pieces(schedule, menus, costs), budget_bytes=int(predicted),
                                   predicted_peak_bytes=int(predicted))
        report = torchckpt.verify_plan(model, plan, batch)
        assert report.within_budget and report.prediction_error <= 0.01, (combo, report)
        assert report.gradients_equal and report.buffers_equal, (combo, report)


def test_a_refused_blocks_pieces_are_checked_on_their_own_inputs() -> None:
    """batch_slices.py's [a refused block's pieces may run in slices]: dropout between a block's pieces refuses the
    block, not its attention and MLP; a sliceable block's pieces are not checked, and a piece that sees another
    first dimension than its block's batch is refused by name."""
    torch.manual_seed(0)
    model = gpt("tiny", dropout=0.1)
    runner = StepRunner(model, model.example_batch(batch_size=4, seq_len=32))
    pieces = [block_pieces(block) for block in model.blocks]
    reasons = sliceable_blocks(runner, list(model.blocks), 2, pieces)
    assert len(reasons) == 2 + sum(map(len, pieces)) and all("outputs differ" in r for r in reasons[:2]), reasons
    assert reasons[2:] == [""] * sum(map(len, pieces)), reasons
    exact = gpt("tiny", dropout=0.0)
    runner = StepRunner(exact, exact.example_batch(batch_size=4, seq_len=32))
    reasons = sliceable_blocks(runner, list(exact.blocks), 2, [block_pieces(block) for block in exact.blocks])
    assert reasons[:2] == ["", ""] and set(reasons[2:]) == {"its block runs in slices"}, reasons

    class Flattening(nn.Module):  # its MLP sees (batch x tokens) rows: slicing them is not slicing the batch
        def __init__(self) -> None:
            super().__init__()
            self.norm, self.mlp = nn.LayerNorm(8), nn.Linear(8, 8)

        def forward(self, x: torch.Tensor) -> torch.Tensor:  # the batch mean refuses the block itself
            return x + self.mlp(self.norm(x).flatten(0, 1)).view_as(x) + x.mean(0)

    blocks = nn.Sequential(Flattening(), Flattening())
    runner = StepRunner(blocks, (torch.randn(4, 3, 8),), loss_fn=lambda out: out.square().mean())
    reasons = sliceable_blocks(runner, list(blocks), 2, [block_pieces(block) for block in blocks])
    assert reasons[2] == "" and reasons[3] == "its first argument's first dimension (12) is not its block's batch (4)"
    with pytest.raises(ValueError, match="one list per block"):
        sliceable_blocks(runner, list(blocks), 2, [[]])

    class Mixing(nn.Linear):
        def forward(self, x: torch.Tensor, mix: bool = False) -> torch.Tensor:
            y = super().forward(x)
            return y + y.mean(0) if mix else y

    class TwoCalls(nn.Module):  # its first piece mixes the batch on its first call only: one failure refuses it
        def __init__(self) -> None:
            super().__init__()
            self.p, self.q = Mixing(8, 8), nn.Linear(8, 8)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.q(self.p(self.p(x, mix=True))) + x.mean(0)

    blocks = nn.Sequential(TwoCalls(), TwoCalls())
    runner = StepRunner(blocks, (torch.randn(4, 3, 8),), loss_fn=lambda out: out.square().mean())
    reasons = sliceable_blocks(runner, list(blocks), 2, [block_pieces(block) for block in blocks])
    assert "outputs differ" in reasons[2] and reasons[3] == "", reasons


def test_a_refused_blocks_exact_pieces_run_in_slices_within_budget() -> None:
    """A GPT with dropout on its residual branches: no block may run in slices, but its attention and MLP may, inside
    the nested option; the floor falls below the nested floor without them, and the plan there keeps its budget with
    every gradient bitwise but the sliced pieces' parameters (to rounding), buffers bitwise."""
    torch.manual_seed(0)
    model = gpt("tiny", dropout=0.1)
    batch = model.example_batch(batch_size=8, seq_len=64)
    whole = torchckpt.profile(model, batch, loss_head=False)
    sliced = torchckpt.profile(model, batch, batch_slices=4, loss_head=False)
    assert sliced.notes["batch slices"].startswith("0 of 2 blocks") and "4 pieces of 2" in sliced.notes["batch slices"]
    assert all(block.nested_sliced_pieces == (1, 3) and block.nested_piece_slices == 4  # attention, MLP; not norms
               for block in sliced.blocks), sliced.blocks
    assert _floor(sliced) < 0.9 * _floor(whole), (_floor(sliced), _floor(whole))
    plan = sliced.plan(_floor(sliced))
    assert any(piece.sliced_pieces for piece in plan.schedule) and "2 in 4 slices of the batch" in plan.table()
    report = torchckpt.verify_plan(model, plan, batch)
    assert report.within_budget and abs(report.prediction_error) <= 0.01, report
    assert report.gradients_equal and report.buffers_equal, report
    pieces = tuple(f"blocks.{piece.block}.{name}." for piece in plan.schedule if piece.sliced_pieces
                   for name in ("attn", "mlp"))
    assert all(name.startswith(pieces) for name in report.rounding_only), report.rounding_only
    text = plan.to_json()
    assert json.loads(text)["version"] == 6 and Plan.from_json(text) == plan
    with pytest.raises(ValueError, match="pieces run in slices only in a nested block"):
        dataclasses.replace(next(p for p in plan.schedule if p.sliced_pieces), nested=False)
    edited = dataclasses.replace(plan, schedule=tuple(
        dataclasses.replace(p, sliced_pieces=(9,)) if p.sliced_pieces else p for p in plan.schedule))
    with pytest.raises(PlanMismatchError, match=r"runs pieces \[9\] of block blocks\.\d in slices, but it has 4"):
        torchckpt.apply(model, edited)


def test_a_compiled_model_is_planned_without_nested_pieces_or_slices_and_refuses_them() -> None:
    """Note: [checkpoints nested or sliced are planned for eager runs]."""
    torch.manual_seed(0)
    model = gpt("tiny", dropout=0.1)
    batch = model.example_batch(batch_size=8, seq_len=32)
    eager = torchckpt.profile(model, batch, batch_slices=2, loss_head=False)
    plan = eager.plan(_floor(eager))
    assert any(piece.nested for piece in plan.schedule), plan.table()
    compiled = torch.compile(model, backend="aot_eager")
    with pytest.raises(ValueError, match="planned for eager runs only.*plan the compiled model"):
        torchckpt.apply(compiled, plan)
    model.blocks[0].compile(backend="aot_eager")  # compiled in place
    try:
        with pytest.raises(ValueError, match="planned for eager runs only"):
            torchckpt.apply(model, plan)
    finally:
        model.blocks[0]._compiled_call_impl = None
    costs = torchckpt.profile(compiled, batch, batch_slices=2, loss_head=False)
    assert costs.notes["pieces"].startswith("no: the model is compiled"), costs.notes
    assert costs.notes["batch slices"].startswith("no: the model is compiled"), costs.notes
    assert all(block.nested_recompute_peak_bytes == -1 for block in costs.blocks)
    handle = torchckpt.apply(compiled, costs.plan(_floor(costs)))  # a plan without them applies
    handle.remove()
