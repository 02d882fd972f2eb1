"""The writer lock of a local checkpoint directory: how ``.lock`` is opened, what it says, who keeps it.

Rules kept here (named in ``docs/design.md``):

1. **[the lock file is ours alone]** ``.lock`` is opened with ``O_NOFOLLOW`` (never ``O_TRUNC``) and
   must be a regular file with one name: a symlink (or a FIFO, a device, a directory) and a hard link
   (``st_nlink > 1``, which ``O_NOFOLLOW`` cannot see) are refused with an error naming the path and
   the fix, before anything is locked, changed or written, so the Checkpointer never truncates or
   chmods a file that something else points it at. It is created ``0600`` and names its holder by
   pid, host, start time and program name only (never the command line: arguments carry secrets).
2. **[a forked child drops the lock]** The lock is an ``flock`` on an open file description, and a
   forked child (a DataLoader worker, a ``multiprocessing`` process) shares it: the lock would outlive
   a killed parent. Every held lock is closed in a forked child right after ``fork``
   (``os.register_at_fork``); closing never unlocks (``LOCK_UN`` would release the parent's lock too),
   it only drops the child's reference. ``O_CLOEXEC`` does the same for ``exec``.
"""

from __future__ import annotations

import errno
import json
import os
import socket
import stat
import sys
import time
import weakref
from typing import Any

from torchckpt.state.errors import CheckpointError, CheckpointLockedError, fix_for_os_error


def holder_record() -> dict[str, Any]:
    """What a lock file says about its holder: pid, host, start time and program name (no arguments).

    Example:
        >>> sorted(holder_record())
        ['host', 'pid', 'program', 'since_unix_s']
    """
    return {
        "pid": os.getpid(),
        "host": socket.gethostname(),
        "since_unix_s": time.time(),
        "program": os.path.basename(sys.argv[0]) if sys.argv and sys.argv[0] else "python",
    }


def describe_holder(raw: bytes) -> str:
    """The holder named by a lock file's bytes (see ``holder_record``), for a "locked by ..." message.

    Example:
        >>> describe_holder(b"not json")
        'an unknown process (the lock file is unreadable)'
    """
    try:
        holder = json.loads(raw.decode("utf-8"))
        since = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(holder["since_unix_s"]))
        program = holder.get("program", holder.get("command", "?"))
        text = f"pid {holder['pid']} on host {holder['host']} since {since} ({program!r})"
    except (ValueError, KeyError, TypeError, AttributeError):
        return "an unknown process (the lock file is unreadable)"
    if holder["pid"] == os.getpid() and holder["host"] == socket.gethostname():
        text += (
            ", which is this process: another Checkpointer on this directory is still open here. "
            "Fix: call close() on it (or build it in a `with` block), or drop every reference to it"
        )
    return text


def locked_error(location: str, raw: bytes) -> CheckpointLockedError:
    """The error a second writer gets: who holds the lock, why that matters, and the fix.

    Example:
        >>> print(locked_error("runs/x", b"?"))  # doctest: +ELLIPSIS
        runs/x is locked by an unknown process (the lock file is unreadable): another Checkpointer ...
    """
    return CheckpointLockedError(
        f"{location} is locked by {describe_holder(raw)}: another Checkpointer is writing there. "
        "Two writers in one directory would delete each other's checkpoints. Fix: stop "
        "that run or use another directory (reading with `torchckpt ls/verify` needs no lock)."
    )


class HeldLock:
    """An ``flock`` held on a directory's ``.lock``; :meth:`release` closes it (idempotent).

    Forked children close their copy at once ([a forked child drops the lock]), and a lock that is
    garbage-collected unreleased is closed too.
    """

    def __init__(self, fd: int, path: str) -> None:
        self.fd: int | None = fd
        self.path = path
        _HELD.add(self)

    def release(self) -> None:
        """Close the descriptor, which releases the flock (idempotent)."""
        fd, self.fd = self.fd, None
        _HELD.discard(self)
        if fd is not None:
            os.close(fd)

    def __del__(self) -> None:
        self.release()


_HELD: weakref.WeakSet[HeldLock] = weakref.WeakSet()


def _drop_locks_in_child() -> None:
    for held in list(_HELD):
        held.release()  # close only: the parent's lock stays ([a forked child drops the lock])


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_drop_locks_in_child)


def acquire(location: str, name: str) -> HeldLock:
    """Open (create ``0600``) and ``flock`` ``location/name``; refuse anything but a regular file.

    Example:
        >>> import tempfile
        >>> tmp = tempfile.TemporaryDirectory()
        >>> held = acquire(tmp.name, ".lock"); oct(os.stat(held.path).st_mode & 0o777)
        '0o600'
        >>> held.release(); tmp.cleanup()
    """
    import fcntl

    path = os.path.join(location, name)
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW | os.O_NONBLOCK, 0o600)
    except OSError as error:
        raise _open_error(path, error) from None
    try:
        status = os.fstat(fd)
        if not stat.S_ISREG(status.st_mode):
            raise CheckpointLockedError(
                f"{path} is not a regular file; the Checkpointer only locks a regular file. "
                "Fix: remove it; the next Checkpointer creates a fresh one."
            )
        if status.st_nlink > 1:  # [the lock file is ours alone]: a hard link shares its content with another name
            raise CheckpointLockedError(
                f"{path} has {status.st_nlink} hard links: another name shares its content, which the "
                "Checkpointer would overwrite. Fix: remove it (`rm` removes this name only; the other names "
                "keep their content); the next Checkpointer creates a fresh one."
            )
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise locked_error(location, os.pread(fd, 4096, 0)) from None
        try:
            os.fchmod(fd, 0o600)  # a lock file made by an older version was 0644
        except PermissionError:
            pass  # someone else's file that we may write: leave its mode alone
        os.ftruncate(fd, 0)
        os.pwrite(fd, json.dumps(holder_record()).encode("utf-8"), 0)
    except BaseException:
        os.close(fd)
        raise
    return HeldLock(fd, path)


def _open_error(path: str, error: OSError) -> CheckpointError:
    """Why ``.lock`` could not be opened: a link or a special file (refused), or the filesystem's own cause."""
    if os.path.islink(path) or error.errno in (errno.ELOOP, errno.EISDIR, errno.ENXIO):
        kind = "a symlink" if os.path.islink(path) else "a directory" if os.path.isdir(path) else "not a regular file"
        return CheckpointLockedError(
            f"{path} is {kind} ({error.strerror}); the Checkpointer only locks a regular file it owns, "
            "so that it never truncates what a link points to. Fix: remove it (`rm` removes a link, not "
            "its target; `rmdir` an empty directory); the next Checkpointer creates a fresh one."
        )
    return CheckpointError(
        f"{path}: cannot create the writer's lock file ({error}); a Checkpointer that saves needs to write "
        f"in its directory. Fix: {fix_for_os_error(error)}."
    )
