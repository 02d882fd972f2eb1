"""Issue 13: models nobody here wrote, from configs with random weights (outside_models.py).

For each model one profile is shared by four budgets (the floor, midway, ~90% of the no-checkpointing
peak, and that peak itself): every plan measures within its budget under ``verify_plan`` with gradients
and buffers bitwise equal to the model without checkpointing, and planning (profiling, solving, verifying) leaves the
model's parameters, buffers, gradients and the RNG exactly as they were. Every model is planned with
``blocks="auto"``, checked against the blocks each model should get (staged vision models: every layer
of every stage; the UNet: its down, mid and up blocks).
"""

from __future__ import annotations

import gc
from typing import Any

import numpy as np
import pytest
import torch
from outside_models import BUILDERS, NEEDS, Case

import torchckpt
from torchckpt.planner import InfeasibleBudgetError, block_paths, fingerprint, plan_from_costs, profile, resolve_blocks
from torchckpt.planner import solve as solver
from torchckpt.planner.from_costs import no_checkpointing_schedule
from torchckpt.planner.runner import StepRunner

# The fast tier plans one model of each kind (an HF decoder, a CNN, a diffusers UNet, a PEFT adapter) at every
# budget; the other families run in the slow tier (make test-all).
FAST = {"llama", "resnet", "unet", "lora_llama"}
assert FAST <= set(BUILDERS), FAST - set(BUILDERS)

# Defects found: (model, budget) -> the reason; these stay strict (xfail(strict=True)).
KNOWN_DEFECTS: dict[tuple[str, str], str] = {}
BUDGETS = ("floor", "midway", "90%", "100%")
PUBLIC_PLAN = {"sequential_mlp", "dict_input", "llama", "unet"}


def _needed(name: str) -> str | None:
    return NEEDS.get(name, "transformers")


def _build(name: str) -> Case:
    module = _needed(name)
    if module is not None:
        pytest.importorskip(module)
        if name == "lora_llama":
            pytest.importorskip("transformers")
    torch.manual_seed(0)
    return BUILDERS[name]()


def _bits(tensor: torch.Tensor) -> np.ndarray:
    """A tensor's bytes as NumPy memory: the meter counts every live tensor, and these copies are not
    part of the step being measured."""
    return tensor.detach().contiguous().reshape(-1).view(torch.uint8).numpy().copy()


def _state(model: torch.nn.Module) -> dict[str, np.ndarray]:
    state = {f"p:{n}": _bits(p) for n, p in model.named_parameters()}
    state.update({f"b:{n}": _bits(b) for n, b in model.named_buffers()})
    state.update({f"g:{n}": _bits(p.grad) for n, p in model.named_parameters() if p.grad is not None})
    state["rng"] = torch.get_rng_state().numpy().copy()
    return state


def _use_cache(model: torch.nn.Module) -> dict[int, Any]:
    return {id(m.config): m.config.use_cache for m in model.modules()
            if hasattr(getattr(m, "config", None), "use_cache")}


def _changed(before: dict[str, np.ndarray], model: torch.nn.Module) -> list[str]:
    after = _state(model)
    if sorted(after) != sorted(before):
        return sorted(set(after) ^ set(before))
    return [k for k in before if not np.array_equal(before[k], after[k])]


class Profiled:
    """One model, profiled once: its cost model, floor and no-checkpointing peak."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.case = case = _build(name)
        model = case.model
        # A run in progress: gradients exist (and BatchNorm statistics have moved) before planning.
        StepRunner(model, case.inputs, case.loss_fn).forward_backward()
        self.before = _state(model)
        self.use_cache = _use_cache(model)
        self.blocks: Any = "auto"
        block_list = resolve_blocks(model, self.blocks)
        self.paths = block_paths(model, block_list)
        self.costs = profile(model, case.inputs, loss_fn=case.loss_fn, blocks=block_list)
        self.changed_by_profile = _changed(self.before, model)
        self.fingerprint = fingerprint(model, case.inputs, self.paths)
        with pytest.raises(InfeasibleBudgetError) as error:  # the floor, as the solver names it
            self.plan("1%")
        self.floor = error.value.floor_bytes
        self.plain = int(solver.evaluate(self.costs, no_checkpointing_schedule(self.costs))[0])

    def budget(self, which: str) -> int:
        return {"floor": self.floor, "midway": (self.floor + self.plain) // 2,
                # ~90% of the plain peak; these tiny models' floors are often above that (parameters and
                # gradients dominate), and then 80% of the way from the floor to the plain peak instead.
                "90%": max(int(0.9 * self.plain), self.floor + (self.plain - self.floor) * 4 // 5),
                "100%": self.plain}[which]  # the no-checkpointing plan

    def plan(self, budget: int | str) -> torchckpt.Plan:
        return plan_from_costs(self.costs, budget, block_paths=self.paths, model_fingerprint=self.fingerprint)


_PROFILED: dict[str, Profiled] = {}


def _profiled(name: str) -> Profiled:
    """The meter counts every live tensor of the process: only one model (the one measured) is kept."""
    if name not in _PROFILED:
        _PROFILED.clear()
        gc.collect()
        _PROFILED[name] = Profiled(name)
    return _PROFILED[name]


def _params(names: list[str], budgets: tuple[str, ...]) -> list:
    out = []
    for name in names:
        for budget in budgets:
            marks = [] if name in FAST else [pytest.mark.slow]
            if (name, budget) in KNOWN_DEFECTS:
                marks.append(pytest.mark.xfail(strict=True, reason=KNOWN_DEFECTS[(name, budget)]))
            out.append(pytest.param(name, budget, id=f"{name}-{budget}", marks=marks))
    return out


@pytest.mark.parametrize(("name", "which"), _params(list(BUILDERS), BUDGETS))
def test_plan_within_budget_and_bitwise_equal(name: str, which: str) -> None:
    profiled = _profiled(name)
    case, model = profiled.case, profiled.case.model
    assert profiled.changed_by_profile == [], "profiling changed the model"
    assert profiled.paths == case.auto_paths
    budget = profiled.budget(which)
    made = profiled.plan(budget)
    assert made.budget_bytes == budget and made.predicted_peak_bytes <= budget
    assert _changed(profiled.before, model) == [], "solving changed the model"
    report = torchckpt.verify_plan(model, made, case.inputs, loss_fn=case.loss_fn)
    print(f"ROW {name} {which} budget={report.budget_bytes} predicted={report.predicted_peak_bytes} "
          f"measured={report.measured_peak_bytes} plain={report.no_checkpointing_peak_bytes} "
          f"within={report.within_budget} grads={report.gradients_equal} buffers={report.buffers_equal} "
          f"extra_s={made.predicted_extra_time_s:.4f} floor={profiled.floor} plain_pred={profiled.plain}")
    assert _changed(profiled.before, model) == [], "verify_plan changed the model"
    assert report.gradients_equal, (report.table(), made.table())
    assert report.buffers_equal, (report.first_differing_buffer, made.table())
    assert report.within_budget, (report.table(), made.table())
    if which == "floor":
        assert made.predicted_extra_time_s > 0  # at the floor something is recomputed
        with pytest.raises(InfeasibleBudgetError) as error:
            profiled.plan(profiled.floor - 1)  # and not a byte lower
        assert error.value.floor_bytes == profiled.floor
        if name in PUBLIC_PLAN:  # torchckpt.plan itself (its own profile) names the same floor
            with pytest.raises(InfeasibleBudgetError) as error:
                torchckpt.plan(model, case.inputs, budget="1%", loss_fn=case.loss_fn, blocks=profiled.blocks)
            assert error.value.floor_bytes == profiled.floor
    assert _changed(profiled.before, model) == []
    assert _use_cache(model) == profiled.use_cache  # HF configs: use_cache (default True) is put back


def _auto_params() -> list:
    out = []
    for name in BUILDERS:
        out.append(pytest.param(name, id=name))
    return out


@pytest.mark.parametrize("name", _auto_params())
def test_auto_finds_the_expected_blocks(name: str) -> None:
    case = _build(name)
    assert block_paths(case.model, resolve_blocks(case.model, "auto")) == case.auto_paths


def test_no_checkpointing_plan_on_a_default_gpt2_measures_as_predicted() -> None:
    """A default GPT-2 config (use_cache=True) a little larger than gpt2() above (6 layers, 128 tokens),
    where the KV cache changes the step's peak: the no-checkpointing plan has no margin, so its measured
    peak must be the one profiled."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.GPT2Config(vocab_size=128, n_embd=64, n_layer=6, n_head=4, n_positions=256,
                                     bos_token_id=0, eos_token_id=0)
    model = transformers.GPT2LMHeadModel(config).train()
    ids = torch.randint(0, 128, (4, 128), generator=torch.Generator().manual_seed(0))
    batch = {"input_ids": ids, "labels": ids}
    made = torchckpt.plan(model, batch, budget="100%")
    assert made.predicted_extra_time_s == 0.0
    report = torchckpt.verify_plan(model, made, batch)
    assert report.gradients_equal and report.buffers_equal
    assert report.no_checkpointing_peak_bytes == made.reference["no_checkpointing_peak_bytes"], report.table()
    assert report.within_budget, report.table()

