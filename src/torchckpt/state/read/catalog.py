"""The steps of a checkpoint directory: which there are, and which are valid (``ls``, ``verify``, retention).

Each step is judged by step.py, which reads it; nothing here reads a file itself.
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Mapping
from dataclasses import dataclass, field

from torchckpt.state.errors import (
    CheckpointCorruptError,
    CheckpointError,
    CheckpointExistsError,
    CheckpointFallbackWarning,
    CheckpointNewerFormatError,
    CheckpointNotFoundError,
)
from torchckpt.state.format.layout import step_dir_name
from torchckpt.state.read.step import (
    StepGoneError,
    UnverifiableStepError,
    VerifyMode,
    check_verify_mode,
    read_manifest,
    verify_step_files,
)
from torchckpt.state.storage.backends import open_storage
from torchckpt.state.storage.base import Storage
from torchckpt.state.storage.local import local_step_dir


@dataclass(frozen=True, kw_only=True)
class CheckpointInfo:
    """One step directory as seen by ``list``/``verify``.

    Example:
        >>> CheckpointInfo(step=3, path="runs/x/step-000000003", valid=False, problem="no manifest").valid
        False
    """

    step: int
    path: str
    valid: bool
    problem: str | None = None
    created_unix_s: float | None = None
    size_bytes: int | None = None
    metrics: Mapping[str, float] = field(default_factory=dict)
    problems: Mapping[str, str] = field(default_factory=dict)
    unverifiable: bool = False
    gone: bool = False


def step_numbers(storage: Storage) -> list[int]:
    """Committed step numbers, oldest first; a non-directory named like a step is skipped with a warning.

    Example:
        >>> step_numbers(open_storage("/nonexistent"))
        []
    """
    steps = []
    for step, entry in sorted(storage.step_entries().items()):
        root = local_step_dir(storage, entry)
        # isdir first: a step retention deletes meanwhile is not a file named like a step (lexists, then isdir,
        # would say so when the deletion lands between them)
        if root is not None and not os.path.isdir(root) and os.path.lexists(root):
            warnings.warn(f"{root}: a file named like a step directory, not a checkpoint; ignored. Fix: remove "
                          "or rename it", CheckpointFallbackWarning, stacklevel=3)
            continue
        steps.append(step)
    return steps

def inspect_step(storage: Storage, step: int, verify: VerifyMode) -> CheckpointInfo:
    """Validity, size and metrics of one step (files are hashed only with ``"full"``).

    A step deleted while it was read comes back with ``gone=True``; one whose manifest names an unknown
    hash algorithm with ``unverifiable=True`` (both not valid).

    Example:
        >>> inspect_step(open_storage("/nonexistent"), 7, "fast").valid
        False
    """
    path = storage.path_of(step_dir_name(step))
    try:
        manifest = read_manifest(storage, step)
        problems = verify_step_files(storage, step, manifest, verify)
    except StepGoneError as error:
        return CheckpointInfo(step=step, path=path, valid=False, problem=str(error), gone=True)
    except CheckpointCorruptError as error:
        return CheckpointInfo(step=step, path=path, valid=False, problem=str(error), problems=error.problems,
                              unverifiable=isinstance(error, UnverifiableStepError))
    return CheckpointInfo(
        step=step,
        path=path,
        valid=not problems,
        problem="; ".join(f"{p}: {m}" for p, m in problems.items()) or None,
        created_unix_s=manifest.created_unix_s,
        size_bytes=manifest.size_bytes,
        metrics=manifest.metrics,
        problems=problems,
    )


def list_checkpoints(location: str | os.PathLike[str], verify: VerifyMode = "fast") -> list[CheckpointInfo]:
    """Every step directory under ``location``, oldest first, with validity (steps deleted meanwhile left out).

    Example:
        >>> list_checkpoints("/nonexistent")
        []
    """
    check_verify_mode(verify)
    storage = open_storage(location)
    infos = [inspect_step(storage, step, verify) for step in step_numbers(storage)]
    return [info for info in infos if not info.gone]


def verify_checkpoint(
    location: str | os.PathLike[str], step: int | None = None, verify: VerifyMode = "full"
) -> list[CheckpointInfo]:
    """Verify one step (or every step when ``step`` is None); never raises for bad data.

    A step deleted while it is verified (by a live writer's retention) is left out, not reported corrupt.

    Example:
        >>> verify_checkpoint("/nonexistent", step=3)  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        torchckpt.state.errors.CheckpointNotFoundError: /nonexistent: no step 3; ...
    """
    check_verify_mode(verify)
    storage = open_storage(location)
    steps = step_numbers(storage)
    if step is not None:
        if step not in steps:
            raise CheckpointNotFoundError(f"{location}: no step {step}; steps found: {steps or 'none'}")
        steps = [step]
    infos = [inspect_step(storage, s, verify) for s in steps]
    if step is not None and infos[0].gone:
        raise StepGoneError(infos[0].problem)
    return [info for info in infos if not info.gone]


def valid_committed(storage: Storage, step: int, verify: VerifyMode) -> CheckpointInfo | None:
    """``step``'s info if it is a committed step that passes ``verify``, else None (absent, corrupt, or a
    stray file named like a step: such a step may be replaced).

    Example:
        >>> print(valid_committed(open_storage("/nonexistent"), 3, "full"))
        None
    """
    if step not in storage.step_entries():
        return None
    info = inspect_step(storage, step, verify)
    return info if info.valid else None


def check_step_free(storage: Storage, step: int, verify: VerifyMode) -> None:
    """Raise :class:`CheckpointExistsError` if ``step`` holds a valid checkpoint (checkpointer/checkpointer.py's
    [committed steps are immutable]).

    Example:
        >>> check_step_free(open_storage("/nonexistent"), 3, "full")
    """
    info = valid_committed(storage, step, verify)
    if info is not None:
        raise CheckpointExistsError(
            f"{info.path} already holds a valid checkpoint of step {step}; committed steps are "
            "never overwritten. Fix: save under a new step number, or delete that directory."
        )


def refuse_foreign_checkpoint(storage: Storage) -> None:
    """Raise :class:`CheckpointNotFoundError` if the directory holds a PyTorch Distributed Checkpoint (DCP) rather
    than torchckpt steps: a restore would find nothing and a run would start over beside the user's weights.

    Example:
        >>> refuse_foreign_checkpoint(open_storage("/nonexistent"))
    """
    location = str(storage.location)
    if "://" not in location and os.path.isfile(os.path.join(location, ".metadata")):
        raise CheckpointNotFoundError(
            f"{location} is a torch.distributed.checkpoint (DCP) directory, not a torchckpt one: nothing was read "
            "or written. Fix: import it first, if you trust where it came from (its .metadata is a pickle): "
            f"`torchckpt import {location} NEW_DIR --trust-dcp-metadata` or "
            "torchckpt.state.import_dcp(path, new_dir, trust_pickle=True), then restore from NEW_DIR")


def refuse_newer_format(storage: Storage) -> None:
    """Raise :class:`CheckpointNewerFormatError` if a step here was written by a newer torchckpt: a writer of
    this version would rewind past it (or abandon it, move it aside); it reads only the manifests and changes
    nothing (docs/state.md, "Format versions").

    Example:
        >>> refuse_newer_format(open_storage("/nonexistent"))
    """
    refuse_foreign_checkpoint(storage)  # nor in another library's checkpoint directory
    try:
        steps = sorted(storage.step_entries(), reverse=True)
    except OSError:
        return  # not a directory, unreadable: taking the lock names the problem
    for step in steps:
        try:
            read_manifest(storage, step)
        except CheckpointNewerFormatError as error:
            raise CheckpointNewerFormatError(
                f"{storage.location}: step {step} was {error.problems and next(iter(error.problems.values()))}; "
                "this torchckpt writes nowhere in a directory that holds it (it would rewind the run past it)",
                error.problems) from None
        except CheckpointError:
            continue  # corrupt, gone: judged where it is read
