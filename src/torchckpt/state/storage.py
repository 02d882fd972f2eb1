"""Where checkpoint bytes live: the local filesystem, or any fsspec URL; atomic commit protocols.

This module holds the interfaces, the local back end and the helpers both back ends share; the fsspec
back end is ``storage_fsspec.py``.

Rules kept here (named in ``docs/design.md``; the design notes they keep in parentheses):

1. **[local commit is a rename]** (Note: [no manifest, no checkpoint]) Local
   commit: every file is written into ``.tmp-step-N-<id>/`` and fsynced, then
   ``manifest.json`` is written and fsynced, then the temp directory is fsynced,
   renamed to ``step-N`` and the parent is fsynced. A crash at any point leaves
   either no ``step-N`` or a complete one.
2. **[manifest is the commit mark]** (Note: [no manifest, no checkpoint]) Remote
   commit (fsspec, no atomic rename): files go straight into ``step-N/`` and the
   manifest is written last; it is the commit mark. Removal deletes the manifest
   first, so a half-removed step is never trusted.
3. **[only the lock holder cleans]** (Note: [retention spares the newest and the unfinished])
   Only a writer holding the lock cleans leftovers (``.tmp-*``, ``.trash-*``, remote
   steps without a manifest), so it never deletes a save that another live process
   is still writing.
4. **[delete by renaming to trash]** Retention removes a local step by renaming it
   to ``.trash-*`` first, so a crash mid-delete never leaves a half-deleted
   ``step-N``.
"""

from __future__ import annotations

import errno
import os
import shutil
import uuid
from collections.abc import Callable, Iterable, Iterator
from typing import Protocol

from torchckpt.state.errors import CheckpointError, CheckpointWriteError, fix_for_os_error
from torchckpt.state.format import (
    CORRUPT_PREFIX,
    LOCK_NAME,
    MANIFEST_NAME,
    TMP_PREFIX,
    TRASH_PREFIX,
    parse_step_dir_name,
    step_dir_name,
)
from torchckpt.state.lockfile import HeldLock, acquire
from torchckpt.state.lockfile import describe_holder as describe_holder  # re-exported for storage_fsspec.py
from torchckpt.state.lockfile import holder_record as holder_record

ABANDONED_DIR = "abandoned"  # where the steps of an abandoned branch go (branches.py)

# Files are written and read in pieces of this size: small enough that hashing piece k overlaps
# writing/reading piece k+1 in another thread, large enough that syscalls cost nothing
# (Note: [hash while writing], Note: [one read per file]).
PIECE_BYTES = 16 << 20

Buffer = bytes | memoryview


class StepWriter(Protocol):
    """Writes the files of one step, then commits them (or aborts).

    ``entry`` names where the files go (a temp directory, or the step directory on fsspec), so that other
    ranks of a sharded save can join it (:meth:`Storage.join_step`)."""

    entry: str

    def write(self, name: str, chunks: Iterable[Buffer], total_bytes: int) -> int: ...
    def commit(self, manifest: bytes) -> None: ...
    def abort(self) -> None: ...


class Storage(Protocol):
    """A checkpoint directory on some filesystem (see :func:`open_storage`)."""

    location: str

    def path_of(self, entry: str, name: str | None = None) -> str: ...
    def step_entries(self) -> dict[int, str]: ...
    def read_file(self, entry: str, name: str) -> bytes: ...
    def read_into(
        self, entry: str, name: str, into: memoryview, on_piece: Callable[[memoryview], None] | None
    ) -> int: ...
    def file_size(self, entry: str, name: str) -> int | None: ...
    def begin_step(self, step: int) -> StepWriter: ...
    def join_step(self, step: int, entry: str) -> StepWriter: ...
    def read_range(self, entry: str, name: str, offset: int, length: int) -> bytes | bytearray: ...
    def remove_step(self, step: int) -> None: ...
    def abandon_step(self, step: int) -> str: ...
    def clean_leftovers(self) -> list[str]: ...
    def acquire_lock(self) -> None: ...
    def release_lock(self) -> None: ...


def open_storage(location: str | os.PathLike[str]) -> Storage:
    """Storage for a local path or an fsspec URL (``s3://``, ``memory://``, ...).

    Example:
        >>> open_storage("/tmp/torchckpt-doctest").location
        '/tmp/torchckpt-doctest'
    """
    text = os.fspath(location)
    if "://" in text and not text.startswith("file://"):
        from torchckpt.state.storage_fsspec import FsspecStorage  # here: it imports this module's helpers

        return FsspecStorage(text)
    return LocalStorage(text.removeprefix("file://"))


def write_error(path: str, error: OSError, done_bytes: int, total_bytes: int) -> CheckpointWriteError:
    """The error a failed write raises: the path, bytes written so far, the cause, and its fix.

    Example:
        >>> print(write_error("run/x", OSError(errno.ENOSPC, "full"), 1, 4))  # doctest: +ELLIPSIS
        run/x: save failed after writing 1 of 4 bytes: no space left on device ...
        >>> print(write_error("run/x", OSError(errno.EROFS, "Read-only file system"), 0, 4))  # doctest: +ELLIPSIS
        run/x: save failed after writing 0 of 4 bytes: read-only file system ... Fix: the filesystem is read-only...
    """
    reason = "no space left on device" if error.errno == errno.ENOSPC else os.strerror(error.errno or 0).lower()
    return CheckpointWriteError(
        f"{path}: save failed after writing {done_bytes} of {total_bytes} bytes: {reason} "
        f"({error}). The partial save was discarded; earlier checkpoints are untouched. "
        f"Fix: {fix_for_os_error(error)}, then save again."
    )


def _write_fully(fd: int, data: bytes | memoryview) -> int:
    """Write all of ``data`` to ``fd``; returns bytes written (a partial write loops)."""
    view = memoryview(data)
    done = 0
    while done < len(view):
        done += os.write(fd, view[done : done + (64 << 20)])
    return done


def split_pieces(chunks: Iterable[Buffer], piece_bytes: int = PIECE_BYTES) -> Iterator[memoryview]:
    """The bytes of ``chunks``, in order, as views of at most ``piece_bytes`` each (no copies).

    Example:
        >>> [bytes(piece) for piece in split_pieces([b"abcde", b"", b"f"], piece_bytes=2)]
        [b'ab', b'cd', b'e', b'f']
    """
    for chunk in chunks:
        view = memoryview(chunk).cast("B")
        for start in range(0, len(view), piece_bytes):
            yield view[start : start + piece_bytes]


class Readable(Protocol):
    """A binary file open for reading: a local file (``open(..., "rb")``) or an fsspec one."""

    def readinto(self, buffer: memoryview, /) -> int | None: ...
    def read(self, size: int = -1, /) -> bytes: ...


def read_pieces(handle: Readable, into: memoryview, on_piece: Callable[[memoryview], None] | None) -> int:
    """Fill ``into`` from ``handle`` piece by piece, calling ``on_piece`` on each piece as it lands.

    Without ``on_piece`` (nothing to hash) it asks for the whole rest at once.
    Returns the bytes read, plus one if the file holds more than ``len(into)`` bytes.

    Example:
        >>> import io
        >>> into = memoryview(bytearray(3))
        >>> read_pieces(io.BytesIO(b"abcd"), into, None), bytes(into)
        (4, b'abc')
    """
    done = 0
    piece_bytes = PIECE_BYTES if on_piece is not None else len(into)
    while done < len(into):
        count = handle.readinto(into[done : done + piece_bytes])
        if not count:
            return done
        if on_piece is not None:
            on_piece(into[done : done + count])
        done += count
    return done + len(handle.read(1))


def fsync_dir(path: str) -> None:
    """fsync a directory, so that a rename or a new entry in it survives a power loss.

    Example:
        >>> import tempfile
        >>> fsync_dir(tempfile.gettempdir())
    """
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class LocalStorage:
    """A checkpoint directory on a local (POSIX) filesystem."""

    def __init__(self, root: str) -> None:
        self.location = root
        self._lock: HeldLock | None = None

    def path_of(self, entry: str, name: str | None = None) -> str:
        """Filesystem path of a step entry or a file in it."""
        return os.path.join(self.location, entry) if name is None else os.path.join(self.location, entry, name)

    def step_entries(self) -> dict[int, str]:
        """Committed step directories by step (``step-N``; temp dirs excluded)."""
        try:
            names = os.listdir(self.location)
        except FileNotFoundError:
            return {}
        steps = {parse_step_dir_name(name): name for name in names}
        steps.pop(None, None)
        return steps  # type: ignore[return-value]

    def read_file(self, entry: str, name: str) -> bytes:
        """Bytes of one file (raises FileNotFoundError if missing)."""
        with open(self.path_of(entry, name), "rb") as handle:
            return handle.read()

    def read_into(
        self, entry: str, name: str, into: memoryview, on_piece: Callable[[memoryview], None] | None
    ) -> int:
        """Read one file into ``into``, piece by piece; returns its length (``len(into) + 1`` if longer).

        Raises FileNotFoundError if it is missing.
        """
        with open(self.path_of(entry, name), "rb", buffering=0) as handle:
            return read_pieces(handle, into, on_piece)

    def file_size(self, entry: str, name: str) -> int | None:
        """Size in bytes of one file, or None if it is missing."""
        try:
            return os.stat(self.path_of(entry, name)).st_size
        except FileNotFoundError:
            return None

    def _ensure_root(self) -> None:
        if os.path.isdir(self.location):
            return
        if os.path.lexists(self.location):
            raise CheckpointError(
                f"{self.location} is a file, not a directory: a Checkpointer keeps its steps in a directory. "
                "Fix: pass a directory path (a new one is created), or move the file away.")
        try:
            os.makedirs(self.location, exist_ok=True)
        except OSError as error:
            raise CheckpointError(f"{self.location}: cannot create the checkpoint directory ({error}). "
                                  f"Fix: {fix_for_os_error(error)}.") from None
        fsync_dir(os.path.dirname(os.path.abspath(self.location)))  # the new root survives a crash

    def begin_step(self, step: int) -> _LocalStepWriter:
        """Start writing ``step`` into a fresh temp directory ([local commit is a rename])."""
        self._ensure_root()
        temp = f"{TMP_PREFIX}{step_dir_name(step)}-{uuid.uuid4().hex[:12]}"
        return _LocalStepWriter(self, step, temp)

    def join_step(self, step: int, entry: str) -> _LocalStepWriter:
        """Write files into the temp directory another rank began (a sharded save); it must be visible here."""
        if not (entry.startswith(f"{TMP_PREFIX}{step_dir_name(step)}-") and "/" not in entry):
            raise CheckpointError(f"{entry!r} is not a temp directory of step {step}")
        if not os.path.isdir(self.path_of(entry)):
            raise CheckpointError(
                f"{self.path_of(entry)}: rank 0 created this directory for step {step} but this process cannot "
                "see it: the checkpoint directory must be one filesystem shared by every rank (a network "
                "filesystem, or an fsspec URL). Fix: pass a shared path to every rank's Checkpointer.")
        return _LocalStepWriter(self, step, entry, create=False)

    def read_range(self, entry: str, name: str, offset: int, length: int) -> bytearray:
        """Up to ``length`` bytes of one file from ``offset`` (fewer at its end; FileNotFoundError if missing).

        Only a regular file inside the step is read (local_files.py's [only regular files are read])."""
        from torchckpt.state.local_files import open_in_step  # it imports this module

        fd = open_in_step(self.path_of(entry), name)
        try:
            length = max(0, min(length, os.fstat(fd).st_size - offset))  # never more than the file holds
            buffer = bytearray(length)  # read straight into it: the caller views it without a copy
            view, done = memoryview(buffer), 0
            while done < length:
                count = os.preadv(fd, [view[done:done + (1 << 30)]], offset + done)
                if not count:
                    break
                done += count
            if done < length:
                del view
                del buffer[done:]
            return buffer
        finally:
            os.close(fd)

    def remove_step(self, step: int) -> None:
        """Delete a committed step: rename to ``.trash-*``, then delete ([delete by renaming to trash])."""
        entry = step_dir_name(step)
        trash = f"{TRASH_PREFIX}{entry}-{uuid.uuid4().hex[:12]}"
        os.rename(self.path_of(entry), self.path_of(trash))
        fsync_dir(self.location)
        shutil.rmtree(self.path_of(trash), ignore_errors=True)

    def abandon_step(self, step: int) -> str:
        """Move a committed step of an abandoned branch to ``abandoned/`` (one rename; branches.py)."""
        entry = step_dir_name(step)
        folder = self.path_of(ABANDONED_DIR)
        os.makedirs(folder, exist_ok=True)
        target = os.path.join(ABANDONED_DIR, entry)
        if os.path.lexists(self.path_of(target)):
            target = f"{target}-{uuid.uuid4().hex[:12]}"
        os.rename(self.path_of(entry), self.path_of(target))
        fsync_dir(folder)
        fsync_dir(self.location)
        return self.path_of(target)

    def move_aside(self, entry: str) -> str:
        """Rename a corrupt step out of the way (kept for inspection as ``.corrupt-*``)."""
        target = f"{CORRUPT_PREFIX}{entry}-{uuid.uuid4().hex[:12]}"
        os.rename(self.path_of(entry), self.path_of(target))
        return target

    def clean_leftovers(self) -> list[str]:
        """Delete temp and trash directories of interrupted saves; only call with the lock
        ([only the lock holder cleans])."""
        if not os.path.isdir(self.location):
            return []
        removed = [n for n in os.listdir(self.location) if n.startswith((TMP_PREFIX, TRASH_PREFIX))]
        for name in removed:
            shutil.rmtree(self.path_of(name), ignore_errors=True)
        return removed

    def acquire_lock(self) -> None:
        """Take the writer lock (``flock``; released by the kernel if the process dies; lockfile.py)."""
        self._ensure_root()
        self._lock = acquire(self.location, LOCK_NAME)

    def release_lock(self) -> None:
        """Release the writer lock (idempotent)."""
        if self._lock is not None:
            self._lock.release()  # closing the descriptor releases the flock
            self._lock = None


class _LocalStepWriter:
    """Writes one step into its temp directory and commits it by rename ([local commit is a rename])."""

    def __init__(self, storage: LocalStorage, step: int, temp_entry: str, create: bool = True) -> None:
        self._storage = storage
        self._step = step
        self.entry = temp_entry
        self._temp = storage.path_of(temp_entry)
        self._owner = create  # a rank that joined a sharded save leaves removal to the rank that began it
        if create:
            self._wrap(lambda: os.mkdir(self._temp), self._temp, 0)

    def write(self, name: str, chunks: Iterable[Buffer], total_bytes: int) -> int:
        """Write ``chunks`` in order as one file and fsync it; returns the bytes written.

        ``total_bytes`` (the sum of the chunks' sizes) is only used in error messages.
        """
        path = os.path.join(self._temp, name)
        progress = [0]

        def write_and_sync() -> None:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o644)
            try:
                for chunk in chunks:
                    progress[0] += _write_fully(fd, chunk)
                os.fsync(fd)
            finally:
                os.close(fd)

        self._wrap(write_and_sync, path, total_bytes, progress)
        return progress[0]

    def commit(self, manifest: bytes) -> None:
        """Write the manifest last, then rename into place and fsync the parent."""
        self.write(MANIFEST_NAME, [manifest], len(manifest))
        final_entry = step_dir_name(self._step)
        final = self._storage.path_of(final_entry)

        def publish() -> None:
            fsync_dir(self._temp)
            if os.path.lexists(final):  # the caller checked it is not a valid checkpoint
                self._storage.move_aside(final_entry)
            os.rename(self._temp, final)
            fsync_dir(self._storage.location)

        self._wrap(publish, final, 0)

    def abort(self) -> None:
        """Discard the temp directory (best effort; start-up cleans what is left)."""
        if self._owner:
            shutil.rmtree(self._temp, ignore_errors=True)

    def _wrap(self, action: Callable[[], None], path: str, total: int, progress: list[int] | None = None) -> None:
        try:
            action()
        except OSError as error:
            self.abort()
            raise write_error(path, error, progress[0] if progress else 0, total) from error
