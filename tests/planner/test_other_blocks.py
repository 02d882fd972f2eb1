"""Issue 28, defect 6: when the blocks ``"auto"`` finds leave the floor high and another grouping the finder saw
measures much lower, the error and the plan name it with the ``blocks=`` to pass, and that fix works
(other_blocks.py's [a much lower floor elsewhere is named])."""

from __future__ import annotations

import ast
import re

import pytest
import torch
from torch import nn

import torchckpt
from torchckpt.planner import InfeasibleBudgetError

pytestmark = pytest.mark.usefixtures("one_thread")


class ConvBlock(nn.Module):
    def __init__(self, channels: int) -> None:
        super().__init__()
        self.a, self.b = nn.Conv2d(channels, channels, 3, padding=1), nn.Conv2d(channels, channels, 3, padding=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.b(torch.relu(self.a(x)))


class TokenBlock(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.up, self.down = nn.Linear(width, 2 * width), nn.Linear(2 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.nn.functional.gelu(self.up(x)))


class Hybrid(nn.Module):
    """MobileViT's shape: two wide convolution blocks at full resolution, then more (so ``"auto"`` picks them)
    small token blocks on a downsampled grid."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Conv2d(3, 16, 3, padding=1)
        self.convs = nn.Sequential(ConvBlock(16), ConvBlock(16))
        self.pool = nn.AvgPool2d(8)
        self.tokens = nn.ModuleList(TokenBlock(16) for _ in range(4))
        self.head = nn.Linear(16, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.pool(self.convs(self.stem(x))).flatten(2).transpose(1, 2)
        for block in self.tokens:
            x = block(x)
        return self.head(x.mean(1))


def _floor(model: nn.Module, batch: tuple, **options: object) -> InfeasibleBudgetError:
    with pytest.raises(InfeasibleBudgetError) as error:
        torchckpt.plan(model, batch, "1%", loss_fn=lambda out: out.square().mean(), **options)
    return error.value


def _named_fix(message: str) -> list[str]:
    named = re.search(r"ConvBlock \(2 blocks\): \d+% of it, blocks=\[model\.get_submodule\(p\) for p in (\[[^\]]*\])\]",
                      message)
    assert named is not None, message
    return ast.literal_eval(named.group(1))


def test_a_much_lower_grouping_is_named_and_the_named_fix_lowers_the_floor() -> None:
    torch.manual_seed(0)
    model = Hybrid()
    batch = (torch.randn(4, 3, 64, 64, generator=torch.Generator().manual_seed(1)),)
    found = _floor(model, batch)
    assert "The blocks planned: tokens.0" in str(found)
    paths = _named_fix(str(found))
    assert paths == ["convs.0", "convs.1"]
    fixed = _floor(model, batch, blocks=[model.get_submodule(path) for path in paths])
    assert fixed.floor_bytes < found.floor_bytes - 0.1 * float(found.breakdown["no_checkpointing_peak_bytes"])
    made = torchckpt.plan(model, batch, found.floor_bytes, loss_fn=lambda out: out.square().mean())
    assert "ConvBlock (2 blocks)" in made.notes["other blocks"], made.notes


def test_blocks_that_do_well_get_no_advice() -> None:
    from torchckpt.models import gpt

    model = gpt("tiny", dropout=0.0)
    batch = model.example_batch(batch_size=4, seq_len=128)
    made = torchckpt.plan(model, batch, "60%")
    assert "other blocks" not in made.notes


@pytest.mark.slow
def test_mobilevit_is_told_its_inverted_residuals() -> None:
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.MobileViTConfig(image_size=64, hidden_sizes=[48, 64, 80],
                                          neck_hidden_sizes=[16, 16, 24, 48, 64, 80, 160], num_labels=10)
    model = transformers.MobileViTForImageClassification(config).train()
    batch = {"pixel_values": torch.randn(4, 3, 64, 64, generator=torch.Generator().manual_seed(1)),
             "labels": torch.tensor([1, 2, 3, 4])}
    with pytest.raises(InfeasibleBudgetError) as error:
        torchckpt.plan(model, batch, "1%")
    message = str(error.value)
    named = re.search(r"MobileViTInvertedResidual \(4 blocks\): \d+% of it, blocks=\[model\.get_submodule\(p\) for "
                      r"p in (\[[^\]]*\])\]", message)
    assert named is not None, message
    blocks = [model.get_submodule(path) for path in ast.literal_eval(named.group(1))]
    with pytest.raises(InfeasibleBudgetError) as fixed:
        torchckpt.plan(model, batch, "1%", blocks=blocks)
    plain = float(error.value.breakdown["no_checkpointing_peak_bytes"])
    assert fixed.value.floor_bytes < error.value.floor_bytes - 0.2 * plain
    made = torchckpt.plan(model, batch, fixed.value.floor_bytes, blocks=blocks)
    report = torchckpt.verify_plan(model, made, batch)
    assert report.within_budget and report.gradients_equal and report.buffers_equal, report.table()
