"""Errors raised by ``torchckpt.state``.

Every message names the path, what was expected, what was found, and the fix
(Note: [errors say what to do]). All derive from :class:`CheckpointError`, so a caller (or
the CLI) can catch one type and print the message without a traceback.
"""

from __future__ import annotations

import errno
import warnings


class CheckpointError(Exception):
    """Base class of every error raised by ``torchckpt.state``."""


class CheckpointCorruptError(CheckpointError):
    """A checkpoint's files do not match its manifest, or cannot be decoded.

    ``problems`` maps each bad path to a one-line description.
    """

    def __init__(self, message: str, problems: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.problems: dict[str, str] = dict(problems or {})


class CheckpointNewerFormatError(CheckpointCorruptError):
    """A step was written by a newer torchckpt, in a format version this one does not read.

    It is not damage: ``ls`` and ``verify`` show the step as not valid (this version cannot check it), and
    restore and every writer refuse instead of falling back to an older step or moving it aside
    (docs/state.md, "Format versions"). Fix: upgrade torchckpt.
    """


class CheckpointLockedError(CheckpointError):
    """Another writer holds the directory's lock."""


class CheckpointWriteError(CheckpointError):
    """A save failed (disk full, permissions, ...); earlier checkpoints are untouched."""


class CheckpointExistsError(CheckpointError):
    """A valid checkpoint for this step is already committed."""


class CheckpointNotFoundError(CheckpointError):
    """The requested step (or any checkpoint) does not exist."""


class CheckpointMismatchError(CheckpointError):
    """The checkpoint does not fit the objects passed to ``restore``."""


class UnsupportedStateError(CheckpointError):
    """A state_dict holds a value that cannot be stored without pickle."""


class UnsafeFileError(CheckpointCorruptError):
    """A file is a pickle (or other executable format) and was refused unread.

    It is a kind of corruption: restore skips such a step like any corrupt one.
    """


class CheckpointFallbackWarning(UserWarning):
    """Restore skipped a corrupt checkpoint and used an older valid one."""


def warn_fallback(message: str) -> None:
    """Report a skipped corrupt checkpoint (a warning, so it is never silent).

    Example:
        >>> import warnings
        >>> with warnings.catch_warnings(record=True) as caught:
        ...     warnings.simplefilter("always")
        ...     warn_fallback("step-2 is corrupt; restored step-1")
        >>> caught[0].category.__name__
        'CheckpointFallbackWarning'
    """
    warnings.warn(message, CheckpointFallbackWarning, stacklevel=3)


_OS_FIXES = {
    errno.ENOSPC: "free space on that disk or point the Checkpointer at a larger one",
    errno.EDQUOT: "free space within your quota or write elsewhere",
    errno.EROFS: ("the filesystem is read-only: write to a writable location (to read checkpoints from read-only "
                  "storage, use torchckpt.state.load(...) or Checkpointer(dir, read_only=True))"),
    errno.EACCES: "permission denied: use a directory you may write to (or fix its owner/permissions)",
    errno.EPERM: "permission denied: use a directory you may write to (or fix its owner/permissions)",
    errno.ENOENT: "a directory on the path does not exist: create it first or fix the path",
    errno.ENOTDIR: "a part of the path is a file, not a directory: fix the path",
    errno.EISDIR: "the path is a directory where a file was expected: fix the path",
}


def fix_for_os_error(error: OSError) -> str:
    """What to do about a failed filesystem call, from its errno (not always "free space").

    Example:
        >>> fix_for_os_error(OSError(errno.ENOTDIR, "Not a directory"))
        'a part of the path is a file, not a directory: fix the path'
    """
    return _OS_FIXES.get(error.errno or 0, "check the path, its permissions and the disk")
