"""A sharded step rewritten by someone with write access to the directory (its manifest kept self-consistent),
and calls that would have broken a sharded save: each is a clear CheckpointError, changes nothing live, and a
corrupt newer step falls back to an older one. (Found by a red-team pass; each failed before its fix.)"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from torchckpt import Checkpointer
from torchckpt.state import CheckpointCorruptError, CheckpointError, CheckpointMismatchError
from torchckpt.state.format.hashing import hash_bytes
from torchckpt.state.format.manifest import FileEntry, Manifest, encode_manifest, parse_manifest


class TwoLayers(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = torch.nn.Linear(4, 4)
        self.b = torch.nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(self.a(x))


def _step(directory: Path, step: int = 1) -> Path:
    return directory / f"step-{step:09d}"


def _read_json(directory: Path, name: str, step: int = 1) -> Any:
    return json.loads((_step(directory, step) / name).read_bytes())


def _rewrite(directory: Path, name: str, data: bytes, step: int = 1) -> None:
    """Replace one file of a step and rebuild its manifest to match, as an attacker could."""
    path = _step(directory, step) / "manifest.json"
    manifest = parse_manifest(path.read_bytes(), str(path))
    (_step(directory, step) / name).write_bytes(data)
    files = dict(manifest.files)
    files[name] = FileEntry(size_bytes=len(data), hash=hash_bytes(data, manifest.hash_algorithm))
    path.write_bytes(encode_manifest(Manifest(step=manifest.step, created_unix_s=manifest.created_unix_s,
                                              hash_algorithm=manifest.hash_algorithm, files=files,
                                              metrics=manifest.metrics, world_size=manifest.world_size)))


def _dump(value: Any) -> bytes:
    return json.dumps(value, separators=(",", ":"), sort_keys=True).encode()


def _restore(directory: Path, **items: Any) -> int | None:
    with Checkpointer(directory, capture_rng=False) as ckpt:
        return ckpt.restore(**items)


def _save_linear(directory: Path, steps: tuple[int, ...] = (1,)) -> torch.nn.Linear:
    model = torch.nn.Linear(4, 3)
    with Checkpointer(directory, sharded=True, capture_rng=False) as ckpt:
        for step in steps:
            ckpt.save(step, model=model)
    return model


def test_chunks_that_overlap_as_much_as_they_miss_are_corrupt(tmp_path: Path) -> None:
    _save_linear(tmp_path)
    index = _read_json(tmp_path, "shards.json")
    chunk = index["tensors"]["model.weight"]["chunks"][0]
    data = (_step(tmp_path) / chunk["file"]).read_bytes()
    rows_0_1, row_1 = data[chunk["offset"]:chunk["offset"] + 32], data[chunk["offset"] + 16:chunk["offset"] + 32]
    algorithm = index["hash_algorithm"]
    index["tensors"]["model.weight"]["chunks"] = [  # 8 + 4 elements = the 12 of [3, 4], row 2 never written
        dict(chunk, sizes=[2, 4], length=32, blocks=[hash_bytes(rows_0_1, algorithm)]),
        dict(chunk, offsets=[1, 0], sizes=[1, 4], offset=chunk["offset"] + 16, length=16,
             blocks=[hash_bytes(row_1, algorithm)])]
    _rewrite(tmp_path, "shards.json", _dump(index))
    with pytest.raises(CheckpointCorruptError, match="do not cover"):
        _restore(tmp_path, model=torch.nn.Linear(4, 3))


@pytest.mark.parametrize("damage", ["nested", "no hash algorithm", "unknown hash algorithm"])
def test_a_malformed_index_is_corrupt_and_restore_falls_back(tmp_path: Path, damage: str) -> None:
    model = _save_linear(tmp_path, steps=(1, 2))
    index = _read_json(tmp_path, "shards.json", step=2)
    if damage == "nested":
        data = b'{"a":' + b"[" * 100_000 + b"]" * 100_000 + b"}"
    else:
        if damage == "no hash algorithm":
            index.pop("hash_algorithm")
        else:
            index["hash_algorithm"] = "md5"
        data = _dump(index)
    _rewrite(tmp_path, "shards.json", data, step=2)
    fresh = torch.nn.Linear(4, 3)
    with pytest.warns(UserWarning, match="skipped corrupt newer step"):
        assert _restore(tmp_path, model=fresh) == 1
    assert torch.equal(fresh.weight, model.weight)


def test_an_export_of_an_index_claiming_a_huge_tensor_is_a_clean_error(tmp_path: Path) -> None:
    _save_linear(tmp_path)
    index = _read_json(tmp_path, "shards.json")
    size = 1 << 36  # a 1 MB index claiming 256 GiB
    index["tensors"]["model.bias"]["size"] = [size]
    index["tensors"]["model.bias"]["chunks"][0].update(sizes=[size], length=size * 4,
                                                       blocks=["0"] * ((size * 4) >> 20))
    _rewrite(tmp_path, "shards.json", _dump(index))
    done = subprocess.run([sys.executable, "-m", "torchckpt", "export", str(tmp_path), "--out",
                           str(tmp_path / "w.safetensors")], capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and "Traceback" not in done.stderr and "lies outside" in done.stderr, done.stderr


def test_an_extra_entry_in_a_saved_module_changes_nothing_live(tmp_path: Path) -> None:
    with Checkpointer(tmp_path, sharded=True, capture_rng=False) as ckpt:
        ckpt.save(1, enc=torch.nn.Linear(4, 3), dec=torch.nn.Linear(3, 2), extras={"epoch": 7})
    state = _read_json(tmp_path, "state.json")
    state["sharded_items"]["dec"]["tree"]["extra"] = 1
    _rewrite(tmp_path, "state.json", _dump(state))
    enc, extras = torch.nn.Linear(4, 3), {"epoch": 0}
    weight = enc.weight.detach().clone()
    with pytest.raises(CheckpointMismatchError, match=r"key\(s\) the live object lacks: \['extra'\]"):
        _restore(tmp_path, enc=enc, dec=torch.nn.Linear(3, 2), extras=extras)
    assert extras == {"epoch": 0} and torch.equal(weight, enc.weight)


def test_a_smaller_live_model_is_a_mismatch_not_corruption(tmp_path: Path) -> None:
    _save_linear(tmp_path)
    with pytest.raises(CheckpointMismatchError, match=r"lacks: \['bias'\]"):
        _restore(tmp_path, model=torch.nn.Linear(4, 3, bias=False))


def test_another_parameter_group_layout_is_refused(tmp_path: Path) -> None:
    model = TwoLayers()
    optimizer = torch.optim.Adam([{"params": model.a.parameters()}, {"params": model.b.parameters(), "lr": 0.5}],
                                 lr=0.1)
    model(torch.randn(2, 4)).sum().backward()
    optimizer.step()
    with Checkpointer(tmp_path, sharded=True, capture_rng=False) as ckpt:
        ckpt.save(1, model=model, optimizer=optimizer)
    live = TwoLayers()
    live_optimizer = torch.optim.Adam(live.parameters(), lr=0.1)
    with pytest.raises(CheckpointMismatchError, match="2 parameter group"):
        _restore(tmp_path, model=live, optimizer=live_optimizer)
    assert live_optimizer.state_dict()["state"] == {}  # DCP's initialising step was undone


def test_a_sharded_save_leaves_a_fresh_optimizer_fresh_and_restores_it_fresh(tmp_path: Path) -> None:
    model = torch.nn.Linear(4, 3)
    optimizer = torch.optim.Adam(model.parameters(), lr=0.1)
    with Checkpointer(tmp_path, sharded=True, capture_rng=False) as ckpt:
        ckpt.save(0, model=model, optimizer=optimizer)
    assert optimizer.state_dict()["state"] == {}  # DCP initialises it with a zero-lr step to read it
    live = torch.nn.Linear(4, 3)
    live_optimizer = torch.optim.Adam(live.parameters(), lr=0.1)
    assert _restore(tmp_path, model=live, optimizer=live_optimizer) == 0
    assert live_optimizer.state_dict()["state"] == {}


@pytest.mark.parametrize("names", [{"state": 0}, {"a.b": 0, "a": 1}])
def test_item_names_are_checked_before_a_sharded_save(tmp_path: Path, names: dict[str, int]) -> None:
    items = {name: torch.nn.Linear(2, 2) for name in names}
    with Checkpointer(tmp_path, sharded=True, capture_rng=False) as ckpt:
        with pytest.raises(ValueError, match="item name"):
            ckpt.save(1, **items)
        assert ckpt.latest_step() is None


def test_the_verify_argument_is_honoured_with_sharded_true(tmp_path: Path) -> None:
    with Checkpointer(tmp_path, capture_rng=False) as ckpt:
        ckpt.save(1, model=torch.nn.Linear(4, 3))
    path = _step(tmp_path) / "model.safetensors"
    data = bytearray(path.read_bytes())
    data[-1] ^= 0x40
    path.write_bytes(bytes(data))
    with Checkpointer(tmp_path, sharded=True, verify="fast", capture_rng=False) as ckpt:
        with pytest.raises(CheckpointError, match="xxh3_128"):
            ckpt.restore(model=torch.nn.Linear(4, 3), verify="full")
