"""Shared storage is written once and restored shared; every other restored tensor owns exactly its bytes
(format/storages.py's [a storage is written once], read/tensor_file.py's [each tensor reads into its own memory]).
Issue 29, items 1 and 9: byte counts are analytic, values bitwise."""

from __future__ import annotations

import json
import os
import warnings
from pathlib import Path

import pytest
import torch
from state_workers import bitwise_equal

from torchckpt.state import CheckpointCorruptError, Checkpointer, CheckpointFallbackWarning, verify_checkpoint
from torchckpt.state.format import manifest as manifest_module
from torchckpt.state.format import snapshot as snapshot_module
from torchckpt.state.format.codec import decode_safetensors, join_tensors
from torchckpt.state.format.layout import step_dir_name
from torchckpt.state.format.storages import view_node

try:  # imported while collecting, so no test pays for it
    from transformers import GPT2Config, GPT2LMHeadModel
except ImportError:  # the GPT-2 tests skip; the others run
    GPT2Config = GPT2LMHeadModel = None


def _tensor_data_bytes(path: str) -> int:
    """The data bytes of a safetensors file (its size less the length field and the header)."""
    with open(path, "rb") as handle:
        return os.path.getsize(path) - 8 - int.from_bytes(handle.read(8), "little")


def _unique_storage_bytes(tensors) -> int:
    return sum({t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}.values())


def _own_bytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


def _same(restored: dict, saved: dict) -> bool:
    """Keys, dtypes and values equal (torch.equal: no NaN here); strides are checked by the caller."""
    return restored.keys() == saved.keys() and all(
        restored[key].dtype == saved[key].dtype and torch.equal(restored[key], saved[key]) for key in saved)


def _tied_gpt2(seed: int = 0) -> torch.nn.Module:
    if GPT2Config is None:
        pytest.skip("needs transformers")
    torch.manual_seed(seed)
    config = GPT2Config(n_layer=2, n_embd=64, n_head=2, vocab_size=1000, n_positions=64)
    model = GPT2LMHeadModel(config)
    assert model.lm_head.weight is model.transformer.wte.weight  # tied, as GPT-2 small is
    return model


def test_tied_gpt2_is_written_once_and_restored_tied_each_tensor_owning_its_bytes(run_dir):
    model = _tied_gpt2()
    state = model.state_dict()
    unique = _unique_storage_bytes(state.values())
    assert unique < sum(_own_bytes(t) for t in state.values())  # the tie would be counted twice
    with Checkpointer(run_dir) as ckpt:
        ckpt.save(1, model=model)
    assert _tensor_data_bytes(os.path.join(run_dir, step_dir_name(1), "model.safetensors")) == unique

    restored = _tied_gpt2(seed=1)
    with Checkpointer(run_dir) as ckpt:
        ckpt.restore(model=restored, rng=False)
    assert restored.lm_head.weight is restored.transformer.wte.weight
    assert bitwise_equal(restored.state_dict(), state)
    for key, tensor in restored.state_dict().items():
        assert tensor.untyped_storage().nbytes() == _own_bytes(tensor), key


def test_views_of_one_storage_are_written_once_and_come_back_sharing_it(run_dir):
    base = torch.arange(1200, dtype=torch.float32)
    extras = {"base": base, "first": base[:600], "second": base[600:], "grid_t": base.view(30, 40).t(),
              "strided": base[::7], "tie": base[:600], "bytes": base[100:200].view(torch.uint8)}
    gappy = torch.arange(10_000, dtype=torch.int64)
    others = {"every_100th": gappy[::100], "channels_last": torch.randn(2, 3, 4, 5).to(
        memory_format=torch.channels_last)}
    with Checkpointer(run_dir) as ckpt:
        ckpt.save(1, extras=extras, others=others)
    step = os.path.join(run_dir, step_dir_name(1))
    assert _tensor_data_bytes(os.path.join(step, "extras.safetensors")) == base.untyped_storage().nbytes()
    # a strided slice alone is written as its own bytes, never as the storage it was cut from
    assert _tensor_data_bytes(os.path.join(step, "others.safetensors")) == 100 * 8 + 2 * 3 * 4 * 5 * 4

    restored_extras: dict = {}
    restored_others: dict = {}
    with Checkpointer(run_dir) as ckpt:
        ckpt.restore(extras=restored_extras, others=restored_others, rng=False)
    assert _same(restored_extras, extras) and _same(restored_others, others)
    shared = {t.untyped_storage().data_ptr() for t in restored_extras.values()}
    assert len(shared) == 1 and restored_extras["base"].untyped_storage().nbytes() == base.untyped_storage().nbytes()
    assert restored_extras["tie"].data_ptr() == restored_extras["first"].data_ptr()  # a tie of a view: that view
    for key, tensor in list(restored_extras.items()) + [("channels_last", restored_others["channels_last"])]:
        assert tensor.stride() == (extras | others)[key].stride(), key  # layouts kept (channels_last too)
    restored_extras["first"][0] = -1.0  # still views of one storage
    assert restored_extras["base"][0] == -1.0 and restored_extras["grid_t"][0, 0] == -1.0
    every = restored_others["every_100th"]
    assert every.untyped_storage().nbytes() == _own_bytes(every)


def test_an_async_save_writes_shared_storage_once_too(run_dir):
    base = torch.randn(64, 64)
    extras = {"w": base, "half": base[32:], "t": base.t()}
    saved = {key: value.clone() for key, value in extras.items()}
    with Checkpointer(run_dir, async_save=True) as ckpt:
        ckpt.save(1, extras=extras)
        base.add_(1.0)  # after save() returned: the step holds the values at the save
    assert _tensor_data_bytes(os.path.join(run_dir, step_dir_name(1), "extras.safetensors")) == 64 * 64 * 4
    restored: dict = {}
    with Checkpointer(run_dir) as ckpt:
        ckpt.restore(extras=restored, rng=False)
    assert all(torch.equal(restored[key], saved[key]) for key in saved)
    assert len({t.untyped_storage().data_ptr() for t in restored.values()}) == 1


def test_restored_model_and_optimizer_tensors_own_exactly_their_bytes(run_dir, tmp_path):
    model = torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.Linear(256, 4))  # 256 KiB and tiny tensors
    optimizer = torch.optim.AdamW(model.parameters())
    model(torch.randn(2, 256)).sum().backward()
    optimizer.step()
    with Checkpointer(run_dir) as ckpt:
        ckpt.save(1, model=model, optimizer=optimizer)
    fresh = torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.Linear(256, 4))
    fresh_optimizer = torch.optim.AdamW(fresh.parameters())
    with Checkpointer(run_dir) as ckpt:
        ckpt.restore(model=fresh, optimizer=fresh_optimizer, rng=False)
    assert bitwise_equal(fresh.state_dict(), model.state_dict())
    assert bitwise_equal(fresh_optimizer.state_dict(), optimizer.state_dict())
    tensors = list(fresh.state_dict().values()) + [
        t for s in fresh_optimizer.state_dict()["state"].values() for t in s.values()]
    assert all(t.untyped_storage().nbytes() == _own_bytes(t) for t in tensors)
    one = tmp_path / "one.pt"
    torch.save(fresh[1].weight.detach(), one)  # writes that tensor, not a read buffer around it
    assert os.path.getsize(one) < _own_bytes(fresh[1].weight) + 2048


def test_a_step_in_the_older_format_still_restores(run_dir, monkeypatch):
    """Format 1 (before storages were written once): every key its own contiguous entry, manifest version 1."""
    model = _tied_gpt2()
    with monkeypatch.context() as patch:
        patch.setattr(manifest_module, "FORMAT_VERSION", 1)
        patch.setattr(snapshot_module, "write_once",
                      lambda tree, tensors: (tree, {key: t.contiguous() for key, t in tensors.items()}))
        with Checkpointer(run_dir) as ckpt:
            ckpt.save(1, model=model)
    step = os.path.join(run_dir, step_dir_name(1))
    assert json.loads(Path(step, "manifest.json").read_text())["format_version"] == 1
    written = decode_safetensors(Path(step, "model.safetensors").read_bytes(), "model.safetensors")
    assert {"lm_head.weight", "transformer.wte.weight"} <= set(written)  # the tie written twice, as then
    assert not os.path.exists(os.path.join(step, "model.json"))  # a flat map: no tree file, as then
    restored = _tied_gpt2(seed=1)
    with Checkpointer(run_dir) as ckpt:
        assert ckpt.restore(model=restored, rng=False) == 1
    assert bitwise_equal(restored.state_dict(), model.state_dict())
    assert restored.lm_head.weight is restored.transformer.wte.weight


def _flip_inside_the_joined_tiny_tensors(path: str, which: int, count: int) -> None:
    data = bytearray(Path(path).read_bytes())
    start = 8 + int.from_bytes(data[:8], "little")
    data[start + which * 16 + 5] ^= 0x10  # a byte of tensor `which` (16 bytes each), inside one joined write
    assert len(data) == start + count * 16
    Path(path).write_bytes(bytes(data))


def test_a_flipped_byte_inside_joined_small_tensors_is_caught_and_restore_falls_back(run_dir):
    count = 1000
    first = {f"t{i}": torch.randn(4) for i in range(count)}
    second = {key: value + 1.0 for key, value in first.items()}
    with Checkpointer(run_dir) as ckpt:
        ckpt.save(1, extras=first)
        ckpt.save(2, extras=second)
    damaged = os.path.join(run_dir, step_dir_name(2), "extras.safetensors")
    _flip_inside_the_joined_tiny_tensors(damaged, 567, count)
    assert verify_checkpoint(run_dir, step=2, verify="fast")[0].valid
    [info] = verify_checkpoint(run_dir, step=2)
    assert not info.valid and damaged in info.problem and "content changed" in info.problem
    restored: dict = {}
    with Checkpointer(run_dir) as ckpt:
        with pytest.raises(CheckpointCorruptError, match="content changed"):
            ckpt.restore(extras=restored, rng=False, fallback=False)
        assert restored == {}
        with pytest.warns(CheckpointFallbackWarning, match="extras.safetensors"):
            assert ckpt.restore(extras=restored, rng=False) == 1
    assert _same(restored, first)


def test_a_torn_tensor_file_is_caught_by_size_while_read(run_dir):
    with Checkpointer(run_dir) as ckpt:
        ckpt.save(1, extras={f"t{i}": torch.randn(4) for i in range(500)} | {"big": torch.randn(100_000)})
    path = os.path.join(run_dir, step_dir_name(1), "extras.safetensors")
    data = Path(path).read_bytes()
    Path(path).write_bytes(data[: len(data) // 2])
    with Checkpointer(run_dir) as ckpt, warnings.catch_warnings(), pytest.raises(
            CheckpointCorruptError, match="size is"):
        ckpt.restore(extras={}, rng=False)


@pytest.mark.parametrize("bad", [{"offset": 12}, {"offset": -4}, {"shape": [3, 3]}, {"stride": [-1]},
                                 {"shape": [2], "stride": [1, 1]}, {"key": "missing"}, {"dtype": "X9"}])
def test_a_crafted_view_entry_is_corrupt_never_out_of_bounds(bad):
    base = torch.arange(4, dtype=torch.float32)
    node = view_node("base", base[:2], 0) | {"offset": 8} | bad
    with pytest.raises(CheckpointCorruptError):
        join_tensors(node, {"base": base}, "extras.json")
