"""Errors raised by ``torchckpt.state``.

Every message names the path, what was expected, what was found, and the fix
(Note: [errors say what to do]). All derive from :class:`CheckpointError`, so a caller (or
the CLI) can catch one type and print the message without a traceback.
"""

from __future__ import annotations

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
