"""The zero-copy write/read paths (format/codec.py's [zero copy both ways]): pieces, hashes, staging, old manifests,
real safetensors."""

from __future__ import annotations

import hashlib
import json
import os
import zlib
from pathlib import Path

import pytest
import safetensors
import safetensors.torch
import torch
import xxhash
from state_workers import bitwise_equal

from torchckpt.state import (
    CheckpointCorruptError,
    Checkpointer,
    export_model_weights,
    verify_checkpoint,
)
from torchckpt.state.format.hashing import HASH_ALGORITHMS, hash_bytes, new_hasher
from torchckpt.state.format.layout import step_dir_name
from torchckpt.state.format.manifest import canonical_json
from torchckpt.state.live.staging import HostStaging
from torchckpt.state.storage import kernel_hints
from torchckpt.state.storage import local as storage_local
from torchckpt.state.storage.base import PIECE_BYTES

REFERENCE_DIGESTS = {  # each algorithm's one-shot digest from its own library, not through our registry
    "xxh3_128": xxhash.xxh3_128_hexdigest,
    "sha256": lambda data: hashlib.sha256(data).hexdigest(),
    "blake2b": lambda data: hashlib.blake2b(data).hexdigest(),
    "crc32": lambda data: f"{zlib.crc32(data) & 0xFFFFFFFF:08x}",
}


def large_model_and_optimizer(seed: int = 0) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """Tensors above PIECE_BYTES (multi-piece files) and above 1 MiB (decoded as views), after a step."""
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(2100, 2100), torch.nn.Linear(2100, 3))  # 17.6 MB weight
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.randn(2, 2100)).square().mean().backward()
    optimizer.step()
    return model, optimizer


def test_registry_lists_every_algorithm_with_a_reference():
    assert sorted(HASH_ALGORITHMS) == sorted(REFERENCE_DIGESTS)


@pytest.mark.parametrize("algorithm", sorted(REFERENCE_DIGESTS))
def test_incremental_hash_equals_the_libraries_one_shot_digest(algorithm):
    data = os.urandom(100_003)
    hasher = new_hasher(algorithm)
    for start in range(0, len(data), 7_919):  # uneven pieces
        hasher.update(memoryview(data)[start : start + 7_919])
    assert hasher.hexdigest() == hash_bytes(data, algorithm) == REFERENCE_DIGESTS[algorithm](data)


@pytest.mark.parametrize("async_save", [False, True], ids=["sync", "async"])
def test_zero_copy_writer_output_is_read_by_reference_safe_open(run_dir, async_save):
    model, optimizer = large_model_and_optimizer()
    with Checkpointer(run_dir, async_save=async_save) as ckpt:
        ckpt.save(1, model=model, optimizer=optimizer)
    step_dir = os.path.join(run_dir, step_dir_name(1))
    assert os.path.getsize(os.path.join(step_dir, "model.safetensors")) > PIECE_BYTES  # several pieces
    with safetensors.safe_open(os.path.join(step_dir, "model.safetensors"), framework="pt") as handle:
        loaded = {key: handle.get_tensor(key) for key in handle.keys()}  # noqa: SIM118 (safe_open has no __iter__)
    assert bitwise_equal(dict(sorted(loaded.items())), dict(sorted(model.state_dict().items())))
    manifest = json.loads(Path(step_dir, "manifest.json").read_text())
    assert manifest["hash_algorithm"] == "xxh3_128"
    for name, entry in manifest["files"].items():  # hashes written on the fly equal hashes of the files
        data = Path(step_dir, name).read_bytes()
        assert entry == {"size_bytes": len(data), "hash": xxhash.xxh3_128_hexdigest(data)}



def test_writeback_is_started_for_every_piece_and_changes_no_byte(run_dir, monkeypatch):
    """kernel_hints.py's [writeback starts as pieces are written], [hints never change what is written or read]."""
    torch.manual_seed(0)
    model = torch.nn.Linear(2100, 2100, bias=False)  # 17.6 MB: two pieces
    asked: dict[str, list[tuple[int, int]]] = {}
    real = kernel_hints.start_writeback

    def recording(fd: int, offset: int, length: int) -> bool:
        asked.setdefault(os.path.basename(os.readlink(f"/proc/self/fd/{fd}")), []).append((offset, length))
        return real(fd, offset, length)

    monkeypatch.setattr(storage_local, "start_writeback", recording)
    with Checkpointer(os.path.join(run_dir, "hinted"), capture_rng=False) as ckpt:
        ckpt.save(1, model=model)
    monkeypatch.setattr(kernel_hints, "_LIBC", None)  # as on a system without sync_file_range
    monkeypatch.setattr(storage_local, "start_writeback", kernel_hints.start_writeback)
    assert kernel_hints.start_writeback(0, 0, 1) is False
    with Checkpointer(os.path.join(run_dir, "plain"), capture_rng=False) as ckpt:
        ckpt.save(1, model=model)
    hinted, plain = (Path(run_dir, name, step_dir_name(1)) for name in ("hinted", "plain"))
    names = sorted(os.listdir(plain))
    assert sorted(os.listdir(hinted)) == names == sorted(asked)
    for name in names:
        size = (hinted / name).stat().st_size
        spans = asked[name]  # contiguous, in order, covering the file exactly, no piece over PIECE_BYTES
        assert [offset for offset, _ in spans] == [sum(n for _, n in spans[:i]) for i in range(len(spans))]
        assert sum(n for _, n in spans) == size and max(n for _, n in spans) <= PIECE_BYTES
        if name.endswith(".safetensors"):
            assert (hinted / name).read_bytes() == (plain / name).read_bytes()
    listed = [json.loads((step / "manifest.json").read_text())["files"] for step in (hinted, plain)]
    assert listed[0]["model.safetensors"] == listed[1]["model.safetensors"]  # the same size and hash
    assert {name: entry["size_bytes"] for name, entry in listed[0].items()} == {
        name: entry["size_bytes"] for name, entry in listed[1].items()}  # state.json differs by its save time
    assert len(asked["model.safetensors"]) > 1  # the weight spans several pieces


def test_large_state_restores_bitwise_and_training_continues_identically(run_dir):
    model, optimizer = large_model_and_optimizer()
    with Checkpointer(run_dir) as ckpt:
        ckpt.save(1, model=model, optimizer=optimizer)
    saved = {key: value.clone() for key, value in model.state_dict().items()}
    restored_model, restored_optimizer = large_model_and_optimizer(seed=5)
    with Checkpointer(run_dir) as ckpt:
        assert ckpt.restore(model=restored_model, optimizer=restored_optimizer, rng=False) == 1
    assert bitwise_equal(restored_model.state_dict(), model.state_dict())
    assert bitwise_equal(restored_optimizer.state_dict(), optimizer.state_dict())
    batch = torch.randn(3, 2100)
    for m, opt in ((model, optimizer), (restored_model, restored_optimizer)):  # state tensors are buffer views
        opt.zero_grad()
        m(batch).square().mean().backward()
        opt.step()
    assert bitwise_equal(restored_model.state_dict(), model.state_dict())
    assert bitwise_equal(restored_optimizer.state_dict(), optimizer.state_dict())
    out = os.path.join(run_dir, "w.safetensors")
    assert export_model_weights(run_dir, out) == 1
    exported = safetensors.torch.load_file(out)
    assert bitwise_equal(dict(sorted(exported.items())), dict(sorted(saved.items())))


def _memory_of(tensor: torch.Tensor) -> tuple[int, int]:
    storage = tensor.untyped_storage()
    return storage.data_ptr(), storage.nbytes()


def test_restore_swaps_module_memory_in_place_and_the_optimizer_keeps_its_parameters(run_dir):
    model, optimizer = large_model_and_optimizer()
    with Checkpointer(run_dir) as ckpt:
        ckpt.save(1, model=model, optimizer=optimizer)
    restored_model, restored_optimizer = large_model_and_optimizer(seed=5)
    weight = restored_model[0].weight
    before = _memory_of(weight)
    with Checkpointer(run_dir) as ckpt:
        ckpt.restore(model=restored_model, optimizer=restored_optimizer, rng=False)
    assert restored_model[0].weight is weight and restored_optimizer.param_groups[0]["params"][0] is weight
    assert weight.requires_grad and type(weight) is torch.nn.Parameter
    # no copy: the weight's memory is now the memory its bytes were read into, its own and nothing else
    assert _memory_of(weight) != before and _memory_of(weight)[1] == weight.numel() * weight.element_size()
    assert bitwise_equal(restored_model.state_dict(), model.state_dict())


def test_restore_copies_when_something_shares_the_module_memory(run_dir):
    """A held view would see a copy but not a swap: restore keeps load_state_dict's semantics."""
    model, optimizer = large_model_and_optimizer()
    with Checkpointer(run_dir) as ckpt:
        ckpt.save(1, model=model, optimizer=optimizer)
    restored_model, restored_optimizer = large_model_and_optimizer(seed=5)
    held = restored_model.state_dict()  # detached tensors sharing the parameters' memory
    before = _memory_of(restored_model[0].weight)
    with Checkpointer(run_dir) as ckpt:
        ckpt.restore(model=restored_model, optimizer=restored_optimizer, rng=False)
    assert _memory_of(restored_model[0].weight) == before
    assert bitwise_equal(held, model.state_dict())


def test_restore_of_modules_with_custom_loading_tied_weights_and_channels_last(run_dir):
    """BatchNorm overrides _load_from_state_dict (copied); tied weights stay tied; strides are kept."""
    torch.manual_seed(0)

    def build() -> torch.nn.Module:
        net = torch.nn.ModuleDict({"conv": torch.nn.Conv2d(3, 4, 3), "norm": torch.nn.BatchNorm2d(4),
                                   "a": torch.nn.Linear(4, 4, bias=False), "b": torch.nn.Linear(4, 4, bias=False)})
        net["b"].weight = net["a"].weight
        return net

    model = build()
    model["norm"](torch.randn(2, 4, 5, 5))  # running statistics move
    with Checkpointer(run_dir) as ckpt:
        ckpt.save(1, model=model)
    for channels_last in (False, True):
        restored = build()
        if channels_last:
            restored["conv"].to(memory_format=torch.channels_last)
        with Checkpointer(run_dir) as ckpt:
            ckpt.restore(model=restored, rng=False)
        assert bitwise_equal(restored.state_dict(), model.state_dict())
        assert restored["a"].weight is restored["b"].weight
        assert restored["conv"].weight.is_contiguous(memory_format=torch.channels_last) == channels_last
    plain = torch.nn.Sequential(torch.nn.Linear(4, 4, bias=False), torch.nn.Linear(4, 4, bias=False))
    plain[1].weight = plain[0].weight
    with Checkpointer(run_dir) as ckpt:
        ckpt.save(2, model=plain)
    copy = torch.nn.Sequential(torch.nn.Linear(4, 4, bias=False), torch.nn.Linear(4, 4, bias=False))
    copy[1].weight = copy[0].weight
    with Checkpointer(run_dir) as ckpt:
        ckpt.restore(model=copy, rng=False)
    assert copy[0].weight is copy[1].weight and torch.equal(copy[0].weight, plain[0].weight)


def test_flip_in_a_later_piece_is_detected_by_full_verify_only(run_dir):
    model, _ = large_model_and_optimizer()
    with Checkpointer(run_dir) as ckpt:
        ckpt.save(1, model=model)
    path = os.path.join(run_dir, step_dir_name(1), "model.safetensors")
    with open(path, "r+b") as handle:  # a byte in the second 16 MiB piece
        handle.seek(PIECE_BYTES + 12_345)
        byte = handle.read(1)
        handle.seek(PIECE_BYTES + 12_345)
        handle.write(bytes([byte[0] ^ 0x10]))
    [full] = verify_checkpoint(run_dir, step=1, verify="full")
    assert not full.valid and "model.safetensors: xxh3_128 is" in full.problem
    assert verify_checkpoint(run_dir, step=1, verify="fast")[0].valid
    with Checkpointer(run_dir) as ckpt, pytest.raises(CheckpointCorruptError, match="xxh3_128 is"):
        ckpt.restore(model=large_model_and_optimizer()[0], fallback=False)


def _rewrite_manifest_as_sha256(step_dir: str) -> None:
    """What the previous torchckpt (sha256 default) wrote: hashes from hashlib, algorithm 'sha256'."""
    manifest_path = os.path.join(step_dir, "manifest.json")
    body = json.loads(Path(manifest_path).read_text())
    body["hash_algorithm"] = "sha256"
    for name in body["files"]:
        body["files"][name]["hash"] = hashlib.sha256(Path(step_dir, name).read_bytes()).hexdigest()
    body.pop("manifest_hash")
    body["manifest_hash"] = hashlib.sha256(canonical_json(body)).hexdigest()
    with open(manifest_path, "w") as handle:
        handle.write(json.dumps(body, indent=1, sort_keys=True))


def test_checkpoint_written_with_the_old_sha256_default_still_verifies_and_restores(run_dir):
    model, optimizer = large_model_and_optimizer()
    with Checkpointer(run_dir) as ckpt:
        ckpt.save(1, model=model, optimizer=optimizer)
    step_dir = os.path.join(run_dir, step_dir_name(1))
    _rewrite_manifest_as_sha256(step_dir)
    assert verify_checkpoint(run_dir, step=1, verify="full")[0].valid
    restored, restored_optimizer = large_model_and_optimizer(seed=3)
    with Checkpointer(run_dir) as ckpt:  # the default is xxh3_128; the manifest's own algorithm is used
        assert ckpt.restore(model=restored, optimizer=restored_optimizer) == 1
        ckpt.save(2, model=restored, optimizer=restored_optimizer)  # new steps use the new default
    assert bitwise_equal(restored.state_dict(), model.state_dict())
    assert json.loads(Path(run_dir, step_dir_name(2), "manifest.json").read_text())["hash_algorithm"] == "xxh3_128"
    with open(os.path.join(step_dir, "model.safetensors"), "r+b") as handle:
        handle.seek(-5, os.SEEK_END)
        handle.write(b"\x00\x01\x02\x03\x04")
    [info] = verify_checkpoint(run_dir, step=1, verify="full")
    assert not info.valid and "model.safetensors: sha256 is" in info.problem


def test_staging_buffer_is_reused_while_the_state_keeps_its_size():
    staging = HostStaging()
    first = {"w": torch.randn(1000), "n": torch.arange(3, dtype=torch.int16), "s": torch.tensor(2.5)}
    [copied] = staging.copy([first])
    pointer = copied["w"].data_ptr()
    assert all(bitwise_equal(copied[k], first[k]) for k in first)
    assert all(t.data_ptr() % 64 == 0 for t in copied.values())  # each tensor on its own cache line
    second = {k: v + 1 for k, v in first.items()}
    [again] = staging.copy([second])
    assert again["w"].data_ptr() == pointer and all(bitwise_equal(again[k], second[k]) for k in second)
    [bigger] = staging.copy([{"w": torch.ones(10_000)}])
    assert staging.capacity_bytes >= 40_000 and bitwise_equal(bigger["w"], torch.ones(10_000))
    staging.release()
    assert staging.capacity_bytes == 0


def test_async_saves_reuse_the_staging_buffer_and_each_step_holds_its_own_state(run_dir):
    model, _ = large_model_and_optimizer()
    expected = {}
    with Checkpointer(run_dir, async_save=True) as ckpt:
        for step in (1, 2, 3):
            ckpt.save(step, model=model)
            expected[step] = {k: v.clone() for k, v in model.state_dict().items()}
            with torch.no_grad():
                for parameter in model.parameters():
                    parameter.mul_(1.5)  # training goes on while the step is written from the staging copy
    for step in (1, 2, 3):
        restored = large_model_and_optimizer(seed=9)[0]
        with Checkpointer(run_dir) as ckpt:
            assert ckpt.restore(step=step, model=restored) == step
        assert bitwise_equal(restored.state_dict(), expected[step])
