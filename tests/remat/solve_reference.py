"""Exhaustive references for the solver tests: every schedule of a small chain, and random small chains."""

from __future__ import annotations

from functools import lru_cache

import numpy as np

from torchckpt.remat.costs import BlockCosts, ChainCosts, OpCosts
from torchckpt.remat.solve import Region, Single, block_menu, evaluate


def all_schedules(costs: ChainCosts) -> list[tuple]:
    """Every valid schedule: any menu option at the top, plain/keep-nothing inside regions, any nesting."""
    menus = [block_menu(b) for b in costs.blocks]
    n = len(menus)

    @lru_cache(maxsize=None)
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
