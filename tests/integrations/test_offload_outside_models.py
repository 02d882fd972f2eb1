"""Offload (costs.py's [offloaded blocks]) on models nobody here wrote: every family of outside_models.py profiled
with ``offload=True`` and planned with copies made nearly free (the CPU's own copies are slower than recomputing, so
its plans would rarely offload; a GPU's hide behind compute): at three budgets (midway and a quarter of the way to
no checkpointing, and every block's measured peak) some plan offloads blocks; each measures within its budget at
its predicted peak (within 5%, never under), keeps the host bytes it predicted, and gives gradients and buffers
bitwise equal to no checkpointing.
Slow tier (make test-all); tests/planner/test_offload_plans.py checks the same on the project's GPT in the fast one.
"""

from __future__ import annotations

import dataclasses
import importlib.util

import pytest
import torch
from outside_models import BUILDERS, NEEDS

import torchckpt
from torchckpt.planner import solve

pytestmark = pytest.mark.slow


@pytest.mark.parametrize("name", sorted(BUILDERS))
def test_offloading_plans_hold_on_outside_models(name: str) -> None:
    package = NEEDS.get(name, "transformers")
    if package is not None and importlib.util.find_spec(package) is None:
        pytest.skip(f"{name} needs {package}")
    torch.manual_seed(0)
    case = BUILDERS[name]()
    costs = torchckpt.profile(case.model, case.inputs, loss_fn=case.loss_fn, offload=True)
    fast = dataclasses.replace(costs, blocks=tuple(dataclasses.replace(b, offload_time_s=0.05 * b.forward_time_s)
                                                   for b in costs.blocks))
    plain_peak, _ = solve.evaluate(costs, tuple(solve.Single(i, 0) for i in range(len(costs.blocks))))
    offloaded_any = False
    for share in (0.5, 0.25, 0.0):
        budget = int(costs.every_block_peak_bytes + share * (plain_peak - costs.every_block_peak_bytes))
        plan = fast.plan(budget)
        offloaded_any |= bool(plan.offload)
        report = torchckpt.verify_plan(case.model, plan, case.inputs, loss_fn=case.loss_fn)
        assert report.gradients_equal and report.buffers_equal, (name, share, report.table())
        assert report.measured_peak_bytes <= report.predicted_peak_bytes <= budget, (name, share, report.table())
        assert report.prediction_error <= 0.05, (name, share, report.table())
        assert report.measured_host_peak_bytes == report.predicted_host_peak_bytes, (name, share)
    # a model so small that the margin of unmeasured plans (64 KiB + 0.5%) spans most of the way from every block's
    # peak to no checkpointing (sequential_mlp) fits only the two measured schedules there
    if plain_peak - costs.every_block_peak_bytes > 2 * costs.margin_bytes:
        assert offloaded_any, f"{name}: no plan offloaded a block"
