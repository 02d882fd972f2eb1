"""Frozen weight matrices (LoRA-style): the planner's prediction against the meter on a post-norm chain.

A linear layer whose weight needs no gradient saves its weight but not its input, so a post-norm block
(``norm(x + mlp(x))``, as in BERT) with frozen weights keeps nothing of its input when it runs plainly:
the input is freed during the forward pass. A checkpointed block holds its input whatever autograd
saves. The profiler measures which case a block is in (``BlockCosts.input_held_when_plain``); these
tests check the resulting predictions against the measured peaks of plain, checkpointed and mixed
schedules, with the tolerance of ``test_planner.py`` (1 KiB on chains, headroom taken off).
"""

from __future__ import annotations

import pytest
import torch
from planner_helpers import prediction_error
from torch import nn

from torchckpt.planner import solve as solver
from torchckpt.planner.profile import profile

WIDTH, BATCH, TOKENS, DEPTH = 32, 4, 64, 4


class _PostNormBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up, self.down, self.norm = nn.Linear(WIDTH, 2 * WIDTH), nn.Linear(2 * WIDTH, WIDTH), nn.LayerNorm(WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(x + self.down(torch.nn.functional.gelu(self.up(x))))


class _PostNormChain(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Linear(WIDTH, WIDTH)
        self.blocks = nn.ModuleList(_PostNormBlock() for _ in range(DEPTH))
        self.head = nn.Linear(WIDTH, 8 * WIDTH)  # a head transient larger than the blocks' inputs

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.stem(x)
        for block in self.blocks:
            h = block(h)
        return self.head(h).pow(2).mean()


def _model(frozen: bool) -> tuple[nn.Module, tuple]:
    torch.manual_seed(0)
    model = _PostNormChain()
    if frozen:  # every weight matrix frozen; biases and norms train, as with adapters
        for param in model.parameters():
            param.requires_grad_(param.dim() < 2)
    return model, (torch.randn(BATCH, TOKENS, WIDTH, generator=torch.Generator().manual_seed(1)),)


def _single(block: int, menus: list, keep_nothing: bool) -> solver.Single:
    return solver.Single(block=block, option=len(menus[block]) - 1 if keep_nothing else 0)


@pytest.mark.parametrize("frozen", [True, False], ids=["frozen-weights", "trainable-weights"])
def test_post_norm_chain_predicted_to_the_kilobyte(frozen: bool) -> None:
    model, batch = _model(frozen)
    costs = profile(model, batch, blocks=list(model.blocks))
    assert costs.chain
    # The measured flag: frozen post-norm blocks do not keep their input; with trainable weights the
    # first linear layer saves it.
    assert [b.input_held_when_plain for b in costs.blocks] == [not frozen] * DEPTH
    menus = [solver.block_menu(block) for block in costs.blocks]
    patterns = {"plain": [False] * DEPTH, "every block recomputed": [True] * DEPTH,
                "alternating": [i % 2 == 0 for i in range(DEPTH)], "last two": [i >= DEPTH - 2 for i in range(DEPTH)]}
    errors = {}
    for name, keep_nothing in patterns.items():
        schedule = tuple(_single(i, menus, keep_nothing[i]) for i in range(DEPTH))
        errors[name] = prediction_error(model, batch, costs, schedule)
    assert all(-1024 <= error <= 1024 for error in errors.values()), errors


def test_post_norm_chain_regions_are_not_under_predicted() -> None:
    """A region holds its first block's input through its backward pass, though that block run plainly
    would not (``Chain.region_context_bytes``); regions are calibrated conservatively (one block output
    more, see ``profile._region_residue``), so only the sign is exact here."""
    model, batch = _model(frozen=True)
    costs = profile(model, batch, blocks=list(model.blocks))
    menus = [solver.block_menu(block) for block in costs.blocks]
    inner = (_single(1, menus, False), _single(2, menus, False))
    schedules = [(_single(0, menus, False), solver.Region(1, 3, inner), _single(3, menus, False)),
                 (solver.Region(0, 2, (_single(0, menus, False), _single(1, menus, True))),
                  solver.Region(2, 4, (_single(2, menus, False), _single(3, menus, False))))]
    for schedule in schedules:
        error = prediction_error(model, batch, costs, schedule)
        assert error >= -1024, (schedule, error)
