"""Sharded checkpoints (state/sharded/) on real gloo ranks: saved by one world size, restored on another,
the parameters and optimizer state are bitwise the full state gathered at save time; on the same world size
training goes on bitwise as if never interrupted; rank-local state follows the rule in docs/state.md."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from torchckpt import Checkpointer

from .sharded_workers import policy_worker, restore_worker, save_worker


@pytest.fixture
def saved_by_two(spawn_ranks, tmp_path: Path) -> tuple[str, list[dict]]:
    directory = str(tmp_path / "saved-by-2" / "ckpt")
    Path(directory).parent.mkdir()
    saved = spawn_ranks(save_worker, 2, "fsdp2", directory, {"per_rank_extras": False})
    return directory, saved


def _check_bitwise(result: dict) -> None:
    assert result["step"] == 3
    assert result["keys_equal"] and result["compared"] == 24  # 6 parameters, each with exp_avg, exp_avg_sq, step
    assert result["unequal"] == []


@pytest.mark.parametrize(("world", "mode"), [(2, "fsdp2"), (2, "ddp"), (1, "single"),
                                             pytest.param(4, "fsdp2", marks=pytest.mark.slow)])
def test_saved_by_two_fsdp2_ranks_restores_bitwise(spawn_ranks, saved_by_two, world: int, mode: str) -> None:
    directory, saved = saved_by_two
    results = spawn_ranks(restore_worker, world, mode, directory, {})
    _check_bitwise(results[0])
    assert all(result["extras"] == {"epoch": 2, "rank_note": 0} for result in results)  # same on every rank
    if world == 2:  # the world size that saved: each rank resumes exactly where it was (RNG streams too)
        assert [r["losses_after"] for r in results] == [s["losses_after"] for s in saved]
        assert results[0]["warnings"] == []
    else:
        [warning] = results[0]["warnings"]
        assert "saved by 2 rank(s) and is restored on" in warning and "RNG streams not restored" in warning


@pytest.mark.parametrize(("saved_world", "saved_mode", "world", "mode"),
                         [pytest.param(4, "fsdp2", 2, "fsdp2", marks=pytest.mark.slow), (2, "ddp", 2, "fsdp2"),
                          (1, "single", 2, "fsdp2")])
def test_reshards_between_world_sizes_and_engines(spawn_ranks, tmp_path: Path, saved_world: int, saved_mode: str,
                                                   world: int, mode: str) -> None:
    directory = str(tmp_path / "ckpt")
    options = {"checkpointer": {"sharded": True}} if saved_world == 1 else {}
    spawn_ranks(save_worker, saved_world, saved_mode, directory, options)
    results = spawn_ranks(restore_worker, world, mode, directory, {})
    _check_bitwise(results[0])


@pytest.mark.slow  # 21 s; elastic resume warnings are checked fast in tests/train/test_resumed.py
def test_rank_local_items_that_differed_are_not_restored_on_another_world_size(spawn_ranks, tmp_path: Path) -> None:
    directory = str(tmp_path / "ckpt")
    spawn_ranks(save_worker, 2, "fsdp2", directory, {"per_rank_extras": True})
    same = spawn_ranks(restore_worker, 2, "fsdp2", directory, {})
    assert [r["extras"]["rank_note"] for r in same] == [0, 1]  # each rank its own
    [other] = spawn_ranks(restore_worker, 1, "single", directory, {})
    assert other["extras"] == {}  # not restored: it differed between the ranks that saved
    assert "item 'extras' not restored (its saved state differed between ranks)" in other["warnings"][0]
    _check_bitwise(other)


def test_every_file_of_a_sharded_step_is_json_or_safetensors(tmp_path: Path) -> None:
    import json

    from torchckpt.state.format.codec import decode_safetensors

    model = torch.nn.Linear(4, 3)
    with Checkpointer(tmp_path, sharded=True) as ckpt:
        ckpt.save(1, model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1), extras={"e": 1})
    step_dir = tmp_path / "step-000000001"
    names = sorted(p.name for p in step_dir.iterdir())
    assert names == ["manifest.json", "rank-00000-of-00001.state.json", "shards-00000-of-00001.safetensors",
                     "shards.json", "state.json"]
    for path in step_dir.iterdir():
        data = path.read_bytes()
        if path.suffix == ".json":
            json.loads(data)
        else:
            assert decode_safetensors(data, str(path))


def test_a_corrupt_block_falls_back_to_the_older_step(tmp_path: Path) -> None:
    model = torch.nn.Linear(64, 64)
    saved_at_1 = model.weight.detach().clone()
    with Checkpointer(tmp_path, sharded=True) as ckpt:
        ckpt.save(1, model=model)
        with torch.no_grad():
            model.weight.add_(1.0)
        ckpt.save(2, model=model)
    shard = tmp_path / "step-000000002" / "shards-00000-of-00001.safetensors"
    data = bytearray(shard.read_bytes())
    data[-5] ^= 0x01  # a byte of a tensor: its block hash no longer matches
    shard.write_bytes(bytes(data))
    fresh = torch.nn.Linear(64, 64)
    with Checkpointer(tmp_path, sharded=True) as ckpt, pytest.warns(UserWarning, match="skipped corrupt newer step"):
        assert ckpt.restore(model=fresh) == 1
    assert torch.equal(fresh.weight, saved_at_1)
    with Checkpointer(tmp_path, sharded=True) as ckpt:
        with pytest.raises(Exception, match="block 0: hash mismatch"):
            ckpt.restore(step=2, model=torch.nn.Linear(64, 64))


def test_a_single_process_checkpointer_restores_a_sharded_step(tmp_path: Path) -> None:
    model = torch.nn.Linear(4, 3)
    with Checkpointer(tmp_path, sharded=True) as ckpt:
        ckpt.save(5, model=model)
    fresh = torch.nn.Linear(4, 3)
    with Checkpointer(tmp_path) as ckpt:  # no process group: it reads the sharded format as well
        assert ckpt.restore(model=fresh) == 5
        assert [info.valid for info in ckpt.list("full")] == [True]
    assert torch.equal(fresh.weight, model.weight)


def test_an_async_sharded_save_stages_only_this_ranks_shard(spawn_ranks, tmp_path: Path) -> None:
    directory = str(tmp_path / "ckpt")
    saved = spawn_ranks(save_worker, 2, "fsdp2", directory, {"checkpointer": {"async_save": True}})
    for result in saved:  # one host copy of this rank's shard (64-byte aligned slots), not of the whole state
        assert result["local_bytes"] <= result["staging_bytes"] <= result["local_bytes"] + 64 * 24
    full = sum(result["local_bytes"] for result in saved)
    assert all(result["staging_bytes"] < 0.75 * full for result in saved)
    results = spawn_ranks(restore_worker, 1, "single", directory, {})
    _check_bitwise(results[0])


def test_a_rank_reads_only_the_blocks_of_the_part_it_needs(tmp_path: Path) -> None:
    from torch.distributed.checkpoint.metadata import MetadataIndex
    from torch.distributed.checkpoint.planner import LoadItemType, ReadItem

    from torchckpt.state.read.step import read_manifest
    from torchckpt.state.sharded.shard_storage import BLOCK_BYTES
    from torchckpt.state.sharded.step import open_sharded, shard_reader
    from torchckpt.state.storage.backends import open_storage

    model = torch.nn.Linear(1024, 1024)  # a 4 MiB weight: four blocks
    with Checkpointer(tmp_path, sharded=True) as ckpt:
        ckpt.save(1, model=model)
    storage = open_storage(tmp_path)
    reader = shard_reader(open_sharded(storage, read_manifest(storage, 1)))
    whole = torch.Size([0, 0])
    item = ReadItem(type=LoadItemType.TENSOR, dest_index=MetadataIndex("model.weight", whole), dest_offsets=whole,
                    storage_index=MetadataIndex("model.weight", whole), storage_offsets=torch.Size([512, 0]),
                    lengths=torch.Size([256, 1024]))  # rows 512..767: the third block exactly
    part = reader._chunk_part(item)
    assert torch.equal(part, model.weight.detach()[512:768])
    assert reader.bytes_read == BLOCK_BYTES
    item = ReadItem(type=LoadItemType.TENSOR, dest_index=MetadataIndex("model.weight", whole), dest_offsets=whole,
                    storage_index=MetadataIndex("model.weight", whole), storage_offsets=torch.Size([300, 0]),
                    lengths=torch.Size([10, 1024]))  # 40 KiB inside the second block: that block only
    assert torch.equal(reader._chunk_part(item), model.weight.detach()[300:310])
    assert reader.bytes_read == 2 * BLOCK_BYTES


def test_a_sharded_step_on_an_fsspec_url_commits_by_its_manifest(tmp_path: Path) -> None:
    model = torch.nn.Linear(8, 4)
    url = f"memory://torchckpt-sharded-{tmp_path.name}"
    with Checkpointer(url, sharded=True) as ckpt:
        ckpt.save(2, model=model, extras={"epoch": 1})
        assert [info.valid for info in ckpt.list("full")] == [True]
    fresh, extras = torch.nn.Linear(8, 4), {}
    with Checkpointer(url, sharded=True) as ckpt:
        assert ckpt.restore(model=fresh, extras=extras) == 2
    assert torch.equal(fresh.weight, model.weight) and extras == {"epoch": 1}


def test_an_index_whose_chunks_miss_part_of_a_tensor_is_corrupt() -> None:
    import json

    from torchckpt.state.errors import CheckpointCorruptError
    from torchckpt.state.sharded.shard_storage import decode_index

    body = {"format": "torchckpt.shards", "format_version": 1, "block_bytes": 1 << 20, "hash_algorithm": "crc32",
            "dcp_version": None, "tensors": {"w": {"dtype": "F32", "requires_grad": False, "size": [4], "chunks": [
                {"offsets": [0], "sizes": [2], "file": "s", "offset": 8, "length": 8, "blocks": ["x"]}]}}}
    with pytest.raises(CheckpointCorruptError, match="do not cover its \\[4\\] elements"):
        decode_index(json.dumps(body).encode(), "shards.json")


def test_a_save_one_rank_cannot_start_fails_on_every_rank_and_the_next_ones_work(spawn_ranks, tmp_path) -> None:
    results = spawn_ranks(policy_worker, 2, str(tmp_path / "ckpt"), "nan")
    first = [result["log"][0] for result in results]
    assert "NaN" in first[1][1]
    # rank 0 says which rank could not start the step and why: rank 1's own error, gathered
    assert "a rank could not start it (rank 1: " in first[0][1] and "NaN" in first[0][1], first[0][1]
    assert all(seconds < 5 for _, _, seconds in first)  # agreed at once, not after the 20 s timeout
    assert [entry[1] for result in results for entry in result["log"][1:]] == ["ok"] * 4
    assert results[0]["steps"] == [2, 3]


def test_async_saves_with_agreed_policies_keep_the_ranks_in_step(spawn_ranks, tmp_path) -> None:
    results = spawn_ranks(policy_worker, 2, str(tmp_path / "ckpt"), "async")
    assert all(entry[1] == "ok" for result in results for entry in result["log"]), results
    assert results[0]["steps"] == [11, 12]
