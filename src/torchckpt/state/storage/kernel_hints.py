"""Advice to the kernel that makes a big save cheaper: start each piece's writeback as soon as it is written.

Rules kept here (named in ``docs/design.md``):

1. **[hints never change what is written or read]** Each function here is advice: on a system without the
   call (not Linux, no libc), or when the call fails, it does nothing and says so in its return value.
   The bytes written and read, and when a file is durable (its ``fsync``, storage/local.py's [local commit
   is a rename]), are the same with or without it.
2. **[writeback starts as pieces are written]** A local save asks the kernel to start writing each piece
   to the disk (``sync_file_range(SYNC_FILE_RANGE_WRITE)``) right after handing it over, so the disk
   works while the next pieces are copied into the page cache, and the file's ``fsync`` waits only for
   the last ones. Without it the kernel starts only when the dirty pages pass its background threshold
   (gigabytes on a machine with much memory), so a save cost the copy into the page cache plus the whole
   flush, one after the other (docs/state.md, "Against torch.save / torch.load").

Tried for restores and not kept (docs/state.md says what was measured): ``madvise(MADV_HUGEPAGE)`` on
the fresh tensors a restore reads into made reads from the page cache much faster but reads from the
disk slower on the benchmark's VM in paired probes, and a resumed run reads from the disk.
"""

from __future__ import annotations

import ctypes
import sys

_SYNC_FILE_RANGE_WRITE = 2  # linux/fs.h


def _libc() -> ctypes.CDLL | None:
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(None, use_errno=True)  # the process's own symbols: libc's, on Linux
        libc.sync_file_range.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint]
    except (OSError, AttributeError):
        return None
    return libc


_LIBC = _libc()


def start_writeback(fd: int, offset: int, length: int) -> bool:
    """Ask the kernel to start writing ``length`` bytes of ``fd`` from ``offset`` to the disk, without waiting
    ([writeback starts as pieces are written]); True if it was asked, False where it cannot be.

    Durability still comes from the file's ``fsync`` ([hints never change what is written or read]).

    Example:
        >>> import os, tempfile
        >>> with tempfile.TemporaryFile() as handle:
        ...     n = os.write(handle.fileno(), b"abc")
        ...     start_writeback(handle.fileno(), 0, n) == sys.platform.startswith("linux")
        True
    """
    if _LIBC is None or length <= 0:
        return False
    return _LIBC.sync_file_range(fd, offset, length, _SYNC_FILE_RANGE_WRITE) == 0
