"""The step a restore reads: the newest valid one (or the one asked for), falling back past corrupt ones.

The read path shared by restore, export and ``load``; step.py reads each candidate.

Rules kept here (named in ``docs/design.md``):

1. **[corrupt newer steps are reported]** Corrupt newer steps are reported (a
   warning naming each file and problem) and skipped when ``fallback`` is on; with
   it off, the newest step's problem is raised. If steps exist but none is valid,
   that is an error, never "no checkpoint": starting from scratch silently would
   lose the run. A step written by a newer torchckpt is not corrupt: restore raises
   :class:`CheckpointNewerFormatError` there and never falls back past it.
2. **[a vanished step is gone, not corrupt]** A step whose directory disappears
   while it is read (a live writer's retention deleted it) is skipped silently and
   the next newest is read: readers take no lock and never see a half-written step
   (commits are renames), so deletion is the only race they can lose.
"""

from __future__ import annotations

from collections.abc import Collection

import torch

from torchckpt.state.errors import (
    CheckpointCorruptError,
    CheckpointError,
    CheckpointNewerFormatError,
    CheckpointNotFoundError,
    warn_fallback,
)
from torchckpt.state.format.snapshot import Snapshot
from torchckpt.state.read.catalog import refuse_foreign_checkpoint, step_numbers
from torchckpt.state.read.step import StepGoneError, load_step, read_manifest
from torchckpt.state.storage.base import Storage


def candidate_steps(storage: Storage, step: int | None) -> list[int]:
    """The steps a restore tries, newest first: every step, or just ``step`` (an error if it is absent).

    Example:
        >>> from torchckpt.state.storage.backends import open_storage
        >>> candidate_steps(open_storage("/nonexistent"), None)
        []
    """
    steps = sorted(step_numbers(storage), reverse=True)
    if step is None:
        return steps
    if step not in steps:
        raise CheckpointNotFoundError(f"{storage.location}: no step {step}; steps found: {sorted(steps) or 'none'}")
    return [step]


_RESCANS = 5


@torch.inference_mode(False)  # restored tensors are normal ones, usable in a later backward()
def read_newest_valid(
    storage: Storage,
    *,
    step: int | None,
    verify: str,
    fallback: bool,
    wanted: Collection[str] | None,
) -> Snapshot | None:
    """The newest valid step (or ``step``), decoded; None if the directory has no steps
    ([corrupt newer steps are reported]).

    Example:
        >>> from torchckpt.state.storage.backends import open_storage
        >>> print(read_newest_valid(open_storage("/nonexistent"), step=None, verify="full",
        ...                         fallback=True, wanted=None))
        None
    """
    skipped: list[str] = []
    tried: set[int] = set()
    for _ in range(_RESCANS):  # a step that vanished may have been replaced by a newer one: look again
        gone = False
        for candidate in candidate_steps(storage, step):
            if candidate in tried:
                continue
            tried.add(candidate)
            try:
                snapshot = load_step(storage, candidate, verify, wanted)
            except StepGoneError as error:  # [a vanished step is gone, not corrupt]
                if step is not None:
                    raise CheckpointNotFoundError(str(error)) from None
                gone = True
                continue
            except CheckpointNewerFormatError as error:  # not damage: falling back would rewind the run
                raise CheckpointNewerFormatError(f"step {candidate} was not restored and nothing was changed: "
                                                 f"{error}", error.problems) from None
            except CheckpointCorruptError as error:
                skipped.append(f"step {candidate}: {error}")
                if fallback and step is None:
                    continue
                raise type(error)(  # keeps UnsafeFileError recognisable
                    f"step {candidate} is corrupt, nothing was restored: {str(error).rstrip('.')}. "
                    + ("Fix: restore(fallback=True) to use the newest valid older step." if step is None else ""),
                    error.problems,
                ) from None
            if skipped:
                warn_fallback(f"restored step {candidate}; skipped corrupt newer step(s): " + " | ".join(skipped))
            return snapshot
        if not gone:
            break
    else:
        raise CheckpointNotFoundError(f"{storage.location}: every step vanished while it was being read, "
                                      f"{_RESCANS} times (a writer's retention deletes them). Fix: try again")
    if skipped:
        raise CheckpointCorruptError(
            f"{storage.location}: no valid checkpoint among {len(skipped)} step(s): " + " | ".join(skipped)
        )
    refuse_foreign_checkpoint(storage)
    return None


def newest_is_sharded(storage: Storage, step: int | None) -> bool:
    """Whether the newest step with a readable manifest (or ``step``) is sharded.

    Example:
        >>> from torchckpt.state.storage.backends import open_storage
        >>> newest_is_sharded(open_storage("/nonexistent"), None)
        False
    """
    for candidate in candidate_steps(storage, step):
        try:
            return read_manifest(storage, candidate).world_size is not None
        except CheckpointError:
            continue
    return False
