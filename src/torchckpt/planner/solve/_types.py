"""The solver's values: menu options, schedule pieces, solutions and the infeasible-budget error.

All are frozen dataclasses checked when built, so a malformed piece fails where it is made, naming the
field, the value given and what is allowed.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from torchckpt._units import check_index


@dataclass(frozen=True)
class MenuOption:
    """One way to run a block (``block_menu``): what it keeps after its forward pass and what it recomputes.

    ``plain`` is True only for option 0 (no checkpoint: autograd keeps ``saved_bytes``, nothing is
    recomputed; ``kept_ops`` then lists every op whose output autograd saves). Otherwise the block is
    checkpointed keeping the outputs of ``kept_ops`` (``OpCosts.index`` values, the executor's
    numbering): ``held_bytes`` is their size and ``recompute_s`` the forward time left to recompute. An
    ``offload`` option runs the block plainly with its saved activations in host memory (costs.py's [offloaded
    blocks]): ``held_bytes`` is what stays on the device, ``host_bytes`` what moves, ``recompute_s`` the copies'
    visible time.
    """

    kept_ops: tuple[int, ...]
    held_bytes: int
    recompute_s: float
    plain: bool
    nested: bool = False  # costs.py's [pieces nested inside a block]
    slices: int = 1  # ... the block run in this many slices of the batch (its nested_slices)
    pieces: bool = True  # ... and its pieces nested inside it (its nested_pieces)
    sliced_pieces: tuple[int, ...] = ()  # ... these of them in slices of the batch (its nested_sliced_pieces) ...
    piece_slices: int = 1  # ... this many (its nested_piece_slices)
    recompute_extra_bytes: int = 0  # menu.py's [kept outputs wait for their op]: added to the backward peak
    offload: bool = False  # costs.py's [offloaded blocks]: run plainly, its saved activations in host memory
    host_bytes: int = 0  # ... the host bytes they take


@dataclass(frozen=True)
class Single:
    """One block run with one menu option: ``block_menu(costs.blocks[block])[option]``.

    Option 0 is plain (no checkpoint); the last option keeps nothing. Inside a ``Region`` only these two
    are allowed (checkpoint.py's [nested checkpoints keep nothing]).

    Example:
        >>> Single(block=3, option=0)
        Single(block=3, option=0)
    """

    block: int
    option: int

    def __post_init__(self) -> None:
        check_index("Single.block", self.block)
        check_index("Single.option", self.option)


@dataclass(frozen=True)
class Region:
    """Blocks ``start .. stop-1`` checkpointed as one region whose inside runs the plan ``inner``.

    During the forward pass the region keeps only the input of block ``start``; when the backward pass
    reaches it, it reruns its blocks following ``inner`` (which may hold further regions).

    Example:
        >>> Region(start=0, stop=2, inner=(Single(block=0, option=0), Single(block=1, option=0))).stop
        2
    """

    start: int
    stop: int
    inner: tuple[Piece, ...] = field(default=())

    def __post_init__(self) -> None:
        check_index("Region.start", self.start)
        check_index("Region.stop", self.stop)
        if self.stop - self.start < 2:
            raise ValueError(f"Region(start={self.start}, stop={self.stop}) spans {self.stop - self.start} block(s); "
                             f"a region spans at least 2 blocks (stop is exclusive); use Single(block, option=last) "
                             f"to checkpoint one block")
        inner = tuple(self.inner) if isinstance(self.inner, (list, tuple)) else self.inner
        if not isinstance(inner, tuple) or not inner or not all(isinstance(p, (Single, Region)) for p in inner):
            raise TypeError(f"Region({self.start}, {self.stop}).inner must be a non-empty tuple of Single/Region "
                            f"pieces covering blocks {self.start}..{self.stop - 1}; got {self.inner!r}")
        object.__setattr__(self, "inner", inner)


Piece = Single | Region


@dataclass(frozen=True)
class Solution:
    """What ``solve`` returns: the schedule, and its predicted peak and extra time (from ``evaluate``)."""

    schedule: tuple[Piece, ...]
    predicted_peak_bytes: int
    extra_time_s: float
    budget_bytes: int
    host_bytes: int = 0  # costs.py's [offloaded blocks]: host memory its offloaded blocks take


class InfeasibleBudgetError(ValueError):
    """No schedule keeps the predicted peak within the budget.

    Attributes: ``budget_bytes``; ``floor_bytes`` (the smallest feasible predicted peak);
    ``breakdown``: ``fixed_bytes`` (parameters, gradients, optimizer state, batch, activations outside
    the blocks), ``activation_bytes`` (``floor_bytes - fixed_bytes``: the least the blocks and the head
    need above that), ``head_bytes``, and ``binding`` (where the min-peak plan reaches its peak).
    """

    def __init__(self, budget_bytes: int, floor_bytes: int, breakdown: dict[str, int | str], message: str) -> None:
        super().__init__(message)
        self.budget_bytes = budget_bytes
        self.floor_bytes = floor_bytes
        self.breakdown = dict(breakdown)

    def __reduce__(self) -> tuple:
        return (type(self), (self.budget_bytes, self.floor_bytes, self.breakdown, str(self)))
