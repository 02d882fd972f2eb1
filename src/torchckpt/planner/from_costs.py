"""From a measured cost model to a Plan: budgets and margins resolved, the solver called, its solution named.

``ChainCosts`` is the cost model as ``profile`` returns it: a ``costs.CostModel`` (torch-free data the solver
reads) that can also plan any budget from these costs alone (``costs.plan(budget)``).
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

from torchckpt._units import format_bytes, parse_bytes, parse_percent
from torchckpt.planner import solve as solver
from torchckpt.planner.costs import BlockCosts, CostModel
from torchckpt.planner.infeasible import name_paths, with_paths
from torchckpt.planner.plan import Plan, PlannedBlock, PlannedRegion, PlanPiece

__all__ = ["ChainCosts", "check_margin_form", "floor_over_options", "head_options", "loss_head_note",
           "lower_bound_over_options",
           "no_checkpointing_schedule", "offload_entry",
           "plan_from_costs", "plan_pieces", "regions_note", "resolve_budget", "resolve_margin", "with_head_note"]


def no_checkpointing_schedule(costs: CostModel) -> tuple:
    """The all-plain schedule (every block keeps everything).

    Example:
        >>> from torchckpt.planner.costs import BlockCosts
        >>> block = BlockCosts(name="b", input_bytes=1, output_bytes=1, saved_bytes=1, forward_time_s=0.1)
        >>> len(no_checkpointing_schedule(ChainCosts(fixed_bytes=0, head_bytes=0, blocks=(block, block))))
        2
    """
    return tuple(solver.Single(block=i, option=0) for i in range(len(costs.blocks)))


def resolve_budget(budget: int | str, costs: CostModel) -> int:
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
                costs: CostModel | None = None) -> tuple[PlanPiece, ...]:
    """Turn a solver schedule (menu option indices) into a plan's pieces (the ops each block keeps).

    With ``costs``, each kept op is also named by occurrence (``PlannedBlock.keep_ops``, how a compiled
    block keeps it: Note: [compiled plans keep ops by name and occurrence]).

    Example:
        >>> option = solver.MenuOption(kept_ops=(), held_bytes=0, recompute_s=0.0, plain=True)
        >>> plan_pieces((solver.Single(block=0, option=0),), [(option,)])[0].plain
        True
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
        sliced_pieces = option.sliced_pieces if option.nested and option.pieces and option.slices == 1 else ()
        batch = costs.blocks[piece.block].nested_slice_batch if costs is not None and (
            option.slices > 1 or sliced_pieces) else 0
        out.append(PlannedBlock(block=piece.block, plain=option.plain, keep=keep, keep_ops=names,
                                nested=option.nested and option.pieces, slices=option.slices, slice_batch=batch,
                                offload=option.offload, sliced_pieces=sliced_pieces,
                                piece_slices=option.piece_slices if sliced_pieces else 1))
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


def regions_note(costs: CostModel, regions: bool = True) -> str | None:
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


def resolve_margin(margin: int | float | str, costs: CostModel, budget_bytes: int) -> int:
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


def plan_from_costs(costs: CostModel, budget: int | str, *, block_paths: Sequence[str],
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
    plain_peak, _ = solver.evaluate(costs, no_checkpointing_schedule(costs))
    found: list[tuple[float, int, solver.Solution, CostModel, dict[str, Any]]] = []
    errors: list[solver.InfeasibleBudgetError] = []
    for rank, (option, head) in enumerate(head_options(costs)):
        try:
            solution = solver.solve_within_host(option, budget_bytes, allow_regions=no_regions is None,
                                                margin_bytes=margin_bytes)
        except solver.InfeasibleBudgetError as error:
            errors.append(error)
            continue
        extra = float(costs.loss_head["extra_time_s"]) if head else 0.0
        found.append((solution.extra_time_s + extra, rank, solution, option, head))
    if not found:  # told again with the paths, the plain peak, and the loss head's part
        lowest = min(errors, key=lambda error: error.floor_bytes)
        told = with_paths(with_head_note(lowest, costs), block_paths, int(plain_peak))
        raise with_other_blocks(told, costs) from None
    # Note: [the loss head is chunked where that is faster]: the least predicted time; ties go to the head whole
    extra_time, _, solution, option, head = min(found, key=lambda entry: entry[:2])
    menus = [solver.block_menu(block) for block in option.blocks]
    applied = solver.schedule_margin_bytes(option, solution.schedule, margin_bytes)
    notes = {} if no_regions is None or len(costs.blocks) < 2 else {"regions": no_regions}
    # repeat.py's, other_blocks.py's, stem.py's, batch_slices.py's notes; and planner/layout.py's [a plan names the
    # layout it was made for] (the engine and ranks agreed by planner/distributed.py)
    for name in ("not recomputed", "other blocks", "stem", "batch slices", "engine", "ranks", "offload"):
        if name in costs.notes:
            notes[name] = costs.notes[name]
    head_note = loss_head_note(costs, chosen=bool(head))
    if head_note:
        notes["loss head"] = head_note
    notes["floor"] = name_paths(floor_note(costs, allow_regions=no_regions is None, margin_bytes=margin_bytes),
                                block_paths)
    return Plan(budget_bytes=budget_bytes, predicted_peak_bytes=int(solution.predicted_peak_bytes),
                predicted_extra_time_s=float(extra_time),
                schedule=plan_pieces(solution.schedule, menus, option), block_paths=tuple(block_paths),
                fingerprint=model_fingerprint,
                reference={"no_checkpointing_peak_bytes": float(plain_peak), "step_time_s": costs.step_time_s,
                           "margin_bytes": float(applied)},
                notes=notes, loss_head=head, optimizer_in_backward=costs.optimizer_in_backward,
                micro_batches=costs.micro_batches, offload=offload_entry(costs, solution),
                optimizer_offload=costs.optimizer_offload)


def offload_entry(costs: CostModel, solution: solver.Solution) -> dict[str, int]:
    """``Plan.offload`` for a solution: empty unless it offloads a block (costs.py's [offloaded blocks]).

    Example:
        >>> from torchckpt.planner.costs import BlockCosts
        >>> block = BlockCosts(name="b", input_bytes=1, output_bytes=1, saved_bytes=1, forward_time_s=0.1)
        >>> costs = ChainCosts(fixed_bytes=0, head_bytes=0, blocks=(block,))
        >>> offload_entry(costs, solver.solve(costs, 10))
        {}
    """
    if not solution.host_bytes:
        return {}
    return {"window_bytes": int(costs.offload["window_bytes"]),
            "host_budget_bytes": int(costs.offload["host_budget_bytes"]),
            "predicted_host_peak_bytes": int(solution.host_bytes), "inputs": int(costs.chain)}


def head_options(costs: CostModel) -> list[tuple[CostModel, dict[str, Any]]]:
    """The cost models a plan may be solved on, each with the ``Plan.loss_head`` it implies: the plain head,
    then, when the profiler proved one (planner/head.py), the head in chunks (its ``head_bytes``; no schedule
    with it was measured, so every one keeps the margin, no checkpointing included).

    Example:
        >>> from torchckpt.planner.costs import BlockCosts
        >>> block = BlockCosts(name="b", input_bytes=10, output_bytes=10, saved_bytes=30, forward_time_s=0.1)
        >>> head = {"path": "lm_head", "chunk_tokens": 8, "head_bytes": 5, "extra_time_s": 0.01}
        >>> costs = ChainCosts(fixed_bytes=100, head_bytes=50, blocks=(block,), loss_head=head)
        >>> [(option.head_bytes, chosen) for option, chosen in head_options(costs)]
        [(50, {}), (5, {'path': 'lm_head', 'chunk_tokens': 8})]
    """
    options: list[tuple[CostModel, dict[str, Any]]] = [(costs, {})]
    entry = costs.loss_head
    if "head_bytes" in entry:
        chunked = replace(costs, head_bytes=entry["head_bytes"], every_block_peak_bytes=0, measured=False)
        options.append((chunked, {"path": entry["path"], "chunk_tokens": entry["chunk_tokens"]}))
    return options


def floor_note(costs: CostModel, *, allow_regions: bool, margin_bytes: int) -> str:
    """What a plan's table says of the floor (the least budget any plan fits, over ``head_options``): its size,
    its share of the no-checkpointing peak, what it is made of and what would lower it (solve's
    ``describe_floor``).

    Example:
        >>> from torchckpt.planner.costs import BlockCosts
        >>> block = BlockCosts(name="b", input_bytes=10, output_bytes=10, saved_bytes=30, forward_time_s=0.1)
        >>> floor_note(ChainCosts(fixed_bytes=100, head_bytes=0, blocks=(block,)), allow_regions=True,
        ...            margin_bytes=0).split(" = ")[0]
        '150 B (100% of the no-checkpointing peak; the least budget any plan fits)'
    """
    told = [(*solver.describe_floor(option, allow_regions=allow_regions, margin_bytes=margin_bytes), head)
            for option, head in head_options(costs)]
    floor, text, head = min(told, key=lambda entry: entry[0])
    plain, _ = solver.evaluate(costs, no_checkpointing_schedule(costs))
    share = f"{floor / plain:.0%} of the no-checkpointing peak; " if plain else ""
    size, parts = text.split(" = ", 1)
    chunked = f", with {head['path']} in chunks" if head else ""
    return f"{size} ({share}the least budget any plan fits{chunked}) = {parts}"


def floor_over_options(costs: CostModel, *, allow_regions: bool, margin_bytes: int) -> int:
    """The least floor over ``head_options``: the smallest budget some plan fits.

    Example:
        >>> from torchckpt.planner.costs import BlockCosts
        >>> block = BlockCosts(name="b", input_bytes=10, output_bytes=10, saved_bytes=30, forward_time_s=0.1)
        >>> floor_over_options(ChainCosts(fixed_bytes=100, head_bytes=0, blocks=(block,)), allow_regions=True,
        ...                    margin_bytes=0)
        150
    """
    return min(solver.floor_bytes(option, allow_regions=allow_regions, margin_bytes=margin_bytes)
               for option, _ in head_options(costs))


def lower_bound_over_options(costs: CostModel, budget_bytes: int, *, margin_bytes: int = 0,
                             regions: bool = True) -> float | None:
    """``solve.recompute_lower_bound`` over ``head_options`` (the chunked head's extra time added): a lower bound
    on the extra time of any plan ``plan_from_costs`` can make for ``budget_bytes``; None where none fits.

    Example:
        >>> from torchckpt.planner.costs import BlockCosts
        >>> block = BlockCosts(name="b", input_bytes=10, output_bytes=10, saved_bytes=30, forward_time_s=0.1)
        >>> lower_bound_over_options(ChainCosts(fixed_bytes=100, head_bytes=0, blocks=(block, block)), 170)
        0.05
    """
    bounds = []
    for option, head in head_options(costs):
        bound = solver.recompute_lower_bound(option, budget_bytes, margin_bytes=margin_bytes, regions=regions)
        if bound is not None:
            bounds.append(bound + (float(costs.loss_head["extra_time_s"]) if head else 0.0))
    return min(bounds) if bounds else None


def loss_head_note(costs: CostModel, *, chosen: bool) -> str:
    """What a plan's table says about the loss head: used, available but not needed, or why not available.

    Example:
        >>> from torchckpt.planner.costs import BlockCosts
        >>> block = BlockCosts(name="b", input_bytes=10, output_bytes=10, saved_bytes=30, forward_time_s=0.1)
        >>> loss_head_note(ChainCosts(fixed_bytes=100, head_bytes=0, blocks=(block,)), chosen=False)
        ''
    """
    entry = costs.loss_head
    if not entry:
        return ""
    if "head_bytes" not in entry:
        return entry.get("note", "")
    saving = format_bytes(max(0, costs.head_bytes - entry["head_bytes"]))
    if chosen:
        return (f"{entry['path']} in chunks of {entry['chunk_tokens']} tokens: its logits never exist whole "
                f"({saving} less at the head; gradients of its weight equal to rounding, all others bitwise)")
    return (f"available ({entry['path']} in chunks would need {saving} less at the head); the plan with the head "
            "whole is as fast at this budget")


def with_head_note(error: solver.InfeasibleBudgetError, costs: CostModel) -> solver.InfeasibleBudgetError:
    """``error`` with what the loss head contributes to the floor and whether chunking it is possible."""
    entry = costs.loss_head
    if "head_bytes" in entry:
        head = f" The loss head ({entry['path']}) is computed in chunks at this floor."
    elif entry.get("note"):
        head = (f" The loss head ({format_bytes(costs.head_bytes)} at the end of the forward pass) stays whole: "
                f"{entry['note']}.")
    else:
        head = ""
    if not head:
        return error
    breakdown = {**error.breakdown, "loss_head": head.strip()}
    return solver.InfeasibleBudgetError(error.budget_bytes, error.floor_bytes, breakdown, f"{error}{head}")


def with_other_blocks(error: solver.InfeasibleBudgetError, costs: CostModel) -> solver.InfeasibleBudgetError:
    """``error`` naming other blocks that measured a much lower peak (other_blocks.py's [a much lower floor
    elsewhere is named]), when the profiler found any."""
    other = costs.notes.get("other blocks")
    if not other:
        return error
    breakdown = {**error.breakdown, "other_blocks": other}
    return solver.InfeasibleBudgetError(error.budget_bytes, error.floor_bytes, breakdown,
                                        f"{error} Other blocks may go lower: {other}.")


def check_margin_form(margin: object) -> None:
    """Raise (TypeError/ValueError naming the forms allowed) unless ``margin`` is a margin ``plan`` accepts.

    Example:
        >>> check_margin_form("auto"); check_margin_form("1%")
        >>> try:
        ...     check_margin_form(-1)
        ... except ValueError as error:
        ...     print(str(error)[:40])
        margin must be 'auto', an int number of
    """
    _margin_spec(margin)


@dataclass(frozen=True, kw_only=True)
class ChainCosts(CostModel):
    """A measured cost model (``torchckpt.profile`` returns one) that plans any budget from these costs alone.

    Example:
        >>> block = BlockCosts(name="b", input_bytes=10, output_bytes=10, saved_bytes=30, forward_time_s=0.1)
        >>> costs = ChainCosts(fixed_bytes=100, head_bytes=0, blocks=(block, block), block_paths=("0", "1"))
        >>> [costs.plan(budget).predicted_extra_time_s for budget in ("100%", 170)]
        [0.0, 0.1]
    """

    def plan(self, budget: int | str, *, margin: int | float | str = "auto", regions: bool = True) -> Plan:
        """The plan with the least predicted recompute time within ``budget``, from these costs alone: one
        ``profile`` serves any number of budgets (``torchckpt.plan`` profiles again each time).

        ``budget``, ``margin`` and ``regions`` are those of ``torchckpt.plan``; the plan names the blocks by
        ``block_paths`` (block names when empty) and carries ``fingerprint``. Raises
        ``InfeasibleBudgetError`` below the floor, ValueError/TypeError for a malformed budget or margin.

        Example:
            >>> block = BlockCosts(name="b", input_bytes=10, output_bytes=10, saved_bytes=30, forward_time_s=0.1)
            >>> ChainCosts(fixed_bytes=100, head_bytes=0, blocks=(block,)).plan("100%").predicted_extra_time_s
            0.0
        """
        paths = self.block_paths or tuple(block.name for block in self.blocks)
        return plan_from_costs(self, budget, block_paths=paths, model_fingerprint=dict(self.fingerprint),
                               margin=margin, regions=regions)
