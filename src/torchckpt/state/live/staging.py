"""Host memory for snapshots: where an async save's tensors are copied before training goes on.

Rules kept here (named in ``docs/design.md``):

1. **[sync saves copy nothing]** A sync save copies nothing: CPU tensors are
   written straight from their own memory while the caller waits (format/codec.py's
   [zero copy both ways]); device tensors are copied to host once (``.cpu()``).
2. **[one reused host buffer]** An async save copies every tensor once,
   synchronously, into one host buffer that the Checkpointer keeps and reuses:
   that copy is the whole blocking part of an async save. A fresh buffer would
   cost a page fault per 4 KiB on every save (measured: the copy into fresh memory
   is 3-10x slower than into a warm buffer, bench/state/bench_throughput.py), so
   the buffer is kept while the state keeps its size. It is pinned when tensors
   live on a CUDA device, so device-to-host copies run at full speed.
3. **[the buffer waits for the last save]** The buffer is reused only after the
   previous save that wrote from it has committed or failed: the Checkpointer
   allows one save in flight and waits for it before the next copy
   (checkpointer/checkpointer.py's [one save in flight]).
4. **[optimizer steps wait for staging]** Background staging
   (``async_staging=True``, opt-in): tensors that only an optimizer step changes
   (parameters, optimizer state; CPU only) are laid out by
   :meth:`HostStaging.copy` but copied by :meth:`HostStaging.finish`, which the
   save's background thread runs while training computes its next forward and
   backward. The Checkpointer makes every optimizer step wait until ``finish`` is
   done. ``finish`` compares each source's version counter with the one it had
   when the save began, so an in-place change made outside an optimizer step (an
   EMA update under ``no_grad``) fails the save loudly instead of writing a torn
   state.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

_ALIGN_BYTES = 64  # every tensor starts on a cache line, so any dtype can view its slice


def to_host(tensors: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """CPU contiguous versions of ``tensors``: the same tensors when already there
    ([sync saves copy nothing]).

    Example:
        >>> weight = torch.ones(2)
        >>> to_host({"w": weight})["w"] is weight
        True
    """
    return {key: tensor.cpu().contiguous() for key, tensor in tensors.items()}


class HostStaging:
    """One reusable host buffer that async saves copy their tensors into ([one reused host buffer]).

    Example:
        >>> staging = HostStaging()
        >>> weight = torch.ones(3)
        >>> [copied] = staging.copy([{"w": weight}])
        >>> weight.add_(1); copied["w"]
        tensor([2., 2., 2.])
        tensor([1., 1., 1.])
        >>> staging.capacity_bytes >= 12
        True
    """

    def __init__(self) -> None:
        self._buffer: torch.Tensor | None = None
        self._deferred: list[tuple[str, torch.Tensor, torch.Tensor, int]] = []  # key, target, source, version

    @property
    def capacity_bytes(self) -> int:
        """Bytes of host memory held now (0 before the first copy and after :meth:`release`)."""
        return 0 if self._buffer is None else self._buffer.numel()

    def copy(
        self,
        groups: Sequence[Mapping[str, torch.Tensor]],
        defer: Callable[[torch.Tensor], bool] | None = None,
    ) -> list[dict[str, torch.Tensor]]:
        """Copy every tensor of ``groups`` into the buffer; returns views with the same keys.

        Tensors for which ``defer(tensor)`` is true (CPU ones only) are left for
        :meth:`finish` ([optimizer steps wait for staging]). The views stay valid
        until the next :meth:`copy` or :meth:`release`.
        """
        offsets, total_bytes = _layout(groups)
        on_cuda = any(tensor.is_cuda for group in groups for tensor in group.values())
        buffer = self._reserve(total_bytes, pinned=on_cuda)
        self._deferred = []
        copies = []
        for group, group_offsets in zip(groups, offsets):
            views = {}
            for key, tensor in group.items():
                if defer is not None and not tensor.is_cuda and defer(tensor):
                    views[key] = _slot(buffer, group_offsets[key], tensor)
                    self._deferred.append((key, views[key], tensor, tensor._version))
                else:
                    views[key] = _copy_into(buffer, group_offsets[key], tensor)
            copies.append(views)
        if on_cuda:
            torch.cuda.synchronize()  # non_blocking copies must land before the writer reads them
        return copies

    @property
    def deferred_count(self) -> int:
        """Tensors the last :meth:`copy` left for :meth:`finish` (0 once finished)."""
        return len(self._deferred)

    def finish(self) -> list[str]:
        """Copy the tensors :meth:`copy` deferred ([optimizer steps wait for staging]); returns the keys of
        those changed in place since.

        Example:
            >>> staging, weight = HostStaging(), torch.ones(2)
            >>> [view] = staging.copy([{"w": weight}], defer=lambda tensor: True)
            >>> staging.deferred_count, staging.finish(), view["w"]
            (1, [], tensor([1., 1.]))
            >>> [view] = staging.copy([{"w": weight}], defer=lambda tensor: True)
            >>> weight.mul_(3); staging.finish()
            tensor([3., 3.])
            ['w']
        """
        deferred, self._deferred = self._deferred, []
        for _, target, source, _ in deferred:
            target.copy_(source)
        return [key for key, _, source, version in deferred if source._version != version]

    def release(self) -> None:
        """Free the buffer (the Checkpointer calls this on close).

        Example:
            >>> staging = HostStaging(); _ = staging.copy([{"w": torch.ones(1)}]); staging.release()
            >>> staging.capacity_bytes
            0
        """
        self._buffer = None
        self._deferred = []

    def _reserve(self, total_bytes: int, pinned: bool) -> torch.Tensor:
        buffer = self._buffer
        fits = buffer is not None and total_bytes <= buffer.numel() <= 2 * total_bytes + _ALIGN_BYTES
        if not (fits and buffer.is_pinned() == pinned):  # type: ignore[union-attr]
            self._buffer = None  # free the old one first: never hold two
            self._buffer = torch.empty(max(total_bytes, 1), dtype=torch.uint8, pin_memory=pinned)
        return self._buffer  # type: ignore[return-value]


def _layout(groups: Sequence[Mapping[str, torch.Tensor]]) -> tuple[list[dict[str, int]], int]:
    offsets: list[dict[str, int]] = []
    position = 0
    for group in groups:
        group_offsets = {}
        for key, tensor in group.items():
            group_offsets[key] = position
            position += -(-tensor.numel() * tensor.element_size() // _ALIGN_BYTES) * _ALIGN_BYTES
        offsets.append(group_offsets)
    return offsets, position


def _slot(buffer: torch.Tensor, offset: int, tensor: torch.Tensor) -> torch.Tensor:
    nbytes = tensor.numel() * tensor.element_size()
    return buffer[offset : offset + nbytes].view(tensor.dtype).view(tensor.shape)


def _copy_into(buffer: torch.Tensor, offset: int, tensor: torch.Tensor) -> torch.Tensor:
    target = _slot(buffer, offset, tensor)
    target.copy_(tensor, non_blocking=tensor.is_cuda)
    return target


def changed_only_by_optimizer_steps(items: Mapping[str, Any]) -> Callable[[torch.Tensor], bool]:
    """Predicate for the tensors background staging may copy late ([optimizer steps wait for staging]): parameters,
    optimizer state.

    Example:
        >>> model = torch.nn.Linear(2, 2)
        >>> late = changed_only_by_optimizer_steps({"model": model})
        >>> late(model.weight), late(torch.ones(2))
        (True, False)
    """
    guarded: set[tuple[int, int]] = set()
    for obj in items.values():
        if isinstance(obj, torch.nn.Module):
            guarded.update((p.data_ptr(), p.numel()) for p in obj.parameters() if p.numel())
        elif isinstance(obj, torch.optim.Optimizer):
            guarded.update((t.data_ptr(), t.numel()) for state in obj.state.values() for t in state.values()
                           if isinstance(t, torch.Tensor) and t.numel())
    return lambda tensor: tensor.numel() > 0 and (tensor.data_ptr(), tensor.numel()) in guarded
