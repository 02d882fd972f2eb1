"""Issue 13: measured schedules need no margin, and times are those of real steps.

The floor reaches the measured peak of checkpointing every block (``checkpoint_modules(blocks,
"nothing_saveable")``, what ``gradient_checkpointing_enable()`` does), so a budget equal to it is
feasible and measures within itself; plans the profiler did not measure keep ``margin_bytes`` below the
budget and still measure within it. ``step_time_s`` is a bare plain step, and the every-block schedule's
predicted extra time is, by construction, its measured extra time (Note: [timing is never asserted]:
timing is only bounded loosely here).
"""

from __future__ import annotations

import gc
import time

import pytest
import torch

import torchckpt
from torchckpt.memory import MemoryMeter
from torchckpt.models import gpt, unet
from torchckpt.planner import solve as solver
from torchckpt.planner.blocks import find_blocks
from torchckpt.planner.costs import BlockCosts, OpCosts
from torchckpt.planner.from_costs import ChainCosts, resolve_margin
from torchckpt.planner.profile import profile
from torchckpt.planner.runner import StepRunner


def _gpt_tiny() -> tuple[torch.nn.Module, tuple]:
    model = gpt("tiny", dropout=0.0)
    return model, model.example_batch(batch_size=2, seq_len=32)


def _gpt_mini() -> tuple[torch.nn.Module, tuple]:
    model = gpt("mini", dropout=0.1)
    return model, model.example_batch(batch_size=4, seq_len=64)


def _unet() -> tuple[torch.nn.Module, tuple]:
    model = unet("small", dropout=0.1)
    return model, model.example_batch(batch_size=2, image_size=32)


def _every_block_peak(model: torch.nn.Module, batch: tuple, blocks: list) -> int:
    """The measured peak of one training step with every block checkpointed keeping nothing."""
    runner = StepRunner(model, batch)
    gc.collect()
    with torchckpt.checkpoint_modules(blocks, policy="nothing_saveable"):
        runner.clear_grads()
        with MemoryMeter() as meter:
            runner.forward_backward()
        runner.clear_grads()
    return meter.peak_bytes


@pytest.mark.parametrize("build", [_gpt_tiny, pytest.param(_gpt_mini, marks=pytest.mark.slow),
                                   pytest.param(_unet, marks=pytest.mark.slow)], ids=["gpt-tiny", "gpt-mini", "unet"])
def test_a_budget_at_the_measured_every_block_peak_is_feasible_and_holds(build) -> None:  # noqa: ANN001
    torch.manual_seed(0)
    model, batch = build()
    _, blocks = find_blocks(model)
    measured = _every_block_peak(model, batch, blocks)
    gc.collect()
    plan = torchckpt.plan(model, batch, budget=measured)
    report = torchckpt.verify_plan(model, plan, batch)
    assert report.within_budget and report.gradients_equal, (report.table(), plan.table())
    gc.collect()
    # without the options that go below checkpointing every block (the chunked loss head, pieces nested in a
    # block: issue 27), every block checkpointed is the floor
    costs = profile(model, batch, loss_head=False, pieces=False)
    assert costs.every_block_peak_bytes == measured
    assert solver.floor_bytes(costs, margin_bytes=costs.margin_bytes) <= measured
    with pytest.raises(torchckpt.InfeasibleBudgetError):
        costs.plan(measured - 1 - costs.margin_bytes)
    # Plans the profiler did not measure keep the margin, and measure within their budgets.
    plain, _ = solver.evaluate(costs, tuple(solver.Single(block=i, option=0) for i in range(len(blocks))))
    for share in (0.25, 0.6):
        budget = int(measured + (plain - measured) * share)
        made = costs.plan(budget)
        assert made.predicted_peak_bytes + made.reference["margin_bytes"] <= budget
        report = torchckpt.verify_plan(model, made, batch)
        assert report.within_budget and report.gradients_equal, (report.table(), made.table())


def test_step_time_is_a_plain_step_and_the_every_block_extra_time_is_calibrated() -> None:
    torch.manual_seed(0)
    model, batch = _gpt_mini()
    costs = profile(model, batch)
    every = tuple(solver.Single(block=i, option=len(solver.block_menu(b)) - 1) for i, b in enumerate(costs.blocks))
    _, extra_s = solver.evaluate(costs, every)
    if not costs.notes["recompute_time_scale"].startswith("1 (not calibrated"):
        assert extra_s == pytest.approx(costs.every_block_step_time_s - costs.step_time_s, rel=1e-9, abs=1e-12)
    runner = StepRunner(model, batch)
    steps = []
    for _ in range(3):
        runner.clear_grads()
        start = time.perf_counter()
        runner.forward_backward()
        steps.append(time.perf_counter() - start)
    runner.clear_grads()
    # Loose on purpose (Note: [timing is never asserted]): one step on shared cores can take several times
    # another (the old estimate, the first, metered step less its forwards, read 254 ms for a 92 ms step).
    assert min(steps) / 10 <= costs.step_time_s <= max(steps) * 10, (costs.step_time_s, steps)


def _costs(**fields: object) -> ChainCosts:
    ops = (OpCosts(index=0, name="mm", output_bytes=40, saved=True, time_s=0.3),
           OpCosts(index=1, name="gelu", output_bytes=40, saved=True, time_s=0.1))
    block = BlockCosts(name="b", input_bytes=8, output_bytes=8, saved_bytes=80, forward_time_s=0.4, ops=ops)
    return ChainCosts(fixed_bytes=1000, head_bytes=0, blocks=(block,) * 4, **fields)  # type: ignore[arg-type]


def test_measured_schedules_need_no_margin_and_others_keep_it() -> None:
    model_peak = solver.evaluate(_costs(), tuple(solver.Single(block=i, option=2) for i in range(4)))[0]
    costs = _costs(every_block_peak_bytes=model_peak - 8, margin_bytes=100)
    every = tuple(solver.Single(block=i, option=2) for i in range(4))
    assert solver.evaluate(costs, every)[0] == model_peak - 8  # [measured schedules are predicted as measured]
    floor = solver.floor_bytes(costs, allow_regions=False, margin_bytes=100)
    assert floor == model_peak - 8
    solution = solver.solve(costs, floor, allow_regions=False, margin_bytes=100)
    assert solution.schedule == every
    with pytest.raises(solver.InfeasibleBudgetError) as caught:
        solver.solve(costs, floor - 1, allow_regions=False, margin_bytes=100)
    assert caught.value.floor_bytes == floor
    # Above the every-block peak, a faster plan that was not measured is taken only once it fits with its margin.
    for budget in range(floor, floor + 200, 8):
        found = solver.solve(costs, budget, allow_regions=False, margin_bytes=100)
        margin = solver.schedule_margin_bytes(costs, found.schedule, 100)
        assert found.predicted_peak_bytes + margin <= budget
        assert margin == (0 if found.schedule == every else 100)
    assert solver.solve(costs, floor + 192, allow_regions=False, margin_bytes=100).extra_time_s < solution.extra_time_s


@pytest.mark.parametrize("margin", [-1, 1.5, "lots", "120%", float("nan")])
def test_bad_margins_are_refused(margin: object) -> None:
    with pytest.raises(ValueError, match="margin must be 'auto', an int number of bytes >= 0, a size string"):
        resolve_margin(margin, _costs(), 1000)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="margin must be"):
        _costs().plan("100%", margin=margin)  # type: ignore[arg-type]


def test_a_bad_margin_is_refused_before_profiling() -> None:
    class Boom(torch.nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            raise AssertionError("profiled")

    with pytest.raises(TypeError, match="margin must be"):
        torchckpt.plan(Boom(), (torch.ones(1),), budget="50%", margin=True, blocks=[torch.nn.Linear(1, 1)])
