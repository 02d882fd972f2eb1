"""Save then restore gives bitwise-equal state, in the documented layout, without pickle."""

from __future__ import annotations

import json
import os
import random
from pathlib import Path

import numpy as np
import pytest
import torch
from state_helpers import tiny_model, trained
from state_workers import bitwise_equal

from torchckpt.state import (
    Checkpointer,
    CheckpointExistsError,
    CheckpointMismatchError,
    UnsupportedStateError,
)
from torchckpt.state.format.hashing import hash_bytes
from torchckpt.state.format.layout import parse_step_dir_name
from torchckpt.state.format.manifest import canonical_json


def _setup(seed: int, tensor_lr: bool = True):
    model = tiny_model(seed)
    lr = torch.tensor(0.01) if tensor_lr else 0.01  # a tensor lr puts tensors into the scheduler too
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.8, 0.9))
    scheduler = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=0.1, total_steps=50)
    # Imported here: the CUDA test below runs where torchdata is not installed (bench/cuda_check.sh).
    from torchdata.stateful_dataloader import StatefulDataLoader

    loader = StatefulDataLoader(list(range(40)), batch_size=4, shuffle=True)
    return model, optimizer, scheduler, loader


def test_restore_returns_none_when_empty(run_dir):
    with Checkpointer(run_dir) as ckpt:
        assert ckpt.restore(model=tiny_model()) is None


def test_full_state_round_trips_bitwise(run_dir):
    model, optimizer, scheduler, loader = _setup(0)
    trained(model, optimizer)
    scheduler.step()
    batches = iter(loader)
    next(batches), next(batches)
    extras = {"epoch": 3, "best": 0.25, "history": [1.0, 2.0]}
    with Checkpointer(run_dir) as ckpt:
        ckpt.save(7, model=model, optimizer=optimizer, scheduler=scheduler, loader=loader, extras=extras)
    expected_rng = (random.random(), np.random.rand(), torch.rand(3))
    expected_batches = [b.tolist() for b in batches]
    expected_after_loop = torch.rand(3)  # the loader's iterator already existed here

    model2, optimizer2, scheduler2, loader2 = _setup(1)
    extras2: dict = {}
    with Checkpointer(run_dir) as ckpt:
        step = ckpt.restore(model=model2, optimizer=optimizer2, scheduler=scheduler2, loader=loader2, extras=extras2)
    assert step == 7
    assert bitwise_equal(model2.state_dict(), model.state_dict())
    assert bitwise_equal(optimizer2.state_dict(), optimizer.state_dict())
    assert scheduler2.state_dict() == scheduler.state_dict() and extras2 == extras
    assert (random.random(), np.random.rand()) == expected_rng[:2] and torch.equal(torch.rand(3), expected_rng[2])
    assert [b.tolist() for b in loader2] == expected_batches
    # Creating the resumed iterator must not shift torch's RNG stream
    # (live/capture.py's [RNG streams are restored last]).
    assert torch.equal(torch.rand(3), expected_after_loop)


def test_layout_matches_design(run_dir):
    model, optimizer, scheduler, _ = _setup(0, tensor_lr=False)
    trained(model, optimizer)
    with Checkpointer(run_dir) as ckpt:
        ckpt.save(1200, model=model, optimizer=optimizer, scheduler=scheduler, metrics={"loss": 0.5})
    step_dir = os.path.join(run_dir, "step-000001200")
    assert sorted(os.listdir(step_dir)) == [
        "manifest.json", "model.safetensors", "optimizer.json", "optimizer.safetensors", "state.json"
    ]
    manifest = json.loads(Path(step_dir, "manifest.json").read_text())
    assert manifest["step"] == 1200 and manifest["metrics"] == {"loss": 0.5}
    for name, entry in manifest["files"].items():
        assert entry["size_bytes"] == os.path.getsize(os.path.join(step_dir, name))
    optimizer_json = json.loads(Path(step_dir, "optimizer.json").read_text())
    betas = list(optimizer.state_dict()["param_groups"][0]["betas"])
    assert optimizer_json["param_groups"][0]["betas"] == {"__torchckpt__": "tuple", "items": betas}
    for name in os.listdir(step_dir):  # no pickle anywhere: no file starts with pickle/zip magic
        head = Path(step_dir, name).read_bytes()[:4]
        pickled = head[:1] == b"\x80" and head[1:2] in (b"\x02", b"\x03", b"\x04", b"\x05")
        assert not (pickled and name.endswith(".json"))
        assert head != b"PK\x03\x04"


def test_saving_a_committed_step_again_is_refused(run_dir):
    model = tiny_model()
    with Checkpointer(run_dir) as ckpt:
        ckpt.save(3, model=model)
        with pytest.raises(CheckpointExistsError, match="step-000000003 already holds a valid checkpoint"):
            ckpt.save(3, model=model)


def test_restore_names_missing_items_and_shape_mismatch(run_dir):
    with Checkpointer(run_dir) as ckpt:
        ckpt.save(1, model=tiny_model())
        missing = r"no item\(s\) \['optimizer'\]; the checkpoint holds \['model'\]"
        with pytest.raises(CheckpointMismatchError, match=missing):
            ckpt.restore(model=tiny_model(), optimizer=torch.optim.SGD(tiny_model().parameters(), lr=1))
        with pytest.raises(CheckpointMismatchError, match="item 'model' .* rejected the saved state"):
            ckpt.restore(model=torch.nn.Linear(3, 3))


def test_objects_without_state_dict_are_rejected_with_a_hint(run_dir):
    plain_loader = torch.utils.data.DataLoader(list(range(4)))
    with Checkpointer(run_dir) as ckpt:
        with pytest.raises(TypeError, match="StatefulDataLoader"):
            ckpt.save(1, loader=plain_loader)
        with pytest.raises(UnsupportedStateError, match="item 'extras': value at fn"):
            ckpt.save(1, extras={"fn": print})
        with pytest.raises(ValueError, match="item name 'state' is reserved"):
            ckpt.save(1, state={})
    assert not [n for n in os.listdir(run_dir) if parse_step_dir_name(n) is not None]


def test_partial_restore_of_model_only(run_dir):
    model, optimizer, scheduler, _ = _setup(0)
    with Checkpointer(run_dir) as ckpt:
        ckpt.save(5, model=model, optimizer=optimizer, scheduler=scheduler)
    fresh = tiny_model(9)
    with Checkpointer(run_dir) as ckpt:
        assert ckpt.restore(model=fresh, rng=False) == 5
    assert bitwise_equal(fresh.state_dict(), model.state_dict())


@pytest.mark.cuda
def test_gpu_state_round_trips_when_cuda_present(run_dir):
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    model = tiny_model().cuda()
    optimizer = torch.optim.AdamW(model.parameters())
    trained_inputs = torch.randn(5, 4, device="cuda")
    model(trained_inputs).sum().backward()
    optimizer.step()
    cuda_rng = torch.cuda.get_rng_state_all()
    with Checkpointer(run_dir) as ckpt:
        ckpt.save(1, model=model, optimizer=optimizer)
    torch.cuda.manual_seed_all(123)
    fresh = tiny_model(5).cuda()
    fresh_opt = torch.optim.AdamW(fresh.parameters())
    with Checkpointer(run_dir) as ckpt:
        ckpt.restore(model=fresh, optimizer=fresh_opt)
    assert bitwise_equal(
        {k: v.cpu() for k, v in fresh.state_dict().items()}, {k: v.cpu() for k, v in model.state_dict().items()}
    )
    assert all(torch.equal(a, b) for a, b in zip(torch.cuda.get_rng_state_all(), cuda_rng))


class _Picky:
    """A user object whose load_state_dict refuses what was saved: only loading it can tell."""

    def state_dict(self):
        return {"version": 1}

    def load_state_dict(self, state):
        raise ValueError("version 1 is too old")


def _restore_fails_and_changes_nothing(run_dir: str, match: str, rng=None, **items) -> None:
    model = items["model"]
    before = {key: value.clone() for key, value in model.state_dict().items()}
    extras = dict(items.get("extras", {}))
    torch_rng = torch.get_rng_state()
    with Checkpointer(run_dir) as ckpt, pytest.raises(CheckpointMismatchError, match=match):
        ckpt.restore(rng=rng, **items)
    assert bitwise_equal(model.state_dict(), before)
    assert items.get("extras", {}) == extras
    assert torch.equal(torch.get_rng_state(), torch_rng)


def test_optimizer_with_other_param_groups_is_refused_before_the_model_is_loaded(run_dir):
    model, optimizer, _, _ = _setup(0)
    trained(model, optimizer)
    with Checkpointer(run_dir) as ckpt:
        ckpt.save(1, model=model, optimizer=optimizer, extras={"epoch": 3})
    live = tiny_model(9)
    params = list(live.parameters())
    two_groups = torch.optim.AdamW([{"params": params[:2]}, {"params": params[2:]}])
    _restore_fails_and_changes_nothing(run_dir, r"item 'optimizer' .* 2 parameter group\(s\); the saved state has 1",
                                       model=live, optimizer=two_groups, extras={"epoch": 99})
    fewer = torch.optim.AdamW(params[:2])
    _restore_fails_and_changes_nothing(run_dir, r"parameter group 0 holds 2 parameter\(s\); the saved one holds 6",
                                       model=live, optimizer=fewer, extras={"epoch": 99})


def test_module_of_another_shape_is_refused_before_any_item_is_loaded(run_dir):
    with Checkpointer(run_dir) as ckpt:
        ckpt.save(1, model=tiny_model(), extras={"epoch": 3}, other=tiny_model(1))
    # `other` is checked and refused before `extras` (passed first) is touched
    _restore_fails_and_changes_nothing(run_dir, r"item 'other' .* size mismatch for 0.weight: saved \[8, 4\], live "
                                                r"\[3, 3\]", extras={"epoch": 99}, model=tiny_model(5),
                                       other=torch.nn.Sequential(torch.nn.Linear(3, 3)))


def test_saved_cuda_rng_streams_that_cannot_be_restored_are_refused_before_any_item(run_dir):
    with Checkpointer(run_dir) as ckpt:
        ckpt.save(1, model=tiny_model())
    step_dir = os.path.join(run_dir, "step-000000001")
    state = json.loads(Path(step_dir, "state.json").read_text())
    found = torch.cuda.device_count() if torch.cuda.is_available() else 0
    state["rng"]["cuda"] = [state["rng"]["torch_cpu"]] * (found + 1)  # one device more than this machine has
    data = json.dumps(state).encode()
    Path(step_dir, "state.json").write_bytes(data)
    manifest = json.loads(Path(step_dir, "manifest.json").read_text())
    manifest.pop("manifest_hash")
    manifest["files"]["state.json"] = {"size_bytes": len(data), "hash": hash_bytes(data, manifest["hash_algorithm"])}
    manifest["manifest_hash"] = hash_bytes(canonical_json(manifest), "sha256")
    Path(step_dir, "manifest.json").write_text(json.dumps(manifest))
    _restore_fails_and_changes_nothing(run_dir, rf"saved RNG streams of {found + 1} CUDA device\(s\), this process "
                                                rf"has {found}", model=tiny_model(5))
    model = tiny_model(5)
    with Checkpointer(run_dir) as ckpt:
        assert ckpt.restore(model=model, rng=False) == 1  # the fix the message names


def test_an_item_that_fails_only_when_loaded_is_loaded_before_the_checked_ones(run_dir):
    with Checkpointer(run_dir) as ckpt:
        ckpt.save(1, extras={"epoch": 3}, model=tiny_model(), picky=_Picky())
    _restore_fails_and_changes_nothing(run_dir, "item 'picky' .* rejected the saved state: version 1 is too old",
                                       extras={"epoch": 99}, model=tiny_model(5), picky=_Picky())
