"""Blocks that may not run (issue 28, defect 5): LayerDrop is off while measuring (layerdrop.py's [every block runs
while measuring]) and its plans hold whichever blocks a step skips; a block skipped by a rule of the model's own is
refused with a fix that works."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import torchckpt
from torchckpt.planner.layerdrop import layerdrop_off

pytestmark = pytest.mark.usefixtures("one_thread")
WIDTH = 64


class Residual(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up, self.down = nn.Linear(WIDTH, 2 * WIDTH), nn.Linear(2 * WIDTH, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.nn.functional.gelu(self.up(x)))


class Dropping(nn.Module):
    """Skips each block with probability ``attribute``'s value, as HF's LayerDrop does (one draw per block)."""

    def __init__(self, attribute: str, probability: float, depth: int = 6) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Residual() for _ in range(depth))
        self.attribute = attribute
        setattr(self, attribute, probability)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            if not (self.training and float(torch.rand([])) < getattr(self, self.attribute)):
                x = block(x)
        return x.square().mean()


def _batch() -> tuple[torch.Tensor]:
    return (torch.randn(512, WIDTH, generator=torch.Generator().manual_seed(1)),)


@pytest.mark.parametrize("seed", [0, *(pytest.param(seed, marks=pytest.mark.slow) for seed in (1, 2, 3))])
def test_layerdrop_is_off_while_measuring_and_the_plan_holds_on_steps_that_skip(seed: int) -> None:
    torch.manual_seed(seed)
    model = Dropping("layerdrop", 0.3)
    made = torchckpt.plan(model, _batch(), "60%")
    assert model.layerdrop == 0.3  # put back
    assert "layerdrop=0.3" in made.notes["regions"] and not any(hasattr(p, "inner") for p in made.schedule)
    report = torchckpt.verify_plan(model, made, _batch(), seed=seed)  # blocks skip in the verified steps
    assert report.within_budget and report.gradients_equal and report.buffers_equal, report.table()


def test_a_block_skipped_by_a_rule_of_its_own_is_refused_with_a_fix_that_works() -> None:
    torch.manual_seed(0)
    model = Dropping("skip_probability", 0.5)
    with pytest.raises(ValueError, match=r"did not run in the measured training step") as error:
        for _ in range(8):  # some step skips a block, at these odds
            torchckpt.plan(model, _batch(), "60%")
    assert "set the skipping probability to 0 while planning" in str(error.value)
    assert "regions=False" in str(error.value)
    model.skip_probability = 0.0  # the fix, as the error names it
    made = torchckpt.plan(model, _batch(), "60%", regions=False)
    model.skip_probability = 0.5
    report = torchckpt.verify_plan(model, made, _batch())
    assert report.within_budget and report.gradients_equal and report.buffers_equal, report.table()


def test_layerdrop_off_finds_configs_and_puts_them_back_however_the_block_ends() -> None:
    class Config:  # as HF configs hold them: instance attributes
        def __init__(self) -> None:
            self.encoder_layerdrop, self.decoder_layerdrop, self.hidden_size = 0.1, 0.0, 8

    model = nn.Sequential(nn.Linear(2, 2))
    model[0].config = Config()  # type: ignore[assignment]
    with pytest.raises(RuntimeError), layerdrop_off(model) as note:
        assert model[0].config.encoder_layerdrop == 0.0
        assert note == ("blocks may be skipped at random (encoder_layerdrop=0.1): measured with every block run, "
                        "single blocks only")
        raise RuntimeError("profiling failed")
    assert model[0].config.encoder_layerdrop == 0.1
    with layerdrop_off(nn.Linear(2, 2)) as none:
        assert none is None
