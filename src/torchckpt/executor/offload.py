"""Offload: a block's saved activations moved to host memory in its forward pass, brought back for its backward.

``Offloader`` runs a function with every activation autograd saves inside it copied to a host buffer
(``memory/host_pool.py``), so the device holds none of them between the block's forward and backward passes;
the backward pass gets them back, bitwise, from the host copy. Nothing is recomputed.

Rules (named in ``docs/design.md``):

1. **[what is offloaded]** Every tensor autograd saves inside the function, except: tensors on another device;
   the storages of the module's parameters and buffers (they live through the step anyway); and, unless
   ``offload_inputs``, the storages of the function's own tensor arguments (a block's input, which a plan may
   hold anyway). With ``offload_inputs`` a saved input goes too, so the device frees it once its caller lets go.
   A storage is copied once, whole, however many views of it are saved, and restored as views of one device
   copy, so the device bytes of the backward pass are the plain step's.
2. **[device copies leave at the block's end]** The device storages stay referenced until the function
   returns, so an address is never reused under a live copy and a storage is copied once; then the device
   references are dropped (on CUDA after the side stream's copies are waited on). Meanwhile the device holds
   what the plain forward pass holds, no more.
3. **[an alive original is used as is]** When the backward pass needs a tensor whose original storage is still
   alive and unchanged, as a block's output can be, or a rotary table the model made once and passes to every
   block (each block saves its own view of it, a view that dies with the forward pass while the table lives on),
   the original storage is used: no second device copy. Alive and unchanged is read on the base tensor the
   saved one views (views share their base's version counter); otherwise the host copy is brought back.
4. **[bring back ahead, within a window]** When the backward pass first needs a host copy, the copies packed
   just before it (the backward pass needs them next) are brought back too, up to ``window_bytes`` ahead of
   use; a copy is dropped from the offloader once every saved view of it was handed over, so autograd frees it
   as the plain step would. On CUDA the copies run on a side stream and the compute stream waits on an event
   before use (the device copy is recorded on the compute stream, so the caching allocator never reuses it
   early); on the CPU they are synchronous, the same code path against a second pool
   (host_pool.py's [the CPU meter never sees a host buffer]).
5. **[over the host limit, a tensor stays]** With ``host_limit_bytes``, a storage that would take the live host
   bytes over it stays on the device (host_pool.py's [a host limit is never crossed]) and is counted in
   ``refused_bytes``, so a plan's measured device peak shows it.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_flatten

from torchckpt._host import local_part
from torchckpt.memory.host_pool import host_buffer, unmetered

__all__ = ["Offloader"]


class _Copy:
    """One device storage's host copy and, while in use, its device copy."""

    __slots__ = ("host", "nbytes", "device_flat", "ready", "original", "version", "handles", "handed", "position",
                 "ahead", "__weakref__")

    def __init__(self, host: torch.Tensor, nbytes: int, original: torch.Tensor, position: int) -> None:
        self.host = host
        self.nbytes = nbytes
        self.device_flat: torch.Tensor | None = None  # the device copy brought back (uint8, whole storage)
        self.ready: Any = None  # CUDA event: the device copy is complete
        base = original._base if original._base is not None else original  # its views share its version counter
        self.original = weakref.ref(base)
        self.version = base._version
        self.handles = 0
        self.handed = 0
        self.position = position
        self.ahead = False  # brought back ahead of use, not used yet

    def original_alive(self) -> bool:
        """[an alive original is used as is]: the base of the device tensor copied is alive and unchanged."""
        original = self.original()
        return original is not None and original._version == self.version


class _Saved:
    """What autograd keeps for one offloaded saved tensor: its copy and its view geometry."""

    __slots__ = ("copy", "dtype", "offset", "size", "stride", "original")

    def __init__(self, copy: _Copy, tensor: torch.Tensor) -> None:
        self.copy = copy
        self.dtype = tensor.dtype
        self.offset = tensor.storage_offset()
        self.size = tuple(tensor.shape)
        self.stride = tuple(tensor.stride())
        self.original = weakref.ref(tensor)


def _flat(storage: torch.UntypedStorage, device: torch.device) -> torch.Tensor:
    return torch.empty(0, dtype=torch.uint8, device=device).set_(storage)


class Offloader:
    """Runs functions with their saved activations offloaded to host memory (module docstring's rules).

    Args:
        device: the device whose activations move (CPU: a second, counted host pool; CUDA: pinned memory).
        module: the model whose parameters and buffers are never offloaded.
        window_bytes: how far ahead of use the backward pass brings copies back ([bring back ahead, ...]).
        host_limit_bytes: the most host bytes alive at once ([over the host limit, a tensor stays]); None: no limit.
        offload_inputs: also offload what autograd saves of the function's tensor arguments ([what is offloaded]).

    Example:
        >>> block = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 8))
        >>> offloader = Offloader(torch.device("cpu"), module=block)
        >>> x = torch.randn(4, 8, requires_grad=True)
        >>> offloader.run(block, x).sum().backward()
        >>> offloader.offloaded_bytes > 0
        True
    """

    def __init__(self, device: torch.device | str, module: nn.Module | None = None, *, window_bytes: int = 0,
                 host_limit_bytes: int | None = None, offload_inputs: bool = False) -> None:
        try:
            self.device = torch.device(device)
        except (RuntimeError, TypeError):
            raise ValueError(f"Offloader(device={device!r}) is not a device; give 'cpu', 'cuda' or 'cuda:N'") from None
        if self.device.type == "cuda" and not torch.cuda.is_available():
            raise ValueError(f"Offloader(device={device!r}): CUDA is not available in this process; give 'cpu' (a "
                             "second, counted pool) or run where a GPU is")
        if self.device.type not in ("cpu", "cuda"):
            raise ValueError(f"Offloader(device={device!r}): offload moves CPU (a second, counted pool) or CUDA "
                             "activations; move the model to one of them")
        if self.device.type == "cuda" and self.device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device())
        if module is not None and not isinstance(module, nn.Module):
            raise TypeError(f"Offloader(module=...) must be an nn.Module; got {type(module).__name__}")
        for name, value in (("window_bytes", window_bytes), ("host_limit_bytes", host_limit_bytes)):
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 0):
                raise ValueError(f"Offloader({name}=...) must be an int >= 0 (bytes); got {value!r}")
        if not isinstance(offload_inputs, bool):
            raise TypeError(f"Offloader(offload_inputs=...) must be True or False; got {offload_inputs!r}")
        self.module = module
        self.offload_inputs = offload_inputs
        self.window_bytes = window_bytes
        self.host_limit_bytes = host_limit_bytes
        self.offloaded_bytes = 0  # host bytes copied out, over the offloader's life
        self.refused_bytes = 0  # bytes kept on the device by the host limit
        self.last_copied: frozenset[int] = frozenset()  # device addresses of the storages the last run copied
        self._order: list[weakref.ref] = []  # copies in pack order (this step's)
        self._ahead = 0  # bytes brought back ahead of use and not yet used
        self._side = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None

    # ----------------------------------------------------------------- forward
    def run(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """Call ``fn(*args, **kwargs)`` with what autograd saves inside offloaded; returns its output."""
        if not callable(fn):
            raise TypeError(f"Offloader.run(fn, ...): fn must be callable; got {type(fn).__name__}")
        skip = self._kept_storages([] if self.offload_inputs else tree_flatten((args, kwargs))[0])
        pending: dict[int, tuple[_Copy, torch.Tensor]] = {}  # data_ptr -> copy, device tensor (rule 2)
        if not any(ref() is not None for ref in self._order):
            self._order, self._ahead = [], 0  # a new step: last step's copies are all gone

        def pack(tensor: torch.Tensor) -> Any:
            return self._pack(tensor, skip, pending)

        try:
            with torch.autograd.graph.saved_tensors_hooks(pack, self._unpack):
                return fn(*args, **kwargs)
        finally:
            if self._side is not None and pending:
                torch.cuda.current_stream(self.device).wait_stream(self._side)
            self.last_copied = frozenset(pending)
            pending.clear()  # rule 2: the device references go

    def _kept_storages(self, values: Iterable[Any]) -> set[int]:
        tensors = [v for v in values if isinstance(v, torch.Tensor)]
        if self.module is not None:  # under FSDP2: the running block's all-gathered parameters, the others' shards
            tensors += [*self.module.parameters(), *self.module.buffers()]
        kept = set()
        with torch.no_grad():  # to_local() would record a node per parameter per call
            for tensor in tensors:
                local = local_part(tensor)  # a DTensor's shard on this rank
                if local.device != self.device or local.layout != torch.strided:
                    continue
                try:  # a parameter subclass with storage of its own (a quantised weight) is kept as any parameter
                    kept.add(local.untyped_storage().data_ptr())
                except (RuntimeError, NotImplementedError):  # a wrapper without storage: nothing autograd saves
                    continue
        return kept

    def _pack(self, tensor: torch.Tensor, skip: set[int], pending: dict[int, tuple[_Copy, torch.Tensor]]) -> Any:
        if tensor.device != self.device or tensor.layout != torch.strided or type(tensor) is not torch.Tensor:
            return tensor  # another device, a sparse tensor, a subclass (DTensor, Parameter): left as autograd has it
        storage = tensor.untyped_storage()
        key, nbytes = storage.data_ptr(), storage.nbytes()
        if nbytes == 0 or key in skip:
            return tensor
        entry = pending.get(key)
        if entry is None:
            host = host_buffer(nbytes, pin=self._side is not None, limit_bytes=self.host_limit_bytes)
            if host is None:  # rule 5
                self.refused_bytes += nbytes
                return tensor
            copy = _Copy(host, nbytes, tensor, len(self._order))
            flat = _flat(storage, self.device)
            if self._side is not None:
                self._side.wait_stream(torch.cuda.current_stream(self.device))
                with torch.cuda.stream(self._side):
                    host.copy_(flat, non_blocking=True)
            else:
                with unmetered():
                    host.copy_(flat)
            self.offloaded_bytes += nbytes
            self._order.append(weakref.ref(copy))
            entry = pending[key] = (copy, tensor)
        entry[0].handles += 1
        return _Saved(entry[0], tensor)

    # ----------------------------------------------------------------- backward
    def _unpack(self, saved: Any) -> torch.Tensor:
        if not isinstance(saved, _Saved):
            return saved
        copy = saved.copy
        if copy.original_alive():  # rule 3
            self._handed(copy)
            original = saved.original()
            if original is not None:
                return original
            base = copy.original()
            assert base is not None  # alive just above; our caller holds no lock that could free it
            return torch.empty(0, dtype=saved.dtype, device=self.device).set_(
                base.untyped_storage(), saved.offset, saved.size, saved.stride)
        self._bring_back(copy)
        for ref in reversed(self._order[max(0, copy.position - 64):copy.position]):  # rule 4: ahead of use
            if self._ahead >= self.window_bytes:
                break
            ahead = ref()
            if ahead is not None and ahead.device_flat is None and ahead.handed == 0 and not ahead.original_alive():
                self._bring_back(ahead)
                ahead.ahead = True
                self._ahead += ahead.nbytes
        flat = copy.device_flat
        if flat is None:  # pragma: no cover - _bring_back always sets it
            raise RuntimeError("offload: a host copy was not brought back")
        if copy.ready is not None:
            stream = torch.cuda.current_stream(self.device)
            stream.wait_event(copy.ready)
            flat.record_stream(stream)
            copy.ready = None
        view = torch.empty(0, dtype=saved.dtype, device=self.device).set_(
            flat.untyped_storage(), saved.offset, saved.size, saved.stride)
        self._handed(copy)
        return view

    def _handed(self, copy: _Copy) -> None:
        if copy.ahead:
            copy.ahead = False
            self._ahead -= copy.nbytes
        copy.handed += 1
        if copy.handed % copy.handles == 0:
            copy.device_flat = None  # rule 4: autograd holds what it still needs

    def _bring_back(self, copy: _Copy) -> None:
        if copy.device_flat is not None:
            return
        if self._side is not None:
            with torch.cuda.stream(self._side):
                flat = torch.empty(copy.nbytes, dtype=torch.uint8, device=self.device)
                flat.copy_(copy.host, non_blocking=True)
                copy.ready = torch.cuda.Event()
                copy.ready.record(self._side)
        else:
            flat = torch.empty(copy.nbytes, dtype=torch.uint8, device=self.device)  # counted by a CPU meter
            with unmetered():
                flat.copy_(copy.host)
        copy.device_flat = flat
