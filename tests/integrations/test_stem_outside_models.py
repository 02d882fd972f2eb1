"""Issue 27, item 2 on models nobody here wrote: with ``blocks="auto"`` the profiler may take the work before the
first block as a block (planner/stem.py); whatever it decides, the plan at the floor measures within its budget
and computes the gradients and buffers of no checkpointing, bitwise, and a stem it takes lowers every block's
measured peak."""

from __future__ import annotations

import pytest
import torch
from outside_models import case_for

import torchckpt
from torchckpt.planner import InfeasibleBudgetError
from torchckpt.planner.blocks import block_paths, resolve_blocks

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.mark.parametrize("name", ["resnet", "convnext", "vit", "unet", "sequential_mlp", "dict_input"])
def test_auto_blocks_with_or_without_a_stem_plan_within_budget_and_bitwise(name: str) -> None:
    case = case_for(name)
    model = case.model
    found = block_paths(model, resolve_blocks(model, "auto"))
    costs = torchckpt.profile(model, case.inputs, loss_fn=case.loss_fn)
    note = costs.notes.get("stem", "")
    if list(costs.block_paths) != found:  # a stem taken: exactly one block more, first, and said so
        assert list(costs.block_paths[1:]) == found and note.startswith(f"{costs.block_paths[0]} taken"), note
    else:
        assert not note.startswith(f"{costs.block_paths[0]} taken"), note
    with pytest.raises(InfeasibleBudgetError) as told:
        costs.plan(1)
    plan = costs.plan(told.value.floor_bytes)
    report = torchckpt.verify_plan(model, plan, case.inputs, loss_fn=case.loss_fn)
    assert report.within_budget, report
    assert report.gradients_equal and report.buffers_equal, (report, report.first_differing_buffer)
    assert report.max_gradient_difference == 0.0 or report.rounding_only, report


@pytest.mark.slow  # 10 s; tests/planner/test_stem.py checks the same on a small stem network in the fast tier
def test_the_stem_of_a_resnet_at_full_resolution_is_taken_and_lowers_the_floor() -> None:
    """An HF ResNet of bottleneck blocks whose stem (7x7 convolution, BatchNorm, max-pooling at 128 px) holds its
    full-resolution activations through every block's backward pass (every block checkpointed: 73% of the
    no-checkpointing peak without the stem, 50% with it, when written)."""
    import importlib.util

    if importlib.util.find_spec("transformers") is None:
        pytest.skip("needs transformers")
    import transformers

    config = transformers.ResNetConfig(num_channels=3, embedding_size=16, hidden_sizes=[32, 64], depths=[2, 2],
                                       layer_type="bottleneck", num_labels=10)
    torch.manual_seed(0)
    model = transformers.ResNetForImageClassification(config).train()
    inputs = {"pixel_values": torch.randn(4, 3, 128, 128, generator=torch.Generator().manual_seed(0)),
              "labels": torch.tensor([1, 2, 3, 4])}
    costs = torchckpt.profile(model, inputs)
    assert costs.block_paths[0] == "resnet.embedder", costs.notes.get("stem")
    with pytest.raises(InfeasibleBudgetError) as by_hand:
        torchckpt.plan(model, inputs, 1, blocks=resolve_blocks(model, "auto"))
    with pytest.raises(InfeasibleBudgetError) as told:
        costs.plan(1)
    assert told.value.floor_bytes < by_hand.value.floor_bytes
    report = torchckpt.verify_plan(model, costs.plan(told.value.floor_bytes), inputs)
    assert report.within_budget and report.gradients_equal and report.buffers_equal, report
    assert report.max_gradient_difference == 0.0, report


@pytest.mark.slow  # 13 s; tests/planner/test_stem.py checks regions off over a stem in the fast tier
def test_a_mobilenet_stem_is_planned_without_regions_and_holds_its_prediction() -> None:
    """HF MobileNetV2: its stem taken, a region over it (its input the batch) measured 7% over its prediction; the
    stem is planned in single blocks only, and plans at and above the floor measure what they predict."""
    import importlib.util

    if importlib.util.find_spec("transformers") is None:
        pytest.skip("needs transformers")
    import transformers

    torch.manual_seed(0)
    config = transformers.MobileNetV2Config(image_size=64, depth_multiplier=0.35, num_labels=10)
    model = transformers.MobileNetV2ForImageClassification(config).train()
    inputs = {"pixel_values": torch.randn(4, 3, 96, 96, generator=torch.Generator().manual_seed(0)),
              "labels": torch.tensor([1, 2, 3, 4])}
    costs = torchckpt.profile(model, inputs)
    assert costs.block_paths[0] == "mobilenet_v2.conv_stem", costs.notes.get("stem")
    assert costs.notes["regions"].startswith("off: the stem"), costs.notes
    with pytest.raises(InfeasibleBudgetError) as told:
        costs.plan(1)
    for budget in (told.value.floor_bytes, int(1.1 * told.value.floor_bytes)):
        plan = costs.plan(budget)
        report = torchckpt.verify_plan(model, plan, inputs)
        assert report.measured_peak_bytes <= plan.predicted_peak_bytes <= budget, report
        assert report.gradients_equal and report.buffers_equal and report.max_gradient_difference == 0.0, report


def _vision(name: str) -> torch.nn.Module:
    transformers = pytest.importorskip("transformers")
    t = transformers
    configs = {  # small configurations of HF vision families with a stem, a patch embedding or neither
        "regnet": lambda: t.RegNetForImageClassification(t.RegNetConfig(
            embedding_size=16, hidden_sizes=[16, 32], depths=[2, 2], groups_width=8, num_labels=10)),
        "mobilenetv2": lambda: t.MobileNetV2ForImageClassification(t.MobileNetV2Config(
            image_size=64, depth_multiplier=0.35, num_labels=10)),
        "efficientnet": lambda: t.EfficientNetForImageClassification(t.EfficientNetConfig(
            image_size=64, width_coefficient=0.25, depth_coefficient=0.3, hidden_dim=320, num_labels=10)),
        "swin": lambda: t.SwinForImageClassification(t.SwinConfig(
            image_size=64, patch_size=4, embed_dim=16, depths=[2, 2], num_heads=[2, 4], window_size=4, num_labels=10)),
        "convnextv2": lambda: t.ConvNextV2ForImageClassification(t.ConvNextV2Config(
            hidden_sizes=[16, 32], depths=[2, 2], num_stages=2, num_labels=10)),
        "bit": lambda: t.BitForImageClassification(t.BitConfig(
            embedding_size=16, hidden_sizes=[32, 64], depths=[1, 1], layer_type="bottleneck", num_groups=8,
            num_labels=10)),
        "mobilevit": lambda: t.MobileViTForImageClassification(t.MobileViTConfig(
            image_size=64, hidden_sizes=[16, 24, 32], neck_hidden_sizes=[8, 8, 16, 16, 24, 32, 64], num_labels=10)),
        "poolformer": lambda: t.PoolFormerForImageClassification(t.PoolFormerConfig(
            hidden_sizes=[16, 32, 64, 128], depths=[1, 1, 2, 1], num_labels=10)),
        "levit": lambda: t.LevitForImageClassification(t.LevitConfig(
            image_size=96, hidden_sizes=[32, 48, 64], num_attention_heads=[2, 2, 2], depths=[1, 1, 1],
            key_dim=[8, 8, 8], num_labels=10)),
    }
    torch.manual_seed(0)
    return configs[name]().train()


@pytest.mark.slow  # ~4 min: nine HF vision families profiled and verified; the fast tier covers ResNet, MobileNetV2
@pytest.mark.parametrize("name", ["regnet", "mobilenetv2", "efficientnet", "swin", "convnextv2", "bit", "mobilevit",
                                  "poolformer", "levit"])
def test_hf_vision_families_plan_exactly_at_their_floor_with_or_without_a_stem(name: str) -> None:
    model = _vision(name)
    inputs = {"pixel_values": torch.randn(4, 3, 96, 96, generator=torch.Generator().manual_seed(0)),
              "labels": torch.tensor([1, 2, 3, 4])}
    costs = torchckpt.profile(model, inputs)
    with pytest.raises(InfeasibleBudgetError) as told:
        costs.plan(1)
    plan = costs.plan(told.value.floor_bytes)
    report = torchckpt.verify_plan(model, plan, inputs)
    assert report.measured_peak_bytes <= plan.predicted_peak_bytes <= told.value.floor_bytes, (report, costs.notes)
    assert report.gradients_equal and report.buffers_equal and report.max_gradient_difference == 0.0, report
