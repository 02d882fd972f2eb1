"""MemoryMeter on CPU against analytic byte counts."""

from __future__ import annotations

import gc

import pytest
import torch
from torch import nn

from torchckpt.memory import MemoryMeter


@pytest.mark.parametrize("dtype,numel", [(torch.float32, 1000), (torch.float16, 4096), (torch.int8, 77),
                                         (torch.float64, 3)])
def test_known_allocation_exact_bytes(dtype: torch.dtype, numel: int) -> None:
    with MemoryMeter(include_existing=False) as meter:
        x = torch.empty(numel, dtype=dtype)
        assert meter.current_bytes == numel * dtype.itemsize
        del x
    assert meter.peak_bytes == numel * dtype.itemsize
    assert meter.current_bytes == 0


def test_views_aliases_and_inplace_are_not_double_counted() -> None:
    with MemoryMeter(include_existing=False) as meter:
        x = torch.zeros(64, 64)
        views = [x.view(4096), x.t(), x[3:10], x.detach(), x.reshape(64, 64), x.unsqueeze(0), x.as_strided((8,), (2,))]
        x.add_(1.0)
        x.mul_(2.0)
        torch.add(x, 1.0, out=x)
        assert meter.current_bytes == 64 * 64 * 4
        del views, x
    assert meter.peak_bytes == 64 * 64 * 4
    assert meter.current_bytes == 0


def test_freed_storage_is_subtracted_and_peak_kept() -> None:
    with MemoryMeter(include_existing=False) as meter:
        a = torch.ones(1000)
        b = torch.ones(2000)
        del a
        c = torch.ones(500)
        assert meter.current_bytes == (2000 + 500) * 4
        assert meter.peak_bytes == (1000 + 2000) * 4
        meter.reset_peak()
        assert meter.peak_bytes == (2000 + 500) * 4
        del b, c
    assert meter.current_bytes == 0


def test_in_place_resize_counts_the_new_size() -> None:
    with MemoryMeter(include_existing=False) as meter:
        x = torch.empty(10)
        x.resize_(1000)
        x.add_(0)  # the next op on x shows the meter the resized storage
        assert meter.current_bytes == 4000


def test_baseline_counts_existing_tensors_and_their_release() -> None:
    existing = torch.ones(12345)
    gc.collect()
    with MemoryMeter() as meter:
        assert meter.baseline_bytes >= existing.numel() * 4
        before = meter.current_bytes
        del existing
        assert meter.current_bytes == before - 12345 * 4


def test_existing_tensors_are_ignored_without_include_existing() -> None:
    weight = torch.randn(100, 100)
    with MemoryMeter(include_existing=False) as meter:
        y = weight.t().contiguous()
        assert meter.current_bytes == 100 * 100 * 4
        del y
    assert meter.baseline_bytes == 0


def test_small_mlp_training_step_matches_hand_computed_peak() -> None:
    """Linear(I,H) -> ReLU -> Linear(H,O), loss = out.sum(); parameters and input exist before.

    Peak is in ReLU's backward: the ReLU output (kept by autograd), the gradient flowing into it and
    the gradient it produces (3 x B*H floats), plus what is already final: the second layer's weight and
    bias gradients (H*O + O floats), the loss and the ones_like seed of backward (1 + 1 floats).
    """
    for batch, inputs, hidden, outputs in [(64, 32, 128, 16), (96, 8, 256, 4)]:
        model = torch.nn.Sequential(torch.nn.Linear(inputs, hidden), torch.nn.ReLU(), torch.nn.Linear(hidden, outputs))
        x = torch.randn(batch, inputs)
        with MemoryMeter(include_existing=False) as meter:
            model(x).sum().backward()
        assert meter.peak_bytes == 4 * (3 * batch * hidden + hidden * outputs + outputs + 2)
        grads_bytes = 4 * sum(p.numel() for p in model.parameters())
        assert meter.current_bytes == grads_bytes  # the loss is gone once backward returns


def test_counts_tensors_made_in_backward_and_recomputation() -> None:
    from torchckpt.executor import checkpoint

    layer = torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.Tanh(), torch.nn.Linear(256, 256))
    x = torch.randn(512, 256, requires_grad=True)
    with MemoryMeter(include_existing=False) as plain:
        layer(x).sum().backward()
    x.grad = None
    layer.zero_grad(set_to_none=True)
    with MemoryMeter(include_existing=False) as ckpt:
        out = checkpoint(layer, x)
        held = ckpt.current_bytes
        out.sum().backward()
    # Between forward and backward the checkpoint holds only the output (512 x 256 floats): no activations.
    activation_bytes = 512 * 256 * 4
    assert held == activation_bytes
    # Recomputation happens inside backward, while the output is still alive: the recomputed tanh output
    # and the recomputed last-layer output (made before early stop) coexist with it, so the meter must see
    # at least three activation-sized tensors, and more than the plain step's peak by exactly the extra
    # recomputed output (the plain step frees nothing it would need).
    assert ckpt.peak_bytes >= 3 * activation_bytes
    assert ckpt.peak_bytes == plain.peak_bytes + activation_bytes


def test_breakdown_names_parameters_gradients_and_optimizer_state() -> None:
    model = torch.nn.Linear(32, 16)
    optimizer = torch.optim.Adam(model.parameters())
    model(torch.randn(4, 32)).sum().backward()
    optimizer.step()
    param_bytes = 4 * (32 * 16 + 16)
    with MemoryMeter(module=model, optimizer=optimizer) as meter:
        activation = torch.empty(1000)
        parts = meter.breakdown()
    assert parts.parameters == param_bytes
    assert parts.gradients == param_bytes
    assert parts.optimizer_state == 2 * param_bytes + 4 * 2  # exp_avg, exp_avg_sq, one step count per param
    assert parts.activations >= activation.numel() * 4
    assert parts.total == meter.current_bytes


def test_bad_arguments_are_explained() -> None:
    with pytest.raises(ValueError, match="only 'cpu' and 'cuda'"):
        MemoryMeter("meta")
    with pytest.raises(TypeError, match="must be an nn.Module"):
        MemoryMeter(module=torch.ones(1))  # type: ignore[arg-type]
    meter = MemoryMeter()
    with meter, pytest.raises(RuntimeError, match="already active"):
        meter.__enter__()


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_meter_follows_allocator() -> None:
    with MemoryMeter("cuda", include_existing=False) as meter:
        x = torch.empty(2**20, device="cuda")
        assert meter.current_bytes == 4 * 2**20
        del x
    assert meter.peak_bytes == 4 * 2**20


def test_device_of_names_the_device_a_step_is_measured_on() -> None:
    from torchckpt.memory import device_of, synchronize

    assert device_of(nn.Linear(2, 2)) == torch.device("cpu")
    assert device_of(nn.ReLU()) == torch.device("cpu")  # nothing to place: the CPU
    assert device_of(nn.Linear(2, 2, device="meta")) == torch.device("cpu")  # meta tensors hold no memory
    synchronize(torch.device("cpu"))  # a no-op, and no error
    with pytest.raises(TypeError, match=r"device_of\(\) takes an nn.Module; got function"):
        device_of(lambda x: x)  # type: ignore[arg-type]


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_device_of_refuses_a_model_split_across_devices() -> None:
    from torchckpt.memory import device_of

    model = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2).cuda())
    with pytest.raises(ValueError, match=r"live on several devices \(cpu, cuda:0\).*model.to\(device\)"):
        device_of(model)
    assert device_of(model.cuda()) == torch.device("cuda", torch.cuda.current_device())
