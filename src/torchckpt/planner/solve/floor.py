"""The floor: the smallest predicted peak any schedule reaches, computed exactly (integer bytes).

A chain's peak above its context is ``max(need of its first piece, held by it + peak of the rest)``
(costs.py's [backward peak] and [forward peak]), monotone in the rest's peak, so the least peak
decomposes: with ``P(s, t)`` the least peak of blocks ``s..t-1`` as the inside of a region and ``Q(s)``
that of the top-level rest from ``s`` (whose end adds the term of [forward-end peak],
``Q(n) = head_bytes - y_{n-1}``),

    P(s, t) = min over first pieces  max(need, held + P(next, t)),   P(t, t) = 0
    Q(s)    = min over first pieces  max(need, held + Q(next))

where a region piece ``[s, v)`` needs ``max(its forward, region context + P(s, v))`` (the region context is
``Chain.region_context_bytes(s)``: ``region_recompute_bytes``, plus ``x_s`` when [what a piece holds] needs
it and block ``s``'s ``freed_side_input_bytes``).
The least predicted peak is ``fixed_bytes + y_{n-1} + Q(0)``. O(n^3) with numpy over the split point.

With a margin (costs.py's [a margin only where a plan was not measured]) the floor is the least budget
some schedule fits: the smaller of that least peak plus the margin and the peaks of the two measured
schedules (no checkpointing; every block checkpointed, when measured), which need none.
"""

from __future__ import annotations

import numpy as np

from torchckpt.planner.costs import CostModel
from torchckpt.planner.solve._chain import Chain
from torchckpt.planner.solve._types import Piece, Region, Single
from torchckpt.planner.solve.evaluate import evaluate_chain

__all__ = ["check_margin", "floor_bytes", "floor_schedule", "schedule_margin_bytes"]

_BIG = np.iinfo(np.int64).max // 4


def _inner_options(chain: Chain, block: int) -> tuple[int, ...]:
    return (0, len(chain.menus[block]) - 1)


def _inside_table(chain: Chain, region_forward: np.ndarray) -> np.ndarray:
    """``P[t, s]``: least peak of blocks s..t-1 as a region's inside, above its context."""
    n = chain.n
    peak = np.full((n + 1, n + 1), _BIG, dtype=np.int64)
    for t in range(1, n + 1):
        peak[t, t] = 0
        gradient = chain.gradient_inside(t)
        for s in range(t - 1, -1, -1):
            best = _BIG
            for k in _inner_options(chain, s):
                option = chain.menus[s][k]
                best = min(best, max(chain.single_need_bytes(s, option, gradient),
                                     chain.held_bytes(s, option) + int(peak[t, s + 1])))
            if t - s >= 3:
                v = np.arange(s + 2, t)
                context = chain.region_context_bytes(s)
                cand = np.maximum(np.maximum(region_forward[s, v] + gradient, context + peak[v, s]),
                                  chain.region_held_bytes(s) + peak[t, v])
                best = min(best, int(cand.min()))
            peak[t, s] = best
    return peak


def _top_table(chain: Chain, inside: np.ndarray | None, region_forward: np.ndarray) -> tuple[list[int], list]:
    """``Q[s]`` and the first piece reaching it (options in menu order, then regions by length; first wins)."""
    n, costs = chain.n, chain.costs
    top = [0] * (n + 1)
    choice: list = [None] * (n + 1)
    top[n] = costs.head_bytes - costs.blocks[-1].output_bytes
    for s in range(n - 1, -1, -1):
        best: int | None = None
        pick: tuple[str, int] | None = None
        for k, option in enumerate(chain.menus[s]):
            value = max(chain.single_need_bytes(s, option, 0), chain.held_bytes(s, option) + top[s + 1])
            if best is None or value < best:
                best, pick = value, ("single", k)
        assert best is not None, f"block {s} has no options"
        if inside is not None:
            for v in range(s + 2, n + 1):
                value = max(int(region_forward[s, v]), chain.region_context_bytes(s) + int(inside[v, s]),
                            chain.region_held_bytes(s) + top[v])
                if value < best:
                    best, pick = value, ("region", v)
        top[s], choice[s] = best, pick
    return top, choice


def _inside_plan(chain: Chain, inside: np.ndarray, region_forward: np.ndarray, s: int, t: int) -> tuple[Piece, ...]:
    """Rebuild a least-peak inside of ``[s, t)`` from ``P`` (first piece reaching the value, in order)."""
    pieces: list[Piece] = []
    gradient = chain.gradient_inside(t)
    while s < t:
        target = int(inside[t, s])
        picked: tuple[Piece, int] | None = None
        for k in _inner_options(chain, s):
            option = chain.menus[s][k]
            if max(chain.single_need_bytes(s, option, gradient),
                   chain.held_bytes(s, option) + int(inside[t, s + 1])) == target:
                picked = (Single(block=s, option=k), s + 1)
                break
        for v in range(s + 2, t) if picked is None else ():
            value = max(int(region_forward[s, v]) + gradient, chain.region_context_bytes(s) + int(inside[v, s]),
                        chain.region_held_bytes(s) + int(inside[t, v]))
            if value == target:
                picked = (Region(s, v, _inside_plan(chain, inside, region_forward, s, v)), v)
                break
        assert picked is not None, "floor reconstruction lost its path"
        pieces.append(picked[0])
        s = picked[1]
    return tuple(pieces)


def min_peak_schedule(chain: Chain, *, allow_regions: bool = True) -> tuple[int, tuple[Piece, ...]]:
    """The floor and one schedule reaching it."""
    region_forward = chain.region_forward_table()
    inside = _inside_table(chain, region_forward) if allow_regions and chain.costs.chain and chain.n >= 2 else None
    top, choice = _top_table(chain, inside, region_forward)
    pieces: list[Piece] = []
    s = 0
    while s < chain.n:
        kind, value = choice[s]
        if kind == "single":
            pieces.append(Single(block=s, option=value))
            s += 1
        else:
            assert inside is not None, "a region was chosen without the inside table"
            pieces.append(Region(s, value, _inside_plan(chain, inside, region_forward, s, value)))
            s = value
    return chain.top_context_bytes + top[0], tuple(pieces)


def floor_schedule(chain: Chain, *, allow_regions: bool = True, margin_bytes: int = 0) -> tuple[int, tuple[Piece, ...]]:
    """The floor with ``margin_bytes`` for schedules that were not measured, and a schedule reaching it."""
    _, schedule = min_peak_schedule(chain, allow_regions=allow_regions)
    best = (evaluate_chain(chain, schedule)[0] + chain.margin_of(schedule, margin_bytes), schedule)
    measured = [chain.plain_schedule()] + ([chain.every_block_schedule()] if chain.costs.every_block_peak_bytes else [])
    for candidate in measured:
        peak = evaluate_chain(chain, candidate)[0] + chain.margin_of(candidate, margin_bytes)
        if peak < best[0]:
            best = (peak, candidate)
    return best


def check_margin(margin_bytes: object) -> int:
    """``margin_bytes`` if it is an int >= 0; else ValueError naming it."""
    if isinstance(margin_bytes, bool) or not isinstance(margin_bytes, int) or margin_bytes < 0:
        raise ValueError(f"margin_bytes must be an int number of bytes >= 0; got {margin_bytes!r}")
    return margin_bytes


def floor_bytes(costs: CostModel, *, allow_regions: bool = True, margin_bytes: int | None = None) -> int:
    """The least budget some schedule fits: its predicted peak plus its margin (``margin_bytes`` for schedules
    that were not measured, None: ``costs.margin_bytes``; 0 for measured ones); ``solve`` raises below it,
    never at or above it.

    Example:
        >>> from torchckpt.planner.costs import BlockCosts
        >>> block = BlockCosts(name="b", input_bytes=4, output_bytes=4, saved_bytes=8, forward_time_s=1.0)
        >>> costs = CostModel(fixed_bytes=100, head_bytes=10, blocks=(block,) * 4)
        >>> floor_bytes(costs), floor_bytes(costs, margin_bytes=10)
        (124, 134)
    """
    margin = check_margin(costs.margin_bytes if margin_bytes is None else margin_bytes)
    floor, _ = floor_schedule(Chain.of(costs), allow_regions=allow_regions, margin_bytes=margin)
    return floor


def schedule_margin_bytes(costs: CostModel, schedule: tuple[Piece, ...], margin_bytes: int | None = None) -> int:
    """The margin ``schedule`` must keep below a budget: 0 if the profiler measured it (no checkpointing;
    every block checkpointed, when ``costs.every_block_peak_bytes`` is set), else ``margin_bytes`` (None:
    ``costs.margin_bytes``).

    Example:
        >>> from torchckpt.planner.costs import BlockCosts
        >>> block = BlockCosts(name="b", input_bytes=4, output_bytes=4, saved_bytes=8, forward_time_s=1.0)
        >>> costs = CostModel(fixed_bytes=100, head_bytes=10, blocks=(block,) * 2)
        >>> [schedule_margin_bytes(costs, (Single(0, k), Single(1, 0)), 64) for k in (0, 1)]
        [0, 64]
    """
    margin = check_margin(costs.margin_bytes if margin_bytes is None else margin_bytes)
    return Chain.of(costs).margin_of(tuple(schedule), margin)
