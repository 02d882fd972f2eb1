"""Issue 13 item 5: ``blocks="auto"`` on staged models (ResNet, ConvNeXt) takes the blocks of every stage, in
forward order, and the plan table, the infeasible-budget message and the blocks errors name them by path.

Before, auto took the longest run of one class in one container: one stage's blocks (torchvision-style
``layer2``) or the stages themselves (HF ConvNeXt ``encoder.stages``), so budgets between the true floor
and that choice's floor were refused. Each test compares against something exact: the paths listed by
hand, the floor of the old choice, and ``verify_plan``'s bitwise gradients and buffers.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import torchckpt
from torchckpt._units import format_bytes
from torchckpt.planner import (
    InfeasibleBudgetError,
    block_paths,
    find_blocks,
    fingerprint,
    plan_from_costs,
    profile,
    resolve_blocks,
)
from torchckpt.planner import solve as solver
from torchckpt.planner.from_costs import no_checkpointing_schedule

pytestmark = pytest.mark.usefixtures("one_thread")


class BasicBlock(nn.Module):
    """torchvision's ResNet BasicBlock, shrunk."""

    def __init__(self, cin: int, cout: int, stride: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.relu = nn.ReLU()
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.downsample = (nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))
                           if stride != 1 or cin != cout else None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        identity = x if self.downsample is None else self.downsample(x)
        out = self.relu(self.bn1(self.conv1(x)))
        return self.relu(self.bn2(self.conv2(out)) + identity)


class TinyResNet(nn.Module):
    """torchvision layout: a stem, ``layer1..layer3`` Sequentials of BasicBlocks (depths 2, 3, 2), a head."""

    def __init__(self, classes: int = 10) -> None:
        super().__init__()
        self.conv1, self.bn1, self.relu = nn.Conv2d(3, 8, 3, 1, 1, bias=False), nn.BatchNorm2d(8), nn.ReLU()
        self.layer1 = nn.Sequential(BasicBlock(8, 8, 1), BasicBlock(8, 8, 1))
        self.layer2 = nn.Sequential(BasicBlock(8, 16, 2), BasicBlock(16, 16, 1), BasicBlock(16, 16, 1))
        self.layer3 = nn.Sequential(BasicBlock(16, 32, 2), BasicBlock(32, 32, 1))
        self.fc = nn.Linear(32, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.relu(self.bn1(self.conv1(x)))
        x = self.layer3(self.layer2(self.layer1(x)))
        return self.fc(x.mean(dim=(2, 3)))


RESNET_PATHS = ["layer1.0", "layer1.1", "layer2.0", "layer2.1", "layer2.2", "layer3.0", "layer3.1"]


def _resnet() -> tuple[nn.Module, tuple, object]:
    torch.manual_seed(0)
    model = TinyResNet().train()
    x = torch.randn(8, 3, 32, 32, generator=torch.Generator().manual_seed(1))
    labels = torch.randint(0, 10, (8,), generator=torch.Generator().manual_seed(2))
    return model, (x,), lambda out: F.cross_entropy(out, labels)


def _convnext() -> tuple[nn.Module, dict, None]:
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.ConvNextConfig(num_channels=3, patch_size=2, hidden_sizes=[8, 16, 32], depths=[2, 3, 2],
                                         num_stages=3, num_labels=10, image_size=32)
    model = transformers.ConvNextForImageClassification(config).train()
    inputs = {"pixel_values": torch.randn(4, 3, 32, 32, generator=torch.Generator().manual_seed(1)),
              "labels": torch.randint(0, 10, (4,), generator=torch.Generator().manual_seed(2))}
    return model, inputs, None


CONVNEXT_PATHS = [f"convnext.encoder.stages.{s}.layers.{i}" for s, depth in enumerate([2, 3, 2]) for i in range(depth)]


def test_auto_takes_every_basic_block_of_every_stage_in_forward_order() -> None:
    model, _, _ = _resnet()
    where, blocks = find_blocks(model)
    assert block_paths(model, blocks) == RESNET_PATHS
    assert where == "layer1 … layer3 (3 containers)"


def test_auto_on_hf_convnext_and_resnet_takes_the_layers_inside_the_stages() -> None:
    transformers = pytest.importorskip("transformers")
    model, _, _ = _convnext()
    assert block_paths(model, resolve_blocks(model, "auto")) == CONVNEXT_PATHS
    config = transformers.ResNetConfig(num_channels=3, embedding_size=8, hidden_sizes=[8, 16, 16, 32],
                                       depths=[1, 2, 3, 1], layer_type="bottleneck")
    resnet = transformers.ResNetModel(config)
    # The bottleneck layers, not the ResNetConvLayers inside them (one convolution each: layers of a block).
    expected = [f"encoder.stages.{s}.layers.{i}" for s, depth in enumerate([1, 2, 3, 1]) for i in range(depth)]
    assert block_paths(resnet, resolve_blocks(resnet, "auto")) == expected


@pytest.mark.parametrize("build, old_choice", [(_resnet, lambda m: list(m.layer2)),
                                               (_convnext, lambda m: list(m.convnext.encoder.stages))],
                         ids=["torchvision-resnet", "hf-convnext"])
def test_a_budget_the_old_choice_refused_now_fits(build, old_choice) -> None:  # noqa: ANN001
    """The old rule's blocks: ResNet ``layer2`` (the longest run in one container), ConvNeXt's three stages
    (a run of 3, as long as the longest stage). A budget midway between the new floor and the old one is
    feasible now, measures within budget, and leaves gradients and buffers bitwise equal."""
    model, inputs, loss_fn = build()
    old = profile(model, inputs, loss_fn=loss_fn, blocks=old_choice(model))
    old_floor = solver.floor_bytes(old)
    blocks = resolve_blocks(model, "auto")
    costs = profile(model, inputs, loss_fn=loss_fn, blocks=blocks)
    floor = solver.floor_bytes(costs)
    assert floor < old_floor
    budget = (floor + old_floor) // 2
    with pytest.raises(InfeasibleBudgetError):
        solver.solve(old, budget)
    paths = block_paths(model, blocks)
    plan = plan_from_costs(costs, budget, block_paths=paths, model_fingerprint=fingerprint(model, inputs, paths))
    assert plan.budget_bytes == budget and plan.predicted_peak_bytes <= budget
    report = torchckpt.verify_plan(model, plan, inputs, loss_fn=loss_fn)
    assert report.within_budget, report.table()
    assert report.gradients_equal and report.buffers_equal, report.table()


def test_table_and_infeasible_message_name_the_blocks_and_the_share_of_the_plain_peak() -> None:
    model, inputs, loss_fn = _resnet()
    blocks = resolve_blocks(model, "auto")
    paths = block_paths(model, blocks)
    costs = profile(model, inputs, loss_fn=loss_fn, blocks=blocks)
    floor = solver.floor_bytes(costs)
    plain = int(solver.evaluate(costs, no_checkpointing_schedule(costs))[0])
    plan = plan_from_costs(costs, "100%", block_paths=paths, model_fingerprint={})
    assert plan.table().splitlines()[0] == "blocks: layer1.0 … layer3.1 (7 blocks)"
    assert plan.table().splitlines()[2].split()[:2] == ["0", "layer1.0"]
    with pytest.raises(InfeasibleBudgetError) as caught:
        plan_from_costs(costs, floor - 1, block_paths=paths, model_fingerprint={})
    error = caught.value
    assert type(error) is InfeasibleBudgetError and isinstance(error, ValueError)
    assert (error.budget_bytes, error.floor_bytes) == (floor - 1, floor)
    share = f"{100 * floor / plain:.1f}%"
    assert f"{floor} bytes ({format_bytes(floor)}; {share} of the no-checkpointing peak, {plain} bytes " in str(error)
    assert str(error).endswith("The blocks planned: layer1.0 … layer3.1 (7 blocks).")
    assert error.breakdown["floor_percent"] == share and error.breakdown["no_checkpointing_peak_bytes"] == plain
    assert "('" not in str(error)  # the solver's "block 3 ('3:BasicBlock')" became "block 3 (layer2.1)"
    assert error.breakdown["fixed_bytes"] == costs.fixed_bytes  # the solver's figures are kept


def test_blocks_out_of_forward_order_are_refused_naming_them() -> None:
    model, inputs, loss_fn = _resnet()
    blocks = list(reversed(resolve_blocks(model, "auto")))
    with pytest.raises(ValueError) as caught:
        profile(model, inputs, loss_fn=loss_fn, blocks=blocks)
    message = str(caught.value)
    assert message.startswith("the blocks layer3.1 … layer1.0 (7 blocks) ran in the order [6, 5, 4, 3, 2, 1, 0] "
                              "(layer1.0, layer1.1, layer2.0, layer2.1, layer2.2, layer3.0, layer3.1)")
    assert "blocks=[...]" in message
