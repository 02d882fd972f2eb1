"""costs.py's [offloaded blocks] end to end on the CPU's second pool: measured, planned within both budgets,
applied, and verified (device and host peaks as predicted, gradients and buffers bitwise)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

import torchckpt
from torchckpt.models import gpt
from torchckpt.planner import solve
from torchckpt.planner.costs import BlockCosts, CostModel
from torchckpt.planner.plan import Plan

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def measured() -> tuple:
    torch.manual_seed(0)
    model = gpt("tiny", dropout=0.1)
    batch = model.example_batch(batch_size=4, seq_len=64)
    with torch.random.fork_rng():
        costs = torchckpt.profile(model, batch, offload=True)
    return model, batch, costs


def _fast_link(costs: CostModel) -> CostModel:
    """The measured costs with copies nearly free (as on a GPU whose copies hide behind compute): the CPU's own
    copies are slower than recomputing, so its plans would rarely offload."""
    blocks = tuple(dataclasses.replace(b, offload_time_s=0.05 * b.forward_time_s) for b in costs.blocks)
    return dataclasses.replace(costs, blocks=blocks)


def test_the_profile_measures_each_blocks_offload(measured: tuple) -> None:
    _, _, costs = measured
    assert set(costs.offload) >= {"window_bytes", "host_budget_bytes", "time_scale", "note"}
    assert costs.offload["window_bytes"] == 0  # on the CPU nothing overlaps ([a default host budget])
    for block in costs.blocks:
        assert 0 <= block.offload_held_bytes < block.saved_bytes
        assert block.offload_host_bytes >= block.saved_bytes  # what autograd saves, each storage whole
        assert block.offload_backward_peak_bytes >= 0 and block.offload_time_s > 0
        assert any(option.offload for option in solve.block_menu(block))


@pytest.mark.parametrize("share", [0.5, 0.0])
def test_an_offloading_plan_is_predicted_exactly_and_bitwise(measured: tuple, share: float) -> None:
    model, batch, costs = measured
    fast = _fast_link(costs)
    plain_peak, _ = solve.evaluate(costs, tuple(solve.Single(i, 0) for i in range(len(costs.blocks))))
    budget = int(costs.every_block_peak_bytes + share * (plain_peak - costs.every_block_peak_bytes))
    plan = fast.plan(budget)
    offloaded = [piece for piece in plan.schedule if getattr(piece, "offload", False)]
    assert offloaded and plan.offload["predicted_host_peak_bytes"] == sum(
        costs.blocks[piece.block].offload_host_bytes for piece in offloaded)
    report = torchckpt.verify_plan(model, plan, batch)
    assert report.gradients_equal and report.buffers_equal and report.max_gradient_difference == 0
    assert report.measured_peak_bytes <= report.predicted_peak_bytes <= plan.budget_bytes
    assert abs(report.prediction_error) <= 0.01
    assert report.measured_host_peak_bytes == report.predicted_host_peak_bytes
    assert "host memory" in report.table() and "offloaded to host" in plan.table()


def test_the_host_budget_holds_and_a_plan_needing_more_is_refused(measured: tuple) -> None:
    _, _, costs = measured
    fast = _fast_link(costs)
    budget = costs.every_block_peak_bytes
    unlimited = fast.plan(budget).offload["predicted_host_peak_bytes"]
    for share in (0.75, 0.5, 0.25, 0.0):
        limit = int(share * unlimited)
        limited = dataclasses.replace(fast, offload={**fast.offload, "host_budget_bytes": limit})
        plan = limited.plan(budget)  # every block checkpointed always fits this budget
        assert plan.offload.get("predicted_host_peak_bytes", 0) <= limit
    tight = dataclasses.replace(fast, offload={**fast.offload, "host_budget_bytes": 0})
    floor = solve.floor_bytes(fast)
    with pytest.raises(solve.InfeasibleBudgetError, match="host_budget"):
        tight.plan(floor)


def test_a_plan_with_offload_round_trips_as_format_4(measured: tuple) -> None:
    _, _, costs = measured
    plan = _fast_link(costs).plan(costs.every_block_peak_bytes)
    text = plan.to_json()
    assert '"version": 4' in text and Plan.from_json(text) == plan


def test_without_offload_the_profile_has_no_option(measured: tuple) -> None:
    model, batch, _ = measured
    costs = torchckpt.profile(model, batch, loss_head=False, pieces=False)
    assert costs.offload == {} and all(b.offload_held_bytes == -1 for b in costs.blocks)


@pytest.mark.parametrize("kwargs, error, match", [
    ({"offload": "yes"}, TypeError, "offload must be True or False"),
    ({"host_budget": "1GiB"}, ValueError, "needs offload=True"),
    ({"offload": True, "host_budget": -1}, ValueError, "host_budget must be >= 0"),
    ({"offload": True, "host_budget": 1.5}, TypeError, "host_budget must be an int number of bytes or a string"),
])
def test_bad_offload_arguments_are_refused_before_profiling(kwargs: dict, error: type, match: str) -> None:
    model = gpt("tiny")
    with pytest.raises(error, match=match):
        torchckpt.plan(model, model.example_batch(batch_size=2, seq_len=8), budget="50%", **kwargs)


def test_a_compiled_model_is_refused_with_the_fix() -> None:
    model = gpt("tiny")
    compiled = torch.compile(model, backend="eager")
    with pytest.raises(ValueError, match="before torch.compile"):
        torchckpt.plan(compiled, model.example_batch(batch_size=2, seq_len=8), budget="50%", offload=True)
    model.blocks[1].compile(backend="eager")  # one block compiled in place: its hooks would not run either
    try:
        with pytest.raises(ValueError, match="before torch.compile"):
            torchckpt.plan(model, model.example_batch(batch_size=2, seq_len=8), budget="50%", offload=True)
    finally:
        model.blocks[1]._compiled_call_impl = None


def test_offload_is_left_out_inside_regions_and_priced_by_the_solver() -> None:
    """menu.py's [offload beside recompute]: the option sits before keep-nothing (the last option stays
    keep-nothing, so regions and every-block schedules are unchanged), and the solver takes it only where it is
    faster than recomputing."""
    block = BlockCosts(name="b", input_bytes=4, output_bytes=4, saved_bytes=40, forward_time_s=1.0,
                       offload_held_bytes=0, offload_host_bytes=40, offload_time_s=0.1)
    menu = solve.block_menu(block)
    assert menu[0].plain and not menu[0].offload and menu[-1].kept_ops == () and not menu[-1].plain
    assert [o.offload for o in menu].count(True) == 1
    offload = {"window_bytes": 0, "host_budget_bytes": 10**6, "d2h_bytes_per_s": 1e9, "h2d_bytes_per_s": 1e9,
               "time_scale": 1.0, "device": "cpu"}
    costs = CostModel(fixed_bytes=100, head_bytes=10, blocks=(block,) * 4, offload=offload)
    assert solve.solve_within_host(costs, 250).extra_time_s == pytest.approx(0.1)
    slow = dataclasses.replace(costs, blocks=(dataclasses.replace(block, offload_time_s=2.0),) * 4)
    assert solve.solve_within_host(slow, 250).host_bytes == 0  # recomputing (1 s) beats a 2 s copy
