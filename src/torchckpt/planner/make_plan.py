"""plan() and frontier(): profile -> solve -> Plan. Measuring lives in profile.py, deciding in solve/.

Budgets are the whole step's peak (parameters, gradients, optimizer state, activations, transients):
an int of bytes, a size string ("6GiB", "800MB"), or a percentage ("60%") of the predicted peak
without checkpointing (which the profiler measures, so it equals the measured plain peak).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

from torchckpt._units import parse_bytes, parse_percent
from torchckpt.executor.compiled import uncompiled
from torchckpt.planner import solve as solver
from torchckpt.planner.costs import BlockCosts, ChainCosts
from torchckpt.planner.infeasible import with_paths
from torchckpt.planner.plan import Plan, PlannedBlock, PlannedRegion, PlanPiece, fingerprint
from torchckpt.planner.profile import profile
from torchckpt.planner.runner import StepFn

__all__ = ["no_checkpointing_schedule", "plan", "plan_from_costs", "plan_pieces", "regions_note", "resolve_budget",
           "resolve_margin"]


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


def plan_pieces(schedule: Sequence[solver.Piece], menus: Sequence[Sequence[solver.MenuOption]],
                costs: ChainCosts | None = None) -> tuple[PlanPiece, ...]:
    """Turn a solver schedule (menu option indices) into a plan's pieces (the ops each block keeps).

    With ``costs``, each kept op is also named by occurrence (``PlannedBlock.keep_ops``, how a compiled
    block keeps it: Note: [compiled plans keep ops by name and occurrence]).

    Example:
        >>> option = solver.MenuOption(kept_ops=(), held_bytes=0, recompute_s=0.0, plain=True)
        >>> plan_pieces((solver.Single(block=0, option=0),), [(option,)])
        (PlannedBlock(block=0, plain=True, keep=(), keep_ops=()),)
    """
    out: list[PlanPiece] = []
    for piece in schedule:
        if isinstance(piece, solver.Region):
            out.append(PlannedRegion(start=piece.start, stop=piece.stop,
                                     inner=plan_pieces(piece.inner, menus, costs)))
            continue
        option = menus[piece.block][piece.option]
        keep = () if option.plain else tuple(option.kept_ops)
        names = occurrence_names(costs.blocks[piece.block], keep) if costs is not None and keep else ()
        out.append(PlannedBlock(block=piece.block, plain=option.plain, keep=keep, keep_ops=names))
    return tuple(out)


_REWRITTEN = re.compile(r"(_$|bernoulli|dropout|rand|normal|uniform|multinomial|poisson|exponential|geometric|cauchy)")


def occurrence_names(block: BlockCosts, indices: Sequence[int]) -> tuple[str, ...]:
    """``"name#k:bytes"`` for each op index of ``block``: the op's name, how many ops of that name ran before
    it, and its output bytes; ``"-"`` for an op that runs after a random or in-place op, which a traced graph
    rewrites (Note: [compiled plans keep ops by name and occurrence]).

    Example:
        >>> from torchckpt.planner.costs import OpCosts
        >>> ops = tuple(OpCosts(index=i, name=n, output_bytes=4, saved=True, time_s=0.0)
        ...             for i, n in enumerate(["aten.mm", "aten.relu", "aten.mm", "aten.bernoulli_", "aten.mul"]))
        >>> block = BlockCosts(name="b", input_bytes=1, output_bytes=1, saved_bytes=1, forward_time_s=0.1, ops=ops)
        >>> occurrence_names(block, [2, 4])
        ('aten.mm#1:4', '-')
    """
    by_index = {op.index: op for op in block.ops}
    missing = [index for index in indices if index not in by_index]
    if missing:
        raise ValueError(f"block {block.name!r} has no op #{missing[0]} in its measured forward pass")
    names = []
    for index in indices:
        before = [op for op in block.ops if op.index < index]
        op = by_index[index]
        if any(_REWRITTEN.search(other.name.rpartition(".")[2]) for other in before):
            names.append("-")
            continue
        names.append(f"{op.name}#{sum(1 for other in before if other.name == op.name)}:{op.output_bytes}")
    return tuple(names)


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


def _margin_spec(margin: object) -> tuple[str, float]:
    """("auto", 0), ("bytes", n) or ("share", f) for a margin; raises naming the forms allowed."""
    forms = ("margin must be 'auto', an int number of bytes >= 0, a size string like '64KiB', or a share of the "
             "budget in [0, 1) as a float (0.01) or a percentage ('1%')")
    if isinstance(margin, str) and margin.strip() == "auto":
        return "auto", 0.0
    if isinstance(margin, bool) or not isinstance(margin, (int, float, str)):
        raise TypeError(f"{forms}; got {margin!r}")
    if isinstance(margin, str) and margin.strip().endswith("%"):
        try:
            share = float(margin.strip()[:-1]) / 100
        except ValueError:
            raise ValueError(f"{forms}; got {margin!r}") from None
    elif isinstance(margin, float):
        share = margin
    elif isinstance(margin, int):
        if margin < 0:
            raise ValueError(f"{forms}; got {margin!r}")
        return "bytes", float(margin)
    else:
        try:
            return "bytes", float(parse_bytes(margin, option="margin"))
        except ValueError as error:
            raise ValueError(f"{forms}; got {margin!r} ({error})") from None
    if not 0 <= share < 1:  # also refuses nan
        raise ValueError(f"{forms}; got {margin!r}")
    return "share", share


def resolve_margin(margin: int | float | str, costs: ChainCosts, budget_bytes: int) -> int:
    """The margin in bytes that plans the profiler did not measure keep below ``budget_bytes``.

    ``"auto"`` (the default of ``plan``) is ``costs.margin_bytes``: what the profiler suggests, 64 KiB plus
    0.5% of the plain step's activation bytes (``profile.HEADROOM_*``; 0 for cost models that record
    none). An int or a size string is bytes; a float in [0, 1) or a percentage is a share of the budget.
    The two schedules the profiler measured (no checkpointing; every block checkpointed) get no margin.

    Example:
        >>> from torchckpt.planner.costs import BlockCosts
        >>> block = BlockCosts(name="b", input_bytes=10, output_bytes=10, saved_bytes=30, forward_time_s=0.1)
        >>> costs = ChainCosts(fixed_bytes=100, head_bytes=0, blocks=(block,), margin_bytes=64)
        >>> [resolve_margin(m, costs, 1000) for m in ("auto", 0, "1KiB", 0.02, "5%")]
        [64, 0, 1024, 20, 50]
    """
    kind, value = _margin_spec(margin)
    if kind == "auto":
        return costs.margin_bytes
    return int(value) if kind == "bytes" else int(value * budget_bytes)


def plan_from_costs(costs: ChainCosts, budget: int | str, *, block_paths: Sequence[str],
                    model_fingerprint: dict[str, Any], regions: bool = True,
                    margin: int | float | str = "auto") -> Plan:
    """Solve an already measured cost model for ``budget`` (used by plan() and frontier sweeps).

    The plan is the one with the least predicted extra time whose predicted peak plus its margin fits:
    ``margin`` (see ``resolve_margin``; ``"auto"`` by default) for plans the profiler did not measure, none
    for the two it measured (costs.py's [a margin only where a plan was not measured]). The margin applied
    is recorded in ``reference["margin_bytes"]``.

    ``regions=False`` plans single blocks only (no regions), as do costs whose ``chain`` is False or
    that were profiled with ``regions=False``; the plan's ``notes["regions"]`` then says why.

    Example:
        >>> from torchckpt.planner.costs import BlockCosts
        >>> block = BlockCosts(name="b", input_bytes=10, output_bytes=10, saved_bytes=30, forward_time_s=0.1)
        >>> costs = ChainCosts(fixed_bytes=100, head_bytes=0, blocks=(block, block))
        >>> plan_from_costs(costs, "100%", block_paths=["0", "1"], model_fingerprint={}).predicted_extra_time_s
        0.0
    """
    _margin_spec(margin)  # a malformed margin fails before the budget is looked at
    budget_bytes = resolve_budget(budget, costs)
    margin_bytes = resolve_margin(margin, costs, budget_bytes)
    no_regions = regions_note(costs, regions)
    try:
        solution = solver.solve(costs, budget_bytes, allow_regions=no_regions is None, margin_bytes=margin_bytes)
    except solver.InfeasibleBudgetError as error:  # told again with the paths and the plain peak
        plain, _ = solver.evaluate(costs, no_checkpointing_schedule(costs))
        raise with_paths(error, block_paths, int(plain)) from None
    menus = [solver.block_menu(block) for block in costs.blocks]
    plain_peak, _ = solver.evaluate(costs, no_checkpointing_schedule(costs))
    applied = solver.schedule_margin_bytes(costs, solution.schedule, margin_bytes)
    return Plan(budget_bytes=budget_bytes, predicted_peak_bytes=int(solution.predicted_peak_bytes),
                predicted_extra_time_s=float(solution.extra_time_s),
                schedule=plan_pieces(solution.schedule, menus, costs), block_paths=tuple(block_paths),
                fingerprint=model_fingerprint,
                reference={"no_checkpointing_peak_bytes": float(plain_peak), "step_time_s": costs.step_time_s,
                           "margin_bytes": float(applied)},
                notes={} if no_regions is None or len(costs.blocks) < 2 else {"regions": no_regions})


def plan(model: nn.Module, example_inputs: tuple | dict, budget: int | str, *,
         loss_fn: Callable[[Any], torch.Tensor] | None = None, optimizer: torch.optim.Optimizer | None = None,
         blocks: str | Sequence[nn.Module] = "auto", regions: bool = True, step_fn: StepFn | None = None,
         margin: int | float | str = "auto") -> Plan:
    """Measure ``model`` and return the plan with the least predicted recompute time within ``budget``.

    The budget covers the whole step as the profiler runs it: by default ``loss = (loss_fn or
    default_loss)(model(*inputs))``, the output deleted before ``loss.backward()``. A loop that keeps the
    output (the logits) through backward peaks that much higher: pass it as ``step_fn(model,
    example_inputs)``, which runs the forward, calls ``backward()`` itself and returns the loss
    (``runner.StepRunner``; not together with ``loss_fn``), and the plan is made for that loop.

    ``regions=False`` plans single blocks only (no blocks checkpointed together as a region); plans have
    no regions either when the profiler cannot prove that a region computes exactly what the model does
    (``Plan.notes["regions"]`` says why).

    ``margin`` is kept below the budget by plans the profiler did not measure (``resolve_margin``):
    ``"auto"`` (64 KiB plus 0.5% of the plain step's activations), bytes, or a share of the budget. No
    checkpointing and every block checkpointed (``gradient_checkpointing_enable()``) are measured, so
    they need none: a budget equal to the measured peak of checkpointing every block is always feasible.

    Raises ``InfeasibleBudgetError`` (a ValueError) naming the smallest feasible peak and its parts when
    the budget is below the floor; a malformed budget or margin is refused before anything is measured.
    To plan several budgets from one measurement, ``torchckpt.profile(...)`` then
    ``ChainCosts.plan(budget)``. The model,
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
    _margin_spec(margin)
    # the blocks as profiled: "auto" is taken in the order the blocks run (profile's rule)
    model = uncompiled(model)  # Note: [a compiled model is planned through its original]
    costs = profile(model, example_inputs, loss_fn=loss_fn, optimizer=optimizer, blocks=blocks, regions=regions,
                    step_fn=step_fn)
    paths = list(costs.block_paths)
    return plan_from_costs(costs, budget, block_paths=paths,
                           model_fingerprint=fingerprint(model, example_inputs, paths), regions=regions, margin=margin)

