"""Selective options ("recompute, keep k ops"): what a menu option says a block keeps is what the executor keeps.

The profiler lists the ops whose outputs autograd saves; a menu option keeps a subset of them. The executor
never keeps some outputs whatever the policy says (policies.py's [no view, in-place or random op is kept]:
views, in-place and random ops; ATen tags attention kernels that take ``dropout_p`` as random). An option
naming one of those would be predicted to hold bytes that are in fact recomputed, so the profiler must leave
them out. These tests check every option of the built-in GPT's menu against the executor: the bytes a
checkpointed block holds after its forward pass, exactly, and the measured peak of a step with every block
on that option, within the 1 KiB of ``test_planner.py`` (headroom taken off), with gradients equal to the
plain model's.
"""

from __future__ import annotations

import pytest
import torch
from planner_helpers import prediction_error

from torchckpt.executor.checkpoint import checkpoint
from torchckpt.executor.policies import save_ops
from torchckpt.memory import MemoryMeter
from torchckpt.models import gpt
from torchckpt.planner import solve as solver
from torchckpt.planner.from_costs import ChainCosts
from torchckpt.planner.profile import profile

BATCH, TOKENS = 4, 64
_Profiled = tuple[torch.nn.Module, tuple, ChainCosts]


@pytest.fixture(scope="module")
def profiled() -> _Profiled:
    torch.manual_seed(0)
    model = gpt("tiny", dropout=0.1)
    batch = model.example_batch(batch_size=BATCH, seq_len=TOKENS)
    return model, batch, profile(model, batch, blocks=list(model.blocks))


def _checkpoint_options(costs: ChainCosts) -> list[tuple[int, solver.MenuOption]]:
    menu = solver.block_menu(costs.blocks[0])
    return [(k, option) for k, option in enumerate(menu) if not option.plain]


def test_the_menu_offers_selective_options(profiled: _Profiled) -> None:
    _, _, costs = profiled
    assert any(option.kept_ops for _, option in _checkpoint_options(costs))
    assert all(costs.blocks[0].ops[i].saved for _, option in _checkpoint_options(costs) for i in option.kept_ops)


def test_each_option_holds_what_the_executor_keeps(profiled: _Profiled) -> None:
    model, _, costs = profiled
    block = model.blocks[0]
    x = torch.randn(BATCH, TOKENS, model.config.d_model, requires_grad=True)
    names = {op.index: op.name for op in costs.blocks[0].ops}
    for _, option in _checkpoint_options(costs):
        with MemoryMeter() as meter:
            before = meter.current_bytes
            y = checkpoint(block, x, policy=save_ops(option.kept_ops))
            held = meter.current_bytes - before - y.untyped_storage().nbytes()
            del y
        assert held == option.held_bytes, [names[i] for i in option.kept_ops]


def test_every_block_on_one_option_is_predicted_to_the_kilobyte(profiled: _Profiled) -> None:
    model, batch, costs = profiled
    menus = [solver.block_menu(block) for block in costs.blocks]
    for _, option in _checkpoint_options(costs):
        # Menus are per block (op times are each block's own); a block whose menu lacks the option runs plain.
        chosen = [next((k for k, o in enumerate(menu) if not o.plain and o.kept_ops == option.kept_ops), 0)
                  for menu in menus]
        schedule = tuple(solver.Single(block=i, option=k) for i, k in enumerate(chosen))
        error = prediction_error(model, batch, costs, schedule)
        assert -1024 <= error <= 1024, (option.kept_ops, error)
