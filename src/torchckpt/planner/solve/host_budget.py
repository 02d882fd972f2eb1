"""Plans with offloaded blocks kept within a host budget (costs.py's [offloaded blocks]).

The chain solver minimises time under the device budget alone. Host memory is a second budget: a plan's host
peak is the sum of its offloaded blocks' ``offload_host_bytes``. Rule:

1. **[host bytes priced until they fit]** When the fastest plan within the device budget takes more host memory
   than ``CostModel.offload["host_budget_bytes"]``, each offload option's time is raised by a price per host byte
   (a Lagrange multiplier), doubled until the plan fits the host budget and then bisected down to the least price
   that still fits; the plan found is evaluated again on the unpriced costs (its real predicted time and peak). A
   device budget that cannot be met without more host memory than allowed raises ``InfeasibleBudgetError`` naming
   both budgets.
"""

from __future__ import annotations

from dataclasses import replace

from torchckpt.planner.costs import CostModel
from torchckpt.planner.solve._chain import Chain
from torchckpt.planner.solve._types import InfeasibleBudgetError, Piece, Single, Solution
from torchckpt.planner.solve.chain_dp import solve
from torchckpt.planner.solve.evaluate import evaluate

__all__ = ["schedule_host_bytes", "solve_within_host"]

_DOUBLINGS = 48
_BISECTIONS = 12


def schedule_host_bytes(costs: CostModel, schedule: tuple[Piece, ...]) -> int:
    """Host bytes a schedule's offloaded blocks take at once (the end of the forward pass).

    Example:
        >>> from torchckpt.planner.costs import BlockCosts
        >>> block = BlockCosts(name="b", input_bytes=4, output_bytes=4, saved_bytes=40, forward_time_s=1.0,
        ...                    offload_held_bytes=0, offload_host_bytes=40, offload_time_s=0.1)
        >>> costs = CostModel(fixed_bytes=100, head_bytes=10, blocks=(block, block))
        >>> schedule_host_bytes(costs, (Single(block=0, option=1), Single(block=1, option=0)))
        40
    """
    menus = Chain.of(costs).menus
    return sum(menus[p.block][p.option].host_bytes for p in schedule if isinstance(p, Single))


def _priced(costs: CostModel, price: float) -> CostModel:
    blocks = tuple(replace(b, offload_time_s=b.offload_time_s + price * b.offload_host_bytes)
                   if b.offload_held_bytes >= 0 else b for b in costs.blocks)
    return replace(costs, blocks=blocks)


def solve_within_host(costs: CostModel, budget_bytes: int, *, allow_regions: bool = True,
                      margin_bytes: int | None = None) -> Solution:
    """``solve``, with the plan's offloaded blocks kept within ``costs.offload["host_budget_bytes"]`` ([host bytes
    priced until they fit]); ``Solution.host_bytes`` is the plan's host peak.

    Example:
        >>> from torchckpt.planner.costs import BlockCosts
        >>> block = BlockCosts(name="b", input_bytes=4, output_bytes=4, saved_bytes=40, forward_time_s=1.0,
        ...                    offload_held_bytes=0, offload_host_bytes=40, offload_time_s=0.1)
        >>> offload = {"window_bytes": 0, "host_budget_bytes": 40, "d2h_bytes_per_s": 1e9, "h2d_bytes_per_s": 1e9,
        ...            "time_scale": 1.0, "device": "cpu"}
        >>> costs = CostModel(fixed_bytes=100, head_bytes=10, blocks=(block,) * 4, offload=offload)
        >>> solution = solve_within_host(costs, 230)
        >>> solution.host_bytes, round(solution.extra_time_s, 3)  # one block offloaded, one recomputed
        (40, 1.1)
    """
    solution = solve(costs, budget_bytes, allow_regions=allow_regions, margin_bytes=margin_bytes)
    host = schedule_host_bytes(costs, solution.schedule)
    limit = costs.offload.get("host_budget_bytes")
    if limit is None or host <= limit:
        return replace(solution, host_bytes=host)
    price = max(costs.step_time_s, 1e-3) / max(host, 1)
    fits, over = None, 0.0
    for _ in range(_DOUBLINGS):
        found = solve(_priced(costs, price), budget_bytes, allow_regions=allow_regions, margin_bytes=margin_bytes)
        if schedule_host_bytes(costs, found.schedule) <= limit:
            fits = price, found
            break
        over, price = price, price * 2
    if fits is None:
        raise InfeasibleBudgetError(budget_bytes, budget_bytes, {"host_bytes": host, "host_budget_bytes": limit},
                                    f"no plan fits both budgets: within the device budget of {budget_bytes} bytes the "
                                    f"least host memory a plan takes for its offloaded blocks is over the host budget "
                                    f"of {limit} bytes. Fix: raise host_budget (torchckpt.plan(..., host_budget=...)), "
                                    "raise the device budget, or plan without offload (offload=False)")
    for _ in range(_BISECTIONS):
        middle = (over + fits[0]) / 2
        found = solve(_priced(costs, middle), budget_bytes, allow_regions=allow_regions, margin_bytes=margin_bytes)
        if schedule_host_bytes(costs, found.schedule) <= limit:
            fits = middle, found
        else:
            over = middle
    schedule = fits[1].schedule
    peak, extra_s = evaluate(costs, schedule)
    return Solution(schedule=schedule, predicted_peak_bytes=peak, extra_time_s=extra_s, budget_bytes=budget_bytes,
                    host_bytes=schedule_host_bytes(costs, schedule))
