"""The infeasible-budget message told where paths and the plain peak are known (``from_costs``).

The solver (no torch, no modules) raises ``InfeasibleBudgetError`` naming the floor in bytes and the
block index where it binds; ``with_paths`` tells it again with the floor as a share of the
no-checkpointing peak and the blocks named by module path (``blocks.describe_paths``).
"""

from __future__ import annotations

import re
from collections.abc import Sequence

from torchckpt._units import format_bytes
from torchckpt.planner.blocks import describe_paths
from torchckpt.planner.solve import InfeasibleBudgetError

__all__ = ["name_paths", "with_paths"]

_BLOCK = re.compile(r"block (\d+) \('[^']*'\)")  # how the solver names a block: block 3 ('3:Block')


def name_paths(text: str, block_paths: Sequence[str]) -> str:
    """``text`` with each block the solver names (``block 3 ('3:Block')``) named by its module path instead.

    Example:
        >>> name_paths("at block 1 ('1:Block') itself", ["layers.0", "layers.1"])
        'at block 1 (layers.1) itself'
    """
    paths = [str(path) for path in block_paths]

    def path(match: re.Match) -> str:
        index = int(match.group(1))
        return f"block {index} ({paths[index] or '(the model itself)'})" if index < len(paths) else match.group(0)
    return _BLOCK.sub(path, text)


def with_paths(error: InfeasibleBudgetError, block_paths: Sequence[str],
               plain_peak_bytes: int) -> InfeasibleBudgetError:
    """``error`` told again with the floor as a percentage of the no-checkpointing peak and the blocks named by
    path; the same type and attributes, ``breakdown`` gaining ``no_checkpointing_peak_bytes``,
    ``floor_percent`` and ``blocks``.

    Example:
        >>> error = InfeasibleBudgetError(50, 80, {"binding": "block 1 ('1:Block')"},
        ...                               "budget 50 bytes is below 80 bytes (80 B), reached at block 1 ('1:Block').")
        >>> told = with_paths(error, ["layers.0", "layers.1"], 160)
        >>> told.floor_bytes, told.breakdown["floor_percent"], told.breakdown["binding"]
        (80, '50.0%', 'block 1 (layers.1)')
        >>> print(told)  # doctest: +NORMALIZE_WHITESPACE
        budget 50 bytes is below 80 bytes (80 B; 50.0% of the no-checkpointing peak, 160 bytes (160 B)),
        reached at block 1 (layers.1). The blocks planned: layers.0, layers.1 (2 blocks).
    """
    paths = [str(path) for path in block_paths]
    floor = error.floor_bytes
    percent = f"{100 * floor / plain_peak_bytes:.1f}%" if plain_peak_bytes > 0 else "n/a"
    share = f"{percent} of the no-checkpointing peak, {plain_peak_bytes} bytes ({format_bytes(plain_peak_bytes)})"
    message = name_paths(str(error), paths)
    figure = f"{floor} bytes ({format_bytes(floor)})"
    if figure in message:
        message = message.replace(figure, f"{floor} bytes ({format_bytes(floor)}; {share})", 1)
    else:
        message = f"{message} The floor, {floor} bytes, is {share}."
    message = f"{message} The blocks planned: {describe_paths(paths)}."
    breakdown = {key: name_paths(value, paths) if isinstance(value, str) else value
                 for key, value in error.breakdown.items()}
    breakdown.update(no_checkpointing_peak_bytes=plain_peak_bytes, floor_percent=percent, blocks=describe_paths(paths))
    return InfeasibleBudgetError(error.budget_bytes, floor, breakdown, message)
