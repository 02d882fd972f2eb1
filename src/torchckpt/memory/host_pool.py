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
"""

from __future__ import annotations

import contextlib
import threading
import weakref
from collections.abc import Iterator

import torch
from torch.utils._python_dispatch import _disable_current_modes

__all__ = ["host_buffer", "host_live_bytes", "host_peak_bytes", "reset_host_peak", "unmetered"]

_LOCK = threading.Lock()
_LIVE = 0
_PEAK = 0


def _release(nbytes: int) -> None:
    global _LIVE
    with _LOCK:
        _LIVE -= nbytes


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
    global _LIVE, _PEAK
    if isinstance(nbytes, bool) or not isinstance(nbytes, int) or nbytes < 0:
        raise ValueError(f"host_buffer(nbytes): expected an int >= 0; got {nbytes!r}")
    if limit_bytes is not None and (isinstance(limit_bytes, bool) or not isinstance(limit_bytes, int)
                                    or limit_bytes < 0):
        raise ValueError(f"host_buffer(limit_bytes): expected None or an int >= 0; got {limit_bytes!r}")
    with _LOCK:
        if limit_bytes is not None and _LIVE + nbytes > limit_bytes:
            return None
        _LIVE += nbytes
        _PEAK = max(_PEAK, _LIVE)
    try:
        with unmetered():
            buffer = torch.empty(nbytes, dtype=torch.uint8, pin_memory=pin)
    except BaseException:
        _release(nbytes)
        raise
    weakref.finalize(buffer, _release, nbytes)
    return buffer


def host_live_bytes() -> int:
    """Bytes of host buffers alive now.

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
