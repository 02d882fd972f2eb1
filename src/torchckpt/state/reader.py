"""Find and decode the newest valid step: the read path shared by restore, export and the CLI.

Rules kept here (named in ``docs/design.md``; the design notes they keep in parentheses):

1. **[only verified steps are decoded]** (Note: [no manifest, no checkpoint]) Only
   steps whose manifest validates are decoded; bytes are decoded from exactly what
   was verified (catalog.py's [decode the bytes that were hashed]).
2. **[corrupt newer steps are reported]** Corrupt newer steps are reported (a
   warning naming each file and problem) and skipped when ``fallback`` is on; with
   it off, the newest step's problem is raised. If steps exist but none is valid,
   that is an error, never "no checkpoint": starting from scratch silently would
   lose the run.
"""

from __future__ import annotations

from collections.abc import Collection

from torchckpt.state.catalog import read_manifest, read_step_files
from torchckpt.state.errors import (
    CheckpointCorruptError,
    CheckpointNotFoundError,
    warn_fallback,
)
from torchckpt.state.format import step_dir_name
from torchckpt.state.snapshot import Snapshot, decode_snapshot
from torchckpt.state.storage import Storage


def load_step(storage: Storage, step: int, verify: str, wanted: Collection[str] | None) -> Snapshot:
    """Verify and decode one step (only ``wanted`` items; None means all).

    Raises :class:`CheckpointCorruptError` naming every bad file.
    """
    manifest = read_manifest(storage, step)
    files = read_step_files(storage, step, manifest, verify)  # type: ignore[arg-type]
    entry = step_dir_name(step)
    return decode_snapshot(files, lambda name: storage.path_of(entry, name), wanted=wanted)


def _candidates(storage: Storage, step: int | None) -> list[int]:
    steps = sorted(storage.step_entries(), reverse=True)
    if step is None:
        return steps
    if step not in steps:
        raise CheckpointNotFoundError(f"{storage.location}: no step {step}; steps found: {sorted(steps) or 'none'}")
    return [step]


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
        >>> from torchckpt.state.storage import open_storage
        >>> print(read_newest_valid(open_storage("/nonexistent"), step=None, verify="full",
        ...                         fallback=True, wanted=None))
        None
    """
    skipped: list[str] = []
    for candidate in _candidates(storage, step):
        try:
            snapshot = load_step(storage, candidate, verify, wanted)
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
    if skipped:
        raise CheckpointCorruptError(
            f"{storage.location}: no valid checkpoint among {len(skipped)} step(s): " + " | ".join(skipped)
        )
    return None
