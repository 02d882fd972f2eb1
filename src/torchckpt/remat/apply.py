"""Wrap modules of an unmodified model in checkpoints, in place and removably.

Rules:

1. Wrapping sets an instance attribute ``forward`` on each module; nothing else changes, so
   ``state_dict`` keys, parameter identity and hooks are untouched (DESIGN invariant 5).
2. ``remove()`` deletes exactly the attributes it set and is idempotent; a module cannot be wrapped
   twice (the second wrap would checkpoint inside a checkpoint by accident).
"""

from __future__ import annotations

import functools
from collections.abc import Iterable
from typing import Any

from torch import nn

from torchckpt.remat.checkpoint import checkpoint
from torchckpt.remat.policies import PolicyLike, resolve_policy

__all__ = ["CheckpointHandle", "checkpoint_modules"]

_MARK = "_torchckpt_wrapped"


class CheckpointHandle:
    """Undo handle returned by :func:`checkpoint_modules`; ``remove()`` restores the original forwards."""

    def __init__(self, modules: list[nn.Module]) -> None:
        self._modules = modules

    @property
    def modules(self) -> list[nn.Module]:
        """The modules currently wrapped by this handle."""
        return list(self._modules)

    def remove(self) -> None:
        """Restore every wrapped module's own ``forward``.

        Example:
            >>> layer = nn.Linear(2, 2)
            >>> handle = checkpoint_modules([layer])
            >>> handle.remove()
            >>> "forward" in vars(layer)
            False
        """
        for module in self._modules:
            if getattr(module, _MARK, False):
                del module.forward
                delattr(module, _MARK)
        self._modules = []

    def __enter__(self) -> CheckpointHandle:
        return self

    def __exit__(self, *exc_info: Any) -> None:
        self.remove()


def checkpoint_modules(modules: Iterable[nn.Module], policy: PolicyLike = None,
                       preserve_rng_state: bool = True) -> CheckpointHandle:
    """Checkpoint every call of each module with ``policy``; returns a handle to undo it.

    Example:
        >>> from torchckpt.models import gpt
        >>> model = gpt("tiny")
        >>> with checkpoint_modules(model.blocks, policy="dots_saveable"):
        ...     loss = model(*model.example_batch(batch_size=2, seq_len=8))
        ...     loss.backward()
    """
    resolved = resolve_policy(policy)
    wrapped: list[nn.Module] = []
    for module in modules:
        if not isinstance(module, nn.Module):
            raise TypeError(f"checkpoint_modules: expected nn.Module items; got {type(module).__name__}")
        if getattr(module, _MARK, False) or "forward" in vars(module):
            CheckpointHandle(wrapped).remove()
            raise ValueError(f"checkpoint_modules: {type(module).__name__} already has an instance-level forward "
                             "(wrapped already?); call remove() on the earlier handle first")
        original = module.forward
        module.forward = functools.partial(checkpoint, original, policy=resolved,
                                           preserve_rng_state=preserve_rng_state)
        setattr(module, _MARK, True)
        wrapped.append(module)
    return CheckpointHandle(wrapped)
