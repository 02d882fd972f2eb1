"""A committed sharded step opened for reading: its manifest, ``state.json``, its shards through DCP.

Restore (restore.py) and export (checkpointer/interchange.py) read a sharded step through here: the small
files whole and checked against the manifest, the shards in blocks verified before use (shard_storage.py).
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.distributed.checkpoint.api import CheckpointException

from torchckpt.state.errors import CheckpointCorruptError, CheckpointError, CheckpointMismatchError
from torchckpt.state.format.codec import decode_json
from torchckpt.state.format.hashing import hash_bytes
from torchckpt.state.format.layout import STATE_NAME, step_dir_name
from torchckpt.state.format.manifest import Manifest
from torchckpt.state.sharded.rank_group import RankGroup, RankLostError, dcp_failures
from torchckpt.state.sharded.shard_storage import INDEX_NAME, ShardReader
from torchckpt.state.storage.base import Storage


@dataclass
class ShardedStep:
    """A committed sharded step opened for reading: its manifest and ``state.json``."""

    storage: Storage
    manifest: Manifest
    state: dict[str, Any]
    sharded_items: dict[str, dict[str, Any]] = field(default_factory=dict)  # name -> kind, model, tree
    local_items: dict[str, dict[str, Any]] = field(default_factory=dict)  # name -> same_on_every_rank, ...

    @property
    def entry(self) -> str:
        return step_dir_name(self.manifest.step)

    def read_file(self, name: str) -> bytes:
        """One small file of the step, whole, checked against the manifest's size and hash (format/manifest.py keeps
        the manifest's names inside the step)."""
        expected = self.manifest.files.get(name)
        path = self.storage.path_of(self.entry, name)
        if expected is None:
            raise CheckpointCorruptError(f"{path}: missing from the manifest", {path: "missing from the manifest"})
        data = self.storage.read_range(self.entry, name, 0, expected.size_bytes + 1)
        data = bytes(data)  # a small file (JSON, the index): one copy is nothing
        if len(data) != expected.size_bytes or hash_bytes(data, self.manifest.hash_algorithm) != expected.hash:
            problem = f"size {len(data)} or hash differs from the manifest's ({expected.size_bytes} bytes)"
            raise CheckpointCorruptError(f"{path}: {problem}", {path: problem})
        return data


def open_sharded(storage: Storage, manifest: Manifest) -> ShardedStep:
    """Read and check ``state.json`` of a committed sharded step: its step and world size match the manifest,
    and each item is described by an object (a sharded item's with its kind and tree).

    Example:
        >>> open_sharded  # doctest: +ELLIPSIS
        <function open_sharded at ...>
    """
    step = ShardedStep(storage, manifest, {})
    path = storage.path_of(step.entry, STATE_NAME)
    state = decode_json(step.read_file(STATE_NAME), path)
    if type(state) is not dict or state.get("world_size") != manifest.world_size or state.get("step") != manifest.step:
        raise CheckpointCorruptError(f"{path}: does not match its manifest", {path: "does not match its manifest"})
    try:
        sharded, local = dict(state["sharded_items"]), dict(state["local_items"])
        if not all(type(meta) is dict and "tree" in meta and "kind" in meta for meta in sharded.values()) or not all(
                type(meta) is dict for meta in local.values()):
            raise ValueError("an item is not described by an object with its kind and tree")
    except (KeyError, TypeError, ValueError) as error:
        raise CheckpointCorruptError(f"{path}: malformed ({error!r})", {path: "malformed"}) from None
    step.state, step.sharded_items, step.local_items = state, sharded, local
    return step


def shard_reader(step: ShardedStep) -> ShardReader:
    """DCP StorageReader over ``step``'s shards: its index read whole and checked against the manifest, only
    files the manifest lists read, in blocks verified before use (shard_storage.py).

    Example:
        >>> import tempfile
        >>> from torchckpt.state.read.step import read_manifest
        >>> from torchckpt.state import Checkpointer
        >>> from torchckpt.state.storage.backends import open_storage
        >>> tmp = tempfile.TemporaryDirectory()
        >>> with Checkpointer(tmp.name, sharded=True, capture_rng=False) as ckpt:
        ...     ckpt.save(1, model=torch.nn.Linear(2, 1))
        >>> storage = open_storage(tmp.name)
        >>> sorted(shard_reader(open_sharded(storage, read_manifest(storage, 1))).metadata.state_dict_metadata)
        ['model.bias', 'model.weight']
        >>> tmp.cleanup()
    """
    index = step.read_file(INDEX_NAME)

    def in_manifest(name: str) -> str:
        if name not in step.manifest.files:
            path = step.storage.path_of(step.entry, name)
            raise CheckpointCorruptError(f"{path}: missing from the manifest", {path: "missing from the manifest"})
        return name

    def read_range(name: str, offset: int, length: int) -> bytes | bytearray:
        return step.storage.read_range(step.entry, in_manifest(name), offset, length)

    def read_into(name: str, offset: int, buffers: Sequence[memoryview]) -> int:
        return step.storage.read_range_into(step.entry, in_manifest(name), offset, buffers)  # type: ignore[attr-defined]

    reader = ShardReader(index, read_range, source=step.storage.path_of(step.entry),
                         read_into=read_into if hasattr(step.storage, "read_range_into") else None)
    for key, where in reader.locations.items():  # every chunk inside a listed file: no size from the index
        listed = step.manifest.files.get(where.file)  # can make a read or an allocation larger than the files
        if listed is None or where.offset + where.length > listed.size_bytes:
            path = step.storage.path_of(step.entry, INDEX_NAME)
            problem = (f"chunk {key} lies outside {where.file} ({where.offset}+{where.length} bytes; the manifest "
                       f"lists {listed.size_bytes if listed else 'no such file'})")
            raise CheckpointCorruptError(f"{path}: {problem}", {path: problem})
    return reader


def dcp_load(step: ShardedStep, ranks: RankGroup | None, targets: dict[str, torch.Tensor], source: str,
             reader: ShardReader | None = None) -> None:
    """Load ``targets`` (index keys such as ``"model.0.weight"`` -> tensors of the saved shape and dtype, or
    DTensors) from ``step`` through DCP: every rank of ``ranks`` together, or this process alone (None).

    ``reader``: a :func:`shard_reader` of ``step`` already open (its metadata built ``targets``). A key the
    step lacks or a shape or dtype that differs is a :class:`CheckpointMismatchError` naming ``source``;
    a byte that fails its hash, a :class:`CheckpointCorruptError`.

    Example:
        >>> import tempfile
        >>> from torchckpt.state.read.step import read_manifest
        >>> from torchckpt.state import Checkpointer
        >>> from torchckpt.state.storage.backends import open_storage
        >>> tmp = tempfile.TemporaryDirectory()
        >>> with Checkpointer(tmp.name, sharded=True, capture_rng=False) as ckpt:
        ...     ckpt.save(1, model=torch.nn.Linear(2, 1, bias=False))
        >>> storage = open_storage(tmp.name)
        >>> step = open_sharded(storage, read_manifest(storage, 1))
        >>> targets = {"model.weight": torch.empty(1, 2)}
        >>> dcp_load(step, None, targets, "state.json")
        >>> targets["model.weight"].shape
        torch.Size([1, 2])
        >>> tmp.cleanup()
    """
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import DefaultLoadPlanner

    reader = shard_reader(step) if reader is None else reader
    missing = sorted(set(targets) - set(reader.metadata.state_dict_metadata))
    if missing:
        raise CheckpointMismatchError(
            f"{source}: the checkpoint lacks {missing[:5]}{' ...' if len(missing) > 5 else ''} (saved keys "
            f"e.g. {sorted(reader.metadata.state_dict_metadata)[:3]}). Fix: build the same model and optimizer "
            "as the run that saved it.")
    for key, target in targets.items():
        saved = reader.metadata.state_dict_metadata[key]
        if tuple(saved.size) != tuple(target.shape) or saved.properties.dtype != target.dtype:  # type: ignore[union-attr]
            raise CheckpointMismatchError(
                f"{source}: {key}: saved {saved.properties.dtype} {list(saved.size)}, live {target.dtype} "  # type: ignore[union-attr]
                f"{list(target.shape)}. Fix: build the same model and optimizer as the run that saved it.")
    planner = DefaultLoadPlanner(flatten_state_dict=False, flatten_sharded_tensors=False)
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*assuming the intent is to load in a single process")
            dcp.load(targets, storage_reader=reader, planner=planner,
                     process_group=ranks.group if ranks is not None else None, no_dist=ranks is None)
    except CheckpointError:
        raise
    except (Exception, CheckpointException) as error:
        failures = dcp_failures(error)
        for failure in failures.values():  # the same on every rank: every rank falls back together
            if isinstance(failure, CheckpointError):
                raise failure from None
        if failures:
            rank_failed, first = min(failures.items())
            raise CheckpointError(f"restoring step {step.manifest.step}: rank {rank_failed} failed: "
                                  f"{type(first).__name__}: {first}") from first
        if ranks is not None and isinstance(error, RuntimeError):
            raise RankLostError(f"restoring step {step.manifest.step}: another rank is gone or stuck ({error})",
                                []) from error
        raise
