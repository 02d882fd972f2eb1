"""Which storage back end serves a location: a local directory (local.py) or an fsspec URL (remote.py)."""

from __future__ import annotations

import os

from torchckpt.state.storage.base import Storage
from torchckpt.state.storage.local import LocalStorage
from torchckpt.state.storage.remote import FsspecStorage


def open_storage(location: str | os.PathLike[str]) -> Storage:
    """Storage for a local path or an fsspec URL (``s3://``, ``memory://``, ...).

    Example:
        >>> open_storage("/tmp/torchckpt-doctest").location
        '/tmp/torchckpt-doctest'
    """
    text = os.fspath(location)
    if "://" in text and not text.startswith("file://"):
        return FsspecStorage(text)
    return LocalStorage(text.removeprefix("file://"))



def resolved_location(location: str | os.PathLike[str]) -> str:
    """``location`` with a local path made absolute (resolved against today's working directory); a URL as is.

    Example:
        >>> os.path.isabs(resolved_location("runs/exp1")), resolved_location("memory://runs")
        (True, 'memory://runs')
    """
    text = os.fspath(location)
    if "://" in text and not text.startswith("file://"):
        return text
    return os.path.abspath(text.removeprefix("file://"))
