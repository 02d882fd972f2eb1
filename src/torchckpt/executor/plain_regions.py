"""Regions that keep nothing run on torch's checkpoint alone (Note: [a region that keeps nothing runs on
torch's checkpoint alone], stated in ``executor/checkpoint.py``): the contexts ``checkpoint`` hands to
``torch.utils.checkpoint.checkpoint`` for them, and ``recompute_checks``, which turns the op-by-op
recompute check back on for every region.
"""

from __future__ import annotations

from types import TracebackType

from torchckpt.executor.outer_writes import UndoOuterWrites
from torchckpt.executor.policies import TAG_STATE

__all__ = ["CountRegion", "UndoWritesRegion", "plain_contexts", "recompute_checks"]


class recompute_checks:  # noqa: N801 (used as a context manager, like torch.no_grad)
    """Inside this context every checkpointed region records its forward pass and checks its
    recomputation op by op (``RecomputationMismatchError``), also regions whose policy keeps nothing,
    which otherwise skip the check (Note: [a region that keeps nothing runs on torch's checkpoint alone]).
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


class CountRegion:
    """The forward context of a region that keeps nothing: no dispatch mode, only the count of active
    regions that ``tag`` and nested checkpoints read."""

    def __enter__(self) -> CountRegion:
        TAG_STATE.active_regions += 1
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        TAG_STATE.active_regions -= 1


class UndoWritesRegion(UndoOuterWrites):
    """The recompute context of a region that keeps nothing: rule 8 only, and the region count."""

    def __enter__(self) -> UndoWritesRegion:
        entered = super().__enter__()
        TAG_STATE.active_regions += 1
        return entered

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        TAG_STATE.active_regions -= 1
        super().__exit__(exc_type, exc, tb)


def plain_contexts() -> tuple[CountRegion, UndoWritesRegion]:
    """The forward and recompute contexts of a region that keeps nothing (``context_fn`` of torch's checkpoint).

    Example:
        >>> forward, recompute = plain_contexts()
        >>> with forward:
        ...     pass
    """
    return CountRegion(), UndoWritesRegion()
