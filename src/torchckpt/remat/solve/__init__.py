"""The planner's solver: pure Python + numpy, never imports torch (DESIGN.md, "The planner's model").

``block_menu`` gives each block's selective-checkpointing options, ``evaluate`` predicts a schedule's
peak and extra time under the rules of ``torchckpt.remat.costs``, ``solve`` finds the fastest schedule
within a budget (single blocks with menu options and nested regions), ``floor_bytes`` the least peak.
"""

from torchckpt.remat.solve._types import InfeasibleBudgetError, MenuOption, Piece, Region, Single, Solution
from torchckpt.remat.solve.chain_dp import DEFAULT_MEMORY_SLOTS, frontier, solve
from torchckpt.remat.solve.evaluate import evaluate
from torchckpt.remat.solve.floor import floor_bytes
from torchckpt.remat.solve.menu import MENU_MAX_OPTIONS, block_menu

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
    "evaluate",
    "floor_bytes",
    "frontier",
    "solve",
]
