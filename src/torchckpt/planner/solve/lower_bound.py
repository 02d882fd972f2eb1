"""A lower bound on the extra time any schedule within a budget needs: the fractional-knapsack relaxation.

What it bounds: the least predicted extra time over every schedule ``solve`` could return for
``budget_bytes`` under costs.py's peak model (any menu option, any nesting of regions), so the ratio
``solve(...).extra_time_s / recompute_lower_bound(...)`` says how far a plan can be from the model's
optimum at most. The bound is what the benchmark compares plans with (issue target: within 1.25x).

The relaxation keeps one constraint of the model and lets every choice be fractional:

1. **[the forward end must fit]** Every schedule's predicted peak is at least its forward-end term
   ``fixed_bytes + sum(held) + head_bytes`` (costs.py's [forward-end peak] and [predicted peak is the
   maximum]). So the blocks together must hold at least ``plain forward end - budget`` bytes less than
   when plain.
   **[each backward pass must fit]** Likewise the backward pass of block ``j`` peaks at least at
   ``C + sum(held by blocks before j) + need_j`` ([backward peak], ``need_j`` the smaller of its plain
   and checkpointed needs; inside a region the context and what earlier blocks hold again are only
   larger), so blocks ``0..j-1`` together must free what that exceeds the budget by. Each constraint
   alone gives a bound (point 3); the bound is the largest. The model's other terms (forward peaks,
   region contexts) are dropped, which is where the bound is loose.
2. **[each block's choices, relaxed]** Per block, the points (bytes held less than plain, extra time):
   plain ``(0, 0)``; a checkpoint keeping a subset ``K`` of the ops autograd saves, relaxed to the
   fractional knapsack over those ops (keep the ops with most time per byte first: its prefixes are the
   vertices of the relaxed set); and, when regions are allowed, a block inside a region that holds
   nothing at the forward end and costs at least its forward time (a region recomputes each of its
   blocks at least once; its first block holds its input, which only makes the region worse than
   this). Times are the op times as measured, unclamped, so every real option lies on or above them.
3. **[greedy on hull segments]** The linear relaxation of picking one point per block (multiple-choice
   knapsack) is solved exactly by taking each block's lower convex hull and buying hull segments from
   all blocks in order of time per byte, the last one fractionally (Sinha and Zoltners, "The
   multiple-choice knapsack problem", Operations Research 27(3), 1979).
4. **[measured schedules need no margin]** Like ``solve``: no checkpointing and every block
   checkpointed (when measured) are accepted at their measured peaks; any other schedule must fit
   ``budget - margin_bytes``. The bound is the least over those three cases.

The bound is never above the true optimum of the model; ``tests/planner/test_lower_bound.py`` checks it
against brute force over every schedule of random chains.
"""

from __future__ import annotations

from torchckpt._units import check_index
from torchckpt.planner.costs import CostModel
from torchckpt.planner.solve._chain import Chain
from torchckpt.planner.solve.evaluate import evaluate

__all__ = ["recompute_lower_bound"]

_Segment = tuple[float, int, float]  # time per byte, bytes, time


def _lower_hull(points: list[tuple[int, float]]) -> list[tuple[int, float]]:
    """The lower convex hull from ``(0, 0)`` rightwards (bytes ascending, slopes increasing)."""
    hull: list[tuple[int, float]] = []
    for point in sorted(set(points)):
        while hull and hull[-1][0] == point[0]:  # equal bytes: the earlier point has the smaller time
            point = hull[-1] if hull[-1][1] <= point[1] else point
            hull.pop()
        while len(hull) >= 2:
            (r1, t1), (r2, t2) = hull[-2], hull[-1]
            # drop hull[-1] if it lies on or above the line from hull[-2] to point
            if (t2 - t1) * (point[0] - r1) >= (point[1] - t1) * (r2 - r1):
                hull.pop()
            else:
                break
        hull.append(point)
    return hull


def _block_points(chain: Chain, block: int, regions: bool) -> list[tuple[int, float]]:
    """[each block's choices, relaxed]: (bytes held less than plain, extra time) vertices for one block."""
    menu = chain.menus[block]
    b = chain.costs.blocks[block]
    held_plain = chain.held_bytes(block, menu[0])
    base = held_plain - chain.region_held_bytes(block)  # keep nothing: hold the input and freed side inputs
    forward = float(b.forward_time_s)
    points: list[tuple[int, float]] = [(0, 0.0), (base, forward)]
    ops = sorted((op for op in b.ops if op.saved), key=lambda op: (-op.time_s / op.output_bytes
                                                                   if op.output_bytes else float("-inf")))
    kept_bytes, kept_time = 0, 0.0
    for op in ops:
        kept_bytes, kept_time = kept_bytes + op.output_bytes, kept_time + op.time_s
        points.append((base - kept_bytes, forward - kept_time))
    for option in menu[1:]:  # thinned menus are subsets of the relaxed set; listing them changes nothing
        points.append((held_plain - chain.held_bytes(block, option), option.recompute_s))
    if regions and chain.costs.chain and chain.n >= 2:
        points.append((held_plain, forward))
    return [(r, t) for r, t in points if r >= 0]


def _segments(chain: Chain, regions: bool) -> list[list[_Segment]]:
    """Each block's lower-hull segments (time per byte, bytes, time)."""
    out = []
    for block in range(chain.n):
        hull = _lower_hull(_block_points(chain, block, regions))
        out.append([((t2 - t1) / (r2 - r1), r2 - r1, t2 - t1) for (r1, t1), (r2, t2) in zip(hull, hull[1:])])
    return out


def _relaxed_time(segments: list[_Segment], required_bytes: int) -> float | None:
    """[greedy on hull segments]: least fractional extra time that frees ``required_bytes`` from these
    segments; None if freeing all of them is not enough."""
    if required_bytes <= 0:
        return 0.0
    need, total = required_bytes, 0.0
    for per_byte, size, time_s in sorted(segments, key=lambda s: s[0]):
        if need <= 0 and per_byte >= 0:
            break
        if per_byte < 0 or size <= need:
            total, need = total + time_s, need - size
        else:
            total, need = total + per_byte * need, 0
    return max(0.0, total) if need <= 0 else None


def _required_bytes(chain: Chain, budget_bytes: int) -> list[tuple[int, int]]:
    """[the forward end must fit] and [each backward pass must fit]: (blocks that can free bytes, bytes they
    must free together) per constraint."""
    costs, n = chain.costs, chain.n
    held_plain = [chain.held_bytes(i, menu[0]) for i, menu in enumerate(chain.menus)]
    required = [(n, costs.fixed_bytes + costs.head_bytes + sum(held_plain) - budget_bytes)]
    before = 0
    for j, menu in enumerate(chain.menus):
        need = min(chain.single_need_bytes(j, option, 0) for option in menu)  # nested pieces can need less
        required.append((j, chain.top_context_bytes + before + need - budget_bytes))
        before += held_plain[j]
    return required


def recompute_lower_bound(costs: CostModel, budget_bytes: int, *, margin_bytes: int = 0,
                          regions: bool = True) -> float | None:
    """A lower bound on the extra time of any schedule within ``budget_bytes`` (seconds), or None where
    the relaxation finds none fits (the budget is below what its forward-end relaxation can reach, so
    ``solve`` raises there too unless a measured schedule fits).

    ``margin_bytes`` and ``regions`` mean what they mean to ``solve``: the margin unmeasured schedules
    need, and whether regions are allowed. See the module docstring for the relaxation.

    Example:
        >>> from torchckpt.planner.costs import BlockCosts
        >>> block = BlockCosts(name="b", input_bytes=10, output_bytes=10, saved_bytes=30, forward_time_s=0.1)
        >>> costs = CostModel(fixed_bytes=100, head_bytes=0, blocks=(block, block))
        >>> [recompute_lower_bound(costs, budget) for budget in (180, 170, 165)]
        [0.025, 0.05, 0.0625]
    """
    chain = Chain.of(costs)
    if isinstance(budget_bytes, bool) or not isinstance(budget_bytes, int):
        raise TypeError(f"recompute_lower_bound(budget_bytes=...) must be an int number of bytes; "
                        f"got {budget_bytes!r}")
    check_index("recompute_lower_bound(budget_bytes)", budget_bytes)
    check_index("recompute_lower_bound(margin_bytes)", margin_bytes)
    plain_peak, _ = evaluate(costs, chain.plain_schedule())
    if plain_peak <= budget_bytes:
        return 0.0
    candidates: list[float] = []
    if costs.every_block_peak_bytes and costs.every_block_peak_bytes <= budget_bytes:
        candidates.append(evaluate(costs, chain.every_block_schedule())[1])
    segments = _segments(chain, regions)
    relaxed: float | None = 0.0
    for blocks, required in _required_bytes(chain, budget_bytes - margin_bytes):
        time_s = _relaxed_time([s for block in segments[:blocks] for s in block], required)
        relaxed = None if time_s is None or relaxed is None else max(relaxed, time_s)
    if relaxed is not None:
        candidates.append(relaxed)
    return min(candidates) if candidates else None
