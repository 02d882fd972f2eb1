"""Opening the files of a local step directory without trusting them: regular files only, bounded reads.

Rules kept here (named in ``docs/design.md``; the design notes they keep in parentheses):

1. **[only regular files are read]** (Note: [reads stay inside the step]) A file of a
   step is opened with ``O_NOFOLLOW | O_NONBLOCK`` and checked with ``fstat`` to be a
   regular file before a byte is read: a FIFO, a device (``/dev/zero``), a socket or a
   directory is refused, so a read never hangs and never runs forever. A symlink is
   followed only when its target stays inside the step directory.
2. **[every read is bounded]** No read asks for more than a fixed bound: the manifest
   at most :data:`MANIFEST_MAX_BYTES`, every other file at most its manifest size (the
   caller's buffer), and hashing for verification streams through two buffers of
   :data:`STREAM_PIECE_BYTES`, never one of the whole file.
"""

from __future__ import annotations

import errno
import os
import stat
from collections.abc import Callable

from torchckpt._progress import add_bytes
from torchckpt.state.storage.base import read_pieces

MANIFEST_MAX_BYTES = 64 << 20
STREAM_PIECE_BYTES = 16 << 20


class RefusedFileError(OSError):
    """A step's file is not a regular file inside the step directory; it was refused unread."""


_KINDS = ((stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO (named pipe)"), (stat.S_ISCHR, "a character device"),
          (stat.S_ISBLK, "a block device"), (stat.S_ISSOCK, "a socket"))


def _kind(mode: int) -> str:
    return next((text for check, text in _KINDS if check(mode)), "not a regular file")


def open_in_step(step_dir: str, name: str) -> int:
    """A read-only descriptor of ``step_dir/name``, a regular file inside ``step_dir`` ([only regular files are read]).

    Raises FileNotFoundError if it is missing, :class:`RefusedFileError` for anything else but a regular file.

    Example:
        >>> import tempfile
        >>> tmp = tempfile.TemporaryDirectory(); os.symlink("/dev/zero", os.path.join(tmp.name, "m.json"))
        >>> open_in_step(tmp.name, "m.json")  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        torchckpt.state.storage.local_files.RefusedFileError: .../m.json: a symlink to /dev/zero, outside its step ...
        >>> tmp.cleanup()
    """
    path = os.path.join(step_dir, name)
    if stat.S_ISLNK(os.lstat(path).st_mode):
        target = os.path.realpath(path)
        root = os.path.realpath(step_dir)
        if os.path.commonpath([root, target]) != root:
            raise RefusedFileError(f"{path}: a symlink to {target}, outside its step directory; "
                                   "refused unread. Fix: replace it with the file itself")
        path = target
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as error:
        if error.errno == errno.ELOOP:
            raise RefusedFileError(f"{path}: a symlink loop; refused unread") from None
        raise
    try:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            raise RefusedFileError(f"{path}: {_kind(mode)}, not a regular file; refused unread "
                                   "(reading it could hang or never end). Fix: remove it")
        os.set_blocking(fd, True)
    except BaseException:
        os.close(fd)
        raise
    return fd


def checked_size(step_dir: str, name: str) -> int | None:
    """Size of a regular file of the step, or None if it is missing.

    Example:
        >>> checked_size("/nonexistent", "manifest.json") is None
        True
    """
    try:
        fd = open_in_step(step_dir, name)
    except FileNotFoundError:
        return None
    try:
        return os.fstat(fd).st_size
    finally:
        os.close(fd)


def read_capped(step_dir: str, name: str, max_bytes: int = MANIFEST_MAX_BYTES) -> bytes:
    """All bytes of a regular file of the step, refused if it holds more than ``max_bytes`` ([every read is bounded]).

    Example:
        >>> import tempfile
        >>> tmp = tempfile.TemporaryDirectory(); _ = open(os.path.join(tmp.name, "a"), "wb").write(b"abcd")
        >>> read_capped(tmp.name, "a")
        b'abcd'
        >>> read_capped(tmp.name, "a", max_bytes=3)  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        torchckpt.state.storage.local_files.RefusedFileError: .../a: holds 4 bytes or more; at most 3 are read ...
        >>> tmp.cleanup()
    """
    with os.fdopen(open_in_step(step_dir, name), "rb", buffering=0) as handle:
        data = handle.read(max_bytes + 1)
    if len(data) > max_bytes:
        raise RefusedFileError(f"{os.path.join(step_dir, name)}: holds {len(data)} bytes or more; at "
                               f"most {max_bytes} are read (no manifest is that large)")
    return data


def read_into_checked(step_dir: str, name: str, into: memoryview, on_piece: Callable[[memoryview], None] | None) -> int:
    """Read a regular file of the step into ``into`` (its manifest size); returns its length, ``len(into) + 1``
    if longer.

    Example:
        >>> checked_size("/nonexistent", "x") is None
        True
    """
    with os.fdopen(open_in_step(step_dir, name), "rb", buffering=0) as handle:
        return read_pieces(handle, into, on_piece)


def stream_pieces(step_dir: str, name: str, on_piece: Callable[[memoryview], Callable[[], object]],
                  limit_bytes: int) -> int:
    """Read a regular file of the step through two reused buffers of :data:`STREAM_PIECE_BYTES`, calling
    ``on_piece`` on each piece; it returns a callable that waits until that piece is consumed (its buffer
    is then reused). Reads at most ``limit_bytes + 1`` bytes; returns how many ([every read is bounded]).

    Example:
        >>> import tempfile
        >>> tmp = tempfile.TemporaryDirectory(); _ = open(os.path.join(tmp.name, "a"), "wb").write(b"abc")
        >>> seen = []
        >>> stream_pieces(tmp.name, "a", lambda piece: lambda: seen.append(bytes(piece)), 3), seen
        (3, [b'abc'])
        >>> tmp.cleanup()
    """
    buffers = [memoryview(bytearray(STREAM_PIECE_BYTES)), memoryview(bytearray(STREAM_PIECE_BYTES))]
    pending: list[Callable[[], object] | None] = [None, None]
    done = turn = 0
    try:
        with os.fdopen(open_in_step(step_dir, name), "rb", buffering=0) as handle:
            while done <= limit_bytes:
                slot = turn % 2
                waiter = pending[slot]
                if waiter is not None:
                    waiter()  # the piece that used this buffer two turns ago is consumed
                count = handle.readinto(buffers[slot][: min(STREAM_PIECE_BYTES, limit_bytes + 1 - done)])
                if not count:
                    break
                pending[slot] = on_piece(buffers[slot][:count])
                done += count
                add_bytes(count)  # _progress.py's [reported per phase, never per op]
                turn += 1
    finally:
        for waiter in pending:
            if waiter is not None:
                waiter()
    return done
