"""Host copies that the memory meter does not see: raw tensor bytes and RNG snapshots as NumPy arrays.

``MemoryMeter`` counts tensor storages, so anything torchckpt keeps *about* a step while measuring it
(the caller's RNG state, gradients to compare, parameters to put back) is held as NumPy memory.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np
import torch

__all__ = ["RngSnapshot", "host_bytes", "preserved_rng"]


def host_bytes(tensor: torch.Tensor) -> np.ndarray:
    """The raw bytes of ``tensor`` as a new NumPy ``uint8`` array (contiguous, on the host).

    Example:
        >>> host_bytes(torch.ones(2, dtype=torch.float16)).tolist()
        [0, 60, 0, 60]
    """
    return tensor.detach().cpu().contiguous().view(-1).view(torch.uint8).numpy().copy()


def _cuda_initialised() -> bool:
    return torch.cuda.is_available() and torch.cuda.is_initialized()


@dataclass(frozen=True)
class RngSnapshot:
    """torch's RNG streams at one moment: the CPU generator and every initialised CUDA device's.

    Example:
        >>> snapshot = RngSnapshot.capture()
        >>> first = torch.rand(1)
        >>> snapshot.restore()
        >>> bool(torch.rand(1) == first)
        True
    """

    cpu: np.ndarray
    cuda: tuple[np.ndarray, ...] = ()

    @classmethod
    def capture(cls) -> RngSnapshot:
        """Snapshot the CPU stream and, when CUDA is initialised, every device's stream."""
        cuda = tuple(host_bytes(state) for state in torch.cuda.get_rng_state_all()) if _cuda_initialised() else ()
        return cls(cpu=host_bytes(torch.get_rng_state()), cuda=cuda)

    def restore(self) -> None:
        """Set every stream back to this snapshot (the snapshot can be restored again)."""
        torch.set_rng_state(torch.from_numpy(self.cpu.copy()))
        if self.cuda:
            torch.cuda.set_rng_state_all([torch.from_numpy(state.copy()) for state in self.cuda])


@contextlib.contextmanager
def preserved_rng() -> Iterator[RngSnapshot]:
    """Restore torch's RNG streams (CPU and CUDA) when the block exits, however it exits.

    Example:
        >>> before = torch.get_rng_state()
        >>> with preserved_rng():
        ...     _ = torch.manual_seed(123)
        >>> torch.equal(torch.get_rng_state(), before)
        True
    """
    snapshot = RngSnapshot.capture()
    try:
        yield snapshot
    finally:
        snapshot.restore()
