"""executor/offload.py: saved activations in host memory between a block's forward and backward passes, bitwise,
each storage copied once, the device holding only what must stay, a host limit never crossed."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from torchckpt.executor import Offloader
from torchckpt.memory import MemoryMeter, host_live_bytes


class _Block(nn.Module):
    """A block whose saved tensors include views of one storage (the transposes of ``h``), an op that saves its own
    output (tanh), a random op (dropout) and a BatchNorm whose statistics it writes."""

    def __init__(self, width: int = 32) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(width, width), nn.Linear(width, width)
        self.norm = nn.BatchNorm1d(width)
        self.drop = nn.Dropout(0.2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.a(x)
        t = torch.tanh(h)
        mix = h.t() @ t  # saves h.t() and t: views and owners of the same storages
        return x + self.drop(self.b(self.norm(t))) + mix.sum() * 1e-3


def _saved_storage_bytes(block: nn.Module, x: torch.Tensor) -> int:
    """The bytes of the distinct storages autograd saves inside ``block``, beside its parameters and input."""
    skip = {t.untyped_storage().data_ptr() for t in (*block.parameters(), *block.buffers(), x)}
    seen: dict[int, int] = {}

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in skip and type(tensor) is torch.Tensor:
            seen[storage.data_ptr()] = storage.nbytes()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = block(x)
    del out
    return sum(seen.values())


def _step(block: nn.Module, x0: torch.Tensor, offloader: Offloader | None, seed: int = 0) -> tuple:
    block.zero_grad(set_to_none=True)
    x = x0.clone().requires_grad_()
    torch.manual_seed(seed)
    with MemoryMeter() as meter:
        start = meter.current_bytes
        out = offloader.run(block, x) if offloader is not None else block(x)
        held = meter.current_bytes - start
        out.square().sum().backward()
        del out
    grads = [p.grad.clone() for p in block.parameters()] + [x.grad.clone()]
    buffers = [b.clone() for b in block.buffers()]
    return grads, buffers, held, meter.peak_bytes - start, meter.host_peak_bytes


def test_gradients_and_buffers_are_bitwise_and_the_device_keeps_only_the_output() -> None:
    torch.manual_seed(0)
    block, x0 = _Block(), torch.randn(64, 32)
    state = {k: v.clone() for k, v in block.state_dict().items()}
    plain_grads, plain_buffers, plain_held, plain_peak, _ = _step(block, x0, None)
    block.load_state_dict(state)
    offloader = Offloader("cpu", module=block)
    grads, buffers, held, peak, host = _step(block, x0, offloader)
    assert all(torch.equal(a, b) for a, b in zip(grads, plain_grads))
    assert all(torch.equal(a, b) for a, b in zip(buffers, plain_buffers))
    output_bytes = x0.numel() * x0.element_size()
    assert held == output_bytes < plain_held  # rule 2: everything saved left the device
    assert peak <= plain_peak
    # rule 1: each storage once, views included, parameters and the input not at all
    assert offloader.offloaded_bytes == _saved_storage_bytes(block, x0.clone().requires_grad_()) == host


def test_host_buffers_are_freed_with_the_graph() -> None:
    block, x0 = _Block(), torch.randn(16, 32)
    before = host_live_bytes()
    offloader = Offloader("cpu", module=block)
    out = offloader.run(block, x0.clone().requires_grad_())
    assert host_live_bytes() - before == offloader.offloaded_bytes > 0
    out.sum().backward()
    del out
    assert host_live_bytes() == before


def test_an_alive_original_is_not_brought_back_and_a_changed_one_is() -> None:
    """Rule 3: tanh saves its output; kept alive by the caller it is used as is (no second device copy); changed in
    place after the forward pass, the host copy (the value autograd saved) is brought back."""
    weight = nn.Parameter(torch.randn(32, 32))

    def fn(x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(x @ weight)

    x = torch.randn(256, 32)
    peaks: list[int] = []
    expected: torch.Tensor | None = None
    for offloader in (None, Offloader("cpu")):
        out = fn(x) if offloader is None else offloader.run(fn, x)
        with MemoryMeter() as meter:
            start = meter.current_bytes
            (grad,) = torch.autograd.grad(out.sum(), weight)
        peaks.append(meter.peak_bytes - start)
        expected = grad if expected is None else expected
        assert torch.equal(grad, expected)
    assert peaks[1] <= peaks[0]  # no copy of ``out`` (32 KiB) came back beside it
    offloader = Offloader("cpu")
    out = offloader.run(fn, x)
    loss = out.sum()
    out.mul_(0)  # autograd alone would refuse this; the host copy holds the value saved
    (grad,) = torch.autograd.grad(loss, weight)
    assert torch.equal(grad, expected)


def test_the_host_limit_is_never_crossed() -> None:
    block, x0 = _Block(), torch.randn(32, 32)
    plain_grads, *_ = _step(block, x0, None)
    offloader = Offloader("cpu", module=block, host_limit_bytes=host_live_bytes())
    grads, _, held, _, _ = _step(block, x0, offloader)
    assert offloader.offloaded_bytes == 0 and offloader.refused_bytes > 0
    assert all(torch.equal(a, b) for a, b in zip(grads, plain_grads))


def test_a_window_brings_copies_back_ahead_and_a_second_backward_works() -> None:
    torch.manual_seed(1)
    block, x0 = _Block(), torch.randn(32, 32)
    block.eval()  # no dropout or statistics: two backward passes through one graph see the same values
    plain_grads, *_ = _step(block, x0, None)
    offloader = Offloader("cpu", module=block, window_bytes=1 << 20)
    block.zero_grad(set_to_none=True)
    x = x0.clone().requires_grad_()
    loss = offloader.run(block, x).square().sum()
    loss.backward(retain_graph=True)
    first = [p.grad.clone() for p in block.parameters()]
    loss.backward()
    assert all(torch.equal(a, b) for a, b in zip(first, plain_grads))
    assert all(torch.equal(2 * a, p.grad) for a, p in zip(first, block.parameters()))


@pytest.mark.parametrize("kwargs, error", [
    ({"device": "meta"}, ValueError), ({"device": "not a device"}, ValueError),
    ({"device": "cpu", "window_bytes": -1}, ValueError), ({"device": "cpu", "offload_inputs": 1}, TypeError),
    ({"device": "cpu", "host_limit_bytes": True}, ValueError), ({"device": "cpu", "module": "model"}, TypeError),
])
def test_bad_arguments_are_refused(kwargs: dict, error: type) -> None:
    with pytest.raises(error, match="Offloader"):
        Offloader(**kwargs)


def test_run_refuses_what_is_not_callable() -> None:
    with pytest.raises(TypeError, match="callable"):
        Offloader("cpu").run("block")
