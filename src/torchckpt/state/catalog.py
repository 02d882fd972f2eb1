"""Reading checkpoints back: list steps, verify files against manifests, read verified bytes.

Rules kept here (named in ``docs/design.md``):

1. **[valid means every listed file checks]** (Note: [no manifest, no checkpoint])
   A step is valid only if its manifest parses and self-checks (format.py's
   [parse_manifest is the only way in]) and every listed file exists with the
   listed size (``verify="fast"``) and, with ``verify="full"``, the listed hash.
2. **[verification reports every problem]** Verification collects every problem of
   a step, each naming its file, and never raises anything but
   :class:`CheckpointCorruptError` for bad data.
3. **[decode the bytes that were hashed]** Restore decodes from the very bytes
   that were hashed, so a file changed between verification and loading cannot
   slip through.
4. **[one read per file]** Each file is read once, into one buffer of its manifest
   size, piece by piece; with ``verify="full"`` each piece is hashed in a second
   thread while the next one is read. The tensors restore decodes are views of
   that buffer (codec.py's [zero copy both ways]): reading costs one pass over the
   bytes.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Literal

import torch

from torchckpt.state.errors import CheckpointCorruptError, CheckpointNotFoundError
from torchckpt.state.format import (
    MANIFEST_NAME,
    FileEntry,
    Manifest,
    new_hasher,
    parse_manifest,
    step_dir_name,
)
from torchckpt.state.storage import Storage, open_storage

VerifyMode = Literal["full", "fast"]
VERIFY_MODES: tuple[str, ...] = ("full", "fast")
_SAFE_FILE_RE = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.-]{0,200}$")


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


def check_verify_mode(verify: str) -> None:
    """Raise ValueError unless ``verify`` is ``"full"`` or ``"fast"``.

    Example:
        >>> check_verify_mode("full")
    """
    if verify not in VERIFY_MODES:
        raise ValueError(f"verify={verify!r} is not allowed; expected one of {VERIFY_MODES}")


def read_manifest(storage: Storage, step: int) -> Manifest:
    """Parse and self-check the manifest of ``step`` ([valid means every listed file checks]).

    Example:
        >>> read_manifest(open_storage("/nonexistent"), 1)  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        torchckpt.state.errors.CheckpointCorruptError: /nonexistent/step-000000001/manifest.json: missing; ...
    """
    entry = step_dir_name(step)
    path = storage.path_of(entry, MANIFEST_NAME)
    try:
        data = storage.read_file(entry, MANIFEST_NAME)
    except FileNotFoundError:
        problem = "missing; the save that wrote this step did not finish, so it is not a checkpoint"
        raise CheckpointCorruptError(f"{path}: {problem}", {path: problem}) from None
    manifest = parse_manifest(data, path)
    _check_manifest_names(manifest, step, path)
    return manifest


def _check_manifest_names(manifest: Manifest, step: int, path: str) -> None:
    if manifest.step != step:
        problem = f"says step {manifest.step} but lives in {step_dir_name(step)} (moved or copied?)"
        raise CheckpointCorruptError(f"{path}: {problem}", {path: problem})
    bad = [name for name in manifest.files if not _SAFE_FILE_RE.match(name) or name == MANIFEST_NAME]
    if bad:
        problem = f"lists file names that are not plain file names: {bad}"
        raise CheckpointCorruptError(f"{path}: {problem}", {path: problem})


def _size_problem(size: int | None, expected: int) -> str | None:
    if size is None:
        return "missing (the manifest lists it)"
    if size != expected:
        return f"size is {size} bytes, manifest says {expected} (truncated or overwritten)"
    return None


def _hash_problem(found: str, expected: str, algorithm: str) -> str | None:
    if found == expected:
        return None
    return (
        f"{algorithm} is {found[:16]}..., manifest says {expected[:16]}... "
        "(content changed: flipped bits or a different file)"
    )


def _read_checked(
    storage: Storage, entry: str, name: str, expected: FileEntry, algorithm: str | None, hash_thread: ThreadPoolExecutor
) -> tuple[memoryview | None, str | None]:
    """(bytes, None) if the file has the listed size (and hash, when ``algorithm``), else (None, problem)."""
    problem = _size_problem(storage.file_size(entry, name), expected.size_bytes)
    if problem is not None:
        return None, problem
    # torch.empty: no zero-fill (bytearray would write every page once more) and 64-byte aligned views
    buffer = torch.empty(expected.size_bytes, dtype=torch.uint8).numpy().data  # ndarray.data: a memoryview
    hasher = new_hasher(algorithm) if algorithm is not None else None
    updates: list[Future[None]] = []
    hash_piece = None
    if hasher is not None:

        def hash_piece(piece: memoryview) -> None:
            updates.append(hash_thread.submit(hasher.update, piece))  # one worker: pieces hash in order

    try:
        size = storage.read_into(entry, name, buffer, hash_piece)
    except FileNotFoundError:
        size = None
    for update in updates:
        update.result()
    problem = _size_problem(size, expected.size_bytes)
    if problem is None and hasher is not None:
        problem = _hash_problem(hasher.hexdigest(), expected.hash, algorithm)  # type: ignore[arg-type]
    if problem is not None:
        return None, problem + (" while it was being read" if size != expected.size_bytes else "")
    return buffer, None


def read_step_files(storage: Storage, step: int, manifest: Manifest, verify: VerifyMode) -> dict[str, memoryview]:
    """Bytes of every listed file, checked per ``verify`` ([valid means every listed file checks],
    [decode the bytes that were hashed], [one read per file]).

    Raises one :class:`CheckpointCorruptError` naming every bad file.
    """
    check_verify_mode(verify)
    return _read_files(storage, step, manifest, verify, keep=True)


def _read_files(
    storage: Storage, step: int, manifest: Manifest, verify: VerifyMode, keep: bool
) -> dict[str, memoryview]:
    entry = step_dir_name(step)
    algorithm = manifest.hash_algorithm if verify == "full" else None
    files: dict[str, memoryview] = {}
    problems: dict[str, str] = {}
    with ThreadPoolExecutor(max_workers=1, thread_name_prefix="torchckpt-hash") as hash_thread:
        for name, expected in manifest.files.items():
            data, problem = _read_checked(storage, entry, name, expected, algorithm, hash_thread)
            if problem is not None:
                problems[storage.path_of(entry, name)] = problem
            elif keep:
                files[name] = data  # type: ignore[assignment]
    _raise_problems(problems)
    return files


def _raise_problems(problems: Mapping[str, str]) -> None:
    if problems:
        lines = "; ".join(f"{path}: {problem}" for path, problem in problems.items())
        raise CheckpointCorruptError(lines, dict(problems))


def inspect_step(storage: Storage, step: int, verify: VerifyMode) -> CheckpointInfo:
    """Validity, size and metrics of one step (files are hashed only with ``"full"``).

    Example:
        >>> inspect_step(open_storage("/nonexistent"), 7, "fast").valid
        False
    """
    path = storage.path_of(step_dir_name(step))
    try:
        manifest = read_manifest(storage, step)
        problems = _verify_files(storage, step, manifest, verify)
    except CheckpointCorruptError as error:
        return CheckpointInfo(step=step, path=path, valid=False, problem=str(error), problems=error.problems)
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


def _verify_files(storage: Storage, step: int, manifest: Manifest, verify: VerifyMode) -> dict[str, str]:
    entry = step_dir_name(step)
    if verify == "full":
        try:
            _read_files(storage, step, manifest, verify, keep=False)
        except CheckpointCorruptError as error:
            return error.problems
        return {}
    problems = {}
    for name, expected in manifest.files.items():
        problem = _size_problem(storage.file_size(entry, name), expected.size_bytes)
        if problem is not None:
            problems[storage.path_of(entry, name)] = problem
    return problems


def list_checkpoints(location: str | os.PathLike[str], verify: VerifyMode = "fast") -> list[CheckpointInfo]:
    """Every step directory under ``location``, oldest first, with validity.

    Example:
        >>> list_checkpoints("/nonexistent")
        []
    """
    check_verify_mode(verify)
    storage = open_storage(location)
    return [inspect_step(storage, step, verify) for step in sorted(storage.step_entries())]


def verify_checkpoint(
    location: str | os.PathLike[str], step: int | None = None, verify: VerifyMode = "full"
) -> list[CheckpointInfo]:
    """Verify one step (or every step when ``step`` is None); never raises for bad data.

    Example:
        >>> verify_checkpoint("/nonexistent", step=3)  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        torchckpt.state.errors.CheckpointNotFoundError: /nonexistent: no step 3; ...
    """
    check_verify_mode(verify)
    storage = open_storage(location)
    steps = sorted(storage.step_entries())
    if step is not None:
        if step not in steps:
            raise CheckpointNotFoundError(f"{location}: no step {step}; steps found: {steps or 'none'}")
        steps = [step]
    return [inspect_step(storage, s, verify) for s in steps]
