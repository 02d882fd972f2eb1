"""Regions that keep nothing run on torch's checkpoint alone (checkpoint.py's [a region that keeps nothing runs on
torch's checkpoint alone], stated in ``executor/checkpoint.py``): the contexts ``checkpoint`` hands to
``torch.utils.checkpoint.checkpoint`` for them, and ``recompute_checks``, which turns the op-by-op
recompute check back on for every region.
"""

from __future__ import annotations

from types import TracebackType
from typing import Any

from torchckpt.executor.outer_writes import UndoOuterWrites
from torchckpt.executor.policies import TAG_STATE

__all__ = ["CountRegion", "CountsRegion", "UndoWritesRegion", "plain_contexts", "recompute_checks"]


class recompute_checks:  # noqa: N801 (used as a context manager, like torch.no_grad)
    """Inside this context every checkpointed region records its forward pass and checks its
    recomputation op by op (``RecomputationMismatchError``), also regions whose policy keeps nothing,
    which otherwise skip the check (checkpoint.py's [a region that keeps nothing runs on torch's checkpoint alone]).
    ``verify_plan`` runs the plan's step inside it. Per thread; contexts nest.

    Example:
        >>> import torch
        >>> from torchckpt.executor import checkpoint
        >>> layer = torch.nn.Linear(4, 4)
        >>> x = torch.randn(2, 4, requires_grad=True)
        >>> with recompute_checks():
        ...     checkpoint(layer, x).sum().backward()   # the forward is recorded, the recompute checked
    """

    def __enter__(self) -> recompute_checks:
        TAG_STATE.checks += 1
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        TAG_STATE.checks -= 1


class CountsRegion:
    """Mixin for a region's contexts: entering counts one more active region, which ``tag`` and nested
    checkpoints read (``TAG_STATE.active_regions``); the class after it in the bases does the rest."""

    def __enter__(self) -> Any:
        enter = getattr(super(), "__enter__", None)
        entered = enter() if enter is not None else self
        TAG_STATE.active_regions += 1
        return entered

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        TAG_STATE.active_regions -= 1
        leave = getattr(super(), "__exit__", None)
        if leave is not None:
            leave(exc_type, exc, tb)


class CountRegion(CountsRegion):
    """The forward context of a region that keeps nothing: no dispatch mode, only the region count."""


class UndoWritesRegion(CountsRegion, UndoOuterWrites):
    """The recompute context of a region that keeps nothing: rule 8 only, and the region count."""


def plain_contexts() -> tuple[CountRegion, UndoWritesRegion]:
    """The forward and recompute contexts of a region that keeps nothing (``context_fn`` of torch's checkpoint).

    Example:
        >>> forward, recompute = plain_contexts()
        >>> with forward:
        ...     pass
    """
    return CountRegion(), UndoWritesRegion()
