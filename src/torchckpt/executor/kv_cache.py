"""KV caches off while checkpointing: Hugging Face configs with ``use_cache=True``.

A model that writes a key/value cache in its forward pass (HF decoders with the default
``config.use_cache=True``) runs differently when recomputed (the cache has grown), which the recompute
check reports as a mismatch. HF's own gradient checkpointing turns the cache off in training; torchckpt
does the same wherever it checkpoints (``checkpoint_modules``, ``apply``, ``profile``), with a one-line
notice, and puts it back when the handle is removed (Note: [KV cache off while checkpointing]). Nothing
here imports ``transformers``: a config is anything with a boolean ``use_cache`` attribute held as a
module's ``config``.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterable, Iterator
from typing import Any

from torch import nn

__all__ = ["configs_with_cache", "disable_kv_cache", "kv_cache_off", "restore_kv_cache"]

_log = logging.getLogger("torchckpt")


def configs_with_cache(modules: Iterable[nn.Module]) -> list[Any]:
    """Every distinct ``config`` with ``use_cache=True`` held by ``modules`` or their submodules (encoder-
    decoder models give their decoder stack its own copy of the config, as T5 does).

    Example:
        >>> class Config: use_cache = True
        >>> layer = nn.Linear(2, 2); layer.config = Config()
        >>> len(configs_with_cache([nn.Sequential(layer)]))
        1
    """
    found: dict[int, Any] = {}
    for root in modules:
        for module in root.modules():
            config = getattr(module, "config", None)
            if config is not None and getattr(config, "use_cache", None) is True:
                found.setdefault(id(config), config)
    return list(found.values())


def disable_kv_cache(modules: Iterable[nn.Module], *, while_: str, undo: str) -> list[Any]:
    """Set ``use_cache=False`` on every caching config of ``modules``; log one line naming them, what it is
    for (``while_``) and how it is undone (``undo``). Returns the configs, for :func:`restore_kv_cache`.

    Example:
        >>> class Config: use_cache = True
        >>> layer = nn.Linear(2, 2); layer.config = Config()
        >>> configs = disable_kv_cache([layer], while_="checkpointing", undo="remove()")
        >>> layer.config.use_cache
        False
        >>> restore_kv_cache(configs); layer.config.use_cache
        True
    """
    configs = configs_with_cache(modules)
    for config in configs:
        config.use_cache = False
    if configs:
        names = ", ".join(sorted({type(config).__name__ for config in configs}))
        _log.warning("torchckpt: set use_cache=False on %s while %s (a KV cache written in the forward pass would "
                     "make recomputation differ; HF's gradient checkpointing does the same); %s sets it back",
                     names, while_, undo)
    return configs


def restore_kv_cache(configs: Iterable[Any]) -> None:
    """Set ``use_cache=True`` again on the configs :func:`disable_kv_cache` turned off.

    Example:
        >>> restore_kv_cache([])
    """
    for config in configs:
        config.use_cache = True


@contextlib.contextmanager
def kv_cache_off(modules: Iterable[nn.Module], *, while_: str) -> Iterator[list[Any]]:
    """KV caches of ``modules`` off inside the block, back on when it exits however it exits.

    Example:
        >>> class Config: use_cache = True
        >>> layer = nn.Linear(2, 2); layer.config = Config()
        >>> with kv_cache_off([layer], while_="profiling"):
        ...     layer.config.use_cache
        False
        >>> layer.config.use_cache
        True
    """
    configs = disable_kv_cache(modules, while_=while_, undo=f"the end of {while_}")
    try:
        yield configs
    finally:
        restore_kv_cache(configs)
