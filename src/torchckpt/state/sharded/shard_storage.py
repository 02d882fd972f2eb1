"""torch.distributed.checkpoint's storage layer, ours: each rank's shards as safetensors, the index as JSON.

DCP plans a sharded save (which rank writes which chunk of which tensor, replicated tensors once) and a
resharding load (which saved chunks overlap each rank's new chunks, found by a sweep over sorted chunk
bounds in ``planner_helpers.create_read_items_for_chunk_list``, not by comparing every pair). Its own
``FileSystemWriter`` stores the index (``.metadata``) as a pickle and non-tensor values with
``torch.save``; this layer stores neither.

Rules kept here (named in ``docs/design.md``):

1. **[shards are safetensors]** Rank ``r`` of ``W`` writes its chunks into one file,
   ``shards-0000r-of-0000W.safetensors``, each under the key ``FQN@OFFSETS`` (the chunk's offsets in the
   whole tensor): any safetensors reader opens it.
2. **[the index is JSON]** The coordinator writes ``shards.json``: every tensor's global shape and dtype,
   its chunks, and where each chunk's bytes are (file, byte offset, length, block hashes). Reading it
   never unpickles; DCP's ``Metadata`` is rebuilt from it field by field, each field checked.
3. **[no bytes items]** Only tensors reach DCP: everything else in a state dict is JSON (save.py splits
   it off first). A write plan holding a non-tensor item is refused (DCP would ``torch.save`` it).
4. **[every byte read is verified]** Each chunk's bytes are hashed in blocks of :data:`BLOCK_BYTES`
   measured from the chunk's start. A rank reads only the blocks that cover the part of a chunk it
   needs (a resharding load needs parts) and checks each block's hash before using a byte.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import (
    LoadPlan,
    LoadPlanner,
    ReadItem,
    SavePlan,
    SavePlanner,
    WriteItemType,
)
from torch.distributed.checkpoint.storage import StorageReader, StorageWriter, WriteResult
from torch.futures import Future

from torchckpt.state.errors import CheckpointCorruptError, UnsupportedStateError
from torchckpt.state.format.codec import SAFETENSORS_DTYPES
from torchckpt.state.format.hashing import HASH_ALGORITHMS, hash_bytes
from torchckpt.state.format.manifest import FileEntry
from torchckpt.state.format.tensor_chunks import safetensors_chunks
from torchckpt.state.sharded.part_reads import IntoReader, load_parts, read_part_into, readable_into
from torchckpt.state.storage.base import StepWriter
from torchckpt.state.storage.hashed_write import hash_thread, write_hashed

INDEX_NAME = "shards.json"
INDEX_FORMAT = "torchckpt.shards"
INDEX_VERSION = 1
BLOCK_BYTES = 1 << 20  # the unit a rank reads and verifies (a multiple of every element size)
_DTYPES_BY_NAME = {name: dtype for dtype, name in SAFETENSORS_DTYPES.items()}


def shard_file_name(rank: int, world_size: int) -> str:
    """File of rank ``rank``'s chunks ([shards are safetensors]).

    Example:
        >>> shard_file_name(1, 4)
        'shards-00001-of-00004.safetensors'
    """
    return f"shards-{rank:05d}-of-{world_size:05d}.safetensors"


def chunk_key(fqn: str, offsets: Sequence[int]) -> str:
    """safetensors key of one chunk: the tensor's name and the chunk's offsets in it.

    Example:
        >>> chunk_key("layer.weight", [64, 0]), chunk_key("step", [])
        ('layer.weight@64,0', 'step@')
    """
    return f"{fqn}@{','.join(str(offset) for offset in offsets)}"


@dataclass(frozen=True, kw_only=True)
class ChunkLocation:
    """Where the bytes of one saved chunk are ([the index is JSON]).

    Example:
        >>> ChunkLocation(file="s.safetensors", offset=64, length=8, blocks=("ab",)).length
        8
    """

    file: str
    offset: int
    length: int
    blocks: tuple[str, ...]


class ShardWriter(StorageWriter):
    """DCP StorageWriter: this rank's chunks into one safetensors file of a step being written.

    ``writer`` writes into the step's temp directory (shared by every rank); ``on_written`` is called
    with this rank's file entries once its file is fsynced. The coordinator's ``finish`` writes the index.

    Example:
        >>> import tempfile
        >>> import torch.distributed.checkpoint as dcp
        >>> from torchckpt.state.storage.backends import open_storage
        >>> tmp = tempfile.TemporaryDirectory(); step = open_storage(tmp.name).begin_step(1)
        >>> written = {}
        >>> shard_writer = ShardWriter(step, rank=0, world_size=1, algorithm="crc32", on_written=written.update)
        >>> _ = dcp.save({"w": torch.ones(3)}, storage_writer=shard_writer)
        >>> sorted(written)
        ['shards-00000-of-00001.safetensors', 'shards.json']
        >>> step.abort(); tmp.cleanup()
    """

    def __init__(self, writer: StepWriter, *, rank: int, world_size: int, algorithm: str,
                 on_written: Callable[[Mapping[str, FileEntry]], None]) -> None:
        super().__init__()
        self._writer = writer
        self._rank = rank
        self._world_size = world_size
        self._algorithm = algorithm
        self._on_written = on_written
        self.is_coordinator = False

    def reset(self, checkpoint_id: str | os.PathLike[str] | None = None) -> None:
        """Nothing to reset: one ShardWriter writes one step."""

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike[str]) -> bool:
        """Any id: the step's place is given at construction."""
        return True

    def set_up_storage_writer(self, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        """Remember whether this rank writes the index."""
        self.is_coordinator = is_coordinator

    def prepare_local_plan(self, plan: SavePlan) -> SavePlan:
        """Refuse non-tensor items ([no bytes items]); the plan is otherwise DCP's."""
        for item in plan.items:
            if item.type == WriteItemType.BYTE_IO:
                raise UnsupportedStateError(
                    f"state dict key {item.index.fqn!r} is not a tensor; DCP would store it with torch.save "
                    "(a pickle). torchckpt hands DCP tensors only and stores the rest as JSON.")
        return plan

    def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        """DCP's global plan, unchanged (each rank names its own file)."""
        return plans

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        """Write this rank's chunks into its safetensors file, hashed while written; block hashes per chunk."""
        tensors: dict[str, torch.Tensor] = {}
        items = {}
        for item in plan.items:
            chunk = item.tensor_data.chunk  # type: ignore[union-attr]  # [no bytes items]
            key = chunk_key(item.index.fqn, chunk.offsets)
            tensors[key] = planner.resolve_data(item).detach().cpu().contiguous()  # type: ignore[union-attr]
            items[key] = item
        name = shard_file_name(self._rank, self._world_size)
        chunks = safetensors_chunks(tensors)
        header = json.loads(bytes(chunks[0][8:]))
        base = len(chunks[0])
        with hash_thread() as pool:
            blocks = {key: pool.submit(block_hashes, tensors[key], self._algorithm) for key in tensors}
            entry = write_hashed(self._writer, name, chunks, self._algorithm, pool)
            results = []
            for key, item in items.items():
                start, end = header[key]["data_offsets"]
                location = {"file": name, "offset": base + start, "length": end - start,
                            "blocks": blocks[key].result()}
                results.append(WriteResult(index=item.index, size_in_bytes=end - start, storage_data=location))
        self._on_written({name: entry})
        future: Future[list[WriteResult]] = Future()
        future.set_result(results)
        return future

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        """Coordinator only: write ``shards.json`` ([the index is JSON])."""
        locations = {result.index: result.storage_data for rank_results in results for result in rank_results}
        data = encode_index(metadata, locations, self._algorithm)
        entry = write_hashed_bytes(self._writer, INDEX_NAME, data, self._algorithm)
        self._on_written({INDEX_NAME: entry})

    def storage_meta(self) -> None:
        """No storage metadata (DCP's ``StorageMeta`` is not stored)."""
        return None


def write_hashed_bytes(writer: StepWriter, name: str, data: bytes, algorithm: str) -> FileEntry:
    """Write one small file whole and return its manifest entry.

    Example:
        >>> import tempfile
        >>> from torchckpt.state.storage.backends import open_storage
        >>> tmp = tempfile.TemporaryDirectory(); step = open_storage(tmp.name).begin_step(1)
        >>> write_hashed_bytes(step, "a.json", b"{}", "crc32").size_bytes
        2
        >>> step.abort(); tmp.cleanup()
    """
    size = writer.write(name, [data], len(data))
    return FileEntry(size_bytes=size, hash=hash_bytes(data, algorithm))


def block_hashes(tensor: torch.Tensor, algorithm: str) -> list[str]:
    """Hashes of a contiguous CPU tensor's bytes in blocks of :data:`BLOCK_BYTES` ([every byte read is verified]).

    Example:
        >>> len(block_hashes(torch.zeros(BLOCK_BYTES // 4 + 1), "crc32"))
        2
    """
    view = tensor.reshape(-1).view(torch.uint8).numpy().data if tensor.numel() else memoryview(b"")
    starts = range(0, max(len(view), 1), BLOCK_BYTES)
    return [hash_bytes(view[start:start + BLOCK_BYTES], algorithm) for start in starts]


def encode_index(metadata: Metadata, locations: Mapping[MetadataIndex, Any], algorithm: str) -> bytes:
    """``shards.json`` bytes: DCP's metadata and every chunk's location ([the index is JSON]).

    Example:
        >>> md = Metadata(state_dict_metadata={"w": TensorStorageMetadata(
        ...     TensorProperties(dtype=torch.float32), torch.Size([2]),
        ...     [ChunkStorageMetadata(torch.Size([0]), torch.Size([2]))])})
        >>> where = {MetadataIndex("w", torch.Size([0]), 0): {"file": "s", "offset": 8, "length": 8, "blocks": ["x"]}}
        >>> sorted(decode_index(encode_index(md, where, "crc32"), "shards.json")[1])
        ['w@0']
    """
    tensors: dict[str, dict[str, Any]] = {}
    for fqn, md in metadata.state_dict_metadata.items():
        if not isinstance(md, TensorStorageMetadata):
            raise UnsupportedStateError(f"state dict key {fqn!r} is not a tensor ([no bytes items])")
        tensors[fqn] = {
            "dtype": SAFETENSORS_DTYPES[md.properties.dtype],
            "requires_grad": bool(md.properties.requires_grad),
            "size": list(md.size),
            "chunks": [],
        }
    for index, where in locations.items():
        chunk = {"offsets": list(index.offset or ()), **where}
        tensors[index.fqn]["chunks"].append(chunk)
        if where["length"] and not where["blocks"]:
            raise AssertionError("a chunk with bytes has block hashes")
    for fqn, md in metadata.state_dict_metadata.items():
        sizes = {tuple(chunk.offsets): list(chunk.sizes) for chunk in md.chunks}  # type: ignore[union-attr]
        for chunk in tensors[fqn]["chunks"]:
            chunk["sizes"] = sizes[tuple(chunk["offsets"])]
        tensors[fqn]["chunks"].sort(key=lambda chunk: chunk["offsets"])
    body = {"format": INDEX_FORMAT, "format_version": INDEX_VERSION, "dcp_version": metadata.version,
            "hash_algorithm": algorithm, "block_bytes": BLOCK_BYTES, "tensors": tensors}
    return json.dumps(body, indent=None, separators=(",", ":"), sort_keys=True).encode("utf-8")


def decode_index(data: bytes, source: str) -> tuple[Metadata, dict[str, ChunkLocation]]:
    """DCP ``Metadata`` and chunk locations (by :func:`chunk_key`) from ``shards.json`` bytes, every field
    checked; a malformed index is a :class:`CheckpointCorruptError` naming ``source``.

    Example:
        >>> decode_index(b"[]", "shards.json")  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        torchckpt.state.errors.CheckpointCorruptError: shards.json: malformed index (...)
    """
    try:
        body = json.loads(data)
        if body["format"] != INDEX_FORMAT or body["format_version"] != INDEX_VERSION:
            raise ValueError(f"format {body['format']!r} version {body['format_version']!r}")
        if body["block_bytes"] != BLOCK_BYTES:
            raise ValueError(f"block_bytes {body['block_bytes']!r}; expected {BLOCK_BYTES}")
        if body["hash_algorithm"] not in HASH_ALGORITHMS:
            raise ValueError(f"hash_algorithm {body['hash_algorithm']!r} is not one of {sorted(HASH_ALGORITHMS)}")
        state_dict_metadata: dict[str, Any] = {}
        locations: dict[str, ChunkLocation] = {}
        for fqn, info in body["tensors"].items():
            size = _ints(info["size"], "size")
            chunks = []
            for chunk in info["chunks"]:
                offsets, sizes = _ints(chunk["offsets"], "offsets"), _ints(chunk["sizes"], "sizes")
                if len(offsets) != len(size) or len(sizes) != len(size) or any(
                        o + s > n for o, s, n in zip(offsets, sizes, size)):
                    raise ValueError(f"chunk {offsets}+{sizes} outside {fqn!r} of size {size}")
                dtype = _DTYPES_BY_NAME[info["dtype"]]
                length = math.prod(sizes) * dtype.itemsize
                blocks = tuple(chunk["blocks"])
                well_formed = (chunk["length"] == length and all(type(b) is str for b in blocks)
                               and len(blocks) == max(1, -(-length // BLOCK_BYTES))
                               and type(chunk["file"]) is str and _is_count(chunk["offset"]))
                if not well_formed:
                    raise ValueError(f"chunk {offsets} of {fqn!r} has a bad location")
                locations[chunk_key(fqn, offsets)] = ChunkLocation(
                    file=chunk["file"], offset=chunk["offset"], length=length, blocks=blocks)
                chunks.append(ChunkStorageMetadata(offsets=torch.Size(offsets), sizes=torch.Size(sizes)))
            if sum(math.prod(chunk.sizes) for chunk in chunks) != math.prod(size) or _overlap(chunks):
                raise ValueError(f"the chunks of {fqn!r} do not cover its {list(size)} elements exactly once")
            properties = TensorProperties(dtype=_DTYPES_BY_NAME[info["dtype"]],
                                          requires_grad=info["requires_grad"] is True)
            state_dict_metadata[fqn] = TensorStorageMetadata(properties=properties, size=torch.Size(size),
                                                             chunks=chunks)
        metadata = Metadata(state_dict_metadata=state_dict_metadata, version=body.get("dcp_version"))
        return metadata, locations
    except (KeyError, TypeError, ValueError, AttributeError, OverflowError, RecursionError) as error:
        problem = f"malformed index ({type(error).__name__}: {str(error)[:300]})"
        raise CheckpointCorruptError(f"{source}: {problem}", {source: problem}) from None


def _overlap(chunks: list[ChunkStorageMetadata]) -> bool:
    """Whether two chunks share an element: a sweep along the first dimension, each chunk compared only with
    the chunks still open where it starts (DCP's writers shard along one dimension: linear in practice)."""
    if not chunks or not chunks[0].offsets:
        return len(chunks) > 1  # a 0-d tensor has one chunk
    ordered = sorted(chunks, key=lambda chunk: chunk.offsets[0])
    open_chunks: list[ChunkStorageMetadata] = []
    for chunk in ordered:
        start = chunk.offsets[0]
        open_chunks = [other for other in open_chunks if other.offsets[0] + other.sizes[0] > start]
        for other in open_chunks:
            if all(o1 < o2 + s2 and o2 < o1 + s1 for o1, s1, o2, s2 in
                   zip(chunk.offsets, chunk.sizes, other.offsets, other.sizes)):
                return True
        if chunk.sizes[0] > 0:
            open_chunks.append(chunk)
    return False


def _is_count(value: object) -> bool:
    return type(value) is int and value >= 0


def _ints(values: object, what: str) -> list[int]:
    if type(values) is not list or not all(_is_count(v) for v in values):
        raise ValueError(f"{what} {values!r} is not a list of non-negative ints")
    return values


RangeReader = Callable[[str, int, int], bytes | bytearray]  # (file name, byte offset, length) -> exactly those bytes


class ShardReader(StorageReader):
    """DCP StorageReader over a committed sharded step: reads only the blocks each chunk part needs.

    ``read_range(file, offset, length)`` returns bytes of one file of the step.

    Example:
        >>> import tempfile
        >>> import torch.distributed.checkpoint as dcp
        >>> from torchckpt.state.storage.backends import open_storage
        >>> tmp = tempfile.TemporaryDirectory(); step = open_storage(tmp.name).begin_step(1)
        >>> _ = dcp.save({"w": torch.arange(3.0)}, storage_writer=ShardWriter(
        ...     step, rank=0, world_size=1, algorithm="crc32", on_written=lambda entries: None))
        >>> step.commit(b"{}")
        >>> def read_range(name, offset, length):
        ...     with open(f"{tmp.name}/step-000000001/{name}", "rb") as f:
        ...         return os.pread(f.fileno(), length, offset)
        >>> index = read_range(INDEX_NAME, 0, 1 << 20)
        >>> target = {"w": torch.zeros(3)}
        >>> dcp.load(target, storage_reader=ShardReader(index, read_range, source="step-000000001"))
        >>> target["w"]
        tensor([0., 1., 2.])
        >>> tmp.cleanup()
    """

    def __init__(self, index: bytes, read_range: RangeReader, *, source: str,
                 read_into: IntoReader | None = None) -> None:
        super().__init__()
        self._source = source
        self.metadata, self.locations = decode_index(index, f"{source}/{INDEX_NAME}")
        self._algorithm = json.loads(index)["hash_algorithm"]  # checked by decode_index
        self._read_range = read_range
        self._read_into = read_into  # part_reads.py's [a part is read into its target], where the storage can
        self.bytes_read = 0

    def reset(self, checkpoint_id: str | os.PathLike[str] | None = None) -> None:
        """Nothing to reset: one ShardReader reads one step."""

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike[str]) -> bool:
        """Any id: the step is given at construction."""
        return True

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        """The index's metadata (decoded once, at construction)."""
        return self.metadata

    def set_up_storage_reader(self, metadata: Metadata, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        """Nothing to set up."""

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        """DCP's plan, unchanged."""
        return plan

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        """DCP's plans, unchanged."""
        return plans

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        """Read, verify and copy each planned part of a saved chunk ([every byte read is verified])."""
        load_parts(plan.items, planner, self._part_into, self._chunk_part)
        future: Future[None] = Future()
        future.set_result(None)
        return future

    def _part_into(self, item: ReadItem, target: torch.Tensor) -> Callable[[], None] | None:
        """part_reads.py's [a part is read into its target]: the check of its blocks, None for the general way."""
        fqn, offsets, location, dtype, lengths, _, first, last = self._part(item)
        if self._read_into is None or not readable_into(target, dtype, math.prod(lengths), first, last):
            return None
        corrupt = lambda problem: self._corrupt(location.file, f"chunk {fqn}@{list(offsets)}: {problem}")  # noqa: E731
        count, check = read_part_into(self._read_into, location.file, location.offset, location.length,
                                      location.blocks, self._algorithm, BLOCK_BYTES,
                                      (first * dtype.itemsize, (last + 1) * dtype.itemsize), target, corrupt)
        self.bytes_read += count
        return check

    def _part(self, item: ReadItem) -> tuple[str, tuple, Any, torch.dtype, list[int], list[int], int, int]:
        """A part's chunk (fqn, offsets, location, dtype), lengths, the chunk's strides, its first and last element."""
        fqn = item.storage_index.fqn
        md = self.metadata.state_dict_metadata[fqn]
        offsets = tuple(item.storage_index.offset or ())
        location = self.locations[chunk_key(fqn, offsets)]
        chunk = next(c for c in md.chunks if tuple(c.offsets) == offsets)  # type: ignore[union-attr]
        dtype = md.properties.dtype  # type: ignore[union-attr]
        sizes, part_at, lengths = list(chunk.sizes), list(item.storage_offsets), list(item.lengths)
        strides = [math.prod(sizes[d + 1:]) for d in range(len(sizes))]
        first = sum(o * s for o, s in zip(part_at, strides))
        last = sum((o + n - 1) * s for o, n, s in zip(part_at, lengths, strides))
        return fqn, offsets, location, dtype, lengths, strides, first, last

    def _chunk_part(self, item: ReadItem) -> torch.Tensor:
        fqn, offsets, location, dtype, lengths, strides, first, last = self._part(item)
        if math.prod(lengths) == 0:
            return torch.empty(lengths, dtype=dtype)
        begin_block = first * dtype.itemsize // BLOCK_BYTES
        end_block = -(-(last + 1) * dtype.itemsize // BLOCK_BYTES)
        begin = begin_block * BLOCK_BYTES
        length = min(end_block * BLOCK_BYTES, location.length) - begin
        data = self._read_range(location.file, location.offset + begin, length)
        if len(data) != length:
            self._corrupt(location.file, f"chunk {fqn}@{list(offsets)}: {len(data)} of {length} bytes could be read")
        for number in range(begin_block, end_block):
            piece = memoryview(data)[(number - begin_block) * BLOCK_BYTES:(number - begin_block + 1) * BLOCK_BYTES]
            if hash_bytes(piece, self._algorithm) != location.blocks[number]:
                self._corrupt(location.file, f"chunk {fqn}@{list(offsets)} block {number}: hash mismatch")
        self.bytes_read += length
        buffer = data if isinstance(data, bytearray) else bytearray(data)  # local reads are one already
        flat = torch.frombuffer(buffer, dtype=torch.uint8).view(dtype)
        return flat.as_strided(lengths, strides, first - begin // dtype.itemsize)

    def _corrupt(self, name: str, problem: str) -> None:
        path = f"{self._source}/{name}"
        raise CheckpointCorruptError(f"{path}: {problem}", {path: problem})
