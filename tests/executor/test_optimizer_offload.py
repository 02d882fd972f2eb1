"""The optimizer's state in host memory between steps (executor/optimizer_offload.py): bitwise the optimizer's own
step, the device holding one parameter's state at a time (exact bytes), checkpoints and load_state_dict, the
optimizer in the backward pass beside it, and what it refuses."""

from __future__ import annotations

import copy

import pytest
import torch

from torchckpt.executor.optimizer_in_backward import optimizer_in_backward
from torchckpt.executor.optimizer_offload import OptimizerOffload, state_offload_of
from torchckpt.memory import MemoryMeter
from torchckpt.memory.host_pool import host_live_bytes, host_state_bytes, is_host_tensor
from torchckpt.models import gpt
from torchckpt.planner.runner import StepRunner

OPTIMIZERS = {
    "adamw": lambda params: torch.optim.AdamW(params, lr=1e-3),
    "sgd-momentum": lambda params: torch.optim.SGD(params, lr=0.1, momentum=0.9),
    "adam-decay": lambda params: torch.optim.Adam(params, lr=1e-3, weight_decay=0.01),
    "rmsprop": lambda params: torch.optim.RMSprop(params, lr=1e-3, momentum=0.5),
    "adagrad": lambda params: torch.optim.Adagrad(params, lr=1e-2),  # its state is made at construction
    "adamw-amsgrad": lambda params: torch.optim.AdamW(params, lr=1e-3, amsgrad=True),
}


def _states_equal(plain: torch.optim.Optimizer, other: torch.optim.Optimizer, pairs: list) -> None:
    for p, q in pairs:
        assert plain.state[p].keys() == other.state[q].keys()
        for key, value in plain.state[p].items():
            assert torch.equal(torch.as_tensor(value), torch.as_tensor(other.state[q][key])), key


@pytest.mark.parametrize("name", OPTIMIZERS)
def test_three_steps_match_the_optimizers_own_step_bitwise(name):
    torch.manual_seed(0)
    model = gpt("tiny", dropout=0.0)  # tied embedding and head: one update for the shared weight
    batch = model.example_batch(batch_size=2, seq_len=32)
    other = copy.deepcopy(model)
    plain, offloaded = OPTIMIZERS[name](model.parameters()), OPTIMIZERS[name](other.parameters())
    schedules = [torch.optim.lr_scheduler.StepLR(o, step_size=1, gamma=0.5) for o in (plain, offloaded)]
    with OptimizerOffload(offloaded) as offload:
        for _ in range(3):
            for m, o, schedule in ((model, plain, schedules[0]), (other, offloaded, schedules[1])):
                m(*batch).backward()
                o.step()
                grads_kept = all(p.grad is not None for p in m.parameters())
                o.zero_grad()
                schedule.step()  # the hyperparameters are read at every update
                assert grads_kept  # the step leaves the gradients where the loop expects them
        pairs = list(zip(model.parameters(), other.parameters()))
        assert all(torch.equal(p, q) for p, q in pairs)
        _states_equal(plain, offloaded, pairs)
        tensors = [v for state in offloaded.state.values() for v in state.values() if v.dim() > 0]
        assert tensors and all(is_host_tensor(v) for v in tensors)
        assert offload.updates == 3 * len(offloaded.state)
    assert not any(is_host_tensor(v) for state in offloaded.state.values() for v in state.values())  # remove()


def test_the_device_holds_one_parameters_state_at_a_time():
    """Exact bytes: between steps no state on the device and all of it (2 x parameters for AdamW) on the host; during
    the step, the device peaks at the plain step's own peak less the state, plus the largest parameter's state."""
    torch.manual_seed(1)
    model = torch.nn.Sequential(torch.nn.Linear(256, 512), torch.nn.ReLU(), torch.nn.Linear(512, 64))
    x = torch.randn(8, 256)
    param_bytes = sum(p.numel() * 4 for p in model.parameters())
    largest = max(p.numel() * 4 for p in model.parameters())

    def step_peak(optimizer: torch.optim.Optimizer) -> tuple[int, int]:
        peaks = []
        for _ in range(2):  # the second step is the steady one (the state exists)
            model(x).sum().backward()
            with MemoryMeter() as meter:
                optimizer.step()
            optimizer.zero_grad()
            peaks.append((meter.peak_bytes, meter.baseline_bytes))
        return peaks[-1]

    plain = torch.optim.AdamW(model.parameters())
    plain_peak, plain_base = step_peak(plain)
    del plain  # its state goes; the same parameters take a fresh, offloaded AdamW
    offloaded = torch.optim.AdamW(model.parameters())
    before, activations = host_state_bytes(), host_live_bytes()
    with OptimizerOffload(offloaded):
        peak, base = step_peak(offloaded)
        assert host_state_bytes() - before == 2 * param_bytes  # exp_avg and exp_avg_sq, exactly
        assert host_live_bytes() == activations  # counted apart from offloaded activations (their host budget)
        scalars = 4 * len(offloaded.state)  # AdamW's float32 step counters stay where AdamW keeps them
        assert StepRunner(model, (x,), optimizer=offloaded).state_bytes()["optimizer_state"] == scalars
        with MemoryMeter(module=model, optimizer=offloaded) as meter:
            assert meter.breakdown().optimizer_state == scalars
    assert plain_base - base == 2 * param_bytes  # the device no longer holds the state between steps
    assert peak - base == (plain_peak - plain_base) + 2 * largest  # one parameter's state on the device at a time
    assert host_state_bytes() == before  # remove() brought it back; the host tensors are gone


def test_load_state_dict_and_a_checkpoint_resume_bitwise(tmp_path):
    import torchckpt

    torch.manual_seed(2)
    model = gpt("tiny", dropout=0.0)
    batch = model.example_batch(batch_size=2, seq_len=32)
    reference = copy.deepcopy(model)
    plain = torch.optim.AdamW(reference.parameters(), lr=1e-3)
    for _ in range(4):
        reference(*batch).backward()
        plain.step()
        plain.zero_grad()

    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    with OptimizerOffload(optimizer):
        for _ in range(2):
            model(*batch).backward()
            optimizer.step()
            optimizer.zero_grad()
        checkpointer = torchckpt.Checkpointer(tmp_path / "run")
        checkpointer.save(2, model=model, optimizer=optimizer)
        checkpointer.close()
    resumed_model = gpt("tiny", dropout=0.0)
    resumed = torch.optim.AdamW(resumed_model.parameters(), lr=1e-3)
    with OptimizerOffload(resumed):
        restorer = torchckpt.Checkpointer(tmp_path / "run")
        assert restorer.restore(model=resumed_model, optimizer=resumed) == 2
        restorer.close()
        tensors = [v for state in resumed.state.values() for v in state.values() if v.dim() > 0]
        assert tensors and all(is_host_tensor(v) for v in tensors)  # load_state_dict put them by the parameter
        for _ in range(2):
            resumed_model(*batch).backward()
            resumed.step()
            resumed.zero_grad()
    pairs = list(zip(reference.parameters(), resumed_model.parameters()))
    assert all(torch.equal(p, q) for p, q in pairs)
    _states_equal(plain, resumed, pairs)


def test_beside_the_optimizer_in_the_backward_pass():
    torch.manual_seed(3)
    model = gpt("tiny", dropout=0.0)
    batch = model.example_batch(batch_size=2, seq_len=32)
    other = copy.deepcopy(model)
    plain, inside = torch.optim.AdamW(model.parameters()), torch.optim.AdamW(other.parameters())
    with OptimizerOffload(inside) as offload, optimizer_in_backward(inside):
        for _ in range(2):
            model(*batch).backward()
            plain.step()
            plain.zero_grad()
            other(*batch).backward()  # the updates run in here, each with its state brought to the device
            inside.step()
        assert offload.updates == 2 * len(inside.state)
        assert all(is_host_tensor(s["exp_avg"]) for s in inside.state.values())
    pairs = list(zip(model.parameters(), other.parameters()))
    assert all(torch.equal(p, q) for p, q in pairs)
    _states_equal(plain, inside, pairs)


def test_what_it_refuses():
    layer = torch.nn.Linear(2, 2)
    with pytest.raises(ValueError, match="LBFGS"):
        OptimizerOffload(torch.optim.LBFGS(layer.parameters()))
    with pytest.raises(ValueError, match="fused=False"):
        OptimizerOffload(torch.optim.AdamW(layer.parameters(), fused=True))
    with pytest.raises(TypeError, match="torch.optim.Optimizer"):
        OptimizerOffload(layer)  # type: ignore[arg-type]
    optimizer = torch.optim.SGD(layer.parameters(), lr=0.1, momentum=0.9)
    with pytest.raises(TypeError, match="pin"):
        OptimizerOffload(optimizer, pin="yes")  # type: ignore[arg-type]
    offload = OptimizerOffload(optimizer)
    assert state_offload_of(optimizer) is offload
    with pytest.raises(ValueError, match="already in host memory"):
        OptimizerOffload(optimizer)
    layer(torch.ones(1, 2)).sum().backward()
    weight = layer.weight.detach().clone()

    def closure() -> torch.Tensor:
        return layer(torch.ones(1, 2)).sum()

    with pytest.raises(ValueError, match="closure"):
        optimizer.step(closure)
    assert torch.equal(layer.weight, weight)  # refused before anything changed
    offload.remove()
    offload.remove()  # idempotent
    assert state_offload_of(optimizer) is None
    optimizer.step(closure)  # as before once removed


def test_a_failing_update_leaves_the_gradients_and_state_where_they_were():
    """An update that raises (here: AdamW refusing a sparse gradient) gives the loop back every gradient, and each
    parameter's state stays in host memory."""
    torch.manual_seed(5)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))
    optimizer = torch.optim.AdamW(model.parameters())
    with OptimizerOffload(optimizer):
        model(torch.ones(3, 4)).sum().backward()
        optimizer.step()  # the state exists, in host memory
        model(torch.ones(3, 4)).sum().backward()
        grads = [p.grad for p in model.parameters()]
        sparse = torch.ones(2).to_sparse()
        model[1].bias.grad = sparse  # the last parameter's update fails, after three have run
        with pytest.raises(RuntimeError, match="sparse"):
            optimizer.step()
        assert [p.grad is g for p, g in zip(model.parameters(), grads)][:3] == [True, True, True]
        assert model[1].bias.grad is sparse
        assert all(is_host_tensor(s["exp_avg"]) for s in optimizer.state.values())


def test_load_state_dict_mid_run_is_honoured_and_lands_in_host_memory():
    """load_state_dict replaces the optimizer's state dict: the next updates use the loaded state (not the one
    before), which goes straight to host tensors, cast as torch casts it; the run continues bitwise."""
    torch.manual_seed(6)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 2))
    twin = copy.deepcopy(model)
    x = torch.randn(4, 8)
    plain, offloaded = torch.optim.AdamW(model.parameters()), torch.optim.AdamW(twin.parameters())

    def steps(m: torch.nn.Module, o: torch.optim.Optimizer, n: int) -> None:
        for _ in range(n):
            m(x).sum().backward()
            o.step()
            o.zero_grad()

    with OptimizerOffload(offloaded):
        steps(model, plain, 2)
        steps(twin, offloaded, 2)
        saved = [copy.deepcopy(o.state_dict()) for o in (plain, offloaded)]
        weights = [copy.deepcopy(m.state_dict()) for m in (model, twin)]
        steps(model, plain, 3)
        steps(twin, offloaded, 3)
        before = host_state_bytes()
        for m, o, w, s in zip((model, twin), (plain, offloaded), weights, saved):
            m.load_state_dict(w)
            o.load_state_dict(s)
        assert host_state_bytes() <= before  # the replaced state's host tensors went
        loaded = [v for state in offloaded.state.values() for v in state.values() if v.dim() > 0]
        assert all(is_host_tensor(v) for v in loaded)
        assert not any(v is w for v in loaded for state in saved[1]["state"].values() for w in state.values())
        steps(model, plain, 2)
        steps(twin, offloaded, 2)
        pairs = list(zip(model.parameters(), twin.parameters()))
        assert all(torch.equal(p, q) for p, q in pairs)
        _states_equal(plain, offloaded, pairs)
        double = {"state": {i: {k: v.double() if v.dim() else v for k, v in entry.items()}
                            for i, entry in saved[1]["state"].items()}, "param_groups": saved[1]["param_groups"]}
        offloaded.load_state_dict(double)  # cast to the parameters' float32, as torch casts it
        assert all(v.dtype == torch.float32 and is_host_tensor(v) for state in offloaded.state.values()
                   for v in state.values() if v.dim() > 0)


def test_planning_with_an_offloaded_optimizer_keeps_its_state_in_host_memory():
    """profile's preserved state puts the optimizer's state back into the same host tensors (before, it made
    plain tensors of them, which the meter then counted as device bytes)."""
    import torchckpt

    torch.manual_seed(7)
    model = gpt("tiny", dropout=0.0)
    batch = model.example_batch(batch_size=2, seq_len=16)
    optimizer = torch.optim.AdamW(model.parameters())
    with OptimizerOffload(optimizer):
        for _ in range(2):
            model(*batch).backward()
            optimizer.step()
            optimizer.zero_grad()
        before = {id(v): v.clone() for state in optimizer.state.values() for v in state.values()}
        torchckpt.profile(model, batch, optimizer=optimizer, optimizer_offload=True)
        after = [v for state in optimizer.state.values() for v in state.values() if v.dim() > 0]
        assert after and all(is_host_tensor(v) for v in after)
        assert all(torch.equal(v, before[id(v)]) for state in optimizer.state.values() for v in state.values())


def test_a_step_pre_hook_registered_after_it_is_refused_one_before_sees_the_gradients():
    layer = torch.nn.Linear(4, 4)
    optimizer = torch.optim.SGD(layer.parameters(), lr=0.1, momentum=0.9)
    seen = []
    optimizer.register_step_pre_hook(lambda o, a, k: seen.append(layer.weight.grad is not None))
    with OptimizerOffload(optimizer):
        layer(torch.ones(1, 4)).sum().backward()
        optimizer.step()
        assert seen == [True]
        late = optimizer.register_step_pre_hook(lambda o, a, k: None)
        weight = layer.weight.detach().clone()
        with pytest.raises(ValueError, match="registered on this optimizer after its state went to host memory"):
            optimizer.step()
        assert torch.equal(layer.weight, weight) and layer.weight.grad is not None  # refused before any update
        late.remove()
        optimizer.step()
        assert not torch.equal(layer.weight, weight)


def test_an_offload_never_removed_does_not_keep_its_optimizer_alive():
    import gc
    import weakref

    layer = torch.nn.Linear(64, 64)
    optimizer = torch.optim.AdamW(layer.parameters())
    OptimizerOffload(optimizer)
    layer(torch.ones(1, 64)).sum().backward()
    optimizer.step()
    before, alive = host_state_bytes(), weakref.ref(optimizer)
    del optimizer, layer
    gc.collect()
    assert alive() is None and host_state_bytes() < before


def test_host_tensors_are_known_by_their_storage_and_empty_state_stays_put():
    from torchckpt.memory.host_pool import host_tensor

    before = host_state_bytes()
    base = host_tensor((256,), torch.float32)
    alias = base.detach()
    del base
    assert is_host_tensor(alias) and host_state_bytes() - before == 1024  # the storage lives on in the alias
    alias.set_(torch.zeros(3).untyped_storage())  # the storage swapped: the host one is gone
    assert host_state_bytes() == before and not is_host_tensor(alias)
    empty = torch.nn.Parameter(torch.empty(0))
    full = torch.nn.Parameter(torch.ones(3))
    optimizer = torch.optim.AdamW([empty, full])
    with OptimizerOffload(optimizer):
        (empty.sum() + full.sum()).backward()
        optimizer.step()
        assert not is_host_tensor(optimizer.state[empty]["exp_avg"])
        assert is_host_tensor(optimizer.state[full]["exp_avg"])


def test_a_checkpoint_of_another_optimizer_is_refused_before_anything_changes(tmp_path):
    """Its load hooks only move the state, so the Checkpointer still checks a saved optimizer state against the
    optimizer before loading anything ([no half restore])."""
    import torchckpt
    from torchckpt.state.errors import CheckpointMismatchError

    small = torch.nn.Linear(4, 4)
    other = torch.optim.AdamW([{"params": [small.weight]}, {"params": [small.bias]}])  # two groups
    with torchckpt.Checkpointer(tmp_path / "run") as checkpointer:
        checkpointer.save(1, optimizer=other)
    optimizer = torch.optim.AdamW(small.parameters())  # one group
    with OptimizerOffload(optimizer):
        small(torch.ones(1, 4)).sum().backward()
        optimizer.step()
        before = {key: value.clone() for key, value in optimizer.state[small.weight].items()}
        with torchckpt.Checkpointer(tmp_path / "run") as checkpointer, pytest.raises(CheckpointMismatchError,
                                                                                    match="parameter group"):
            checkpointer.restore(optimizer=optimizer)
        assert all(torch.equal(value, before[key]) for key, value in optimizer.state[small.weight].items())
