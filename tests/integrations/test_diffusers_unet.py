"""Issue 13 item 6: a diffusers ``UNet2DModel`` (tiny config, random weights) planned with ``blocks="auto"``:
its down blocks, mid block and up blocks in forward order, per-block plans (no regions: the skips make
it no chain), every plan measured within its budget with gradients and buffers bitwise equal to the
model without checkpointing, and planning leaves the model and the RNG exactly as they were."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import torchckpt
from torchckpt.planner import block_paths, find_blocks, fingerprint, plan_from_costs, profile, resolve_blocks
from torchckpt.planner import solve as solver
from torchckpt.planner.from_costs import no_checkpointing_schedule
from torchckpt.planner.plan import PlannedRegion

diffusers = pytest.importorskip("diffusers")

PATHS = ["down_blocks.0", "down_blocks.1", "mid_block", "up_blocks.0", "up_blocks.1"]


def _unet() -> tuple[torch.nn.Module, tuple, object]:
    torch.manual_seed(0)
    model = diffusers.UNet2DModel(sample_size=32, block_out_channels=(32, 64), layers_per_block=1,
                                  down_block_types=("DownBlock2D", "AttnDownBlock2D"),
                                  up_block_types=("AttnUpBlock2D", "UpBlock2D"), norm_num_groups=8).train()
    generator = torch.Generator().manual_seed(1)
    x, target = torch.randn(2, 3, 32, 32, generator=generator), torch.randn(2, 3, 32, 32, generator=generator)
    timesteps = torch.tensor([10, 500])
    return model, (x, timesteps), lambda out: F.mse_loss(out.sample, target)


def _state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    tensors = {f"p:{n}": p.detach().clone() for n, p in model.named_parameters()}
    tensors.update({f"b:{n}": b.clone() for n, b in model.named_buffers()})
    tensors.update({f"g:{n}": p.grad.clone() for n, p in model.named_parameters() if p.grad is not None})
    tensors["rng"] = torch.get_rng_state()
    return tensors


def test_auto_finds_down_mid_and_up_blocks_in_forward_order() -> None:
    model, _, _ = _unet()
    where, blocks = find_blocks(model)
    assert where == "down_blocks+mid_block+up_blocks"
    assert block_paths(model, blocks) == PATHS


def test_plans_from_the_floor_up_fit_and_are_exact() -> None:
    model, inputs, loss_fn = _unet()
    model(*inputs).sample.sum().backward()  # gradients already there, as in a run in progress
    before = _state(model)
    blocks = resolve_blocks(model, "auto")
    paths = block_paths(model, blocks)
    costs = profile(model, inputs, loss_fn=loss_fn, blocks=blocks)
    assert not costs.chain  # the down blocks' skips are read by the up blocks: single blocks only
    floor = solver.floor_bytes(costs)
    plain = int(solver.evaluate(costs, no_checkpointing_schedule(costs))[0])
    assert floor < plain
    fp = fingerprint(model, inputs, paths)
    for budget in (floor, (floor + plain) // 2, int(0.9 * plain)):
        plan = plan_from_costs(costs, budget, block_paths=paths, model_fingerprint=fp)
        assert plan.block_paths == tuple(PATHS)
        assert not any(isinstance(piece, PlannedRegion) for piece in plan.schedule)
        assert "regions" in plan.notes and plan.predicted_peak_bytes <= budget
        report = torchckpt.verify_plan(model, plan, inputs, loss_fn=loss_fn)
        assert report.within_budget, (budget, report.table(), plan.table())
        assert report.gradients_equal and report.buffers_equal, report.table()
    after = _state(model)
    assert sorted(after) == sorted(before)
    assert [name for name in before if not torch.equal(before[name], after[name])] == []


def test_public_plan_with_dict_inputs_and_blocks_by_hand() -> None:
    model, (x, timesteps), loss_fn = _unet()
    inputs = {"sample": x, "timestep": timesteps}
    blocks = [*model.down_blocks, model.mid_block, *model.up_blocks]
    plan = torchckpt.plan(model, inputs, "60%", loss_fn=loss_fn, blocks=blocks)
    assert plan.block_paths == tuple(PATHS)
    assert plan.table().splitlines()[0] == "blocks: down_blocks.0 … up_blocks.1 (5 blocks)"
    report = torchckpt.verify_plan(model, plan, inputs, loss_fn=loss_fn)
    assert report.within_budget and report.gradients_equal and report.buffers_equal, report.table()


def test_autoencoder_blocks_auto_are_taken_in_the_order_they_run() -> None:
    """diffusers' AutoencoderKL registers its decoder's up blocks before the mid block it runs first:
    ``blocks="auto"`` (named_modules order) once refused to plan it; the profiler now takes the blocks in
    the order they ran, and the plan is within budget and bitwise exact. Blocks given by hand in another
    order are still refused, naming the order they ran in."""
    torch.manual_seed(0)
    model = diffusers.AutoencoderKL(in_channels=3, out_channels=3, down_block_types=("DownEncoderBlock2D",) * 2,
                                    up_block_types=("UpDecoderBlock2D",) * 2, block_out_channels=(16, 32),
                                    layers_per_block=1, latent_channels=4, norm_num_groups=8, sample_size=32).train()
    x = torch.randn(2, 3, 32, 32, generator=torch.Generator().manual_seed(1))

    def loss_fn(out: object) -> torch.Tensor:
        return (out.sample - x).pow(2).mean()  # type: ignore[attr-defined]

    plan = torchckpt.plan(model, (x,), budget="85%", loss_fn=loss_fn)
    paths = list(plan.block_paths)
    mid = [i for i, path in enumerate(paths) if path.startswith("decoder.mid_block")]
    up = [i for i, path in enumerate(paths) if path.startswith("decoder.up_blocks")]
    assert mid and up and max(mid) < min(up), paths
    report = torchckpt.verify_plan(model, plan, (x,), loss_fn=loss_fn)
    assert report.within_budget and report.gradients_equal and report.buffers_equal
    named = resolve_blocks(model, "auto")  # named_modules order: up blocks before the mid block
    with pytest.raises(ValueError, match=r"ran in the order .* not in the order given"):
        torchckpt.plan(model, (x,), budget="85%", loss_fn=loss_fn, blocks=named)
