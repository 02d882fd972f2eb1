"""Reading one step: its manifest, its files verified against it, and the step decoded from them.

The one module a read of a step goes through: restore, export, ``load``, ``ls`` and ``verify`` call it
(catalog.py lists and judges steps with it, newest.py picks the step to restore).

Rules kept here (named in ``docs/design.md``; the design notes they keep in parentheses):

1. **[valid means every listed file checks]** (Note: [no manifest, no checkpoint])
   A step is valid only if its manifest parses and self-checks (format/manifest.py's
   [parse_manifest is the only way in]) and every listed file exists with the
   listed size (``verify="fast"``) and, with ``verify="full"``, the listed hash.
2. **[verification reports every problem]** Verification collects every problem of
   a step, each naming its file, and never raises anything but
   :class:`CheckpointCorruptError` for bad data.
3. **[decode the bytes that were hashed]** Restore decodes from the very bytes
   that were hashed, so a file changed between verification and loading cannot
   slip through.
4. **[one read per file]** Each file is read once, piece by piece; with
   ``verify="full"`` each piece is hashed in a second thread while the next one is
   read. A local ``.safetensors`` file is read straight into its tensors, each in its
   own memory (tensor_file.py's [each tensor reads into its own memory]); any other
   file (and every file of an fsspec step) into one buffer of its manifest size, whose
   tensors are decoded as views of it (format/codec.py's [zero copy both ways]):
   reading costs one pass over the bytes.
5. **[only verified steps are decoded]** (Note: [no manifest, no checkpoint]) Only
   steps whose manifest validates are decoded; bytes are decoded from exactly what
   was verified ([decode the bytes that were hashed]).

Only the files the asked-for items need are read, and the RNG entry is checked before anything live
changes (load.py's [the whole step checks before anything changes]).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Collection, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Literal

import torch

from torchckpt._progress import counting_bytes
from torchckpt.state.errors import CheckpointCorruptError, CheckpointNotFoundError
from torchckpt.state.format.codec import decode_json
from torchckpt.state.format.hashing import HASH_ALGORITHMS, new_hasher
from torchckpt.state.format.layout import MANIFEST_NAME, STATE_NAME, step_dir_name
from torchckpt.state.format.manifest import FileEntry, Manifest, parse_manifest
from torchckpt.state.format.snapshot import FileData, Snapshot, decode_snapshot
from torchckpt.state.live.capture import check_rng
from torchckpt.state.read.tensor_file import read_tensors
from torchckpt.state.storage.base import Storage
from torchckpt.state.storage.local import local_step_dir
from torchckpt.state.storage.local_files import (
    MANIFEST_MAX_BYTES,
    checked_size,
    read_capped,
    read_into_checked,
    stream_pieces,
)

VerifyMode = Literal["full", "fast"]
VERIFY_MODES: tuple[str, ...] = ("full", "fast")
_SAFE_FILE_RE = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.-]{0,200}$")


class StepGoneError(CheckpointNotFoundError):
    """A step's directory vanished while it was read (the writer's retention deleted it): gone, not corrupt."""


class UnverifiableStepError(CheckpointCorruptError):
    """A step's manifest names a hash algorithm this torchckpt does not know: it cannot be verified."""


def _raise_if_gone(storage: Storage, step: int, path: str) -> None:
    if step not in storage.step_entries():
        raise StepGoneError(f"{path}: step {step} was deleted while it was being read (the writer's retention "
                            "removed it); it is gone, not corrupt")


def _os_problem(error: OSError) -> str:
    if isinstance(error, NotADirectoryError):
        return "its step is a file, not a directory (a stray file named like a step)"
    if isinstance(error, PermissionError):
        return f"unreadable: permission denied ({error.strerror}). Fix: chmod/chown it so this user can read it"
    return f"unreadable ({error})"


def _file_size(storage: Storage, entry: str, name: str) -> int | None:
    root = local_step_dir(storage, entry)
    return checked_size(root, name) if root is not None else storage.file_size(entry, name)


def _read_into(storage: Storage, entry: str, name: str, into: memoryview,
               on_piece: Callable[[memoryview], None] | None) -> int:
    root = local_step_dir(storage, entry)
    if root is not None:
        return read_into_checked(root, name, into, on_piece)
    return storage.read_into(entry, name, into, on_piece)


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
        >>> from torchckpt.state.storage.backends import open_storage
        >>> read_manifest(open_storage("/nonexistent"), 1)  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        torchckpt.state.read.step.StepGoneError: /nonexistent/step-000000001/manifest.json: step 1 was deleted ...
    """
    entry = step_dir_name(step)
    path = storage.path_of(entry, MANIFEST_NAME)
    root = local_step_dir(storage, entry)
    try:
        if root is not None:
            data = read_capped(root, MANIFEST_NAME, MANIFEST_MAX_BYTES)  # Note: [reads stay inside the step]
        else:
            size = storage.file_size(entry, MANIFEST_NAME)
            if size is not None and size > MANIFEST_MAX_BYTES:
                raise OSError(f"{path}: {size} bytes; at most {MANIFEST_MAX_BYTES} are read")
            data = storage.read_file(entry, MANIFEST_NAME)
    except FileNotFoundError:
        _raise_if_gone(storage, step, path)
        problem = "missing; the save that wrote this step did not finish, so it is not a checkpoint"
        raise CheckpointCorruptError(f"{path}: {problem}", {path: problem}) from None
    except OSError as error:
        problem = _os_problem(error)
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
    storage: Storage, step: int, name: str, expected: FileEntry, algorithm: str | None, hash_thread: ThreadPoolExecutor,
    keep: bool,
) -> tuple[FileData | None, str | None]:
    """(bytes, None) if the file has the listed size (and hash, when ``algorithm``), else (None, problem).

    With ``keep=False`` (verification) the file is hashed as a stream, never held whole. Raises
    :class:`StepGoneError` if the step vanished meanwhile.
    """
    entry = step_dir_name(step)
    path = storage.path_of(entry, name)
    try:
        data, problem = _read_or_stream(storage, entry, name, expected, algorithm, hash_thread, keep)
    except FileNotFoundError:
        data, problem = None, _size_problem(None, 0)
    except OSError as error:
        return None, _os_problem(error)
    if problem is not None and problem.startswith("missing"):
        _raise_if_gone(storage, step, path)
    return data, problem


def _read_or_stream(
    storage: Storage, entry: str, name: str, expected: FileEntry, algorithm: str | None,
    hash_thread: ThreadPoolExecutor, keep: bool,
) -> tuple[FileData | None, str | None]:
    problem = _size_problem(_file_size(storage, entry, name), expected.size_bytes)  # sizes first, then bytes
    if problem is not None:
        return None, problem
    hasher = new_hasher(algorithm) if algorithm is not None else None
    root = local_step_dir(storage, entry)
    if not keep and hasher is not None and root is not None:  # [every read is bounded]: stream, never hold it
        streamed = stream_pieces(root, name, lambda piece: hash_thread.submit(hasher.update, piece).result,
                                 expected.size_bytes)
        return None, _final_problem(streamed, expected, hasher, algorithm)
    if keep and root is not None and name.endswith(".safetensors"):
        # tensor_file.py's [each tensor reads into its own memory]
        on_pieces = None if hasher is None else (
            lambda pieces: hash_thread.submit(_update_all, hasher, pieces).result)  # one task per batch
        try:
            tensors, read_bytes = read_tensors(root, name, expected.size_bytes, on_pieces)
        except (RuntimeError, MemoryError) as error:
            return None, _no_memory(expected, error)
        if tensors is not None:  # else its header is not valid: read it whole below, which names the problem
            problem = _final_problem(read_bytes, expected, hasher, algorithm)
            return (None, problem) if problem is not None else (tensors, None)
    try:
        # torch.empty: no zero-fill (bytearray would write every page once more) and 64-byte aligned views
        buffer = torch.empty(expected.size_bytes, dtype=torch.uint8).numpy().data  # ndarray.data: a memoryview
    except (RuntimeError, MemoryError) as error:
        return None, _no_memory(expected, error)
    updates: list[Future[None]] = []
    hash_piece = None
    if hasher is not None:

        def hash_piece(piece: memoryview) -> None:
            updates.append(hash_thread.submit(hasher.update, piece))  # one worker: pieces hash in order

    try:
        size: int | None = _read_into(storage, entry, name, buffer, hash_piece)
    finally:
        for update in updates:
            update.result()
    problem = _final_problem(size, expected, hasher, algorithm)
    return (None, problem) if problem is not None else (buffer, None)


def _update_all(hasher: object, pieces: list[memoryview]) -> None:
    for piece in pieces:
        hasher.update(piece)  # type: ignore[attr-defined]


def _no_memory(expected: FileEntry, error: BaseException) -> str:
    return (f"needs {expected.size_bytes} bytes of memory to read and could not get them ({error}). "
            "Fix: restore on a machine with more memory")


def _final_problem(size: int | None, expected: FileEntry, hasher: object, algorithm: str | None) -> str | None:
    problem = _size_problem(size, expected.size_bytes)
    if problem is not None:
        return problem + " while it was being read"
    if hasher is not None:
        return _hash_problem(hasher.hexdigest(), expected.hash, algorithm)  # type: ignore[attr-defined, arg-type]
    return None


def read_step_files(
    storage: Storage, step: int, manifest: Manifest, verify: VerifyMode, names: Collection[str] | None = None
) -> dict[str, FileData]:
    """Bytes of the listed files (only ``names`` when given), checked per ``verify`` ([valid means every listed
    file checks], [decode the bytes that were hashed], [one read per file]).

    Raises one :class:`CheckpointCorruptError` naming every bad file, :class:`UnverifiableStepError` if the
    manifest's hash algorithm is unknown (with ``"full"``), :class:`StepGoneError` if the step vanished.
    """
    check_verify_mode(verify)
    return _read_files(storage, step, manifest, verify, keep=True, names=names)


def _read_files(
    storage: Storage, step: int, manifest: Manifest, verify: VerifyMode, keep: bool,
    names: Collection[str] | None = None,
) -> dict[str, FileData]:
    entry = step_dir_name(step)
    algorithm = manifest.hash_algorithm if verify == "full" else None
    if algorithm is not None and algorithm not in HASH_ALGORITHMS:
        path = storage.path_of(entry, MANIFEST_NAME)
        message = (f"unverifiable: hash algorithm {algorithm!r} is unknown to this torchckpt (known: "
                   f"{sorted(HASH_ALGORITHMS)}). Fix: upgrade torchckpt, or use verify='fast' if you trust the files")
        raise UnverifiableStepError(f"{path}: {message}", {path: message})
    files: dict[str, FileData] = {}
    problems: dict[str, str] = {}
    listed = {name: expected for name, expected in manifest.files.items() if names is None or name in names}
    what = f"{'reading' if keep else 'verifying'} {storage.path_of(entry)}"  # _progress.py: shown if listened to
    done = 0
    with ThreadPoolExecutor(max_workers=1, thread_name_prefix="torchckpt-hash") as hash_thread, \
            counting_bytes(what, sum(expected.size_bytes for expected in listed.values())) as reached:
        for name, expected in listed.items():
            data, problem = _read_checked(storage, step, name, expected, algorithm, hash_thread, keep)
            done += expected.size_bytes
            reached(done)
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


def verify_step_files(storage: Storage, step: int, manifest: Manifest, verify: VerifyMode) -> dict[str, str]:
    """Every problem of the files ``manifest`` lists, by path: sizes (``"fast"``) or hashes too (``"full"``), the
    files streamed, never held ([verification reports every problem]).

    Raises :class:`UnverifiableStepError` (``"full"``, an unknown hash algorithm), :class:`StepGoneError`.
    """
    entry = step_dir_name(step)
    if verify == "full":
        try:
            _read_files(storage, step, manifest, verify, keep=False)
        except UnverifiableStepError:
            raise
        except CheckpointCorruptError as error:
            return error.problems
        return {}
    problems = {}
    for name, expected in manifest.files.items():
        path = storage.path_of(entry, name)
        try:
            problem = _size_problem(_file_size(storage, entry, name), expected.size_bytes)
        except OSError as error:
            problem = _os_problem(error)
        if problem == "missing (the manifest lists it)":
            _raise_if_gone(storage, step, path)
        if problem is not None:
            problems[path] = problem
    return problems


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


def _needed_files(state: FileData | None, manifest: Manifest, wanted: Collection[str] | None,
                  source: str) -> set[str]:
    """The files the ``wanted`` items live in (load.py's [the whole step checks before anything changes])."""
    if wanted is None or state is None or isinstance(state, Mapping):
        return set(manifest.files)
    try:
        items = decode_json(state, source)["items"]
        return {STATE_NAME} | {
            file for name in wanted if name in items
            for file in (items[name]["tensor_file"], items[name]["tree_file"]) if file is not None
        }
    except (CheckpointCorruptError, KeyError, TypeError):
        return set(manifest.files)  # decode_snapshot names the problem
