"""Host copies that the memory meter does not see: raw tensor bytes and RNG snapshots as NumPy arrays.

``MemoryMeter`` counts tensor storages, so anything torchckpt keeps *about* a step while measuring it
(the caller's RNG state, gradients to compare, parameters to put back) is held as NumPy memory.
"""

from __future__ import annotations

import contextlib
import copy
import gc
import random
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import nn

__all__ = ["RngSnapshot", "host_bytes", "host_rng_state", "local_part", "paused_gc", "preserved_rng",
           "preserved_state", "same_host_rng"]


def _dtensor_type() -> type | None:
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # a torch built without distributed
        return None
    return DTensor


def local_part(tensor: torch.Tensor) -> torch.Tensor:
    """This process's own part of ``tensor``: the local shard of a ``DTensor`` (FSDP2's sharded parameters,
    gradients and optimizer state), else the tensor itself.

    Example:
        >>> t = torch.ones(2)
        >>> local_part(t) is t
        True
    """
    dtensor = _dtensor_type()
    if dtensor is not None and isinstance(tensor, dtensor):
        return tensor.to_local()  # type: ignore[attr-defined]
    return tensor


def host_bytes(tensor: torch.Tensor) -> np.ndarray:
    """The raw bytes of ``tensor`` (of its local shard, for a ``DTensor``) as a new NumPy ``uint8`` array
    (contiguous, on the host).

    Example:
        >>> host_bytes(torch.ones(2, dtype=torch.float16)).tolist()
        [0, 60, 0, 60]
    """
    return local_part(tensor).detach().cpu().contiguous().view(-1).view(torch.uint8).numpy().copy()


@contextlib.contextmanager
def paused_gc() -> Iterator[None]:
    """Collect garbage, then keep Python's cyclic garbage collector off inside the block (as ``timeit`` does).

    Measured steps run inside it: tensors left in reference cycles by earlier work would otherwise be
    counted in one step's baseline and freed in the middle of another (hundreds of KiB between runs of the
    same test), and a collection inside a timed step would be timed with it.

    Example:
        >>> with paused_gc():
        ...     gc.isenabled()
        False
    """
    gc.collect()
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


def _cuda_initialised() -> bool:
    return torch.cuda.is_available() and torch.cuda.is_initialized()


@dataclass(frozen=True)
class RngSnapshot:
    """RNG streams at one moment: torch's CPU generator and every initialised CUDA device's; with
    ``capture(host=True)`` also NumPy's global generator (``np.random``) and Python's ``random``.

    Example:
        >>> import random
        >>> snapshot = RngSnapshot.capture(host=True)
        >>> first, draw = torch.rand(1), random.random()
        >>> snapshot.restore()
        >>> bool(torch.rand(1) == first), random.random() == draw
        (True, True)
    """

    cpu: np.ndarray
    cuda: tuple[np.ndarray, ...] = ()
    numpy: tuple[Any, ...] | None = None  # np.random.get_state(), or None: not captured
    python: tuple[Any, ...] | None = None  # random.getstate(), or None: not captured

    @classmethod
    def capture(cls, host: bool = False) -> RngSnapshot:
        """Snapshot the CPU stream and, when CUDA is initialised, every device's stream; ``host=True``: NumPy's and
        Python's global streams too (about 0.1 ms more)."""
        cuda = tuple(host_bytes(state) for state in torch.cuda.get_rng_state_all()) if _cuda_initialised() else ()
        if not host:
            return cls(cpu=host_bytes(torch.get_rng_state()), cuda=cuda)
        return cls(cpu=host_bytes(torch.get_rng_state()), cuda=cuda, numpy=tuple(np.random.get_state(legacy=True)),
                   python=random.getstate())

    def restore(self) -> None:
        """Set every stream captured back to this snapshot (the snapshot can be restored again)."""
        torch.set_rng_state(torch.from_numpy(self.cpu.copy()))
        if self.cuda:
            torch.cuda.set_rng_state_all([torch.from_numpy(state.copy()) for state in self.cuda])
        if self.numpy is not None:
            np.random.set_state(self.numpy)
        if self.python is not None:
            random.setstate(self.python)


def host_rng_state() -> tuple[tuple[Any, ...], tuple[Any, ...]]:
    """NumPy's global stream (legacy tuple) and Python's ``random``, as ``same_host_rng`` compares them.

    Example:
        >>> before = host_rng_state()
        >>> _ = random.random()
        >>> same_host_rng(before, host_rng_state())
        False
    """
    return tuple(np.random.get_state(legacy=True)), random.getstate()


def same_host_rng(a: tuple[tuple[Any, ...], tuple[Any, ...]], b: tuple[tuple[Any, ...], tuple[Any, ...]]) -> bool:
    """Whether two ``host_rng_state`` readings are equal in every field (a cached Gaussian moves only NumPy's last
    two)."""
    (numpy_a, python_a), (numpy_b, python_b) = a, b
    return python_a == python_b and len(numpy_a) == len(numpy_b) and all(
        np.array_equal(x, y) if isinstance(x, np.ndarray) else x == y for x, y in zip(numpy_a, numpy_b))


@contextlib.contextmanager
def preserved_rng() -> Iterator[RngSnapshot]:
    """Restore the RNG streams (torch's CPU and CUDA, NumPy's and Python's global ones) when the block exits,
    however it exits.

    Example:
        >>> before = torch.get_rng_state()
        >>> with preserved_rng():
        ...     _ = torch.manual_seed(123)
        >>> torch.equal(torch.get_rng_state(), before)
        True
    """
    snapshot = RngSnapshot.capture(host=True)
    try:
        yield snapshot
    finally:
        snapshot.restore()


@dataclass(frozen=True)
class _HostTensor:
    """A tensor kept as host bytes with what it takes to rebuild it (dtype, shape, device)."""

    data: np.ndarray
    dtype: torch.dtype
    shape: torch.Size
    device: torch.device
    # a DTensor's (type, mesh, placements, global shape, stride) to rebuild it with; not the tensor itself,
    # which would keep its shard (a gradient about to be cleared, say) alive and counted by a meter
    sharding: tuple[Any, ...] | None = None


def _to_host(tensor: torch.Tensor) -> _HostTensor:
    local = local_part(tensor)
    sharded: Any = tensor
    sharding = None if local is tensor else (type(tensor), sharded.device_mesh, tuple(sharded.placements),
                                             tensor.shape, tensor.stride())
    return _HostTensor(host_bytes(local), local.dtype, local.shape, local.device, sharding)


def _from_host(saved: _HostTensor) -> torch.Tensor:
    local = torch.from_numpy(saved.data.copy()).view(saved.dtype).view(saved.shape).to(saved.device)
    if saved.sharding is None:
        return local
    kind, mesh, placements, shape, stride = saved.sharding
    return kind.from_local(local, mesh, placements, run_check=False, shape=shape, stride=stride)


def _optimizer_snapshot(optimizer: torch.optim.Optimizer) -> dict[int, dict[str, Any]]:
    """Per parameter (by id), its optimizer state with tensors as host bytes and the rest deep-copied."""
    return {id(param): {key: _to_host(value) if isinstance(value, torch.Tensor) else copy.deepcopy(value)
                        for key, value in state.items()}
            for param, state in optimizer.state.items()}


def _restore_optimizer(optimizer: torch.optim.Optimizer, saved: dict[int, dict[str, Any]]) -> None:
    """The saved state back; into the tensors the optimizer holds where they still fit, so that state kept in
    host memory (executor/optimizer_offload.py) stays there."""
    params = {id(param): param for group in optimizer.param_groups for param in group["params"]}
    now = {id(param): dict(state) for param, state in optimizer.state.items()}
    optimizer.state.clear()
    for key, state in saved.items():
        restored: dict[str, Any] = {}
        for name, value in state.items():
            if isinstance(value, _HostTensor):
                fresh, held = _from_host(value), now.get(key, {}).get(name)
                if isinstance(held, torch.Tensor) and (held.shape, held.dtype) == (fresh.shape, fresh.dtype) and \
                        held.device.type == "cpu" and fresh.device.type == "cpu":
                    with torch.no_grad():
                        held.copy_(fresh)
                    fresh = held
                value = fresh
            restored[name] = value
        optimizer.state[params[key]] = restored


@contextlib.contextmanager
def preserved_state(model: nn.Module, optimizer: torch.optim.Optimizer | None = None) -> Iterator[None]:
    """Put back, when the block exits however it exits, everything a measured training step changes:
    the model's parameters, buffers, gradients and train/eval modes, the optimizer's state (``optimizer``,
    if given; its parameter groups are left as they are) and the RNG streams (torch's CPU and every
    initialised CUDA device's, NumPy's and Python's global ones). Values are written back into the same
    tensors, so parameter identity holds.

    The copies are NumPy memory, so a ``MemoryMeter`` running inside the block does not count them.

    Example:
        >>> layer = nn.Linear(2, 2)
        >>> optimizer = torch.optim.AdamW(layer.parameters())
        >>> before = layer.weight.detach().clone()
        >>> with preserved_state(layer, optimizer):
        ...     layer(torch.ones(1, 2)).sum().backward()
        ...     optimizer.step()
        >>> torch.equal(layer.weight, before), layer.weight.grad is None, len(optimizer.state)
        (True, True, 0)
    """
    tensors: dict[str, torch.Tensor] = dict(model.named_parameters())
    tensors.update(dict(model.named_buffers()))
    saved = {name: _to_host(tensor) for name, tensor in tensors.items()}
    grads = {name: None if param.grad is None else _to_host(param.grad) for name, param in model.named_parameters()}
    modes = {name: module.training for name, module in model.named_modules()}
    optimizer_state = _optimizer_snapshot(optimizer) if optimizer is not None else None
    rng = RngSnapshot.capture(host=True)
    try:
        yield
    finally:
        with torch.no_grad():
            for name, tensor in tensors.items():
                restored = _from_host(saved[name])
                local_part(tensor).copy_(local_part(restored))
        for name, param in model.named_parameters():
            grad = grads.get(name)
            param.grad = None if grad is None else _from_host(grad)
        for name, module in model.named_modules():
            module.training = modes.get(name, module.training)
        if optimizer is not None and optimizer_state is not None:
            _restore_optimizer(optimizer, optimizer_state)
        rng.restore()
