"""Undo what a recomputation writes to tensors it did not create (checkpoint.py's [recomputation leaves buffers alone]).

A recomputation (of a checkpointed region, or of a checkpointed loop's steps) runs a forward pass a
second time; whatever that forward writes in place to tensors from outside it (a BatchNorm's running
statistics, a counter buffer) would be written twice. ``WriteLog`` copies each such tensor the first
time it is written and puts it back at the end; ``UndoOuterWrites`` is a dispatch mode around it. The
rule itself is stated in ``executor/checkpoint.py``.
"""

from __future__ import annotations

import functools
from types import TracebackType
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

__all__ = ["UndoOuterWrites", "WriteLog"]


def _storage_key(tensor: torch.Tensor) -> int | None:
    try:
        return tensor.untyped_storage().data_ptr() or None
    except (RuntimeError, NotImplementedError):
        return None


# Kernels that update a BatchNorm's running statistics in place although their schemas do not say so.
_UNDECLARED_WRITES = {"aten::native_batch_norm": ("running_mean", "running_var"),
                      "aten::cudnn_batch_norm": ("running_mean", "running_var"),
                      "aten::miopen_batch_norm": ("running_mean", "running_var")}


@functools.cache
def _written_arguments(func: Any) -> tuple[tuple[int, str], ...]:
    """(position, name) of every argument ``func`` writes in place: ``Tensor(a!)`` in its schema, and the
    running statistics of the batch-norm kernels whose schemas leave that out."""
    undeclared = _UNDECLARED_WRITES.get(func._schema.name, ())
    return tuple((position, argument.name) for position, argument in enumerate(func._schema.arguments)
                 if (argument.alias_info is not None and argument.alias_info.is_write)
                 or argument.name in undeclared)


class WriteLog:
    """Copies of the tensors from outside a recomputation that it writes in place, to put back at its end.
    checkpoint.py's [recomputation leaves buffers alone].

    Example:
        >>> log, buffer = WriteLog(), torch.zeros(2)
        >>> log.before(torch.ops.aten.add_.Tensor, (buffer, 1.0), {})
        >>> _ = buffer.add_(1.0)
        >>> log.restore()
        >>> buffer.tolist()
        [0.0, 0.0]
    """

    def __init__(self) -> None:
        self.fresh: set[int] = set()  # storage keys of tensors the recomputation allocated itself
        self.saved: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}  # view key -> (tensor, copy)

    def note_outputs(self, func: Any, flat: list[Any], served: bool = False) -> None:
        """Remember the storages ``func`` allocated (views and in-place results share an older one)."""
        if served or not any(ret.alias_info is not None for ret in func._schema.returns):
            for value in flat:
                if isinstance(value, torch.Tensor):
                    key = _storage_key(value)
                    if key is not None:
                        self.fresh.add(key)

    def before(self, func: Any, args: tuple, kwargs: dict) -> None:
        """Copy each tensor from outside that ``func`` is about to write, the first time it is written."""
        for position, name in _written_arguments(func):
            value = args[position] if position < len(args) else kwargs.get(name)
            for tensor in tree_flatten(value)[0]:
                if not isinstance(tensor, torch.Tensor):
                    continue
                key = _storage_key(tensor)
                if key is None or key in self.fresh:
                    continue
                view = (key, tensor.storage_offset(), tuple(tensor.shape), tuple(tensor.stride()), tensor.dtype)
                if view not in self.saved:
                    self.saved[view] = (tensor, tensor.clone())

    def restore(self) -> None:
        """Put every copied tensor back, newest copy first, so overlapping views end as they began."""
        saved, self.saved, self.fresh = self.saved, {}, set()
        with torch.no_grad():
            for tensor, copy in reversed(list(saved.values())):
                tensor.copy_(copy)


class UndoOuterWrites(TorchDispatchMode):
    """A dispatch mode that, when it exits, puts back every tensor that existed before it was entered and
    was written in place inside it (checkpoint.py's [recomputation leaves buffers alone]). The checkpointed loops
    recompute their steps under it; a checkpointed region's recompute mode does the same by itself.

    Example:
        >>> norm = torch.nn.BatchNorm1d(3)
        >>> with UndoOuterWrites():
        ...     y = norm(torch.randn(4, 3))
        >>> int(norm.num_batches_tracked), bool(norm.running_mean.eq(0).all())
        (0, True)
    """

    def __init__(self) -> None:
        super().__init__()
        self.writes = WriteLog()

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        self.writes.before(func, args, kwargs)
        out = func(*args, **kwargs)
        self.writes.note_outputs(func, tree_flatten(out)[0])
        return out

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        super().__exit__(exc_type, exc, tb)
        self.writes.restore()
