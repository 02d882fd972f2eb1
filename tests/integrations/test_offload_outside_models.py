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
import itertools
from collections.abc import Callable
from typing import Any

import pytest
import torch
from outside_models import BUILDERS, Case, case_for

import torchckpt
from torchckpt.models import gpt
from torchckpt.planner import solve
from torchckpt.planner.from_costs import plan_pieces

_KINDS = ("plain", "offload", "nothing", "nested")


def _case(name: str) -> Case:
    return case_for(name)


def _option(menu: tuple, kind: str) -> int | None:
    for k, option in enumerate(menu):
        if (kind == "plain" and option.plain and not option.offload) or (kind == "offload" and option.offload) or \
                (kind == "nested" and option.nested) or (kind == "nothing" and k == len(menu) - 1):
            return k
    return None


def _mixes_hold(model: Any, inputs: Any, loss_fn: Any,
                mixes: list[tuple[str, ...]] | Callable[[int], list[tuple[str, ...]]]) -> None:
    """Each mix of plain, offloaded, recomputed and nested blocks, as a plan: predicted at or above its measured peak
    (the measured schedules' context, the inputs an offloaded block leaves alive, differ in a mix: ResNet's final
    ReLU saves its output, HF keeps the embeddings' output through the forward pass), host bytes as predicted,
    gradients and buffers bitwise. ``mixes`` may be made from the number of blocks profiled (a stem the profile
    takes is one more than the model's repeated blocks)."""
    optimizer = torch.optim.AdamW(model.parameters())
    costs = torchckpt.profile(model, inputs, loss_fn=loss_fn, optimizer=optimizer, offload=True, loss_head=False)
    menus = [solve.block_menu(block) for block in costs.blocks]
    template = costs.plan(costs.every_block_peak_bytes)
    for kinds in mixes(len(costs.blocks)) if callable(mixes) else mixes:
        assert len(kinds) == len(costs.blocks), (kinds, costs.block_paths)
        options = [_option(menu, kind) for menu, kind in zip(menus, kinds)]
        if None in options:
            continue
        schedule = tuple(solve.Single(i, k) for i, k in enumerate(options) if k is not None)
        peak, _ = solve.evaluate(costs, schedule)
        host = solve.schedule_host_bytes(costs, schedule)
        offload = {"window_bytes": 0, "host_budget_bytes": 1 << 40, "predicted_host_peak_bytes": host,
                   "inputs": int(costs.chain)} if host else {}
        plan = dataclasses.replace(template, schedule=plan_pieces(schedule, menus, costs), predicted_peak_bytes=peak,
                                   budget_bytes=peak, offload=offload)
        report = torchckpt.verify_plan(model, plan, inputs, loss_fn=loss_fn, optimizer=optimizer)
        assert report.measured_peak_bytes <= peak, (kinds, report.table())
        assert report.measured_host_peak_bytes == host, kinds
        assert report.gradients_equal and report.buffers_equal, (kinds, report.table())


def test_mixes_of_offload_and_recompute_are_predicted_at_or_above_their_peaks() -> None:
    torch.manual_seed(0)
    model = gpt("tiny", dropout=0.1)
    mixes = [("plain", "offload"), ("offload", "plain"), ("nothing", "offload"), ("offload", "nested")]
    _mixes_hold(model, model.example_batch(batch_size=2, seq_len=32), None, mixes)


@pytest.mark.slow  # 17 s; four of them in the fast tier above
def test_every_mix_on_the_projects_gpt() -> None:
    torch.manual_seed(0)
    model = gpt("tiny", dropout=0.1)
    _mixes_hold(model, model.example_batch(batch_size=4, seq_len=64), None, list(itertools.product(_KINDS, repeat=2)))


@pytest.mark.slow  # 20-60 s a model; the project's GPT in the fast tier above
@pytest.mark.parametrize("name", ["llama", "roberta", "resnet", "unet", "gpt2"])
def test_mixes_hold_on_outside_models(name: str) -> None:
    case = _case(name)

    def mixes(n: int) -> list[tuple[str, ...]]:  # n: the blocks profiled (HF ResNet's: its stem, then its layers)
        made = [tuple(kind for _ in range(n)) for kind in _KINDS]
        made += [tuple(_KINDS[(i + shift) % 4] for i in range(n)) for shift in range(4)]
        return made + [tuple(("plain", "offload")[(i + shift) % 2] for i in range(n)) for shift in range(2)]
    _mixes_hold(case.model, case.inputs, case.loss_fn, mixes)


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(BUILDERS))
def test_offloading_plans_hold_on_outside_models(name: str) -> None:
    case = _case(name)
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


@pytest.mark.slow  # 2-3 min: an 8-layer HF Llama at 8 x 256 tokens with AdamW
def test_a_rotary_table_kept_by_a_plain_block_is_counted() -> None:
    """Offloaded blocks after plain ones: the plain blocks keep views of the rotary table (made once, passed to every
    block) alive through the backward pass, where a step with every block offloaded had freed it. Measured 64 KiB
    over its prediction before the offload residues counted freed side inputs as alive."""
    pytest.importorskip("transformers")
    from torchckpt.models.registry import get_model

    model, inputs = get_model("hf-llama-8x256").build()
    _mixes_hold(model, inputs, None, [("plain",) + ("offload",) * 7, ("plain", "plain") + ("offload",) * 6])
