"""``solve``: the least extra time within a budget, by dynamic programming over (start, stop, memory).

After Beaumont, Eyraud-Dubois, Herrmann, Joly, Shilova, "Optimal checkpointing for heterogeneous
chains" (Rotor, 2019), with per-block selective menus at the top level; on a homogeneous chain it
reduces to Griewank & Walther's binomial Revolve (tests/planner/test_solve_dp.py checks the counts).

Budgets ``m`` are bytes left above the context ``C + H`` of a chain, on a grid of step ``q``:

    G(s, t, m) = least extra time of blocks s..t-1 as (the tail of) a region's inside ending at t,
    F(s, m)    = least extra time of the top-level chain from block s,

each the minimum over the first piece: a single block with option o (plain or keep-nothing inside
regions, any menu option at the top) needing ``need`` and holding ``held``:
``time(o) + G(s+1, t, m - held)`` when ``m >= need``; or a region ``[s, v)`` (v < t inside, v <= n at
the top): ``forward_time(s, v) + G(s, v, m - region context) + rest(v, m - x_s)`` when ``m``
covers its forward pass. ``F(n, m) = 0`` iff ``m >= head_bytes - y_{n-1}`` (costs.py's
[forward-end peak]). Wrapping a whole inside in one more region never helps (same peaks, more time), so
``v < t`` inside.

Discretisation (the solver's rules, by name):

1. **[rounding only overestimates]** Every ``need`` and ``held`` is rounded *up* to the grid and the
   budget *down*, so a schedule the DP accepts is feasible: each check overestimates the true bytes.
2. **[slack is recovered, never trusted]** The step is the gcd of all byte figures when the budget spans
   at most ``memory_slots`` of them (then the DP is exact), else the budget over ``memory_slots`` (fewer
   on chains so long that the tables would pass 2**25 floats). Rounding loses at most one step per
   piece, so the grid runs ``n + 1`` steps past the budget; plans found there are re-checked with
   ``evaluate`` and the fastest one that truly fits is kept (slack recovered, never trusted).
3. **[ties go to the first candidate]** Ties go to the first candidate: plain, then options in menu
   order, then shorter regions.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

from torchckpt._units import check_positive_int, format_bytes
from torchckpt.planner.costs import CostModel
from torchckpt.planner.solve._chain import Chain
from torchckpt.planner.solve._types import InfeasibleBudgetError, Piece, Region, Single, Solution
from torchckpt.planner.solve.evaluate import evaluate_chain
from torchckpt.planner.solve.floor import check_margin, floor_schedule, min_peak_schedule
from torchckpt.planner.solve.floor_parts import floor_parts

__all__ = ["DEFAULT_MEMORY_SLOTS", "solve", "solve_budgets"]

DEFAULT_MEMORY_SLOTS = 500
_MAX_TABLE_FLOATS = 2**25


class _Grid:
    """Byte figures of the chain on the memory grid (rounded up), plus the tables' shared terms."""

    def __init__(self, chain: Chain, step: int, size: int, allow_regions: bool) -> None:
        self.chain, self.step, self.size, self.allow_regions = chain, step, size, allow_regions
        self._singles: dict[tuple[int, int, int], tuple[int, int, float]] = {}
        n, blocks = chain.n, chain.costs.blocks
        self.region_held = [self.up(chain.region_held_bytes(s)) for s in range(n)]
        self.region_context = [self.up(chain.region_context_bytes(s)) for s in range(n)]
        self.region_forward = chain.region_forward_table()  # bytes; each chain adds its gradient g
        self.region_time = np.zeros((n + 1, n + 1))
        for s in range(n):
            total = 0.0
            for v in range(s + 1, n + 1):
                total = total + blocks[v - 1].forward_time_s
                self.region_time[s, v] = total

    def up_array(self, num_bytes: np.ndarray) -> np.ndarray:
        return -(-num_bytes // self.step)

    def up(self, num_bytes: int) -> int:
        return -(-int(num_bytes) // self.step)

    def single(self, block: int, option_index: int, gradient: int) -> tuple[int, int, float]:
        """(need, held, time) of a single block on the grid."""
        key = (block, option_index, gradient)
        if key not in self._singles:
            option = self.chain.menus[block][option_index]
            held = self.up(self.chain.held_bytes(block, option))
            need = max(held, self.up(self.chain.single_need_bytes(block, option, gradient)))
            self._singles[key] = (need, held, option.recompute_s)
        return self._singles[key]


def _relax_single(best: np.ndarray, rest: np.ndarray, need: int, held: int, time_s: float) -> None:
    size = best.shape[0]
    if need >= size:
        return
    cand = rest[need - held:size - held]
    if time_s != 0.0:
        cand = time_s + cand
    np.minimum(best[need:], cand, out=best[need:])


def _relax_regions(grid: _Grid, best: np.ndarray, inner: np.ndarray, rest: np.ndarray, s: int,
                   stops: np.ndarray, forward_need: np.ndarray, inner_first: np.ndarray) -> None:
    """best[m] = min(best[m], min_v time(s,v) + inner[v][m - rc] + rest[v][m - x_s]) where m >= forward_need[v]
    (``rc``: the region context, ``Chain.region_context_bytes(s)``)."""
    size, lo, context = best.shape[0], grid.region_held[s], grid.region_context[s]
    base = max(lo, context)
    if base >= size or stops.size == 0:
        return
    vals = inner[:, base - context:size - context] + grid.region_time[s, stops][:, None]
    vals += rest[:, base - lo:size - lo]
    for row in np.nonzero(forward_need > np.maximum(base, inner_first + context))[0]:
        vals[row, :forward_need[row] - base] = np.inf
    np.minimum(best[base:], vals.min(axis=0), out=best[base:])


def _inside_tables(grid: _Grid) -> tuple[np.ndarray, np.ndarray]:
    """``inside[t, s, m] = G(s, t, m)`` and the first finite ``m`` of each."""
    n, size = grid.chain.n, grid.size
    inside = np.full((n + 1, n + 1, size), np.inf)
    first = np.full((n + 1, n + 1), size, dtype=np.int64)
    for t in range(1, n + 1):
        inside[t, t] = 0.0
        first[t, t] = 0
        gradient = grid.chain.gradient_inside(t)
        for s in range(t - 1, -1, -1):
            best = inside[t, s]
            for k in (0, len(grid.chain.menus[s]) - 1):
                _relax_single(best, inside[t, s + 1], *grid.single(s, k, gradient))
            if t - s >= 3:
                stops = np.arange(s + 2, t)
                need = grid.up_array(grid.region_forward[s, s + 2:t] + gradient)
                _relax_regions(grid, best, inside[s + 2:t, s], inside[t, s + 2:t], s, stops, need, first[s + 2:t, s])
            finite = np.flatnonzero(np.isfinite(best))
            first[t, s] = finite[0] if finite.size else size
    return inside, first


def _top_table(grid: _Grid, inside: np.ndarray | None, first: np.ndarray | None) -> np.ndarray:
    """``top[s, m] = F(s, m)``."""
    chain, size = grid.chain, grid.size
    n, costs = chain.n, chain.costs
    top = np.full((n + 1, size), np.inf)
    top[n, max(0, grid.up(costs.head_bytes - costs.blocks[-1].output_bytes)):] = 0.0
    for s in range(n - 1, -1, -1):
        best = top[s]
        for k in range(len(chain.menus[s])):
            _relax_single(best, top[s + 1], *grid.single(s, k, 0))
        if inside is not None and first is not None and n - s >= 2:
            stops = np.arange(s + 2, n + 1)
            need = grid.up_array(grid.region_forward[s, s + 2:n + 1])
            _relax_regions(grid, best, inside[s + 2:n + 1, s], top[s + 2:n + 1], s, stops, need, first[s + 2:n + 1, s])
    return top


def _rebuild(grid: _Grid, table_rest, s: int, t: int, m: int, options: Sequence[int], gradient: int,
             inside: np.ndarray | None, regions_to: int) -> tuple[Piece | None, int, int]:
    """The first candidate whose value equals the table's at (s, m): (piece or None for a region, next, m)."""
    target = table_rest(s)[m]
    for k in options:
        need, held, time_s = grid.single(s, k, gradient)
        if m >= need:
            value = table_rest(s + 1)[m - held]
            value = time_s + value if time_s != 0.0 else value
            if value == target:
                return Single(block=s, option=k), s + 1, m - held
    lo, context = grid.region_held[s], grid.region_context[s]
    for v in range(s + 2, regions_to):
        if inside is None or m < max(lo, context) or m < grid.up(int(grid.region_forward[s, v]) + gradient):
            continue
        value = (inside[v, s, m - context] + grid.region_time[s, v]) + table_rest(v)[m - lo]
        if value == target:
            return None, v, m - lo
    raise AssertionError(f"solver reconstruction lost its path at block {s} (chain ending at {t}, slot {m})")


def _inside_plan(grid: _Grid, inside: np.ndarray, s: int, t: int, m: int) -> tuple[Piece, ...]:
    pieces: list[Piece] = []
    gradient = grid.chain.gradient_inside(t)
    while s < t:
        options = (0, len(grid.chain.menus[s]) - 1)
        piece, nxt, m_next = _rebuild(grid, lambda v: inside[t, v], s, t, m, options, gradient, inside, t)
        if piece is None:
            piece = Region(s, nxt, _inside_plan(grid, inside, s, nxt, m - grid.region_context[s]))
        pieces.append(piece)
        s, m = nxt, m_next
    return tuple(pieces)


def _top_plan(grid: _Grid, top: np.ndarray, inside: np.ndarray | None, m: int) -> tuple[Piece, ...]:
    pieces: list[Piece] = []
    s, n = 0, grid.chain.n
    while s < n:
        options = range(len(grid.chain.menus[s]))
        regions_to = n + 1 if inside is not None else 0
        piece, nxt, m_next = _rebuild(grid, lambda v: top[v], s, n, m, options, 0, inside, regions_to)
        if piece is None:
            assert inside is not None, "a region was rebuilt without the inside table"
            piece = Region(s, nxt, _inside_plan(grid, inside, s, nxt, m - grid.region_context[s]))
        pieces.append(piece)
        s, m = nxt, m_next
    return tuple(pieces)


def _byte_gcd(chain: Chain) -> int:
    costs = chain.costs
    values = [costs.head_bytes, costs.region_recompute_bytes, costs.blocks[-1].output_bytes]
    for block, menu in zip(costs.blocks, chain.menus):
        values += [block.input_bytes, block.saved_bytes, block.forward_peak_bytes, block.backward_peak_bytes,
                   block.recompute_peak_bytes, block.freed_side_input_bytes,
                   max(0, block.nested_recompute_peak_bytes), block.nested_held_bytes,
                   max(0, block.nested_forward_peak_bytes)]
        values += [option.held_bytes for option in menu] + [option.recompute_extra_bytes for option in menu]
    return math.gcd(*values) or 1


def _dp_best(chain: Chain, budget_bytes: int, allow_regions: bool,
             memory_slots: int) -> tuple[tuple[Piece, ...], int, float] | None:
    """The fastest DP plan whose exact evaluation fits the budget, or None."""
    room = budget_bytes - chain.top_context_bytes
    if room < 0:
        return None
    gcd = _byte_gcd(chain)
    # Tables hold (n + 1)^2 * slots floats: keep them under 2**25 (256 MiB) on very long chains.
    memory_slots = max(32, min(memory_slots, _MAX_TABLE_FLOATS // (chain.n + 1) ** 2 - chain.n - 2))
    exact = room // gcd <= memory_slots
    step = gcd if exact else gcd * -(-room // (memory_slots * gcd))
    slots = room // step
    grid = _Grid(chain, step, slots + 1 + (0 if exact else chain.n + 1), allow_regions)
    inside, first = _inside_tables(grid) if allow_regions and chain.n >= 2 else (None, None)
    top = _top_table(grid, inside, first)
    plans: dict[int, tuple] = {}

    def fits(m: int) -> bool:  # the plan the DP finds at slot m, checked exactly
        if not np.isfinite(top[0, m]):
            return False
        if m not in plans:
            schedule = _top_plan(grid, top, inside, m)
            plans[m] = (schedule, *evaluate_chain(chain, schedule)[:2])
        return plans[m][1] <= budget_bytes

    # Slot `slots` is sound ([rounding only overestimates]); past it, take the largest slot whose plan truly
    # fits, by bisection (fit is monotone in the slot for all practical purposes; every answer is checked anyway).
    lo, hi = slots, grid.size - 1
    if fits(hi):
        return plans[hi]
    hi -= 1
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if fits(mid):
            lo = mid
        else:
            hi = mid - 1
    return plans[lo] if fits(lo) else None


def _check_budget(budget_bytes: object) -> int:
    if isinstance(budget_bytes, bool) or not isinstance(budget_bytes, int):
        raise TypeError(f"budget_bytes must be an int number of bytes; got {budget_bytes!r} "
                        f"({type(budget_bytes).__name__}); parse sizes like '6GiB' with torchckpt's parse_bytes")
    if budget_bytes < 0:
        raise ValueError(f"budget_bytes must be >= 0; got {budget_bytes}")
    return budget_bytes


def _infeasible(chain: Chain, budget_bytes: int, floor: int, schedule: tuple[Piece, ...],
                margin_bytes: int) -> InfeasibleBudgetError:
    costs = chain.costs
    margin = chain.margin_of(schedule, margin_bytes)
    parts, figures = floor_parts(chain, schedule, margin)  # floor_parts.py's [the floor is told in parts]
    breakdown: dict[str, int | str] = {"fixed_bytes": costs.fixed_bytes,
                                       "activation_bytes": floor - margin - costs.fixed_bytes,
                                       "head_bytes": costs.head_bytes, **figures}
    message = (f"budget {budget_bytes} bytes ({format_bytes(budget_bytes)}) is below the smallest feasible "
               f"peak (predicted), {floor} bytes ({format_bytes(floor)}), reached at {figures['binding']} with "
               f"the least-peak plan: {floor} bytes = {parts} Any budget >= {floor} bytes is feasible.")
    return InfeasibleBudgetError(budget_bytes, floor, breakdown, message)


def solve(costs: CostModel, budget_bytes: int, *, allow_regions: bool = True,
          memory_slots: int = DEFAULT_MEMORY_SLOTS, margin_bytes: int | None = None) -> Solution:
    """The schedule with the least predicted extra time whose predicted peak plus its margin is within
    ``budget_bytes``.

    ``margin_bytes`` is the margin of schedules the profiler did not measure (None: ``costs.margin_bytes``,
    what ``margin="auto"`` gives; 0 for cost models that record none); the two it measured (no
    checkpointing, and every block checkpointed when ``costs.every_block_peak_bytes`` is set) need none
    (costs.py's [a margin only where a plan was not measured]). ``allow_regions=False`` plans single
    blocks only; so does a cost model with ``chain=False``. ``memory_slots`` sets the memory grid (see
    the module docstring); the result is always re-checked with ``evaluate``. Raises
    ``InfeasibleBudgetError`` when ``budget_bytes < floor_bytes(costs, margin_bytes=margin_bytes)``.

    Example:
        >>> from torchckpt.planner.costs import BlockCosts
        >>> block = BlockCosts(name="b", input_bytes=4, output_bytes=4, saved_bytes=8, forward_time_s=1.0)
        >>> costs = CostModel(fixed_bytes=100, head_bytes=10, blocks=(block,) * 4)
        >>> solve(costs, 160).extra_time_s, solve(costs, 150).extra_time_s  # all plain peaks at 158
        (0.0, 1.0)
        >>> solve(costs, 140).schedule
        (Region(start=0, stop=2, inner=(Single(block=0, option=0), Single(block=1, option=0))),
         Single(block=2, option=0), Single(block=3, option=0))
        >>> solve(costs, 150, margin_bytes=12).extra_time_s  # 138 + 12 fits, 142 + 12 does not
        2.0
    """
    budget_bytes = _check_budget(budget_bytes)
    check_positive_int("memory_slots", memory_slots)
    chain = Chain.of(costs)
    margin_bytes = check_margin(costs.margin_bytes if margin_bytes is None else margin_bytes)
    allow_regions = bool(allow_regions) and costs.chain
    plain = chain.plain_schedule()
    peak, extra_s, _ = evaluate_chain(chain, plain)
    if peak + chain.margin_of(plain, margin_bytes) <= budget_bytes:
        return Solution(schedule=plain, predicted_peak_bytes=peak, extra_time_s=extra_s, budget_bytes=budget_bytes)
    found: list[tuple[tuple[Piece, ...], int, float]] = []
    if costs.every_block_peak_bytes:  # measured: no margin ([a margin only where a plan was not measured])
        every = chain.every_block_schedule()
        every_peak, every_s, _ = evaluate_chain(chain, every)
        if every_peak <= budget_bytes:
            found.append((every, every_peak, every_s))
    room = budget_bytes - margin_bytes
    best = _dp_best(chain, room, bool(allow_regions), memory_slots) if room >= 0 else None
    if best is None and room >= 0:
        _, schedule = min_peak_schedule(chain, allow_regions=bool(allow_regions))
        peak, extra_s, _ = evaluate_chain(chain, schedule)
        if peak + chain.margin_of(schedule, margin_bytes) <= budget_bytes:  # the grid lost the slack: it fits
            best = schedule, peak, extra_s
    if best is not None and (not found or best[2] < found[0][2]):
        found = [best]
    if not found:
        floor, schedule = floor_schedule(chain, allow_regions=bool(allow_regions), margin_bytes=margin_bytes)
        assert floor > budget_bytes, f"the floor {floor} is within budget {budget_bytes} but no plan was found"
        raise _infeasible(chain, budget_bytes, floor, schedule, margin_bytes)
    schedule, peak, extra_s = found[0]
    assert peak + chain.margin_of(schedule, margin_bytes) <= budget_bytes, \
        f"solver returned a plan over budget ({peak} + margin > {budget_bytes})"
    return Solution(schedule=schedule, predicted_peak_bytes=peak, extra_time_s=extra_s, budget_bytes=budget_bytes)


def solve_budgets(costs: CostModel, budgets: Sequence[int], *, allow_regions: bool = True) -> tuple[Solution, ...]:
    """``solve`` at each budget, in the order given (raises for a budget below ``floor_bytes``).

    Example:
        >>> from torchckpt.planner.costs import BlockCosts
        >>> block = BlockCosts(name="b", input_bytes=4, output_bytes=4, saved_bytes=8, forward_time_s=1.0)
        >>> costs = CostModel(fixed_bytes=100, head_bytes=10, blocks=(block,) * 4)
        >>> [s.extra_time_s for s in solve_budgets(costs, [160, 140, 130])]
        [0.0, 2.0, 4.0]
    """
    return tuple(solve(costs, budget, allow_regions=allow_regions) for budget in budgets)
