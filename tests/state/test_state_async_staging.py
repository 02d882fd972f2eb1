"""async_staging=True: parameters and optimizer state are copied by the background thread while training
computes; optimizer steps wait for that copy; buffers are copied before save() returns; an in-place change
outside an optimizer step fails the save loudly instead of writing a torn state."""

from __future__ import annotations

import copy
import threading

import pytest
import torch
from state_workers import bitwise_equal
from torch.optim.optimizer import _global_optimizer_pre_hooks

from torchckpt.state import Checkpointer, CheckpointError
from torchckpt.state.live.staging import HostStaging


def _model_and_optimizer(seed: int = 0) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(600, 600), torch.nn.BatchNorm1d(600), torch.nn.Linear(600, 4))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    _train_step(model, optimizer)
    return model, optimizer


def _train_step(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
    optimizer.zero_grad()
    model(torch.randn(8, 600)).square().mean().backward()  # BatchNorm's running statistics move here
    optimizer.step()


def _restored(run_dir: str, step: int) -> tuple[dict, dict]:
    model, optimizer = _model_and_optimizer(seed=9)
    with Checkpointer(run_dir) as ckpt:
        assert ckpt.restore(model=model, optimizer=optimizer, step=step, rng=False) == step
    return model.state_dict(), optimizer.state_dict()


@pytest.fixture
def gated_finish(monkeypatch):
    """Holds the background copy until the test opens the gate: the test decides what training did first."""
    gate = threading.Event()
    real_finish = HostStaging.finish

    def finish(self: HostStaging) -> list[str]:
        assert gate.wait(timeout=30)
        return real_finish(self)

    monkeypatch.setattr(HostStaging, "finish", finish)
    return gate


def test_training_goes_on_and_each_step_holds_the_state_at_its_save(run_dir):
    model, optimizer = _model_and_optimizer()
    expected = {}
    with Checkpointer(run_dir, async_save=True, async_staging=True) as ckpt:
        for step in range(1, 5):
            expected[step] = (copy.deepcopy(model.state_dict()), copy.deepcopy(optimizer.state_dict()))
            ckpt.save(step, model=model, optimizer=optimizer)
            _train_step(model, optimizer)  # forward/backward overlap the copy; the step waits for it
    for step, (model_state, optimizer_state) in expected.items():
        restored_model, restored_optimizer = _restored(run_dir, step)
        assert bitwise_equal(restored_model, model_state)
        assert bitwise_equal(restored_optimizer, optimizer_state)


def test_optimizer_step_waits_for_the_background_copy_and_buffers_are_copied_at_save(run_dir, gated_finish):
    model, optimizer = _model_and_optimizer()
    expected = (copy.deepcopy(model.state_dict()), copy.deepcopy(optimizer.state_dict()))
    hooks_before = len(_global_optimizer_pre_hooks)
    with Checkpointer(run_dir, async_save=True, async_staging=True) as ckpt:
        ckpt.save(1, model=model, optimizer=optimizer)
        optimizer.zero_grad()
        model(torch.randn(8, 600)).square().mean().backward()  # running statistics change before the copy
        stepped = threading.Thread(target=optimizer.step)
        stepped.start()
        stepped.join(timeout=0.5)
        assert stepped.is_alive()  # the optimizer step is held until the copy is done
        gated_finish.set()
        stepped.join(timeout=30)
        assert not stepped.is_alive() and ckpt.optimizer_wait_s > 0
    assert len(_global_optimizer_pre_hooks) == hooks_before  # the guard is gone once the save is done
    restored_model, restored_optimizer = _restored(run_dir, 1)
    assert bitwise_equal(restored_model, expected[0])
    assert bitwise_equal(restored_optimizer, expected[1])


def test_change_outside_an_optimizer_step_fails_the_save_and_commits_nothing(run_dir, gated_finish):
    model, optimizer = _model_and_optimizer()
    with Checkpointer(run_dir, async_save=True, async_staging=True) as ckpt:
        ckpt.save(1, model=model, optimizer=optimizer)
        with torch.no_grad():
            model[0].weight.mul_(0.5)  # an EMA-style edit while the copy is pending
        gated_finish.set()
        with pytest.raises(CheckpointError, match=r"not saved: tensor\(s\) \['0.weight'\] changed in place.*"
                                                  r"ckpt.wait_staged\(\)"):
            ckpt.wait()
        assert ckpt.list() == []
        ckpt.save(2, model=model, optimizer=optimizer)  # the Checkpointer stays usable
        ckpt.wait_staged()
        with torch.no_grad():
            model[0].weight.mul_(0.5)  # after wait_staged: allowed
    with Checkpointer(run_dir) as ckpt:
        assert [info.step for info in ckpt.list() if info.valid] == [2]


def test_async_staging_needs_async_save(run_dir):
    with pytest.raises(ValueError, match="pass async_save=True too"):
        Checkpointer(run_dir, async_staging=True)
