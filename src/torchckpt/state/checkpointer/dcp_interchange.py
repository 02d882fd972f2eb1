"""Interchange with PyTorch Distributed Checkpoint (DCP) directories: export a step's model to one, import one.

A DCP directory (what ``torch.distributed.checkpoint.save`` writes, and torchtitan) holds ``.distcp`` files of raw
tensor bytes and a ``.metadata`` file that says where each tensor lies. PyTorch writes ``.metadata`` with
``pickle`` and reads it back only with ``pickle.load``: there is no other reader of it.

Rules kept here (named in ``docs/design.md``; the design notes they keep in parentheses):

1. **[a DCP import unpickles only when trusted]** (Note: [no pickle]) Reading a DCP directory means unpickling
   its ``.metadata``, which runs whatever code the file names; so ``import_dcp`` reads one only when the caller
   says the directory is trusted (``trust_pickle=True``, ``--trust-dcp-metadata``), and otherwise refuses it
   naming the flag and why, before reading anything. Tensors are then read by DCP's own reader into tensors
   this module allocates from the metadata's sizes and dtypes; entries that are not tensors (pickled Python
   objects in DCP's ``.distcp`` files) are never loaded: they are named as left out.
2. **[a DCP export is plain DCP]** ``export_dcp`` writes a step's module item, whole, with
   ``torch.distributed.checkpoint.save`` under its state_dict keys (what ``dcp.load`` and torchtitan's model
   loader read), into a temp directory renamed into place, so a crash never leaves a half-written export; an
   existing output is refused.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import warnings
from collections.abc import Iterator
from typing import Any

import torch

from torchckpt.state.checkpointer.interchange import import_state_dict, model_weights
from torchckpt.state.errors import CheckpointError, CheckpointExistsError, CheckpointNotFoundError, UnsafeFileError

__all__ = ["export_dcp", "import_dcp", "is_dcp_directory"]

METADATA = ".metadata"


def is_dcp_directory(path: str | os.PathLike[str]) -> bool:
    """Whether ``path`` is a directory written by ``torch.distributed.checkpoint.save`` (it holds ``.metadata``).

    Example:
        >>> is_dcp_directory("/nonexistent")
        False
    """
    return os.path.isfile(os.path.join(os.fspath(path), METADATA))


def export_dcp(directory: str | os.PathLike[str], out: str | os.PathLike[str], step: int | None = None,
               item: str = "model") -> int:
    """Write the model weights of the newest valid step (or ``step``) as a DCP directory ``out``
    ([a DCP export is plain DCP]); returns the exported step.

    Example:
        >>> import tempfile
        >>> import torch.distributed.checkpoint as dcp
        >>> from torchckpt.state import Checkpointer
        >>> tmp = tempfile.TemporaryDirectory(); model = torch.nn.Linear(2, 2)
        >>> with Checkpointer(tmp.name) as ckpt:
        ...     ckpt.save(3, model=model)
        >>> export_dcp(tmp.name, os.path.join(tmp.name, "dcp"))
        3
        >>> loaded = {"weight": torch.empty(2, 2), "bias": torch.empty(2)}
        >>> dcp.load(loaded, checkpoint_id=os.path.join(tmp.name, "dcp"))
        >>> torch.equal(loaded["weight"], model.weight)
        True
        >>> tmp.cleanup()
    """
    import torch.distributed.checkpoint as dcp

    target = os.path.abspath(os.fspath(out))
    if os.path.exists(target):
        raise CheckpointExistsError(f"{target} exists; a DCP export writes a new directory. Fix: pass another "
                                    "--out, or remove that one")
    parent = os.path.dirname(target)
    if not os.path.isdir(parent):
        raise CheckpointNotFoundError(f"{target}: no directory {parent} to export into. Fix: create it first")
    exported, tensors = model_weights(directory, step, item)
    temp = f"{target}.tmp-{os.getpid()}"
    try:
        with _one_process():
            dcp.save(dict(tensors), checkpoint_id=temp, no_dist=True)
        os.replace(temp, target)
    except OSError as error:
        raise CheckpointError(f"{target}: could not write the DCP export ({error}). Fix: check the path, "
                              "permissions and free space") from error
    finally:
        if os.path.isdir(temp):
            shutil.rmtree(temp, ignore_errors=True)
    return exported


def import_dcp(path: str | os.PathLike[str], directory: str | os.PathLike[str], step: int | None = None, *,
               trust_pickle: bool = False) -> tuple[int, list[str]]:
    """Convert a DCP directory's tensors into a torchckpt checkpoint's ``model`` item; returns its step and the
    keys left out (entries that are not tensors). Needs ``trust_pickle=True`` ([a DCP import unpickles only when
    trusted]). Keys under a top-level ``model`` (``{"model": ...}`` saved whole) lose that prefix; the step is
    ``step``, else 0; an existing newer run is refused as by ``import_torch_save``.

    Example:
        >>> import tempfile
        >>> import torch.distributed.checkpoint as dcp
        >>> tmp = tempfile.TemporaryDirectory(); source = os.path.join(tmp.name, "dcp")
        >>> _ = dcp.save({"model": torch.nn.Linear(2, 2).state_dict()}, checkpoint_id=source, no_dist=True)
        >>> import_dcp(source, os.path.join(tmp.name, "run"), step=7, trust_pickle=True)
        (7, [])
        >>> import_dcp(source, os.path.join(tmp.name, "run2"))  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        torchckpt.state.errors.UnsafeFileError: ...: DCP keeps its .metadata as a pickle...
        >>> tmp.cleanup()
    """
    source = os.path.abspath(os.fspath(path))
    if not is_dcp_directory(source):
        raise CheckpointNotFoundError(f"{source}: not a DCP directory (no {METADATA} file in it). Fix: pass the "
                                      "directory torch.distributed.checkpoint.save wrote")
    if trust_pickle is not True:
        raise UnsafeFileError(
            f"{source}: DCP keeps its {METADATA} as a pickle, and PyTorch reads it only by unpickling, which runs "
            "any code the file names; torchckpt unpickles nothing unless told to. Fix: if you trust where this "
            "directory came from, pass --trust-dcp-metadata (import_dcp(..., trust_pickle=True))")
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    reader = dcp.FileSystemReader(source)
    try:
        metadata = reader.read_metadata()  # the unpickling the caller allowed
    except Exception as error:  # noqa: BLE001 - whatever a broken pickle raises, named with the file
        raise CheckpointError(f"{source}/{METADATA}: not readable as DCP metadata ({type(error).__name__}: "
                              f"{error})") from None
    tensors: dict[str, torch.Tensor] = {}
    left_out: list[str] = []
    for key, saved in metadata.state_dict_metadata.items():
        if isinstance(saved, TensorStorageMetadata):
            tensors[key] = torch.empty(saved.size, dtype=saved.properties.dtype)
        else:
            left_out.append(key)
    if not tensors:
        raise CheckpointError(f"{source}: holds no tensors (only {sorted(left_out)[:5]}); nothing to import")
    with _one_process():
        dcp.load(tensors, storage_reader=reader, no_dist=True)
    prefix = "model."
    if all(key.startswith(prefix) for key in tensors):
        tensors = {key[len(prefix):]: value for key, value in tensors.items()}
    chosen = 0 if step is None else step
    return import_state_dict({"model": _Weights(tensors)}, directory, chosen, source), sorted(left_out)


@contextlib.contextmanager
def _one_process() -> Iterator[None]:
    """DCP's warning that it runs in one process, which is what this module means, silenced."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield


class _Weights:
    """An item holding imported tensors (what the import saves as ``model``)."""

    def __init__(self, state: dict[str, Any]) -> None:
        self._state = state

    def state_dict(self) -> dict[str, Any]:
        return self._state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._state = state
