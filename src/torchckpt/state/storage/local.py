"""A checkpoint directory on a local (POSIX) filesystem: atomic commit by rename.

Rules kept here (named in ``docs/design.md``; the design notes they keep in parentheses):

1. **[local commit is a rename]** (Note: [no manifest, no checkpoint]) Local
   commit: every file is written into ``.tmp-step-N-<id>/`` and fsynced, then
   ``manifest.json`` is written and fsynced, then the temp directory is fsynced,
   renamed to ``step-N`` and the parent is fsynced. A crash at any point leaves
   either no ``step-N`` or a complete one.
2. **[delete by renaming to trash]** Retention removes a local step by renaming it
   to ``.trash-*`` first, so a crash mid-delete never leaves a half-deleted
   ``step-N``.

Leftovers are cleaned only with the lock (base.py's [only the lock holder cleans]).
"""

from __future__ import annotations

import os
import shutil
import uuid
from collections.abc import Callable, Iterable, Sequence

from torchckpt.state.errors import CheckpointError, fix_for_os_error
from torchckpt.state.format.layout import (
    ABANDONED_DIR,
    CORRUPT_PREFIX,
    LOCK_NAME,
    MANIFEST_NAME,
    TMP_PREFIX,
    TRASH_PREFIX,
    parse_step_dir_name,
    step_dir_name,
)
from torchckpt.state.process.lockfile import HeldLock, acquire
from torchckpt.state.storage.base import Buffer, Storage, read_pieces, write_error
from torchckpt.state.storage.kernel_hints import start_writeback
from torchckpt.state.storage.local_files import open_in_step


def _write_fully(fd: int, data: bytes | memoryview) -> int:
    """Write all of ``data`` to ``fd``; returns bytes written (a partial write loops)."""
    view = memoryview(data)
    done = 0
    while done < len(view):
        done += os.write(fd, view[done : done + (64 << 20)])
    return done


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

    def read_range_into(self, entry: str, name: str, offset: int, buffers: Sequence[memoryview]) -> int:
        """Read one file's bytes from ``offset`` into ``buffers`` in order, straight into their memory (``preadv``);
        returns the bytes read, fewer only at the file's end (sharded/part_reads.py). Only a regular file inside
        the step is read (local_files.py's [only regular files are read])."""
        fd = open_in_step(self.path_of(entry), name)
        try:
            views = [view for view in buffers if len(view)]
            done = 0
            while views:
                count = os.preadv(fd, views[:64], offset + done)
                if not count:
                    break
                done += count
                while views and count >= len(views[0]):
                    count -= len(views.pop(0))
                if count:
                    views[0] = views[0][count:]
            return done
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
        """Move a committed step of an abandoned branch to ``abandoned/`` (one rename; checkpointer/branches.py)."""
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
        (base.py's [only the lock holder cleans])."""
        if not os.path.isdir(self.location):
            return []
        removed = [n for n in os.listdir(self.location) if n.startswith((TMP_PREFIX, TRASH_PREFIX))]
        for name in removed:
            shutil.rmtree(self.path_of(name), ignore_errors=True)
        return removed

    def acquire_lock(self) -> None:
        """Take the writer lock (``flock``; released by the kernel if the process dies; process/lockfile.py)."""
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
                for chunk in chunks:  # kernel_hints.py's [writeback starts as pieces are written]
                    written = _write_fully(fd, chunk)
                    start_writeback(fd, progress[0], written)
                    progress[0] += written
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


def local_step_dir(storage: Storage, entry: str) -> str | None:
    """The local directory of a step entry, or None when ``storage`` is not a local directory (remote.py).

    Example:
        >>> local_step_dir(LocalStorage("/tmp/run"), "step-000000001")
        '/tmp/run/step-000000001'
    """
    return storage.path_of(entry) if isinstance(storage, LocalStorage) else None
