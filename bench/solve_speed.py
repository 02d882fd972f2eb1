"""Solver speed: wall time of ``solve`` on transformer-like chains of n blocks (pure numpy, no torch).

Run: ``python bench/solve_speed.py``. Each chain has heterogeneous measured-looking byte figures (so the
memory grid is the discretised one, ``DEFAULT_MEMORY_SLOTS`` + n + 2 slots), 8 saved ops per block
(menus of up to 16 options); budgets halfway (mid) and 5% of the way (tight) from the floor to the
no-checkpointing peak. Prints per row: time of ``solve`` (median of 3), of ``floor_bytes``, the plan's shape.
"""

from __future__ import annotations

import statistics
import sys
import time

import numpy as np

from torchckpt.planner.costs import BlockCosts, OpCosts
from torchckpt.planner.from_costs import ChainCosts
from torchckpt.planner.solve import Region, Single, evaluate, floor_bytes, solve

MIB = 2**20


def transformer_like(n: int, seed: int = 0) -> ChainCosts:
    """n blocks of ~24 MiB saved activations each, sizes jittered by a few KiB so that nothing divides evenly."""
    rng = np.random.default_rng(seed)
    width = 4 * MIB + 4096 * int(rng.integers(1, 9))
    blocks = []
    for i in range(n):
        outputs = [width, width, 4 * width, 4 * width, width, 2 * width // 3, width, width // 2]
        ops = tuple(OpCosts(index=k, name=f"op{k}", output_bytes=int(b + rng.integers(0, 4096)), saved=True,
                            time_s=float(rng.uniform(0.2e-3, 2e-3))) for k, b in enumerate(outputs))
        blocks.append(BlockCosts(name=f"layer{i}", input_bytes=width, output_bytes=width,
                                 saved_bytes=sum(op.output_bytes for op in ops) + int(rng.integers(0, MIB)),
                                 forward_time_s=sum(op.time_s for op in ops) * 1.05,
                                 forward_peak_bytes=int(rng.integers(0, 8 * MIB)),
                                 backward_peak_bytes=int(rng.integers(0, 16 * MIB)),
                                 recompute_peak_bytes=int(rng.integers(0, 4 * MIB)), ops=ops))
    return ChainCosts(fixed_bytes=2 * 1024 * MIB + 12345, head_bytes=64 * MIB + 7, blocks=tuple(blocks),
                      region_recompute_bytes=int(rng.integers(0, MIB)))


def _median_s(fn, repeats: int = 3) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _shape(schedule: tuple) -> str:
    regions = sum(isinstance(p, Region) for p in schedule)
    checkpointed = sum(isinstance(p, Single) and p.option != 0 for p in schedule)
    return f"{regions} regions, {checkpointed} checkpointed singles, {len(schedule) - regions - checkpointed} plain"


def main(sizes: tuple[int, ...] = (12, 24, 48, 100)) -> None:
    header = ("n", "budget", "solve s", "floor s", "budget MiB", "peak MiB", "extra ms")
    print(" ".join(f"{h:>{w}}" for h, w in zip(header, (4, 7, 8, 8, 11, 9, 9))) + "  plan")
    for n in sizes:
        costs = transformer_like(n)
        plain_peak, _ = evaluate(costs, tuple(Single(i, 0) for i in range(n)))
        floor = floor_bytes(costs)
        floor_s = _median_s(lambda costs=costs: floor_bytes(costs))
        for label, fraction in (("mid", 0.5), ("tight", 0.05)):
            budget = int(floor + fraction * (plain_peak - floor))
            solution = solve(costs, budget)
            solve_s = _median_s(lambda costs=costs, budget=budget: solve(costs, budget))
            print(f"{n:>4} {label:>7} {solve_s:>8.3f} {floor_s:>8.3f} {budget / MIB:>11.1f} "
                  f"{solution.predicted_peak_bytes / MIB:>9.1f} {solution.extra_time_s * 1e3:>9.2f}  "
                  f"{_shape(solution.schedule)}")


if __name__ == "__main__":
    main(tuple(int(a) for a in sys.argv[1:]) or (12, 24, 48, 100))
