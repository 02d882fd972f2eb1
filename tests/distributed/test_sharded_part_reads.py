"""part_reads.py's [a part is read into its target]: a part of a saved chunk lands in the target's own memory
bitwise, reading only the blocks that cover it, and a flipped byte anywhere in those blocks (inside the part, or
in the bytes of its first and last block outside it) fails the hash before the restore uses the target."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch.distributed.checkpoint.metadata import MetadataIndex
from torch.distributed.checkpoint.planner import LoadItemType, ReadItem

from torchckpt import Checkpointer
from torchckpt.state import CheckpointCorruptError
from torchckpt.state.read.step import read_manifest
from torchckpt.state.sharded.shard_storage import BLOCK_BYTES, ShardReader
from torchckpt.state.sharded.step import open_sharded, shard_reader
from torchckpt.state.storage.backends import open_storage

WHOLE = torch.Size([0, 0])


def _item(first_row: int, rows: int) -> ReadItem:
    return ReadItem(type=LoadItemType.TENSOR, dest_index=MetadataIndex("model.weight", WHOLE), dest_offsets=WHOLE,
                    storage_index=MetadataIndex("model.weight", WHOLE), storage_offsets=torch.Size([first_row, 0]),
                    lengths=torch.Size([rows, 1024]))


def _reader(directory: Path) -> ShardReader:
    storage = open_storage(directory)
    return shard_reader(open_sharded(storage, read_manifest(storage, 1)))


@pytest.fixture
def saved(tmp_path: Path) -> tuple[Path, torch.Tensor]:
    model = torch.nn.Linear(1024, 1024)  # a 4 MiB weight: four blocks
    with Checkpointer(tmp_path, sharded=True) as ckpt:
        ckpt.save(1, model=model)
    return tmp_path, model.weight.detach().clone()


@pytest.mark.parametrize(("first_row", "rows", "blocks"), [(0, 1024, 4), (512, 256, 1), (300, 10, 1), (250, 20, 2)])
def test_a_part_is_read_into_its_target_bitwise_reading_only_its_blocks(
        saved: tuple[Path, torch.Tensor], first_row: int, rows: int, blocks: int) -> None:
    directory, weight = saved
    reader = _reader(directory)
    target = torch.full((rows, 1024), float("nan"))
    check = reader._part_into(_item(first_row, rows), target)
    assert check is not None  # the straight path was taken
    check()
    assert torch.equal(target, weight[first_row:first_row + rows])
    assert reader.bytes_read == blocks * BLOCK_BYTES


def test_parts_it_cannot_read_straight_go_the_general_way(saved: tuple[Path, torch.Tensor]) -> None:
    reader = _reader(saved[0])
    assert reader._part_into(_item(0, 4), torch.empty(4, 1024, dtype=torch.float64)) is None  # another dtype
    assert reader._part_into(_item(0, 4), torch.empty(1024, 4).t()) is None  # not contiguous
    assert reader.bytes_read == 0


@pytest.mark.parametrize("flipped_row", [299, 305, 312])  # before the part, in it, after it: all in block 1
def test_a_flipped_byte_in_a_block_of_the_part_fails_its_hash(saved: tuple[Path, torch.Tensor],
                                                              flipped_row: int) -> None:
    directory, _ = saved
    reader = _reader(directory)
    location = next(where for key, where in reader.locations.items() if key.startswith("model.weight"))
    shard = next((directory / "step-000000001").glob("shards-*.safetensors"))
    data = bytearray(shard.read_bytes())
    data[location.offset + flipped_row * 1024 * 4 + 7] ^= 0x10
    shard.write_bytes(bytes(data))
    with pytest.raises(CheckpointCorruptError, match=r"chunk model.weight@\[0, 0\]: block 1: hash mismatch"):
        reader._part_into(_item(300, 10), torch.empty(10, 1024))()  # type: ignore[misc]
