"""recompute_lower_bound: never above the model's optimum (brute force over every schedule), tight where the
relaxation is exact, and clear errors for bad input."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from test_solve_dp import brute_force, random_chain

from torchckpt.planner.costs import BlockCosts, OpCosts
from torchckpt.planner.from_costs import ChainCosts
from torchckpt.planner.solve import Region, evaluate, floor_bytes, solve
from torchckpt.planner.solve._chain import Chain
from torchckpt.planner.solve.lower_bound import recompute_lower_bound

TOLERANCE = 1e-9


def _fitting_times(costs: ChainCosts, results: list, budget: int, margin: int = 0) -> list[float]:
    chain = Chain.of(costs)
    return [time_s for peak, time_s, schedule in results if peak + chain.margin_of(schedule, margin) <= budget]


@pytest.mark.parametrize("seed", range(40))
def test_never_above_the_best_schedule(seed: int) -> None:
    rng = np.random.default_rng(seed)
    costs = random_chain(rng, int(rng.integers(1, 6)))
    results = brute_force(costs)
    peaks = sorted({peak for peak, _, _ in results})
    inside = (int(b) for b in rng.integers(peaks[0], peaks[-1] + 1, 5))
    for budget in sorted({peaks[0] - 1, peaks[0], peaks[-1], *inside}):
        bound = recompute_lower_bound(costs, budget)
        fitting = _fitting_times(costs, results, budget)
        if bound is None:
            assert not fitting, f"budget {budget}: the bound says nothing fits but {min(fitting)} s does"
            continue
        if not fitting:  # a relaxation may find a fractional answer where no schedule fits
            continue
        assert 0.0 <= bound <= min(fitting) + TOLERANCE
        assert bound <= solve(costs, budget).extra_time_s + TOLERANCE


@pytest.mark.parametrize("seed", range(15))
def test_never_above_with_a_margin_a_measured_schedule_and_without_regions(seed: int) -> None:
    rng = np.random.default_rng(500 + seed)
    costs = random_chain(rng, int(rng.integers(2, 6)))
    chain = Chain.of(costs)
    every_peak, _ = evaluate(costs, chain.every_block_schedule())
    # the measured figure of every block checkpointed is below what the rules give (as on real models)
    costs = dataclasses.replace(costs, every_block_peak_bytes=max(1, every_peak - int(rng.integers(0, 4))))
    results = brute_force(costs)
    singles = [r for r in results if not any(isinstance(p, Region) for p in r[2])]
    margin = int(rng.integers(0, 4))
    low, high = floor_bytes(costs, margin_bytes=margin), max(peak for peak, _, _ in results)
    for budget in sorted({low, high, *(int(b) for b in rng.integers(low, high + 1, 4))}):
        bound = recompute_lower_bound(costs, budget, margin_bytes=margin)
        assert bound is not None and bound <= min(_fitting_times(costs, results, budget, margin)) + TOLERANCE
        assert bound <= solve(costs, budget, margin_bytes=margin).extra_time_s + TOLERANCE
        without = recompute_lower_bound(costs, budget, margin_bytes=margin, regions=False)
        fitting = _fitting_times(costs, singles, budget, margin)
        if fitting:
            assert without is not None and without <= min(fitting) + TOLERANCE


def _uniform_with_ops(n: int) -> ChainCosts:
    """Blocks whose two saved ops are worth keeping in order; a large head makes the forward end bind."""
    ops = (OpCosts(index=0, name="mm", output_bytes=4, saved=True, time_s=3.0),
           OpCosts(index=1, name="gelu", output_bytes=4, saved=True, time_s=1.0))
    block = BlockCosts(name="b", input_bytes=2, output_bytes=2, saved_bytes=8, forward_time_s=4.0, ops=ops)
    return ChainCosts(fixed_bytes=0, head_bytes=1000, blocks=(block,) * n, chain=False)


def test_tight_where_whole_choices_meet_the_budget() -> None:
    costs = _uniform_with_ops(4)
    plain, _ = evaluate(costs, Chain.of(costs).plain_schedule())
    assert plain == 1000 + 4 * 10
    # freeing 4 bytes: one block drops the gelu output (1 s); 8 bytes: two blocks do (2 s)
    for freed, expected in ((0, 0.0), (4, 1.0), (8, 2.0), (16, 4.0)):
        assert recompute_lower_bound(costs, plain - freed) == pytest.approx(expected)
        assert solve(costs, plain - freed).extra_time_s == pytest.approx(expected)
    # freeing 6 bytes: a second block must drop all of its gelu output (2 s); fractionally, half of it (1.5 s)
    assert recompute_lower_bound(costs, plain - 6) == pytest.approx(1.5)
    assert solve(costs, plain - 6).extra_time_s == pytest.approx(2.0)


def test_zero_when_no_checkpointing_fits_and_none_below_every_relaxed_choice() -> None:
    costs = _uniform_with_ops(2)
    plain, _ = evaluate(costs, Chain.of(costs).plain_schedule())
    assert recompute_lower_bound(costs, plain) == 0.0
    assert recompute_lower_bound(costs, plain + 10**9) == 0.0
    assert recompute_lower_bound(costs, 10) is None


@pytest.mark.parametrize(("budget", "error", "words"), [
    (-1, ValueError, "budget_bytes"), (1.5, TypeError, "int number of bytes"), (True, TypeError, "int")])
def test_bad_budgets_are_named(budget: object, error: type, words: str) -> None:
    with pytest.raises(error, match=words):
        recompute_lower_bound(_uniform_with_ops(2), budget)  # type: ignore[arg-type]


def test_bad_costs_are_named() -> None:
    with pytest.raises(TypeError, match="ChainCosts"):
        recompute_lower_bound({"blocks": []}, 100)  # type: ignore[arg-type]
