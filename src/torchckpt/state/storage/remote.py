"""The fsspec back end of checkpoint storage (``s3://``, ``gs://``, ``memory://``, ...).

Rules kept here (named in ``docs/design.md``; the design notes they keep in parentheses):

1. **[manifest is the commit mark]** (Note: [no manifest, no checkpoint]) Remote
   commit (fsspec, no atomic rename): files go straight into ``step-N/`` and the
   manifest is written last; it is the commit mark. Removal deletes the manifest
   first, so a half-removed step is never trusted.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Callable, Iterable

from torchckpt._optional import install_hint
from torchckpt.state.errors import CheckpointError, CheckpointLockedError, CheckpointWriteError
from torchckpt.state.format.layout import ABANDONED_DIR, LOCK_NAME, MANIFEST_NAME, parse_step_dir_name, step_dir_name
from torchckpt.state.process.lockfile import describe_holder, holder_record
from torchckpt.state.storage.base import Buffer, read_pieces, write_error

__all__ = ["FsspecStorage"]


class FsspecStorage:
    """A checkpoint directory behind an fsspec URL; the manifest is the commit mark
    ([manifest is the commit mark])."""

    def __init__(self, url: str) -> None:
        try:
            import fsspec
        except ImportError:
            raise CheckpointWriteError(
                f"{url}: remote checkpoint paths need fsspec, which is not installed. "
                f"Fix: {install_hint('fsspec')}, plus your store's package (s3fs, gcsfs, ...)."
            ) from None
        self.location = url
        self._fs, self._root = fsspec.core.url_to_fs(url)
        self._holds_lock = False

    def path_of(self, entry: str, name: str | None = None) -> str:
        """URL of a step entry or a file in it."""
        inner = f"{self._root}/{entry}" if name is None else f"{self._root}/{entry}/{name}"
        return self._fs.unstrip_protocol(inner)

    def _inner(self, entry: str, name: str | None = None) -> str:
        return f"{self._root}/{entry}" if name is None else f"{self._root}/{entry}/{name}"

    def _names(self) -> list[str]:
        try:
            return [p.rstrip("/").rsplit("/", 1)[-1] for p in self._fs.ls(self._root, detail=False)]
        except FileNotFoundError:
            return []

    def step_entries(self) -> dict[int, str]:
        """Step directories by step (committed or not; the manifest decides)."""
        steps = {parse_step_dir_name(name): name for name in self._names()}
        steps.pop(None, None)
        return steps  # type: ignore[return-value]

    def read_file(self, entry: str, name: str) -> bytes:
        """Bytes of one file (raises FileNotFoundError if missing)."""
        return self._fs.cat_file(self._inner(entry, name))

    def read_into(
        self, entry: str, name: str, into: memoryview, on_piece: Callable[[memoryview], None] | None
    ) -> int:
        """Read one file into ``into``, piece by piece; returns its length (``len(into) + 1`` if longer)."""
        with self._fs.open(self._inner(entry, name), "rb") as handle:
            return read_pieces(handle, into, on_piece)

    def file_size(self, entry: str, name: str) -> int | None:
        """Size in bytes of one file, or None if it is missing."""
        try:
            return int(self._fs.size(self._inner(entry, name)))
        except FileNotFoundError:
            return None

    def begin_step(self, step: int) -> _FsspecStepWriter:
        """Start writing ``step`` in place; an uncommitted leftover is removed first."""
        entry = step_dir_name(step)
        if self._fs.exists(self._inner(entry)):
            self._remove_entry(entry)
        self._fs.makedirs(self._inner(entry), exist_ok=True)
        return _FsspecStepWriter(self, entry)

    def join_step(self, step: int, entry: str) -> _FsspecStepWriter:
        """Write files into the step another rank began (a sharded save); only that rank commits or aborts."""
        if entry != step_dir_name(step):
            raise CheckpointError(f"{entry!r} is not the directory of step {step}")
        return _FsspecStepWriter(self, entry, owner=False)

    def read_range(self, entry: str, name: str, offset: int, length: int) -> bytes:
        """Up to ``length`` bytes of one file from ``offset`` (one ranged request)."""
        path = self._inner(entry, name)
        size = int(self._fs.size(path))
        return bytes(self._fs.cat_file(path, start=min(offset, size), end=min(offset + length, size)))

    def _remove_entry(self, entry: str) -> None:
        manifest = self._inner(entry, MANIFEST_NAME)
        if self._fs.exists(manifest):
            self._fs.rm(manifest)  # un-commit first ([manifest is the commit mark])
        self._fs.rm(self._inner(entry), recursive=True)

    def remove_step(self, step: int) -> None:
        """Delete a committed step, manifest first ([manifest is the commit mark])."""
        self._remove_entry(step_dir_name(step))

    def abandon_step(self, step: int) -> str:
        """Copy a committed step of an abandoned branch to ``abandoned/`` (manifest last), then remove it
        (manifest first): no rename on object stores (checkpointer/branches.py)."""
        entry = step_dir_name(step)
        target = f"{ABANDONED_DIR}/{entry}-{uuid.uuid4().hex[:12]}"
        names = [p.rstrip("/").rsplit("/", 1)[-1] for p in self._fs.ls(self._inner(entry), detail=False)]
        for name in sorted(names, key=lambda n: n == MANIFEST_NAME):
            self._fs.pipe_file(self._inner(target, name), self._fs.cat_file(self._inner(entry, name)))
        self._remove_entry(entry)
        return self.path_of(target)

    def clean_leftovers(self) -> list[str]:
        """Delete step directories that have no manifest; only call with the lock
        (base.py's [only the lock holder cleans])."""
        removed = [
            entry
            for entry in self.step_entries().values()
            if not self._fs.exists(self._inner(entry, MANIFEST_NAME))
        ]
        for entry in removed:
            self._fs.rm(self._inner(entry), recursive=True)
        return removed

    def acquire_lock(self) -> None:
        """Best-effort lock: a ``.lock`` file naming its holder (object stores lack flock)."""
        path = self._inner(LOCK_NAME)
        if self._fs.exists(path):
            holder = describe_holder(self._fs.cat_file(path))
            raise CheckpointLockedError(
                f"{self.location} is locked by {holder}. Fix: stop that run or use another "
                f"directory; if that process is dead, delete {self._fs.unstrip_protocol(path)}."
            )
        self._fs.makedirs(self._root, exist_ok=True)
        self._fs.pipe_file(path, json.dumps(holder_record()).encode("utf-8"))
        self._holds_lock = True

    def release_lock(self) -> None:
        """Delete the lock file if this object created it (idempotent)."""
        if self._holds_lock:
            self._fs.rm(self._inner(LOCK_NAME))
            self._holds_lock = False


class _FsspecStepWriter:
    """Writes one step's files in place; the manifest, written last, commits it."""

    def __init__(self, storage: FsspecStorage, entry: str, owner: bool = True) -> None:
        self._storage = storage
        self._entry = entry
        self.entry = entry
        self._owner = owner  # a rank that joined a sharded save leaves removal to the rank that began it

    def write(self, name: str, chunks: Iterable[Buffer], total_bytes: int) -> int:
        """Upload ``chunks`` in order as one file (streamed, not joined); returns the bytes written."""
        path = self._storage._inner(self._entry, name)
        done = 0
        try:
            with self._storage._fs.open(path, "wb") as handle:
                for chunk in chunks:
                    handle.write(chunk)
                    done += memoryview(chunk).nbytes
        except OSError as error:
            self.abort()
            raise write_error(self._storage.path_of(self._entry, name), error, done, total_bytes) from error
        return done

    def commit(self, manifest: bytes) -> None:
        """Upload the manifest: from now on the step is a checkpoint."""
        self.write(MANIFEST_NAME, [manifest], len(manifest))

    def abort(self) -> None:
        """Remove what was uploaded (best effort; start-up cleans what is left)."""
        if not self._owner:
            return
        try:
            self._storage._remove_entry(self._entry)
        except OSError:
            pass
