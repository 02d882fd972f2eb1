"""Damaged checkpoints are detected, named, reported, and skipped; nothing crashes."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
from cli_helpers import run_cli
from state_helpers import tiny_model, trained
from state_workers import bitwise_equal

from torchckpt.state import (
    CheckpointCorruptError,
    Checkpointer,
    CheckpointFallbackWarning,
    verify_checkpoint,
)
from torchckpt.state.format.hashing import hash_bytes
from torchckpt.state.format.layout import CORRUPT_PREFIX, step_dir_name
from torchckpt.state.format.manifest import canonical_json


def _truncate(path):
    data = Path(path).read_bytes()
    Path(path).write_bytes(data[:-7])


def _flip_byte(path):
    data = bytearray(Path(path).read_bytes())
    data[len(data) - 3] ^= 0x01  # inside the tensor data, so the file still parses
    Path(path).write_bytes(bytes(data))


def _remove(path):
    os.remove(path)


def _bad_hash_in_manifest(manifest_path, file_name="model.safetensors"):
    body = json.loads(Path(manifest_path).read_text())
    body["files"][file_name]["hash"] = "0" * 64
    body.pop("manifest_hash")
    body["manifest_hash"] = hash_bytes(canonical_json(body), "sha256")  # a self-consistent manifest
    Path(manifest_path).write_text(json.dumps(body))


# (damage, file it is applied to, file the report must name, words the report must contain)
DAMAGES = [
    ("truncated", _truncate, "model.safetensors", "model.safetensors", "size is"),
    ("flipped-byte", _flip_byte, "optimizer.safetensors", "optimizer.safetensors", "content changed"),
    ("missing-file", _remove, "optimizer.json", "optimizer.json", "missing"),
    ("bad-hash-in-manifest", _bad_hash_in_manifest, "manifest.json", "model.safetensors", "manifest says 0000"),
    ("flipped-manifest", _flip_byte, "manifest.json", "manifest.json", "manifest"),
    ("missing-manifest", _remove, "manifest.json", "manifest.json", "did not finish"),
    ("truncated-state", _truncate, "state.json", "state.json", "size is"),
]


@pytest.fixture
def two_steps(run_dir):
    """Steps 1 and 2 of a small training run; returns (model state at 1, optimizer state at 1)."""
    model = tiny_model()
    optimizer = torch.optim.AdamW(model.parameters())
    with Checkpointer(run_dir) as ckpt:
        trained(model, optimizer)
        ckpt.save(1, model=model, optimizer=optimizer)
        model_at_1 = {k: v.clone() for k, v in model.state_dict().items()}
        optimizer_state_at_1 = {
            i: {k: v.clone() for k, v in s.items()} for i, s in optimizer.state_dict()["state"].items()
        }
        trained(model, optimizer)
        ckpt.save(2, model=model, optimizer=optimizer)
    return model_at_1, optimizer_state_at_1


@pytest.mark.parametrize("damage", DAMAGES, ids=[d[0] for d in DAMAGES])
def test_damage_is_named_by_verify_and_restore_falls_back(run_dir, two_steps, damage, capsys):
    _, apply, target, named, words = damage
    apply(os.path.join(run_dir, step_dir_name(2), target))
    named_path = os.path.join(run_dir, step_dir_name(2), named)

    [info] = verify_checkpoint(run_dir, step=2)
    assert not info.valid and named_path in info.problem and words in info.problem

    model = tiny_model(5)
    optimizer = torch.optim.AdamW(model.parameters())
    with Checkpointer(run_dir) as ckpt:
        with pytest.raises(CheckpointCorruptError, match="step 2 is corrupt, nothing was restored") as caught:
            ckpt.restore(model=model, optimizer=optimizer, fallback=False)
        assert named_path in str(caught.value)
        with pytest.warns(CheckpointFallbackWarning, match=f"restored step 1; skipped corrupt newer step.*{named}"):
            assert ckpt.restore(model=model, optimizer=optimizer) == 1
    model_at_1, optimizer_at_1 = two_steps
    assert bitwise_equal(model.state_dict(), model_at_1)
    assert bitwise_equal(optimizer.state_dict()["state"], optimizer_at_1)

    capsys.readouterr()
    assert run_cli(["verify", run_dir]) == 1
    out = capsys.readouterr()
    assert "step 1: OK" in out.out and "step 2: CORRUPT" in out.out and named_path in out.out
    assert "Traceback" not in out.out + out.err


def test_flipped_byte_passes_fast_but_not_full_verification(run_dir, two_steps):
    _flip_byte(os.path.join(run_dir, step_dir_name(2), "model.safetensors"))
    assert verify_checkpoint(run_dir, step=2, verify="fast")[0].valid
    assert not verify_checkpoint(run_dir, step=2, verify="full")[0].valid


def test_every_step_corrupt_is_an_error_not_a_fresh_start(run_dir, two_steps):
    for step in (1, 2):
        _truncate(os.path.join(run_dir, step_dir_name(step), "model.safetensors"))
    with Checkpointer(run_dir) as ckpt, pytest.raises(CheckpointCorruptError, match="no valid checkpoint among 2 step"):
        ckpt.restore(model=tiny_model())


def test_resaving_over_a_corrupt_step_moves_it_aside(run_dir, two_steps):
    _truncate(os.path.join(run_dir, step_dir_name(2), "model.safetensors"))
    model = tiny_model(3)
    with Checkpointer(run_dir) as ckpt:
        with pytest.warns(CheckpointFallbackWarning):
            assert ckpt.restore(model=model, rng=False) == 1
        ckpt.save(2, model=model)
        assert ckpt.restore(model=tiny_model(4), rng=False) == 2
    assert any(name.startswith(CORRUPT_PREFIX + step_dir_name(2)) for name in os.listdir(run_dir))
    assert verify_checkpoint(run_dir, step=2)[0].valid
