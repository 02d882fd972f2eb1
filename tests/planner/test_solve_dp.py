"""solve() against exact references: brute force over every schedule, Chen's sqrt(n), Revolve's binomial law."""

from __future__ import annotations

import math
from functools import cache

import numpy as np
import pytest

from torchckpt.planner.costs import BlockCosts, OpCosts
from torchckpt.planner.from_costs import ChainCosts
from torchckpt.planner.solve import (
    InfeasibleBudgetError,
    Region,
    Single,
    block_menu,
    evaluate,
    floor_bytes,
    solve,
    solve_budgets,
)

# --------------------------------------------------------------------------- exhaustive references


def all_schedules(costs: ChainCosts) -> list[tuple]:
    """Every valid schedule: any menu option at the top, plain/keep-nothing inside regions, any nesting."""
    menus = [block_menu(b) for b in costs.blocks]
    n = len(menus)

    @cache
    def plans(s: int, t: int, enclosing: tuple[int, int] | None) -> tuple[tuple, ...]:
        if s == t:
            return ((),)
        out = []
        options = range(len(menus[s])) if enclosing is None else (0, len(menus[s]) - 1)
        for k in options:
            out += [(Single(s, k),) + rest for rest in plans(s + 1, t, enclosing)]
        for v in range(s + 2, t + 1):
            if (s, v) == enclosing:
                continue
            for inner in plans(s, v, (s, v)):
                out += [(Region(s, v, inner),) + rest for rest in plans(v, t, enclosing)]
        return tuple(out)

    return list(plans(0, n, None))


def brute_force(costs: ChainCosts) -> list[tuple[int, float, tuple]]:
    """(peak, extra time, schedule) for every schedule."""
    return [(*evaluate(costs, schedule), schedule) for schedule in all_schedules(costs)]


def random_chain(rng: np.random.Generator, n: int, unit: int = 1) -> ChainCosts:
    """A heterogeneous chain with byte figures that are multiples of ``unit`` and integer times."""
    sizes = [int(rng.integers(1, 6)) * unit for _ in range(n + 1)]
    blocks = []
    for i in range(n):
        ops = []
        for k in range(int(rng.integers(0, 3))):
            ops.append(OpCosts(index=k, name=f"op{k}", output_bytes=int(rng.integers(1, 8)) * unit, saved=True,
                               time_s=float(rng.integers(0, 3))))
        saved = sum(op.output_bytes for op in ops) + int(rng.integers(0, 6)) * unit
        blocks.append(BlockCosts(name=f"b{i}", input_bytes=sizes[i], output_bytes=sizes[i + 1], saved_bytes=saved,
                                 forward_time_s=float(rng.integers(1, 6)),
                                 forward_peak_bytes=int(rng.integers(0, 4)) * unit,
                                 backward_peak_bytes=int(rng.integers(0, 4)) * unit,
                                 recompute_peak_bytes=int(rng.integers(0, 3)) * unit, ops=tuple(ops)))
    return ChainCosts(fixed_bytes=int(rng.integers(0, 20)) * unit, head_bytes=int(rng.integers(0, 10)) * unit,
                      region_recompute_bytes=int(rng.integers(0, 3)) * unit, blocks=tuple(blocks))


def _uniform(n: int, *, x: int = 1, saved: int = 8, time_s: float = 1.0) -> ChainCosts:
    block = BlockCosts(name="layer", input_bytes=x, output_bytes=x, saved_bytes=saved, forward_time_s=time_s)
    return ChainCosts(fixed_bytes=0, head_bytes=0, blocks=(block,) * n)


def _plain(n: int) -> tuple:
    return tuple(Single(i, 0) for i in range(n))


def _best_time(results: list, budget: int) -> float:
    return min(time_s for peak, time_s, _ in results if peak <= budget)


# --------------------------------------------------------------------------- (a), (b)


@pytest.mark.parametrize("extra", [0, 1, 1000])
def test_budget_at_or_above_all_plain_recomputes_nothing(extra: int) -> None:
    costs = _uniform(12, x=3, saved=17)
    plain_peak, _ = evaluate(costs, _plain(12))
    solution = solve(costs, plain_peak + extra)
    assert solution.schedule == _plain(12)
    assert (solution.predicted_peak_bytes, solution.extra_time_s) == (plain_peak, 0.0)


@pytest.mark.parametrize("seed", range(6))
def test_budget_just_below_all_plain_is_optimal(seed: int) -> None:
    costs = random_chain(np.random.default_rng(100 + seed), 4)
    results = brute_force(costs)
    plain_peak, _ = evaluate(costs, _plain(4))
    budget = plain_peak - 1
    if budget < min(peak for peak, _, _ in results):
        pytest.skip("this chain cannot go below its all-plain peak")
    solution = solve(costs, budget)
    assert solution.schedule != _plain(4)
    assert solution.extra_time_s == _best_time(results, budget)
    free = any(o.recompute_s == 0.0 for b in costs.blocks for o in block_menu(b)[1:])
    assert free or solution.extra_time_s > 0.0  # only a checkpoint option costing no time can be free
    assert evaluate(costs, solution.schedule) == (solution.predicted_peak_bytes, solution.extra_time_s)


# --------------------------------------------------------------------------- (c) Chen et al. 2016


@pytest.mark.parametrize("n, k", [(9, 3), (16, 4), (25, 5)])
def test_sqrt_n_segments_at_their_own_budget(n: int, k: int) -> None:
    # All-or-nothing blocks (no ops): segments of k blocks, each a region with a plain inside, the last
    # segment plain at the top level. That plan's peak is the budget; the optimum there is exactly it.
    costs = _uniform(n)
    segments = tuple(Region(s, s + k, tuple(Single(i, 0) for i in range(s, s + k))) for s in range(0, n - k, k))
    chen = segments + tuple(Single(i, 0) for i in range(n - k, n))
    peak, time_s = evaluate(costs, chen)
    assert time_s == n - k
    solution = solve(costs, peak)
    assert solution.schedule == chen
    assert solve(costs, peak - 1).extra_time_s > n - k  # the budget is tight


# --------------------------------------------------------------------------- (d) Revolve


def _revolve_advances(steps: int, slots: int) -> int:
    """Griewank (1992): with s slots and t repetitions, binom(s + t, s) steps reverse; the least number of
    recomputations for l steps is t*l - binom(s + t, t - 1), t the least with binom(s + t, s) >= l."""
    t = 0
    while math.comb(slots + t, slots) < steps:
        t += 1
    return t * steps - (math.comb(slots + t, t - 1) if t else 0)


def _revolve_chain(steps: int, tape: int) -> ChainCosts:
    # One checkpoint slot = one block input (input_bytes = 1); one step's tape = saved_bytes = tape, so
    # large that two tapes never fit. A step's reversal holds its input, its tape and the adjoint of its
    # output (y = 1 by costs.py's [backward peak]); the last step's adjoint (the seed) is its backward
    # transient, as its output, the loss, has no size here. Regions then hold one slot and leave their inside the same
    # room, exactly Revolve's recursion; each step's forward costs 1 s, so time counts recomputations.
    step = BlockCosts(name="step", input_bytes=1, output_bytes=1, saved_bytes=tape, forward_time_s=1.0)
    last = BlockCosts(name="last", input_bytes=1, output_bytes=0, saved_bytes=tape, forward_time_s=1.0,
                      backward_peak_bytes=1)
    return ChainCosts(fixed_bytes=0, head_bytes=0, blocks=(step,) * (steps - 1) + (last,))


@pytest.mark.parametrize("slots", [1, 2, 3, 4])
@pytest.mark.parametrize("steps", [1, 2, 3, 4, 5, 7, 10, 16, 21])
def test_homogeneous_chain_reaches_the_binomial_optimum(steps: int, slots: int) -> None:
    tape = 1000
    costs = _revolve_chain(steps, tape)
    budget = tape + slots + 2  # the tape, the working input and adjoint, and `slots` stored states
    solution = solve(costs, budget)
    assert solution.extra_time_s == _revolve_advances(steps, slots)


def test_revolve_counts_match_the_executor_module() -> None:
    from torchckpt.loops.revolve import optimal_advances

    for steps, slots in [(5, 2), (10, 3), (21, 2)]:
        assert _revolve_advances(steps, slots) == optimal_advances(steps, slots)


# --------------------------------------------------------------------------- (e), (f) brute force


@pytest.mark.parametrize("seed", range(40))
def test_random_chains_match_brute_force(seed: int) -> None:
    rng = np.random.default_rng(seed)
    costs = random_chain(rng, int(rng.integers(1, 6)))
    results = brute_force(costs)
    peaks = sorted({peak for peak, _, _ in results})
    floor = peaks[0]
    assert floor_bytes(costs) == floor
    for budget in sorted({floor, peaks[-1], *(int(b) for b in rng.integers(floor, peaks[-1] + 1, 4))}):
        solution = solve(costs, budget)
        assert solution.predicted_peak_bytes <= budget
        assert solution.extra_time_s == _best_time(results, budget)
        assert evaluate(costs, solution.schedule) == (solution.predicted_peak_bytes, solution.extra_time_s)
    with pytest.raises(InfeasibleBudgetError) as caught:
        solve(costs, floor - 1)
    assert caught.value.floor_bytes == floor


@pytest.mark.parametrize("seed", range(12))
def test_single_blocks_only_match_brute_force(seed: int) -> None:
    rng = np.random.default_rng(1000 + seed)
    costs = random_chain(rng, int(rng.integers(1, 6)))
    results = [r for r in brute_force(costs) if not any(isinstance(p, Region) for p in r[2])]
    floor = min(peak for peak, _, _ in results)
    assert floor_bytes(costs, allow_regions=False) == floor
    budget = int(rng.integers(floor, max(peak for peak, _, _ in results) + 1))
    solution = solve(costs, budget, allow_regions=False)
    assert not any(isinstance(p, Region) for p in solution.schedule)
    assert solution.extra_time_s == _best_time(results, budget)


@pytest.mark.parametrize("seed", range(12))
def test_coarse_memory_grid_stays_within_budget(seed: int) -> None:
    # Byte figures of 1000 * k with 7 slots: the grid cannot be exact; rounding up keeps every answer
    # feasible, and no answer can beat the exhaustive optimum.
    rng = np.random.default_rng(2000 + seed)
    costs = random_chain(rng, int(rng.integers(3, 6)), unit=997)
    results = brute_force(costs)
    floor = min(peak for peak, _, _ in results)
    for budget in (floor, floor + 1500, floor + 4000, max(peak for peak, _, _ in results) - 1):
        solution = solve(costs, budget, memory_slots=7)
        assert solution.predicted_peak_bytes <= budget
        assert solution.extra_time_s >= _best_time(results, budget)
        assert evaluate(costs, solution.schedule) == (solution.predicted_peak_bytes, solution.extra_time_s)


def test_enumeration_reference_is_complete_for_two_blocks() -> None:
    # 2 blocks with 2-option menus: 4 single-block schedules; one region whose inside is one of 4.
    assert len(all_schedules(_uniform(2))) == 8


def test_solve_is_deterministic_and_frontier_is_monotone() -> None:
    costs = random_chain(np.random.default_rng(7), 5)
    floor = floor_bytes(costs)
    plain_peak, _ = evaluate(costs, _plain(5))
    budgets = [*range(floor, plain_peak, max(1, (plain_peak - floor) // 8)), plain_peak]
    first, second = solve_budgets(costs, budgets), solve_budgets(costs, budgets)
    assert first == second
    times = [solution.extra_time_s for solution in first]
    assert times == sorted(times, reverse=True) and times[0] > 0.0 and times[-1] == 0.0
