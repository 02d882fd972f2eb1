"""What every storage back end offers (the Storage and StepWriter protocols), and the helpers they share.

The back ends: local.py (a POSIX directory) and remote.py (any fsspec URL); backends.py picks one.

Rules kept here (named in ``docs/design.md``; the design notes they keep in parentheses):

1. **[only the lock holder cleans]** (Note: [retention spares the newest and the unfinished])
   Only a writer holding the lock cleans leftovers (``.tmp-*``, ``.trash-*``, remote
   steps without a manifest: :meth:`Storage.clean_leftovers`), so it never deletes a save
   that another live process is still writing.
"""

from __future__ import annotations

import errno
import os
from collections.abc import Callable, Iterable, Iterator
from typing import Protocol

from torchckpt._progress import add_bytes
from torchckpt.state.errors import CheckpointWriteError, fix_for_os_error

# Files are written and read in pieces of this size: small enough that hashing piece k overlaps
# writing/reading piece k+1 in another thread, large enough that syscalls cost nothing
# (checkpointer.py's [hash while writing], read/step.py's [one read per file]).
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
        add_bytes(count)  # _progress.py's [reported per phase, never per op]
    return done + len(handle.read(1))

