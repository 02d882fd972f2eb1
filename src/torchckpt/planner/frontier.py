"""frontier(): sweep budgets from the floor to the no-checkpointing peak; Pareto points and references.

Every point is a solved plan's prediction (peak bytes, extra seconds per step); the references are the
usual hand-made choices evaluated with the same cost model: no checkpointing, every block checkpointed
(what ``gradient_checkpointing_enable()`` does), and ``checkpoint_sequential`` with sqrt(L) segments.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from torchckpt._optional import require
from torchckpt._units import format_bytes
from torchckpt.executor.compiled import uncompiled
from torchckpt.planner import solve as solver
from torchckpt.planner.from_costs import (
    ChainCosts,
    floor_over_options,
    no_checkpointing_schedule,
    plan_from_costs,
    regions_note,
    resolve_margin,
)
from torchckpt.planner.plan import Plan, fingerprint
from torchckpt.planner.profile import profile
from torchckpt.planner.runner import StepFn

__all__ = ["Frontier", "FrontierPoint", "frontier", "frontier_from_costs", "reference_schedules"]


@dataclass(frozen=True, kw_only=True)
class FrontierPoint:
    """One point: a label, its predicted peak and extra time, and the plan when torchckpt made it."""

    label: str
    peak_bytes: int
    extra_time_s: float
    plan: Plan | None = None


@dataclass(frozen=True, kw_only=True)
class Frontier:
    """Pareto points of torchckpt's plans plus the reference methods."""

    points: tuple[FrontierPoint, ...]
    references: tuple[FrontierPoint, ...]
    step_time_s: float

    def table(self) -> str:
        """Rows of (label, peak, extra time, extra time as % of a plain step)."""
        rows = [f"{'plan':<34} {'peak':>12} {'extra time':>12} {'of a step':>10}"]
        for point in sorted(self.points + self.references, key=lambda p: (-p.peak_bytes, p.extra_time_s)):
            share = point.extra_time_s / self.step_time_s if self.step_time_s else 0.0
            rows.append(f"{point.label:<34} {format_bytes(point.peak_bytes):>12} "
                        f"{point.extra_time_s * 1e3:>9.1f} ms {share:>9.0%}")
        return "\n".join(rows)

    def __str__(self) -> str:
        return self.table()

    def plot(self, path: str | Path) -> Path:
        """Write a PNG: peak memory (x) against extra time (y); torchckpt as a line, references as points."""
        matplotlib = require("matplotlib", "Frontier.plot")
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        figure, axes = plt.subplots(figsize=(7, 4.5))
        points = sorted(self.points, key=lambda p: p.peak_bytes)
        axes.plot([p.peak_bytes / 2**20 for p in points], [p.extra_time_s * 1e3 for p in points], "o-",
                  label="torchckpt plans")
        for reference in self.references:
            axes.plot(reference.peak_bytes / 2**20, reference.extra_time_s * 1e3, "s")
            axes.annotate(reference.label, (reference.peak_bytes / 2**20, reference.extra_time_s * 1e3),
                          textcoords="offset points", xytext=(5, 5), fontsize=8)
        axes.set_xlabel("predicted peak memory (MiB)")
        axes.set_ylabel("predicted recompute time per step (ms)")
        axes.grid(True, alpha=0.3)
        axes.legend()
        figure.tight_layout()
        out = Path(path)
        figure.savefig(out, dpi=120)
        plt.close(figure)
        return out


def reference_schedules(costs: ChainCosts) -> dict[str, tuple]:
    """The hand-made schedules torchckpt is compared with, in the solver's schedule form.

    Example:
        >>> from torchckpt.planner.costs import BlockCosts
        >>> block = BlockCosts(name="b", input_bytes=4, output_bytes=4, saved_bytes=40, forward_time_s=0.1)
        >>> sorted(reference_schedules(ChainCosts(fixed_bytes=0, head_bytes=0, blocks=(block,) * 9)))
        ['checkpoint every block', 'checkpoint_sequential sqrt(L)', 'no checkpointing']
    """
    n = len(costs.blocks)
    keep_nothing = [len(solver.block_menu(block)) - 1 for block in costs.blocks]
    schedules = {
        "no checkpointing": no_checkpointing_schedule(costs),
        "checkpoint every block": tuple(solver.Single(block=i, option=keep_nothing[i]) for i in range(n)),
    }
    segments = max(1, round(math.sqrt(n)))
    if n >= 2 and segments >= 2 and costs.chain:
        bounds = [round(i * n / segments) for i in range(segments + 1)]
        pieces: list[Any] = []
        for start, stop in zip(bounds[:-2], bounds[1:-1]):  # like torch: the last segment runs plainly
            inner = tuple(solver.Single(block=i, option=0) for i in range(start, stop))
            pieces.append(solver.Region(start=start, stop=stop, inner=inner) if stop - start > 1 else
                          solver.Single(block=start, option=keep_nothing[start]))
        pieces.extend(solver.Single(block=i, option=0) for i in range(bounds[-2], n))
        schedules["checkpoint_sequential sqrt(L)"] = tuple(pieces)
    return schedules


def frontier_from_costs(costs: ChainCosts, *, points: int = 12, block_paths: Sequence[str] = (),
                        model_fingerprint: dict[str, Any] | None = None, regions: bool = True,
                        margin: int | float | str = "auto") -> Frontier:
    """Solve ``points`` budgets spaced evenly from the floor to the no-checkpointing peak (``regions=False``:
    plans of single blocks only; ``margin``: kept by plans the profiler did not measure; see
    ``plan_from_costs``). ``block_paths`` and ``model_fingerprint`` default to the ones ``costs`` records.

    Example:
        >>> from torchckpt.planner.costs import BlockCosts
        >>> block = BlockCosts(name="b", input_bytes=4, output_bytes=4, saved_bytes=40, forward_time_s=0.1)
        >>> front = frontier_from_costs(ChainCosts(fixed_bytes=0, head_bytes=0, blocks=(block,) * 4), points=3)
        >>> front.points[-1].extra_time_s
        0.0
    """
    if points < 2:
        raise ValueError(f"frontier: points must be >= 2; got {points}")
    references = tuple(FrontierPoint(label=label, peak_bytes=int(peak), extra_time_s=float(extra))
                       for label, (peak, extra) in ((label, solver.evaluate(costs, schedule))
                                                    for label, schedule in reference_schedules(costs).items()))
    top = max(r.peak_bytes for r in references if r.label == "no checkpointing")
    margin_bytes = resolve_margin(margin, costs, top)
    floor = floor_over_options(costs, allow_regions=regions_note(costs, regions) is None, margin_bytes=margin_bytes)
    paths = list(block_paths) or list(costs.block_paths) or [block.name for block in costs.blocks]
    found: dict[tuple[int, float], FrontierPoint] = {}
    for k in range(points):
        budget = int(floor + (top - floor) * k / (points - 1))
        made = plan_from_costs(costs, max(budget, floor), block_paths=paths,
                               model_fingerprint=model_fingerprint or dict(costs.fingerprint), regions=regions,
                               margin=margin_bytes)
        key = (made.predicted_peak_bytes, round(made.predicted_extra_time_s, 12))
        found.setdefault(key, FrontierPoint(label=f"torchckpt @ {format_bytes(made.budget_bytes)}",
                                            peak_bytes=made.predicted_peak_bytes,
                                            extra_time_s=made.predicted_extra_time_s, plan=made))
    pareto = [p for p in found.values()
              if not any(q.peak_bytes <= p.peak_bytes and q.extra_time_s < p.extra_time_s for q in found.values())]
    return Frontier(points=tuple(sorted(pareto, key=lambda p: p.peak_bytes)), references=references,
                    step_time_s=costs.step_time_s)


def frontier(model: nn.Module, example_inputs: tuple | dict, *, points: int = 12,
             loss_fn: Callable[[Any], torch.Tensor] | None = None, optimizer: torch.optim.Optimizer | None = None,
             blocks: str | Sequence[nn.Module] = "auto", regions: bool = True,
             step_fn: StepFn | None = None) -> Frontier:
    """Profile once, then solve a sweep of budgets: the memory/time trade-off of ``model``
    (``regions=False``: plans of single blocks only; ``step_fn``: profile the user's own forward and
    backward, as in ``plan``).

    Example:
        >>> from torchckpt.models import gpt
        >>> model = gpt("tiny")
        >>> front = frontier(model, model.example_batch(batch_size=2, seq_len=32), points=4)
        >>> front.points[0].peak_bytes <= front.points[-1].peak_bytes
        True
    """
    # the blocks as profiled: "auto" is taken in the order the blocks run (profile's rule)
    model = uncompiled(model)  # Note: [a compiled model is planned through its original]
    costs = profile(model, example_inputs, loss_fn=loss_fn, optimizer=optimizer, blocks=blocks, regions=regions,
                    step_fn=step_fn)
    paths = list(costs.block_paths)
    return frontier_from_costs(costs, points=points, block_paths=paths,
                               model_fingerprint=fingerprint(model, example_inputs, paths), regions=regions)
