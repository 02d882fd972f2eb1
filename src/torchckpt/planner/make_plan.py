"""plan() and frontier(): profile -> solve -> Plan. Measuring lives in profile.py, deciding in solve/.

Budgets are the whole step's peak (parameters, gradients, optimizer state, activations, transients):
an int of bytes, a size string ("6GiB", "800MB"), or a percentage ("60%") of the predicted peak
without checkpointing (which the profiler measures, so it equals the measured plain peak).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

from torchckpt._units import parse_bytes, parse_percent
from torchckpt.planner import solve as solver
from torchckpt.planner.blocks import block_paths, resolve_blocks
from torchckpt.planner.costs import ChainCosts
from torchckpt.planner.plan import Plan, PlannedBlock, PlannedRegion, PlanPiece, fingerprint
from torchckpt.planner.profile import profile

__all__ = ["no_checkpointing_schedule", "plan", "plan_from_costs", "plan_pieces", "regions_note", "resolve_budget"]


def no_checkpointing_schedule(costs: ChainCosts) -> tuple:
    """The all-plain schedule (every block keeps everything).

    Example:
        >>> from torchckpt.planner.costs import BlockCosts
        >>> block = BlockCosts(name="b", input_bytes=1, output_bytes=1, saved_bytes=1, forward_time_s=0.1)
        >>> len(no_checkpointing_schedule(ChainCosts(fixed_bytes=0, head_bytes=0, blocks=(block, block))))
        2
    """
    return tuple(solver.Single(block=i, option=0) for i in range(len(costs.blocks)))


def resolve_budget(budget: int | str, costs: ChainCosts) -> int:
    """Turn a budget (bytes, size string or percentage of the no-checkpointing peak) into bytes.

    Example:
        >>> from torchckpt.planner.costs import BlockCosts
        >>> block = BlockCosts(name="b", input_bytes=10, output_bytes=10, saved_bytes=30, forward_time_s=0.1)
        >>> costs = ChainCosts(fixed_bytes=100, head_bytes=0, blocks=(block,))
        >>> resolve_budget("50%", costs), resolve_budget("1KiB", costs)
        (75, 1024)
    """
    percent = parse_percent(budget, option="budget")
    if percent is not None:
        plain_peak, _ = solver.evaluate(costs, no_checkpointing_schedule(costs))
        return int(plain_peak * percent / 100)
    return parse_bytes(budget, option="budget")


def plan_pieces(schedule: Sequence[solver.Piece],
                menus: Sequence[Sequence[solver.MenuOption]]) -> tuple[PlanPiece, ...]:
    """Turn a solver schedule (menu option indices) into a plan's pieces (the ops each block keeps).

    Example:
        >>> option = solver.MenuOption(kept_ops=(), held_bytes=0, recompute_s=0.0, plain=True)
        >>> plan_pieces((solver.Single(block=0, option=0),), [(option,)])
        (PlannedBlock(block=0, plain=True, keep=()),)
    """
    out: list[PlanPiece] = []
    for piece in schedule:
        if isinstance(piece, solver.Region):
            out.append(PlannedRegion(start=piece.start, stop=piece.stop, inner=plan_pieces(piece.inner, menus)))
            continue
        option = menus[piece.block][piece.option]
        out.append(PlannedBlock(block=piece.block, plain=option.plain, keep=() if option.plain else option.kept_ops))
    return tuple(out)


def regions_note(costs: ChainCosts, regions: bool = True) -> str | None:
    """Why plans from ``costs`` have no regions (``regions=False``, or the profiler could not prove a region
    exact), or None when they may have them.

    Example:
        >>> from torchckpt.planner.costs import BlockCosts
        >>> block = BlockCosts(name="b", input_bytes=1, output_bytes=1, saved_bytes=1, forward_time_s=0.1)
        >>> regions_note(ChainCosts(fixed_bytes=0, head_bytes=0, blocks=(block, block)), regions=False)
        'off (regions=False)'
    """
    if not regions:
        return "off (regions=False)"
    if "regions" in costs.notes:
        return costs.notes["regions"]
    if not costs.chain:
        return costs.notes.get("chain") or "no: the blocks are not called as a chain; single blocks only"
    return None


def plan_from_costs(costs: ChainCosts, budget: int | str, *, block_paths: Sequence[str],
                    model_fingerprint: dict[str, Any], regions: bool = True) -> Plan:
    """Solve an already measured cost model for ``budget`` (used by plan() and frontier sweeps).

    ``regions=False`` plans single blocks only (no regions), as do costs whose ``chain`` is False or
    that were profiled with ``regions=False``; the plan's ``notes["regions"]`` then says why.

    Example:
        >>> from torchckpt.planner.costs import BlockCosts
        >>> block = BlockCosts(name="b", input_bytes=10, output_bytes=10, saved_bytes=30, forward_time_s=0.1)
        >>> costs = ChainCosts(fixed_bytes=100, head_bytes=0, blocks=(block, block))
        >>> plan_from_costs(costs, "100%", block_paths=["0", "1"], model_fingerprint={}).predicted_extra_time_s
        0.0
    """
    budget_bytes = resolve_budget(budget, costs)
    no_regions = regions_note(costs, regions)
    solution = solver.solve(costs, budget_bytes, allow_regions=no_regions is None)
    menus = [solver.block_menu(block) for block in costs.blocks]
    plain_peak, _ = solver.evaluate(costs, no_checkpointing_schedule(costs))
    return Plan(budget_bytes=budget_bytes, predicted_peak_bytes=int(solution.predicted_peak_bytes),
                predicted_extra_time_s=float(solution.extra_time_s),
                schedule=plan_pieces(solution.schedule, menus), block_paths=tuple(block_paths),
                fingerprint=model_fingerprint,
                reference={"no_checkpointing_peak_bytes": float(plain_peak), "step_time_s": costs.step_time_s},
                notes={} if no_regions is None or len(costs.blocks) < 2 else {"regions": no_regions})


def plan(model: nn.Module, example_inputs: tuple | dict, budget: int | str, *,
         loss_fn: Callable[[Any], torch.Tensor] | None = None, optimizer: torch.optim.Optimizer | None = None,
         blocks: str | Sequence[nn.Module] = "auto", regions: bool = True) -> Plan:
    """Measure ``model`` and return the plan with the least predicted recompute time within ``budget``.

    ``regions=False`` plans single blocks only (no blocks checkpointed together as a region); plans have
    no regions either when the profiler cannot prove that a region computes exactly what the model does
    (``Plan.notes["regions"]`` says why).

    Raises ``InfeasibleBudgetError`` (a ValueError) naming the smallest feasible peak and its parts when
    the budget is below the floor; a malformed budget is refused before anything is measured. The model,
    ``optimizer`` and RNG streams are left exactly as they were (Note: [planning changes nothing]).

    Example:
        >>> import torchckpt
        >>> from torchckpt.models import gpt
        >>> model = gpt("tiny")
        >>> batch = model.example_batch(batch_size=2, seq_len=32)
        >>> torchckpt.plan(model, batch, budget="100%").predicted_extra_time_s
        0.0
    """
    if parse_percent(budget, option="budget") is None:  # a bad budget fails before minutes of profiling
        parse_bytes(budget, option="budget")
    block_list = resolve_blocks(model, blocks)
    paths = block_paths(model, block_list)
    costs = profile(model, example_inputs, loss_fn=loss_fn, optimizer=optimizer, blocks=block_list, regions=regions)
    return plan_from_costs(costs, budget, block_paths=paths,
                           model_fingerprint=fingerprint(model, example_inputs, paths), regions=regions)

