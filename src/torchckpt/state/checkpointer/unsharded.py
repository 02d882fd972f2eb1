"""The unsharded save of one step: this process's items snapshotted into files, written hashed, committed.

A Checkpointer without a process group saves through here (with one, through sharded/save.py). How the
step is committed is the storage back end's (storage/local.py's [local commit is a rename],
storage/remote.py's [manifest is the commit mark]).
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import Any

from torchckpt.state.checkpointer.branches import abandon_newer_steps
from torchckpt.state.checkpointer.retention import RetentionPolicy, apply_retention
from torchckpt.state.checkpointer.room import make_room
from torchckpt.state.format.manifest import TAGGED_FORMAT_VERSION, Manifest, encode_manifest
from torchckpt.state.format.snapshot import FileChunks, encode_snapshot
from torchckpt.state.format.tensor_kinds import needs_format_3
from torchckpt.state.live.capture import capture_item
from torchckpt.state.live.staging import HostStaging, changed_only_by_optimizer_steps
from torchckpt.state.storage.base import Storage
from torchckpt.state.storage.hashed_write import write_files_hashed


def snapshot_unsharded(step: int, items: Mapping[str, Any], metrics: Mapping[str, float], rng: dict[str, Any] | None,
                       staging: HostStaging | None, async_staging: bool) -> dict[str, FileChunks]:
    """The files of ``step``: each item captured and encoded; with ``staging`` its tensors are copied there first
    (checkpointer.py's [async saves copy before returning]), all but those ``async_staging`` leaves to the
    background thread (live/staging.py's [optimizer steps wait for staging]).

    Example:
        >>> sorted(snapshot_unsharded(1, {"extras": {"epoch": 2}}, {}, None, None, False))
        ['state.json']
    """
    captured = {name: capture_item(name, obj) for name, obj in items.items()}
    defer = changed_only_by_optimizer_steps(items) if async_staging else None
    return encode_snapshot(step=step, items=captured, rng=rng, metrics=metrics, staging=staging, defer=defer)


def write_unsharded(storage: Storage, step: int, files: Mapping[str, FileChunks], metrics: Mapping[str, float],
                    algorithm: str, retention: RetentionPolicy, remove_old_when_full: bool = False) -> None:
    """Write ``files`` as ``step``, each hashed on the way; set newer steps aside (branches.py's [set aside
    before the commit]), commit, then apply ``retention`` (checkpointer.py's [retention runs after a commit]).
    A step that cannot fit on the disk is refused before it is written (room.py; ``remove_old_when_full``:
    room.py's [making room removes only what retention would]).

    Example:
        >>> import tempfile
        >>> from torchckpt.state.storage.backends import open_storage
        >>> tmp = tempfile.TemporaryDirectory(); storage = open_storage(tmp.name)
        >>> write_unsharded(storage, 3, {"state.json": [b"{}"]}, {}, "crc32", RetentionPolicy())
        >>> storage.step_entries()
        {3: 'step-000000003'}
        >>> tmp.cleanup()
    """
    make_room(storage, step, files, retention, remove_old_when_full)
    writer = storage.begin_step(step)
    try:
        entries = write_files_hashed(writer, files, algorithm, what=f"saving step {step} to {storage.location}")
        manifest = Manifest(step=step, created_unix_s=time.time(), hash_algorithm=algorithm, files=entries,
                            metrics=metrics, format_version=TAGGED_FORMAT_VERSION if needs_format_3(files) else None)
        abandon_newer_steps(storage, step)  # branches.py's [set aside before the commit]
        writer.commit(encode_manifest(manifest))
    except BaseException:
        writer.abort()
        raise
    apply_retention(storage, retention)
