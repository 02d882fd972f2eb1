"""Every policy on every built-in model (dropout on): gradients bitwise equal to no checkpointing."""

from __future__ import annotations

import copy

import pytest
import torch

from torchckpt.executor import (
    POLICIES,
    checkpoint_modules,
    save_anything_except_these_names,
    save_from_both_policies,
    save_only_these_names,
    saved_residuals,
)
from torchckpt.memory import MemoryMeter
from torchckpt.models import block_modules, gpt, mlp, unet

_POLICIES = {
    **POLICIES,
    "save_only_these_names": save_only_these_names("attention", "mlp_hidden", "conv_1", "linear"),
    "save_anything_except_these_names": save_anything_except_these_names("mlp_hidden", "conv_1", "linear"),
    "save_from_both_policies": save_from_both_policies("dots_with_no_batch_dims_saveable",
                                                       save_only_these_names("attention", "conv_1")),
    "user_callable": lambda op: op.name in {"aten.gelu", "aten.silu", "aten.native_layer_norm"},
}
_MODELS = {  # model, and example_batch options sized for a fast CPU test
    "gpt": (lambda: gpt("tiny", dropout=0.2), {"seq_len": 32}),
    "unet": (lambda: unet("tiny", dropout=0.2), {"image_size": 16}),
    "mlp": (lambda: mlp(depth=4, width=32, dropout=0.2), {}),
}


def _step_grads(model: torch.nn.Module, batch: tuple) -> tuple[float, list[torch.Tensor]]:
    torch.manual_seed(123)  # the same dropout masks for both runs
    loss = model(*batch)
    loss.backward()
    grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad(set_to_none=True)
    return loss.item(), grads


@pytest.mark.parametrize("model_name", sorted(_MODELS))
@pytest.mark.parametrize("policy_name", sorted(_POLICIES))
def test_gradients_bitwise_equal(model_name: str, policy_name: str) -> None:
    torch.manual_seed(0)
    build, batch_options = _MODELS[model_name]
    model = build()
    batch = model.example_batch(batch_size=2, seed=1, **batch_options)
    expected_loss, expected = _step_grads(model, batch)
    with checkpoint_modules(block_modules(model), policy=_POLICIES[policy_name]):
        loss, grads = _step_grads(model, batch)
    assert loss == expected_loss
    for name, (a, b) in zip([n for n, _ in model.named_parameters()], zip(grads, expected)):
        assert torch.equal(a, b), f"{name} differs under {policy_name}"


@pytest.mark.slow  # 20 s; every-block peaks are measured fast in tests/planner
def test_recompute_all_blocks_uses_under_a_quarter_of_the_activation_memory() -> None:
    """gpt('small'), batch 8 x 256. Gradients are allocated before the measured step, so the part of the
    peak above the baseline is exactly activations plus transients."""
    torch.manual_seed(0)
    model = gpt("small")
    batch = model.example_batch(batch_size=8, seq_len=256)
    model(batch[0][:1, :8], batch[1][:1, :8]).backward()
    model.zero_grad(set_to_none=False)
    peaks = {}
    for method in ("plain", "recompute_every_block"):
        handle = checkpoint_modules(model.blocks, policy="nothing_saveable") if method != "plain" else None
        torch.manual_seed(7)
        with MemoryMeter() as meter:
            model(*batch).backward()
        peaks[method] = meter.peak_bytes - meter.baseline_bytes
        if handle:
            handle.remove()
    assert peaks["recompute_every_block"] <= 0.25 * peaks["plain"], peaks


@pytest.mark.parametrize("policy", ["nothing_saveable", "dots_saveable", "everything_saveable",
                                    "dots_with_no_batch_dims_saveable"])
def test_saved_residuals_equal_what_the_meter_measures(policy: str) -> None:
    torch.manual_seed(0)
    block = copy.deepcopy(gpt("tiny", dropout=0.0).blocks[0])
    x = torch.randn(4, 64, 64, requires_grad=True)
    report = saved_residuals(block, x, policy=policy)
    with MemoryMeter(include_existing=False) as meter:
        from torchckpt.executor import checkpoint

        out = checkpoint(block, x, policy=policy)
        held = meter.current_bytes - out.untyped_storage().nbytes()
    assert report.activation_bytes > 0 or policy == "nothing_saveable"
    assert abs(report.activation_bytes - held) <= 0.01 * max(held, 1), (report.table(), held)
    assert report.input_bytes == x.numel() * 4 or policy == "everything_saveable"
