"""Host memory for offloaded activations, counted apart from the device's.

Rules (named in ``docs/design.md``):

1. **[host bytes are counted apart]** Every host buffer an offload makes comes from ``host_buffer`` and is
   counted in this module's live and peak host bytes (``host_live_bytes``, ``host_peak_bytes``) from its
   allocation until it is freed (a finaliser on the buffer). ``MemoryMeter`` reads the peak as its
   ``host_peak_bytes``; the device figures never include these buffers.
2. **[the CPU meter never sees a host buffer]** On the CPU the device and the host are the same memory, so an
   offload there runs against a second pool of host buffers that ``MemoryMeter`` must not count as device
   bytes: buffers are allocated, and copied into and out of, with the dispatch modes switched off
   (``unmetered``). On CUDA the buffers are pinned CPU memory, which the CUDA allocator's statistics never
   include anyway.
3. **[a host limit is never crossed]** ``host_buffer(nbytes, limit_bytes=L)`` returns None instead of
   allocating when the live host bytes would exceed ``L``: the caller keeps the tensor on the device.
4. **[a host tensor is known by its address]** ``host_tensor`` makes a typed host tensor (an optimizer's state
   between steps, executor/optimizer_offload.py), counted apart from the offloaded activations
   (``host_state_bytes``: neither a host limit nor the activations' host peak includes it). Every host
   allocation's address is kept, and its bytes counted, until its storage dies (not the tensor that made it: a
   view or ``detach()`` keeps it alive, ``set_`` releases it), so ``is_host_tensor`` tells it apart and a
   ``MemoryMeter`` entered while it lives does not take it for a device tensor alive at entry.
"""

from __future__ import annotations

import contextlib
import threading
import weakref
from collections.abc import Iterator

import torch
from torch.utils._python_dispatch import _disable_current_modes

from torchckpt._host import local_part

__all__ = ["host_buffer", "host_live_bytes", "host_peak_bytes", "host_state_bytes", "host_tensor", "is_host_tensor",
           "reset_host_peak", "unmetered"]

_LOCK = threading.Lock()
_LIVE = 0  # offloaded activations (host_buffer)
_PEAK = 0
_STATE_LIVE = 0  # typed host tensors (host_tensor): an optimizer's state
_ADDRESSES: set[int] = set()  # [a host tensor is known by its address]


def _release(nbytes: int, address: int, state: bool) -> None:
    global _LIVE, _STATE_LIVE
    with _LOCK:
        if state:
            _STATE_LIVE -= nbytes
        else:
            _LIVE -= nbytes
        _ADDRESSES.discard(address)


@contextlib.contextmanager
def unmetered() -> Iterator[None]:
    """[the CPU meter never sees a host buffer]: run host-buffer allocations and copies with the dispatch modes
    (the CPU meter's among them) switched off.

    Example:
        >>> from torchckpt.memory import MemoryMeter
        >>> with MemoryMeter(include_existing=False) as meter, unmetered():
        ...     scratch = torch.empty(1024)
        >>> meter.peak_bytes
        0
    """
    with _disable_current_modes():
        yield


def host_buffer(nbytes: int, *, pin: bool = False, limit_bytes: int | None = None) -> torch.Tensor | None:
    """A counted host buffer of ``nbytes`` bytes (uint8, uninitialised), pinned if ``pin``; None when allocating
    it would take the live host bytes over ``limit_bytes`` ([a host limit is never crossed]).

    Example:
        >>> buffer = host_buffer(4096)
        >>> host_live_bytes() >= 4096
        True
        >>> del buffer
    """
    if isinstance(nbytes, bool) or not isinstance(nbytes, int) or nbytes < 0:
        raise ValueError(f"host_buffer(nbytes): expected an int >= 0; got {nbytes!r}")
    return _counted((nbytes,), torch.uint8, pin, limit_bytes, state=False)


def host_tensor(shape: tuple[int, ...] | torch.Size, dtype: torch.dtype, *, pin: bool = False) -> torch.Tensor:
    """A counted, uninitialised host tensor of ``shape`` and ``dtype``, pinned if ``pin`` ([a host tensor is known
    by its address]).

    Example:
        >>> state = host_tensor((2, 3), torch.float32)
        >>> is_host_tensor(state), is_host_tensor(torch.zeros(2, 3))
        (True, False)
    """
    if not isinstance(dtype, torch.dtype):
        raise TypeError(f"host_tensor(dtype): expected a torch.dtype; got {dtype!r}")
    buffer = _counted(tuple(shape), dtype, pin, None, state=True)
    assert buffer is not None  # no limit: never refused
    return buffer


def _counted(shape: tuple[int, ...], dtype: torch.dtype, pin: bool, limit_bytes: int | None, *,
             state: bool) -> torch.Tensor | None:
    global _LIVE, _PEAK, _STATE_LIVE
    if limit_bytes is not None and (isinstance(limit_bytes, bool) or not isinstance(limit_bytes, int)
                                    or limit_bytes < 0):
        raise ValueError(f"host_buffer(limit_bytes): expected None or an int >= 0; got {limit_bytes!r}")
    nbytes = dtype.itemsize
    for size in shape:
        nbytes *= size
    with _LOCK:
        if state:
            _STATE_LIVE += nbytes
        else:
            if limit_bytes is not None and _LIVE + nbytes > limit_bytes:
                return None
            _LIVE += nbytes
            _PEAK = max(_PEAK, _LIVE)
    try:
        with unmetered():
            buffer = torch.empty(shape, dtype=dtype, pin_memory=pin)
    except BaseException:
        _release(nbytes, 0, state)
        raise
    storage = buffer.untyped_storage()
    address = storage.data_ptr()
    with _LOCK:
        _ADDRESSES.add(address)
    weakref.finalize(storage, _release, nbytes, address, state)  # the storage, not this tensor: rule 4
    return buffer


def is_host_tensor(tensor: torch.Tensor | torch.UntypedStorage) -> bool:
    """Whether ``tensor`` (or a storage) lives in a buffer ``host_buffer`` or ``host_tensor`` made (still alive).

    Example:
        >>> is_host_tensor(torch.ones(3))
        False
    """
    try:  # a DTensor (FSDP2): its shard on this rank
        storage = tensor if isinstance(tensor, torch.UntypedStorage) else local_part(tensor).untyped_storage()
        address = storage.data_ptr()
    except (RuntimeError, NotImplementedError):  # a sparse tensor, a wrapper subclass: not one of these buffers
        return False
    return address != 0 and address in _ADDRESSES


def host_state_bytes() -> int:
    """Bytes of ``host_tensor`` tensors alive now (an optimizer's state in host memory; rule 4).

    Example:
        >>> before = host_state_bytes(); state = host_tensor((256,), torch.float32)
        >>> host_state_bytes() - before
        1024
    """
    return _STATE_LIVE


def host_live_bytes() -> int:
    """Bytes of host buffers (offloaded activations, ``host_buffer``) alive now.

    Example:
        >>> host_live_bytes() >= 0
        True
    """
    return _LIVE


def host_peak_bytes() -> int:
    """The most host-buffer bytes alive at once since the last ``reset_host_peak()``.

    Example:
        >>> reset_host_peak(); buffer = host_buffer(512)
        >>> host_peak_bytes() >= 512
        True
    """
    return _PEAK


def reset_host_peak() -> None:
    """Restart the host peak from the live host bytes (``MemoryMeter`` does this on entry and in ``reset_peak``).

    Example:
        >>> reset_host_peak(); host_peak_bytes() == host_live_bytes()
        True
    """
    global _PEAK
    with _LOCK:
        _PEAK = _LIVE
