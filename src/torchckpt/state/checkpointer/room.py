"""Room on disk for a step: a local save checks the free space before it writes a byte.

Rules kept here (named in ``docs/design.md``):

1. **[a step that cannot fit is refused before it is written]** Before a local save writes step N,
   the bytes of its files (each rounded up to the filesystem's block, plus room for the manifest)
   are compared with the free space (``shutil.disk_usage``). If they do not fit, the save raises
   :class:`CheckpointWriteError` naming both numbers and the options that work, and nothing is
   written or removed: the new step is written before the old one is removed, so a state larger
   than half the free space fits once and never again; that is said before the write, not by a
   failure in the middle of it. The check is a forecast: another process may fill the disk
   meanwhile, and then the write fails as before (``ENOSPC``, the partial save discarded).
2. **[making room removes only what retention would]** With ``remove_old_steps_when_full=True``, a
   step that does not fit first removes the steps retention would remove once N commits, oldest
   first, as few as make room, and only if they do: never a step the policy keeps. The risk
   window: from that removal until N commits, a crash leaves only the steps the policy keeps (with
   ``keep_last=1``, no step at all: the run would start from scratch).
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Mapping

from torchckpt.state.checkpointer.retention import RetentionPolicy, steps_to_keep
from torchckpt.state.errors import CheckpointWriteError
from torchckpt.state.format.layout import step_dir_name
from torchckpt.state.format.snapshot import FileChunks
from torchckpt.state.read.catalog import inspect_step
from torchckpt.state.storage.base import Storage
from torchckpt.state.storage.local import LocalStorage

_MANIFEST_ROOM_BYTES = 4096  # the manifest's fixed part; plus 256 bytes per file and a block for the directory


def _round_up(size: int, block: int) -> int:
    return -(-size // block) * block


def _existing_parent(path: str) -> str:
    path = os.path.abspath(path)
    while not os.path.isdir(path) and os.path.dirname(path) != path:
        path = os.path.dirname(path)
    return path


def _bytes_on_disk(root: str) -> int:
    total = 0
    for folder, _, names in os.walk(root):
        for name in names:
            try:
                total += os.lstat(os.path.join(folder, name)).st_blocks * 512
            except OSError:
                continue
    return total


def step_bytes_needed(files: Mapping[str, FileChunks], block: int = 4096) -> int:
    """Bytes of disk a step of ``files`` takes: each file rounded up to ``block``, plus the manifest's room.

    Example:
        >>> step_bytes_needed({"state.json": [b"{}"], "model.safetensors": [b"x" * 5000]})
        24576
    """
    manifest = _round_up(_MANIFEST_ROOM_BYTES + 256 * len(files), block) + block
    sizes = (sum(memoryview(chunk).nbytes for chunk in chunks) for chunks in files.values())
    return manifest + sum(_round_up(size, block) for size in sizes)


def make_room(storage: Storage, step: int, files: Mapping[str, FileChunks], policy: RetentionPolicy,
              remove_old: bool) -> None:
    """Raise :class:`CheckpointWriteError` unless ``files`` fit on the disk as step ``step`` ([a step that cannot
    fit is refused before it is written]); with ``remove_old`` remove what retention would first ([making room
    removes only what retention would]). Remote storage is not checked.

    Example:
        >>> import tempfile
        >>> from torchckpt.state.storage.backends import open_storage
        >>> tmp = tempfile.TemporaryDirectory()
        >>> make_room(open_storage(tmp.name), 1, {"state.json": [b"{}"]}, RetentionPolicy(), False)
        >>> tmp.cleanup()
    """
    if not isinstance(storage, LocalStorage):
        return
    where = _existing_parent(storage.location)
    stats = os.statvfs(where)
    needed = step_bytes_needed(files, max(stats.f_frsize, 512))
    free = shutil.disk_usage(where).free
    if needed <= free:
        return
    infos = [inspect_step(storage, old, "fast") for old in sorted(storage.step_entries()) if old < step]
    valid = {info.step: info.metrics for info in infos if info.valid}
    with_new = {**valid, step: {}}
    doomed = sorted(set(valid) - steps_to_keep(with_new, policy))
    freed = {old: _bytes_on_disk(storage.path_of(step_dir_name(old))) for old in doomed}
    if remove_old and free + sum(freed.values()) >= needed:
        for old in doomed:
            storage.remove_step(old)
            free += freed[old]
            if free >= needed:
                return
    _refuse(storage, step, needed, free, freed, remove_old)


def _size(count: int) -> str:
    return f"{count / (1 << 20):.1f} MiB" if count >= 1 << 20 else f"{count} bytes"


def _refuse(storage: Storage, step: int, needed: int, free: int, freed: Mapping[int, int], remove_old: bool) -> None:
    if remove_old:
        tried = (f"remove_old_steps_when_full=True could free only {_size(sum(freed.values()))} (steps "
                 f"{sorted(freed)}, those retention removes once step {step} commits); it removed nothing")
    elif freed:
        tried = (f"Checkpointer(..., remove_old_steps_when_full=True) removes steps {sorted(freed)} (which retention "
                 f"removes anyway once step {step} commits; {_size(sum(freed.values()))}) before writing, "
                 "if that makes room; until the commit a crash leaves only the steps the policy keeps")
    else:
        tried = ("let retention remove older steps (keep_last=1 with remove_old_steps_when_full=True removes the "
                 "previous step first; no step here is one the current policy removes)")
    raise CheckpointWriteError(
        f"no space left on device for step {step} in {storage.location}: it needs {_size(needed)} and "
        f"{_size(free)} are free; nothing was written or removed, earlier checkpoints are untouched. Fix: "
        f"point the Checkpointer at a directory on a disk with room, or free space on this one; or {tried}.")
