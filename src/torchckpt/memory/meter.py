"""MemoryMeter: exact live tensor bytes on CPU, allocator statistics on CUDA, process RSS.

How the CPU meter counts (the rules every figure it reports obeys, named in ``docs/design.md``):

1. **[the unit is a storage]** The unit is a *storage*. A tensor's bytes are its untyped storage's
   ``nbytes()``; views, aliases, ``detach()`` and in-place results share their base's storage and are
   counted once.
2. **[counted from first sight until freed]** A storage is counted from the moment the meter first sees
   it (as the output or the input of an op that runs through the dispatcher while the meter is active,
   which includes autograd's backward, checkpoint recomputation and selective-checkpoint caches) until
   it is freed. Freed is freed: the weak-reference callback fires when the storage's C++ object dies,
   not when a Python name goes away.
3. **[the baseline is what lives at entry]** Storages alive at entry (parameters, inputs, optimizer
   state) form the *baseline*: the meter finds them with one scan of the garbage collector's tensors at
   entry, counts them in ``current_bytes`` and ``peak_bytes``, and subtracts them when they are freed.
   ``MemoryMeter(include_existing=False)`` counts only what is created inside.
4. **[only the meter's device counts]** Only storages on the meter's device are counted (CPU by
   default). Meta, fake and sparse tensors own no countable storage and are ignored; a ``DTensor``
   counts as its local shard.
5. **[storage resizes are seen]** ``UntypedStorage.resize_`` does not run through the dispatcher, and
   FSDP2 frees and re-allocates its all-gathered parameters that way (``resize_(0)`` after a block's
   forward, back to full size before its backward). While a CPU meter is active, ``resize_`` is wrapped
   so every meter active on the calling thread recounts the storage at once: a freed all-gather stops
   counting when it is freed, not when the storage is next seen.
6. **[compiled code is measured where its ops dispatch]** The meter's mode says
   ``ignore_compile_internals``, so ``torch.compile``'d code keeps running compiled inside the meter
   (Dynamo skips frames only under modes that do not). With ``backend="aot_eager"`` every op of the
   compiled graphs dispatches through the meter, so the peak is the compiled step's; inductor's kernels
   allocate their buffers outside the dispatcher and are not counted (measure peak RSS for inductor).
   Higher-order ops reach the meter's ``__torch_dispatch__``: the two that wrap one op in compiled graphs
   (``run_and_save_rng_state``, ``run_with_rng_state``) run there; any other (``cond``, flex attention) is
   refused, since its body would run unseen.

On CUDA the numbers come from the caching allocator (``torch.cuda.memory_allocated`` and
``max_memory_allocated``), which already follow the same rules at block granularity.

Process RSS is the physical figure: ``VmHWM``/``VmRSS`` from ``/proc/self/status``, with the high-water
mark reset through ``/proc/self/clear_refs``. glibc returns freed memory to the OS only for blocks
above its mmap threshold, so run with ``MALLOC_MMAP_THRESHOLD_=65536`` for RSS to follow live bytes
closely (``make test`` and ``make demo`` do).
"""

from __future__ import annotations

import functools
import gc
import threading
import weakref
from collections.abc import Iterable
from dataclasses import dataclass
from types import TracebackType
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from torchckpt._host import local_part
from torchckpt.memory.host_pool import host_peak_bytes, is_host_tensor, reset_host_peak
from torchckpt.memory.rss import read_rss_bytes, reset_peak_rss

__all__ = ["MemoryMeter", "MemoryBreakdown", "device_of", "synchronize"]


def device_of(module: torch.nn.Module) -> torch.device:
    """The one device a module's parameters and buffers live on: the device a meter of its step watches.

    A module without parameters or buffers is taken to run on the CPU; one that spans devices is refused
    (the planner measures one device).

    Example:
        >>> device_of(torch.nn.Linear(2, 2))
        device(type='cpu')
    """
    if not isinstance(module, torch.nn.Module):
        raise TypeError(f"device_of() takes an nn.Module; got {type(module).__name__}")
    devices = {t.device for t in (*module.parameters(), *module.buffers()) if t.device.type != "meta"}
    if len(devices) > 1:
        names = ", ".join(sorted(str(d) for d in devices))
        raise ValueError(f"{type(module).__name__}'s parameters and buffers live on several devices ({names}); "
                         "torchckpt measures a step on one device. Fix: move the model to one device "
                         "(model.to(device)) before planning")
    device = devices.pop() if devices else torch.device("cpu")
    if device.type not in ("cpu", "cuda"):
        raise ValueError(f"{type(module).__name__} lives on {device}; torchckpt measures CPU and CUDA only. "
                         "Fix: move it to 'cpu' or a CUDA device")
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    return device


def synchronize(device: torch.device) -> None:
    """Wait for the device's queued work (CUDA); a no-op on the CPU, whose ops finish when they return.

    Example:
        >>> synchronize(torch.device("cpu"))
    """
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@dataclass(frozen=True, kw_only=True)
class MemoryBreakdown:
    """Live bytes by category at one moment (``MemoryMeter.breakdown()``).

    ``activations`` is everything live that is not a parameter, a gradient or optimizer state of the
    module and optimizer the meter was given: saved activations, caches, inputs, outputs, transients.
    """

    parameters: int
    gradients: int
    optimizer_state: int
    activations: int

    @property
    def total(self) -> int:
        """Sum of the categories (equals ``current_bytes`` when taken)."""
        return self.parameters + self.gradients + self.optimizer_state + self.activations


def _storage_of(tensor: torch.Tensor, device_type: str) -> torch.UntypedStorage | None:
    """The tensor's untyped storage if it is a plain dense tensor on ``device_type``, else None."""
    if tensor.device.type != device_type or tensor.layout != torch.strided:
        return None
    if type(tensor) not in (torch.Tensor, torch.nn.Parameter):
        local = local_part(tensor)  # a DTensor's memory is its local shard's (its own ops run on the shard
        if local is not tensor:  # with this meter's mode set aside, so their outputs are seen only here)
            return _storage_of(local, device_type)
        return None  # other subclasses (fake, functional) own no countable storage
    try:
        return tensor.untyped_storage()
    except (RuntimeError, NotImplementedError):
        return None


# CPU meters inside their ``with`` block, with the thread each runs on: [storage resizes are seen]
_ACTIVE_METERS: list[tuple[weakref.ref, int]] = []
_ACTIVE_LOCK = threading.Lock()
_ORIGINAL_RESIZE = torch.UntypedStorage.resize_


def _resize_seen(storage: torch.UntypedStorage, size: int) -> Any:
    """``UntypedStorage.resize_``, then every meter active on this thread recounts the storage (a meter's
    dispatch mode sees only its own thread's ops, and so do its resizes): [storage resizes are seen]."""
    result = _ORIGINAL_RESIZE(storage, size)
    thread = threading.get_ident()
    for ref, owner in list(_ACTIVE_METERS):
        meter = ref()
        if meter is not None and owner == thread:
            meter._observe_storage(storage)
    return result


def _watch_resizes(meter: MemoryMeter) -> None:
    with _ACTIVE_LOCK:
        if not _ACTIVE_METERS:
            torch.UntypedStorage.resize_ = _resize_seen  # type: ignore[method-assign,assignment]
        _ACTIVE_METERS.append((weakref.ref(meter), threading.get_ident()))


def _unwatch_resizes(meter: MemoryMeter) -> None:
    with _ACTIVE_LOCK:
        _ACTIVE_METERS[:] = [(ref, owner) for ref, owner in _ACTIVE_METERS if ref() is not None and ref() is not meter]
        if not _ACTIVE_METERS:
            torch.UntypedStorage.resize_ = _ORIGINAL_RESIZE  # type: ignore[method-assign]


def _drop(table: dict[int, weakref.ref], key: int, _ref: weakref.ref) -> None:
    """A weakref callback: forget ``key`` once its storage is freed."""
    table.pop(key, None)


# Higher-order ops a compiled graph calls around one ordinary op (a checkpoint's RNG bookkeeping): running them
# here runs that op, whose output is observed like any op's. Any other higher-order op is refused.
_BODYLESS_HOPS = frozenset({"run_and_save_rng_state", "run_with_rng_state"})


class _StorageTracker(TorchDispatchMode):
    """Dispatch mode that records every storage an op produces or reads, and its release."""

    # A compiled graph calls higher-order ops (run_and_save_rng_state for a checkpoint's RNG): those in
    # _BODYLESS_HOPS run here like any op; the rest are refused (NotImplemented), as before.
    supports_higher_order_operators = True

    def __init__(self, meter: MemoryMeter) -> None:
        super().__init__()
        self._meter = meter

    @classmethod
    def ignore_compile_internals(cls) -> bool:
        """Compiled code keeps running compiled inside the meter ([compiled code is measured where its ops
        dispatch]): Dynamo skips frames only under modes that do not say this."""
        return True

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        if isinstance(func, torch._ops.HigherOrderOperator) and func.name() not in _BODYLESS_HOPS:
            # its body would run unseen (the mode is off while an op runs here): refuse instead of undercounting
            raise NotImplementedError(
                f"MemoryMeter cannot measure inside the higher-order op {func.name()!r} (torch.cond, flex_attention "
                "and the like run their bodies where the meter does not see them, so the peak would be too low). "
                "Measure a step without it, or on CUDA, where the allocator's statistics see everything")
        out = func(*args, **(kwargs or {}))
        meter = self._meter
        for value in tree_flatten((out, args, kwargs))[0]:
            if isinstance(value, torch.Tensor):
                meter._observe(value)
        return out


class MemoryMeter:
    """Measure peak and current tensor memory of the code run inside ``with MemoryMeter() as m:``.

    Args:
        device: ``"cpu"`` (exact, via a dispatch mode) or a CUDA device (allocator statistics).
        include_existing: count tensors alive at entry (parameters, inputs) as the baseline.
        module: optional model whose parameters and gradients ``breakdown()`` names.
        optimizer: optional optimizer whose state ``breakdown()`` names.

    Example:
        >>> import torch
        >>> with MemoryMeter(include_existing=False) as meter:
        ...     x = torch.empty(1024, dtype=torch.float32)
        ...     y = x.view(32, 32)          # a view: no new bytes
        ...     del x, y
        >>> meter.peak_bytes, meter.current_bytes
        (4096, 0)
    """

    def __init__(
        self,
        device: str | torch.device = "cpu",
        *,
        include_existing: bool = True,
        module: torch.nn.Module | None = None,
        optimizer: torch.optim.Optimizer | None = None,
    ) -> None:
        self.device = torch.device(device)
        if self.device.type not in ("cpu", "cuda"):
            raise ValueError(f"MemoryMeter(device={device!r}): only 'cpu' and 'cuda' devices are supported")
        if self.device.type == "cuda" and not torch.cuda.is_available():
            raise RuntimeError(f"MemoryMeter(device={device!r}): CUDA is not available in this process; "
                               "use device='cpu'")
        if module is not None and not isinstance(module, torch.nn.Module):
            raise TypeError(f"MemoryMeter(module=...) must be an nn.Module; got {type(module).__name__}")
        if optimizer is not None and not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError(f"MemoryMeter(optimizer=...) must be a torch.optim.Optimizer; "
                            f"got {type(optimizer).__name__}")
        self.include_existing = include_existing
        self.module = module
        self.optimizer = optimizer
        self._live: dict[int, int] = {}  # id(storage) -> bytes counted for it
        self._refs: dict[int, weakref.ref] = {}
        self._uncounted: dict[int, weakref.ref] = {}  # alive at entry with include_existing=False
        self._current = 0
        self._peak = 0
        self._baseline = 0
        self._mode: _StorageTracker | None = None
        self._active = False
        self._cuda_offset = 0
        self._host_peak = 0

    # ----------------------------------------------------------------- context manager
    def __enter__(self) -> MemoryMeter:
        if self._active:
            raise RuntimeError("this MemoryMeter is already active; create a new one to nest meters")
        self._active = True
        reset_peak_rss()
        reset_host_peak()
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            self._cuda_offset = 0 if self.include_existing else torch.cuda.memory_allocated(self.device)
            return self
        self._scan_existing()
        self._baseline = self._current
        self._peak = self._current
        self._mode = _StorageTracker(self)
        self._mode.__enter__()
        _watch_resizes(self)
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self._host_peak = host_peak_bytes()
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            self._peak = self.peak_bytes
            self._current = self.current_bytes
        elif self._mode is not None:
            _unwatch_resizes(self)
            self._mode.__exit__(exc_type, exc, tb)
            self._mode = None
            self._refs.clear()  # figures stay as they were at exit: later frees are not ours to count
            self._live.clear()
            self._uncounted.clear()
        self._active = False

    # ----------------------------------------------------------------- figures
    @property
    def peak_bytes(self) -> int:
        """Highest live tensor bytes seen since entry (or the last ``reset_peak()``)."""
        if self.device.type == "cuda" and self._active:
            return torch.cuda.max_memory_allocated(self.device) - self._cuda_offset
        return self._peak

    @property
    def current_bytes(self) -> int:
        """Live tensor bytes now (after exit: at exit)."""
        if self.device.type == "cuda" and self._active:
            return torch.cuda.memory_allocated(self.device) - self._cuda_offset
        return self._current

    @property
    def host_peak_bytes(self) -> int:
        """Most bytes of offloaded activations alive in host memory at once since entry (or ``reset_peak()``):
        host_pool.py's [host bytes are counted apart]; never part of ``peak_bytes``."""
        return host_peak_bytes() if self._active else self._host_peak

    @property
    def baseline_bytes(self) -> int:
        """Bytes of the storages alive at entry (0 with ``include_existing=False``)."""
        return self._baseline

    @property
    def peak_rss_bytes(self) -> int:
        """Process peak resident set size since entry (Linux ``VmHWM``; 0 where unavailable)."""
        return read_rss_bytes()[1]

    @property
    def rss_bytes(self) -> int:
        """Process resident set size now (Linux ``VmRSS``; 0 where unavailable)."""
        return read_rss_bytes()[0]

    def reset_peak(self) -> None:
        """Restart peak tracking from the current live bytes (and the RSS high-water mark).

        Example:
            >>> with MemoryMeter(include_existing=False) as meter:
            ...     x = torch.ones(256); del x
            ...     meter.reset_peak()
            >>> meter.peak_bytes
            0
        """
        reset_peak_rss()
        reset_host_peak()
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
        self._peak = self._current

    def breakdown(self) -> MemoryBreakdown:
        """Live bytes now, split into parameters, gradients, optimizer state and activations.

        Categories come from the ``module`` and ``optimizer`` given to the meter; without them every
        byte is in ``activations``. CPU only (on CUDA the allocator does not know what a block holds).

        Example:
            >>> model = torch.nn.Linear(4, 4)
            >>> with MemoryMeter(module=model) as meter:
            ...     parts = meter.breakdown()
            >>> parts.parameters
            80
        """
        if self.device.type == "cuda":
            raise NotImplementedError("MemoryMeter.breakdown() is CPU only; on CUDA use torch.cuda.memory_snapshot()")
        gc.collect()
        seen: set[int] = set()

        def total(tensors: Iterable[torch.Tensor]) -> int:
            count = 0
            for tensor in tensors:
                storage = _storage_of(tensor, self.device.type)
                if storage is None or id(storage) in seen or id(storage) not in self._live:
                    continue
                seen.add(id(storage))
                count += self._live[id(storage)]
            return count

        params = list(self.module.parameters()) if self.module is not None else []
        parameters = total(params)
        gradients = total(p.grad for p in params if p.grad is not None)
        optimizer_state = 0
        if self.optimizer is not None:
            state_tensors = [v for state in self.optimizer.state.values() for v in state.values()
                             if isinstance(v, torch.Tensor)]
            optimizer_state = total(state_tensors)
        activations = self._current - parameters - gradients - optimizer_state
        return MemoryBreakdown(parameters=parameters, gradients=gradients,
                               optimizer_state=optimizer_state, activations=activations)

    # ----------------------------------------------------------------- bookkeeping
    def _scan_existing(self) -> None:
        """[the baseline is what lives at entry]: storages alive at entry are the baseline (or, without
        include_existing, ignored)."""
        for obj in gc.get_objects():
            if not issubclass(type(obj), torch.Tensor):  # type(), not isinstance: no proxy __class__ lookups
                continue
            if self.include_existing:
                self._observe(obj)
                continue
            storage = _storage_of(obj, self.device.type)
            if storage is not None and id(storage) not in self._uncounted:
                key = id(storage)
                self._uncounted[key] = weakref.ref(storage, functools.partial(_drop, self._uncounted, key))

    def _observe(self, tensor: torch.Tensor) -> None:
        storage = _storage_of(tensor, self.device.type)
        if storage is not None:
            self._observe_storage(storage)

    def _observe_storage(self, storage: torch.UntypedStorage) -> None:
        if storage.device.type != self.device.type or is_host_tensor(storage):  # host_pool.py's rule 4
            return
        key = id(storage)
        if key in self._uncounted:
            return
        nbytes = storage.nbytes()
        counted = self._live.get(key)
        if counted is None:
            self._refs[key] = weakref.ref(storage, self._released_callback(key))
            self._live[key] = nbytes
            self._grow(nbytes)
        elif counted != nbytes:  # resized in place (resize_, out= ops)
            self._live[key] = nbytes
            self._grow(nbytes - counted)

    def _grow(self, delta: int) -> None:
        self._current += delta
        if self._current > self._peak:
            self._peak = self._current

    def _released_callback(self, key: int):  # noqa: ANN202 - a weakref callback
        meter_ref = weakref.ref(self)

        def released(_ref: weakref.ref) -> None:
            meter = meter_ref()
            if meter is None:
                return
            counted = meter._live.pop(key, None)
            meter._refs.pop(key, None)
            if counted is not None:
                meter._current -= counted

        return released
