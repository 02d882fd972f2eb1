"""Wrap modules of an unmodified model in checkpoints, in place and removably (``checkpoint_modules``).

Rules (collected in ``docs/design.md``):

1. **[wrapping sets only forward]** Wrapping sets an instance attribute ``forward`` on each module;
   nothing else changes, so ``state_dict`` keys, parameter identity and hooks are untouched
   (Note: [applying a plan is undoable]).
2. **[wrap once, remove exactly]** ``remove()`` deletes exactly the attributes it set and is
   idempotent; a module cannot be wrapped twice (the second wrap would checkpoint inside a checkpoint
   by accident).
"""

from __future__ import annotations

import functools
import weakref
from collections.abc import Callable, Iterable
from typing import Any

from torch import nn

from torchckpt.executor.checkpoint import checkpoint
from torchckpt.executor.compiled import SideEffectsOnce, uncompiled
from torchckpt.executor.kv_cache import disable_kv_cache, restore_kv_cache
from torchckpt.executor.policies import PolicyLike, resolve_policy

__all__ = ["CheckpointHandle", "checkpoint_modules", "wrap_forward"]

_MARK = "_torchckpt_wrapped"


class CheckpointHandle:
    """Undo handle returned by :func:`checkpoint_modules`; ``remove()`` restores the original forwards."""

    def __init__(self, modules: list[nn.Module], cache_configs: list[Any] | None = None,
                 undo: list[Callable[[], None]] | None = None) -> None:
        self._modules = modules
        self._cache_configs = list(cache_configs or ())
        self._undo = list(undo or ())  # more to undo on remove() (an optimizer run in backward)
        # Note: [Python side effects run once under compile]; a handle dropped without remove() lets go when collected
        self._side_effects = SideEffectsOnce() if modules else None
        if self._side_effects is not None:
            weakref.finalize(self, self._side_effects.release)

    @property
    def modules(self) -> list[nn.Module]:
        """The modules currently wrapped by this handle."""
        return list(self._modules)

    def remove(self) -> None:
        """Restore every wrapped module's own ``forward`` and the ``use_cache`` it turned off.

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
        for undo in self._undo:
            undo()
        self._undo = []
        restore_kv_cache(self._cache_configs)
        self._cache_configs = []
        if self._side_effects is not None:
            self._side_effects.release()

    def __enter__(self) -> CheckpointHandle:
        return self

    def __exit__(self, *exc_info: Any) -> None:
        self.remove()


def wrap_forward(module: nn.Module, forward: Callable[..., Any], wrapped: list[nn.Module]) -> None:
    """Give ``module`` the instance-level ``forward`` and append it to ``wrapped``
    ([wrapping sets only forward], [wrap once, remove exactly]).

    On an error every module in ``wrapped`` is unwrapped first, so a half-applied wrap never stays.

    Example:
        >>> layer, wrapped = nn.Linear(2, 2), []
        >>> wrap_forward(layer, layer.forward, wrapped)
        >>> CheckpointHandle(wrapped).remove()
    """
    if not isinstance(module, nn.Module):
        CheckpointHandle(wrapped).remove()
        raise TypeError(f"expected nn.Module items; got {type(module).__name__}")
    if getattr(module, _MARK, False) or "forward" in vars(module):
        CheckpointHandle(wrapped).remove()
        raise ValueError(f"{type(module).__name__} already has an instance-level forward "
                         "(wrapped already?); call remove() on the earlier handle first")
    module.forward = forward
    setattr(module, _MARK, True)
    wrapped.append(module)


def checkpoint_modules(modules: Iterable[nn.Module], policy: PolicyLike = None,
                       preserve_rng_state: bool = True) -> CheckpointHandle:
    """Checkpoint every call of each module with ``policy``; returns a handle to undo it.

    A Hugging Face config with ``use_cache=True`` held by the modules is set to False until ``remove()``,
    with a one-line notice (a KV cache written in the forward pass would make recomputation differ).

    Example:
        >>> from torchckpt.models import gpt
        >>> model = gpt("tiny")
        >>> with checkpoint_modules(model.blocks, policy="dots_saveable"):
        ...     loss = model(*model.example_batch(batch_size=2, seq_len=8))
        ...     loss.backward()
    """
    resolved = resolve_policy(policy)
    # Note: [a compiled model is planned through its original]: the wrap goes inside the compiled code
    modules = [uncompiled(module) for module in modules]
    wrapped: list[nn.Module] = []
    for module in modules:
        if not isinstance(module, nn.Module):
            CheckpointHandle(wrapped).remove()
            raise TypeError(f"checkpoint_modules: expected nn.Module items; got {type(module).__name__}")
        wrap_forward(module, functools.partial(checkpoint, module.forward, policy=resolved,
                                               preserve_rng_state=preserve_rng_state), wrapped)
    # Note: [KV cache off while checkpointing]
    return CheckpointHandle(wrapped, disable_kv_cache(modules, while_="checkpoint_modules is applied",
                                                      undo="handle.remove()"))
