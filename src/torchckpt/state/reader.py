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
3. **[a vanished step is gone, not corrupt]** A step whose directory disappears
   while it is read (a live writer's retention deleted it) is skipped silently and
   the next newest is read: readers take no lock and never see a half-written step
   (commits are renames), so deletion is the only race they can lose.
4. **[the whole step checks before anything changes]** Only the files the asked-for
   items need are read; every one of them, and the RNG entry, is decoded and
   checked before any live object or RNG stream is touched. Then every item is
   checked against its live object as far as that can be done without loading it
   (capture.py's [no half restore]: kinds, module keys and shapes, optimizer groups,
   CUDA device count of the RNG streams to restore); items only loading can check
   are loaded before the checked ones, and RNG streams last.
"""

from __future__ import annotations

import base64
import os
import random
from collections.abc import Collection, Mapping
from typing import Any

import numpy as np
import torch

from torchckpt.state.capture import apply_item, check_item, check_item_name, check_rng_devices, restore_rng
from torchckpt.state.catalog import (
    StepGoneError,
    check_verify_mode,
    read_manifest,
    read_step_files,
    step_numbers,
)
from torchckpt.state.codec import decode_json
from torchckpt.state.errors import (
    CheckpointCorruptError,
    CheckpointMismatchError,
    CheckpointNotFoundError,
    warn_fallback,
)
from torchckpt.state.format import STATE_NAME, Manifest, step_dir_name
from torchckpt.state.snapshot import Snapshot, decode_snapshot
from torchckpt.state.storage import Storage, open_storage


def load_step(storage: Storage, step: int, verify: str, wanted: Collection[str] | None) -> Snapshot:
    """Verify and decode one step (only ``wanted`` items; None means all).

    Raises :class:`CheckpointCorruptError` naming every bad file.
    """
    manifest = read_manifest(storage, step)
    entry = step_dir_name(step)
    files = read_step_files(storage, step, manifest, verify, names={STATE_NAME})  # type: ignore[arg-type]
    needed = _needed_files(files.get(STATE_NAME), manifest, wanted, storage.path_of(entry, STATE_NAME))
    files.update(read_step_files(storage, step, manifest, verify, names=needed - {STATE_NAME}))  # type: ignore[arg-type]
    snapshot = decode_snapshot(files, lambda name: storage.path_of(entry, name), wanted=wanted)
    state_path = storage.path_of(entry, STATE_NAME)
    if snapshot.step != step:  # restore returns this number: it must be the step's own
        problem = f"says step {snapshot.step} but lives in {entry} (its manifest says {step})"
        raise CheckpointCorruptError(f"{state_path}: {problem}", {state_path: problem})
    if snapshot.rng is not None:
        check_rng(snapshot.rng, state_path)
    return snapshot


def _needed_files(state: memoryview | None, manifest: Manifest, wanted: Collection[str] | None,
                  source: str) -> set[str]:
    """The files the ``wanted`` items live in ([the whole step checks before anything changes])."""
    if wanted is None or state is None:
        return set(manifest.files)
    try:
        items = decode_json(state, source)["items"]
        return {STATE_NAME} | {
            file for name in wanted if name in items
            for file in (items[name]["tensor_file"], items[name]["tree_file"]) if file is not None
        }
    except (CheckpointCorruptError, KeyError, TypeError):
        return set(manifest.files)  # decode_snapshot names the problem


def check_rng(rng: Mapping[str, Any], source: str) -> None:
    """Raise :class:`CheckpointCorruptError` unless ``rng`` (a decoded RNG entry) can be restored; changes no
    RNG stream: each state is tried on a fresh generator ([the whole step checks before anything changes]).

    Example:
        >>> check_rng({"python": (3, (1,), None)}, "step-000000001/state.json")  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        torchckpt.state.errors.CheckpointCorruptError: step-000000001/state.json: malformed RNG entry ...
    """
    try:
        random.Random().setstate(rng["python"])
        np.random.RandomState().set_state(rng["numpy"])
        torch.Generator().set_state(torch.from_numpy(_bytes_of(rng["torch_cpu"])))
        for text in rng["cuda"]:
            _bytes_of(text)
    except (KeyError, TypeError, ValueError, RuntimeError, IndexError, OverflowError) as error:
        problem = f"malformed RNG entry ({type(error).__name__}: {error}); nothing was restored from this step"
        raise CheckpointCorruptError(f"{source}: {problem}", {source: problem}) from None


def _bytes_of(text: str) -> np.ndarray:
    if not isinstance(text, str):
        raise TypeError(f"expected base64 text, found {type(text).__name__}")
    return np.frombuffer(base64.b64decode(text, validate=True), dtype=np.uint8).copy()


def candidate_steps(storage: Storage, step: int | None) -> list[int]:
    """The steps a restore tries, newest first: every step, or just ``step`` (an error if it is absent).

    Example:
        >>> from torchckpt.state.storage import open_storage
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
    return None


def apply_snapshot(snapshot: Snapshot, items: Mapping[str, Any], rng: bool | None, state_path: str) -> None:
    """Load a decoded step into live objects and the RNG streams; every check runs before anything changes.

    ``rng``: True requires saved RNG streams and restores them, None restores them when the step has
    them, False leaves this process's streams alone.

    Example:
        >>> from torchckpt.state.snapshot import encode_snapshot, join_files
        >>> files = join_files(encode_snapshot(step=2, items={"extras": ("dict", {"epoch": 3})}, rng=None, metrics={}))
        >>> extras = {}; apply_snapshot(decode_snapshot(files, str), {"extras": extras}, False, "state.json"); extras
        {'epoch': 3}
    """
    missing = [name for name in items if name not in snapshot.item_names]
    if missing:
        raise CheckpointMismatchError(
            f"{state_path}: no item(s) {missing}; the checkpoint holds {list(snapshot.item_names)}. "
            "Fix: pass only items that were saved (names must match the save call)."
        )
    if rng and snapshot.rng is None:
        raise CheckpointMismatchError(f"{state_path}: saved without RNG streams (capture_rng=False or imported). "
                                      "Fix: pass rng=None (restore them only when saved) or rng=False.")
    for name, obj in items.items():  # a compiled model's keys are named before any item is loaded
        check_compiled_keys(name, obj, snapshot.items[name][1], state_path)
    certain = {name: check_item(name, obj, *snapshot.items[name], state_path) for name, obj in items.items()}
    streams = snapshot.rng if rng is not False else None  # the RNG streams to restore, if any
    if streams is not None:
        check_rng_devices(streams, state_path)
    # capture.py's [no half restore]: items only their own loading can check go first (a stable sort)
    for name in sorted(items, key=lambda item: certain[item]):
        kind, state = snapshot.items[name]
        apply_item(name, items[name], kind, state, state_path)
    if streams is not None:
        restore_rng(streams, state_path)


_COMPILED_PREFIX = "_orig_mod."


def check_compiled_keys(name: str, obj: object, state: Any, source: str) -> None:
    """Name a torch.compile ``_orig_mod.`` prefix when it is all that separates saved and live module keys.

    Example:
        >>> check_compiled_keys("model", torch.nn.Linear(1, 1), {"_orig_mod.weight": 0, "_orig_mod.bias": 0},
        ...                     "state.json")  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        torchckpt.state.errors.CheckpointMismatchError: state.json: item 'model': the saved keys carry ...
    """
    if not isinstance(obj, torch.nn.Module) or not isinstance(state, Mapping):
        return
    live, saved = set(obj.state_dict()), set(state)
    if live == saved:
        return
    strip = {key.removeprefix(_COMPILED_PREFIX) for key in saved}
    if strip == live and strip != saved:
        raise CheckpointMismatchError(
            f"{source}: item {name!r}: the saved keys carry torch.compile's {_COMPILED_PREFIX!r} prefix (e.g. "
            f"{sorted(saved)[0]!r}) but the live module's do not: it was saved from a compiled model. Fix: pass "
            "the compiled model (or model._orig_mod when saving), the same kind of object both times.")
    added = {_COMPILED_PREFIX + key for key in saved}
    if added == live:
        raise CheckpointMismatchError(
            f"{source}: item {name!r}: the live module's keys carry torch.compile's {_COMPILED_PREFIX!r} prefix "
            f"(e.g. {sorted(live)[0]!r}) but the saved ones do not. Fix: restore into model._orig_mod (the "
            "module that was compiled), or save and restore the same kind of object.")


def load(
    directory: str | os.PathLike[str],
    step: int | None = None,
    *,
    verify: str = "full",
    fallback: bool = True,
    rng: bool = False,
    **items: Any,
) -> int | None:
    """Load the newest valid step (or ``step``) into ``items`` without a lock, e.g. in an evaluation job or from
    read-only storage; returns the step, or None if the directory has no checkpoint.

    It never sees a half-written step (a commit is a rename), skips a step a live writer deletes meanwhile
    ([a vanished step is gone, not corrupt]), and reads only the files the given items need. ``rng=True``
    also restores the RNG streams; by default this process's RNG is left alone.

    Example:
        >>> import tempfile
        >>> from torchckpt.state.checkpointer import Checkpointer
        >>> tmp = tempfile.TemporaryDirectory(); saved = torch.nn.Linear(2, 2)
        >>> with Checkpointer(tmp.name) as ckpt:
        ...     ckpt.save(7, model=saved)
        >>> model = torch.nn.Linear(2, 2)
        >>> load(tmp.name, model=model), torch.equal(model.weight, saved.weight)
        (7, True)
        >>> tmp.cleanup()
    """
    check_verify_mode(verify)
    for name in items:
        check_item_name(name)
    storage = open_storage(directory)
    snapshot = read_newest_valid(storage, step=step, verify=verify, fallback=fallback, wanted=set(items))
    if snapshot is None:
        return None
    apply_snapshot(snapshot, items, rng, storage.path_of(step_dir_name(snapshot.step), STATE_NAME))
    return snapshot.step
