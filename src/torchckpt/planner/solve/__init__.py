"""The planner's solver: pure Python + numpy, never imports torch (``docs/design.md``, "The planner's model").

``block_menu`` gives each block's selective-checkpointing options, ``evaluate`` predicts a schedule's
peak and extra time under the rules of ``torchckpt.planner.costs``, ``solve`` finds the fastest schedule
within a budget (single blocks with menu options and nested regions), ``floor_bytes`` the least peak,
``recompute_lower_bound`` a bound no schedule's extra time is below (the fractional-knapsack relaxation),
``solve_within_host`` a plan whose offloaded blocks also fit a host budget.
"""

from torchckpt.planner.solve._types import InfeasibleBudgetError, MenuOption, Piece, Region, Single, Solution
from torchckpt.planner.solve.chain_dp import DEFAULT_MEMORY_SLOTS, solve, solve_budgets
from torchckpt.planner.solve.evaluate import evaluate
from torchckpt.planner.solve.floor import floor_bytes, schedule_margin_bytes
from torchckpt.planner.solve.floor_parts import describe_floor
from torchckpt.planner.solve.host_budget import schedule_host_bytes, solve_within_host
from torchckpt.planner.solve.lower_bound import recompute_lower_bound
from torchckpt.planner.solve.menu import MENU_MAX_OPTIONS, block_menu

__all__ = [
    "DEFAULT_MEMORY_SLOTS",
    "InfeasibleBudgetError",
    "MENU_MAX_OPTIONS",
    "MenuOption",
    "Piece",
    "Region",
    "Single",
    "Solution",
    "block_menu",
    "describe_floor",
    "evaluate",
    "floor_bytes",
    "recompute_lower_bound",
    "schedule_host_bytes",
    "schedule_margin_bytes",
    "solve_budgets",
    "solve",
    "solve_within_host",
]
