"""Issue 28: outside models and loops (outside_loops.py) planned at the floor, as a user in the middle of a run would.

Each case: an AdamW run in progress (one step taken, so its state exists); ``plan()`` at the floor (with the
optimizer and the loop's micro-batch count) and ``verify_plan()`` leave the model, the optimizer and torch's,
NumPy's and Python's RNG streams exactly as they were; the verified step is within budget with gradients and
buffers bitwise equal (the chunked loss head's weight to rounding, as verify_plan states); then two optimizer steps
of the user's loop with the plan applied measure within the budget on every micro-batch and end with the same
parameters as the plain loop from the same state (bitwise where no loss head is chunked). A loop torchckpt refuses
must be refused with the error its case expects, and the fix that error names must then plan and pass the same
checks.
"""

from __future__ import annotations

import ast
import gc
import random
import re
from typing import Any

import numpy as np
import pytest
import torch
from outside_loops import BUILDERS, NEEDS, Loop

import torchckpt
from torchckpt.memory import MemoryMeter
from torchckpt.planner import InfeasibleBudgetError
from torchckpt.planner.runner import StepRunner

# One of each kind in the fast tier; the rest in the slow tier (make test-all).
# T5 and frozen leading layers have fast tests of their own (test_t5_between_blocks.py, test_frozen_leading_blocks.py)
# (micro-batches: tests/planner/test_micro_batches.py)
FAST = {"wav2vec2", "gan_d_twice"}  # spectral norm: tests/planner/test_repeat.py
assert FAST <= set(BUILDERS), FAST - set(BUILDERS)
STEPS = 2


def _build(name: str) -> Loop:
    module = NEEDS.get(name, "transformers")
    if module is not None:
        pytest.importorskip(module)
    torch.manual_seed(0)
    return BUILDERS[name]()


def _bits(tensor: torch.Tensor) -> np.ndarray:
    """Bytes as NumPy memory: the meter counts every live tensor, and these copies are not the step's."""
    return tensor.detach().contiguous().reshape(-1).view(torch.uint8).numpy().copy()


def _snapshot(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    state: dict[str, Any] = {f"p:{n}": _bits(p) for n, p in model.named_parameters()}
    state.update({f"b:{n}": _bits(b) for n, b in model.named_buffers()})
    state.update({f"g:{n}": _bits(p.grad) for n, p in model.named_parameters() if p.grad is not None})
    for i, entry in enumerate(optimizer.state.values()):
        state.update({f"o:{i}:{key}": _bits(value) if isinstance(value, torch.Tensor) else value
                      for key, value in entry.items()})
    state["torch"] = torch.get_rng_state().numpy().copy()
    numpy_state = np.random.get_state()
    state["numpy"] = (numpy_state[1].copy(), numpy_state[2])
    state["random"] = random.getstate()
    return state


def _changed(before: dict[str, Any], model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> list[str]:
    after = _snapshot(model, optimizer)
    if sorted(after) != sorted(before):
        return sorted(set(after) ^ set(before))

    def same(a: Any, b: Any) -> bool:
        if isinstance(a, np.ndarray):
            return np.array_equal(a, b)
        if isinstance(a, tuple):
            return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
        return bool(a == b)

    return [key for key in before if not same(before[key], after[key])]


def _runner(case: Loop, optimizer: torch.optim.Optimizer) -> StepRunner:
    return StepRunner(case.model, case.inputs, case.loss_fn, optimizer, step_fn=case.step_fn)


def _train(case: Loop, optimizer: torch.optim.Optimizer, seed: int) -> tuple[list[int], dict[str, np.ndarray]]:
    """The user's loop: STEPS optimizer steps of ``case.micro_batches`` backward passes each; the meter's peak of
    every micro-batch, and the parameters and buffers at the end."""
    runner = _runner(case, optimizer)
    torch.manual_seed(seed)
    np.random.seed(seed)
    random.seed(seed)
    peaks = []
    for _ in range(STEPS):
        for _ in range(case.micro_batches):
            with MemoryMeter(torch.device("cpu")) as meter:
                runner.forward_backward()
            peaks.append(meter.peak_bytes)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    final = {f"p:{n}": _bits(p) for n, p in case.model.named_parameters()}
    final.update({f"b:{n}": _bits(b) for n, b in case.model.named_buffers()})
    return peaks, final


def _restore(case: Loop, optimizer: torch.optim.Optimizer, params: dict[str, np.ndarray],
             optimizer_state: dict) -> None:
    tensors = {f"p:{n}": p for n, p in case.model.named_parameters()}
    tensors.update({f"b:{n}": b for n, b in case.model.named_buffers()})
    with torch.no_grad():
        for name, tensor in tensors.items():
            tensor.copy_(torch.from_numpy(params[name].copy()).view(tensor.dtype).view(tensor.shape))
    optimizer.load_state_dict(optimizer_state)
    optimizer.zero_grad(set_to_none=True)


def _plan_options(case: Loop, optimizer: torch.optim.Optimizer, fix: dict[str, Any] | None = None) -> dict[str, Any]:
    options: dict[str, Any] = {"optimizer": optimizer, "micro_batches": case.micro_batches}
    if case.loss_fn is not None:
        options["loss_fn"] = case.loss_fn
    if case.step_fn is not None:
        options["step_fn"] = case.step_fn
    blocks = (fix or {}).get("blocks", case.blocks)
    options["blocks"] = blocks(case.model) if callable(blocks) else blocks
    return options


@pytest.mark.parametrize("name", [pytest.param(name, marks=[] if name in FAST else [pytest.mark.slow])
                                  for name in BUILDERS])
def test_planned_at_the_floor_within_budget_on_every_micro_batch_and_exact(name: str) -> None:
    gc.collect()
    case = _build(name)
    model = case.model
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    runner = _runner(case, optimizer)
    for _ in range(case.micro_batches):  # a run in progress: the optimizer's state exists
        runner.forward_backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    np.random.seed(7)
    random.seed(7)
    before = _snapshot(model, optimizer)

    options = _plan_options(case, optimizer)
    if case.refused is not None:
        with pytest.raises(ValueError, match=case.refused) as refusal:
            torchckpt.plan(model, case.inputs, "100%", **options)
        assert _changed(before, model, optimizer) == [], "a refused plan() changed something"
        options = _plan_options(case, optimizer, _fix_from(str(refusal.value), case))
    with pytest.raises(InfeasibleBudgetError) as error:
        torchckpt.plan(model, case.inputs, "1%", **options)
    budget = error.value.floor_bytes
    made = torchckpt.plan(model, case.inputs, budget, **options)
    assert _changed(before, model, optimizer) == [], "plan() changed the model, the optimizer or an RNG stream"
    for note, text in case.expect_notes.items():
        assert text in made.notes.get(note, ""), (note, made.notes)
    verify_options = {k: v for k, v in options.items() if k in ("loss_fn", "step_fn", "optimizer")}
    report = torchckpt.verify_plan(model, made, case.inputs, **verify_options)
    assert _changed(before, model, optimizer) == [], "verify_plan() changed the model, the optimizer or an RNG stream"
    print(f"ROW {name} budget={budget} predicted={made.predicted_peak_bytes} measured={report.measured_peak_bytes} "
          f"plain={report.no_checkpointing_peak_bytes} head={bool(made.loss_head)}")
    assert report.gradients_equal and report.buffers_equal, (report.table(), made.table())
    assert report.within_budget, (report.table(), made.table())

    params = {f"p:{n}": _bits(p) for n, p in model.named_parameters()}
    params.update({f"b:{n}": _bits(b) for n, b in model.named_buffers()})
    optimizer_state = _copy_state(optimizer)
    _, plain_params = _train(case, optimizer, seed=11)
    _restore(case, optimizer, params, optimizer_state)
    with torchckpt.apply(model, made):
        peaks, planned_params = _train(case, optimizer, seed=11)
    assert max(peaks) <= budget, (peaks, budget, made.table())
    head = set(made.loss_head and _tied_to_head(model, made.loss_head["path"]))
    differing = [n for n in plain_params if not np.array_equal(plain_params[n], planned_params[n]) and n not in head]
    assert differing == [], differing


def _fix_from(message: str, case: Loop) -> dict[str, Any]:
    """The fix the error names, as plan() arguments: the block paths it lists, when the case says so."""
    if case.fix.get("blocks") != "as the error names them":
        return case.fix
    named = re.search(r"blocks=\[model\.get_submodule\(p\) for p in (\[[^\]]*\])\]", message)
    assert named is not None, message
    paths = ast.literal_eval(named.group(1))
    assert paths, message
    return {"blocks": lambda model: [model.get_submodule(path) for path in paths]}


def _copy_state(optimizer: torch.optim.Optimizer) -> dict:
    state = optimizer.state_dict()
    return {"state": {k: {n: v.clone() if isinstance(v, torch.Tensor) else v for n, v in entry.items()}
                      for k, entry in state["state"].items()},
            "param_groups": [dict(group) for group in state["param_groups"]]}


def _tied_to_head(model: torch.nn.Module, path: str) -> list[str]:
    """Parameter names sharing storage with the chunked head's weight (its gradient is equal to rounding only)."""
    weight = model.get_submodule(path).weight
    return [f"p:{n}" for n, p in model.named_parameters()
            if p.untyped_storage().data_ptr() == weight.untyped_storage().data_ptr()]
