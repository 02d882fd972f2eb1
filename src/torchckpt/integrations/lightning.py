"""Lightning: a ``CheckpointIO`` plugin that writes every Lightning checkpoint as a torchckpt checkpoint.

    from torchckpt.integrations.lightning import TorchckptIO
    trainer = lightning.Trainer(plugins=[TorchckptIO()], callbacks=[ModelCheckpoint(save_last=True, ...)])
    trainer.fit(model, loader, ckpt_path="last")      # the ordinary workflow, unchanged

Rules kept here (named in ``docs/design.md``'s style; the state package's notes they rely on in parentheses):

1. **[a Lightning path is a checkpoint directory]** Each path Lightning asks for (``.../last.ckpt``,
   ``.../epoch=0-step=10.ckpt``) is a torchckpt run directory holding one committed step: the save is a
   ``Checkpointer.save`` (hashed while written, committed by a rename; local.py's [local commit is a rename]) and
   the step before it is removed only after the new one is committed (``keep_last=1``), so a ``kill -9`` at
   any instant leaves the path holding the old or the new checkpoint, never a half one, never nothing.
   **[a first save appears whole]** A path's first save is written to a hidden ``.tmp-NAME-*`` sibling
   and renamed into place, so a kill -9 during it leaves no directory at the path (one holding no step
   would be picked by ``ckpt_path="last"`` and refused), only that sibling, which nothing reads.
   ModelCheckpoint's ``ls``/``exists``/``modified`` and ``ckpt_path="last"`` work on directories as on files.
2. **[the dict round-trips exactly]** Lightning's dict is stored by torchckpt's codec, never pickle:
   ``state_dict`` as item ``model`` (so ``torchckpt export`` reads it), everything else as item
   ``lightning`` with a placeholder at ``state_dict``'s place (holding its key order and whether it was an
   ``OrderedDict``), so the keys at both levels come back in their order. Tensors come
   back bitwise, Python values with their types (tuples, int keys, NumPy values are tagged). A value the
   codec cannot store is an ``UnsupportedStateError`` naming the key, before anything is written.
3. **[step numbers only grow]** The torchckpt step of a save is Lightning's ``global_step``, or one more than
   the path's newest step when that is not greater (``last.ckpt`` saved again at the same step, or after
   resuming an older checkpoint), so a save never collides with a committed step nor starts a rewind.
4. **[removal is a rename first]** ``remove_checkpoint`` renames the directory to a hidden ``.trash-*``
   sibling before deleting it: a crash mid-delete never leaves a half checkpoint under a ``.ckpt`` name.
"""

from __future__ import annotations

import os
import shutil
import uuid
from collections import OrderedDict
from collections.abc import Callable, Mapping
from typing import Any

import torch

from torchckpt._optional import install_hint

try:
    from lightning.fabric.plugins.io.checkpoint_io import CheckpointIO
    from lightning.fabric.utilities.cloud_io import get_filesystem
    from lightning.fabric.utilities.types import _PATH
except ImportError as error:  # the message names the pip command
    raise ImportError(f"torchckpt.integrations.lightning needs lightning, which did not import ({error}): "
                      f"{install_hint('lightning')}") from error

from torchckpt.state import (
    Checkpointer,
    CheckpointerConfig,
    CheckpointMismatchError,
    CheckpointNotFoundError,
    UnsupportedStateError,
    load,
)
from torchckpt.state.format.codec import split_tensors
from torchckpt.state.storage.local import fsync_dir

__all__ = ["TorchckptIO"]

_MODEL_ITEM = "model"  # Lightning's "state_dict" (torchckpt export reads item "model")
_REST_ITEM = "lightning"  # every other key of Lightning's dict
_STATE_DICT_KEY = "state_dict"
_MARK = "__torchckpt_lightning__"  # the placeholder's key (it stands in item "lightning")
_VERIFY_MODES = ("full", "fast")


class TorchckptIO(CheckpointIO):
    """Lightning ``CheckpointIO`` that saves atomically, hashed and pickle-free with torchckpt.

    Pass it to ``lightning.Trainer(plugins=[TorchckptIO()])``; ModelCheckpoint (``every_n_train_steps``,
    ``save_top_k``, ``save_last``) and ``trainer.fit(..., ckpt_path="last")`` work unchanged. Each
    checkpoint path becomes a directory (rule [a Lightning path is a checkpoint directory]).

    Args:
        verify: ``"full"`` (default) hashes every file when loading; ``"fast"`` checks sizes only.
        hash_algorithm: the manifest's hash (torchckpt's default when None); see ``CheckpointerConfig``.

    Example:
        >>> import os, tempfile, torch
        >>> tmp = tempfile.TemporaryDirectory(); path = os.path.join(tmp.name, "last.ckpt")
        >>> io = TorchckptIO()
        >>> io.save_checkpoint({"state_dict": {"w": torch.ones(2)}, "epoch": 0, "global_step": 3,
        ...                     "loops": {"betas": (0.9, 0.99)}}, path)
        >>> loaded = io.load_checkpoint(path)
        >>> list(loaded), loaded["loops"]["betas"], torch.equal(loaded["state_dict"]["w"], torch.ones(2))
        (['state_dict', 'epoch', 'global_step', 'loops'], (0.9, 0.99), True)
        >>> io.remove_checkpoint(path); os.path.exists(path)
        False
        >>> tmp.cleanup()
    """

    def __init__(self, *, verify: str = "full", hash_algorithm: str | None = None) -> None:
        if not isinstance(verify, str) or verify not in _VERIFY_MODES:
            raise ValueError(f"TorchckptIO(verify={verify!r}): expected 'full' (hash every file when loading) "
                             "or 'fast' (sizes only)")
        if hash_algorithm is not None and not isinstance(hash_algorithm, str):
            raise TypeError(f"TorchckptIO(hash_algorithm={hash_algorithm!r}): expected a str such as 'sha256', "
                            "or None for torchckpt's default")
        self.verify = verify
        self.hash_algorithm = hash_algorithm
        self._options: dict[str, Any] = {"keep_last": 1, "capture_rng": False}
        if hash_algorithm is not None:
            self._options["hash_algorithm"] = hash_algorithm
        CheckpointerConfig(**self._options)  # a bad hash name fails here, not at the first save

    # ----- saving -------------------------------------------------------------------------

    def save_checkpoint(self, checkpoint: dict[str, Any], path: _PATH, storage_options: Any | None = None) -> None:
        """Write ``checkpoint`` (Lightning's dict) to ``path`` as one committed torchckpt step.

        Raises ``UnsupportedStateError`` naming the key of a value that needs pickle (nothing is written
        then), ``CheckpointError`` when ``path`` is a regular file (e.g. left by ``TorchCheckpointIO``).

        Example:
            >>> import os, tempfile
            >>> tmp = tempfile.TemporaryDirectory(); path = os.path.join(tmp.name, "x.ckpt")
            >>> TorchckptIO().save_checkpoint({"epoch": 1, "global_step": 0}, path)
            >>> sorted(os.listdir(path))
            ['.lock', 'step-000000000']
            >>> tmp.cleanup()
        """
        if storage_options is not None:
            raise TypeError(f"save_checkpoint(storage_options={storage_options!r}): TorchckptIO takes no storage "
                            "options (torchckpt chooses the layout). Fix: call trainer.save_checkpoint without them.")
        if not isinstance(checkpoint, dict):
            raise TypeError(f"save_checkpoint: checkpoint must be a dict (Lightning's checkpoint), got "
                            f"{type(checkpoint).__qualname__}")
        location = _location(path, "save_checkpoint")
        _refuse_regular_file(location, "save to")
        items = _split(checkpoint, location)
        _check_representable(items, location)  # [the dict round-trips exactly]: fail before any file is made
        if _is_local(location):
            os.makedirs(os.path.dirname(os.path.abspath(location)), exist_ok=True)
            if not os.path.lexists(location):
                self._save_new(checkpoint, items, location)  # [a first save appears whole]
                return
        with Checkpointer(location, **self._options) as ckpt:
            infos = ckpt.list()
            newest = max((info.step for info in infos), default=-1)
            step = _global_step(checkpoint)
            step = step if step > newest else newest + 1  # [step numbers only grow]
            ckpt.save(step, metrics=_metrics(checkpoint), **items)

    def _save_new(self, checkpoint: Mapping[str, Any], items: Mapping[str, dict[str, Any]], location: str) -> None:
        """Save into a hidden sibling, then rename it to ``location``: a kill -9 meanwhile leaves no directory
        at ``location`` (which ``ckpt_path="last"`` would pick and fail on), only a ``.tmp-*`` sibling."""
        parent, name = os.path.split(os.path.abspath(location))
        staging = os.path.join(parent, f".tmp-{name}-{uuid.uuid4().hex[:8]}")
        try:
            with Checkpointer(staging, **self._options) as ckpt:
                ckpt.save(_global_step(checkpoint), metrics=_metrics(checkpoint), **items)
            os.rename(staging, location)
        except BaseException:
            shutil.rmtree(staging, ignore_errors=True)
            raise
        fsync_dir(parent)  # the rename survives a power loss too

    # ----- loading ------------------------------------------------------------------------

    def load_checkpoint(
        self, path: _PATH, map_location: Any | None = None, weights_only: bool | None = None
    ) -> dict[str, Any]:
        """Read the checkpoint at ``path`` back into the dict Lightning saved (keys in their order).

        Tensors come back on the CPU, or where ``map_location`` (a device, a device string, a dict of
        ``{"cpu": device}``, or ``torch.load``'s ``fn(storage, location)``) puts them. ``weights_only`` is
        accepted and has no effect: nothing is ever unpickled. A missing path is a
        ``CheckpointNotFoundError``; a damaged one a ``CheckpointCorruptError`` naming the file.

        Example:
            >>> import os, tempfile
            >>> tmp = tempfile.TemporaryDirectory(); path = os.path.join(tmp.name, "x.ckpt")
            >>> io = TorchckptIO(); io.save_checkpoint({"global_step": 2, "state_dict": {"w": torch.ones(1)}}, path)
            >>> io.load_checkpoint(path, map_location="cpu")["state_dict"]["w"].device
            device(type='cpu')
            >>> tmp.cleanup()
        """
        if weights_only is not None and not isinstance(weights_only, bool):
            raise TypeError(f"load_checkpoint(weights_only={weights_only!r}): expected None or a bool")
        location = _location(path, "load_checkpoint")
        _refuse_regular_file(location, "load")
        if not get_filesystem(location).exists(location):
            raise CheckpointNotFoundError(f"checkpoint not found: {location} does not exist. Fix: pass the path "
                                          "ModelCheckpoint wrote (a directory ending in .ckpt), or ckpt_path='last'.")
        model: dict[str, Any] = {}
        rest: dict[str, Any] = {}
        items: dict[str, Any] = {_REST_ITEM: rest, _MODEL_ITEM: model}  # plain dicts: filled in place
        if load(location, verify=self.verify, **items) is None:
            raise CheckpointNotFoundError(f"{location} holds no committed checkpoint (a save that never finished "
                                          "leaves only a temp directory). Fix: resume from another checkpoint.")
        checkpoint = {key: (_state_dict_back(value, model) if key == _STATE_DICT_KEY else value)
                      for key, value in rest.items()}
        return _map_tensors(checkpoint, _mapper(map_location)) if map_location is not None else checkpoint

    # ----- removing -----------------------------------------------------------------------

    def remove_checkpoint(self, path: _PATH) -> None:
        """Delete the checkpoint at ``path`` (ModelCheckpoint's top-k pruning); a missing path is fine.

        Example:
            >>> import os, tempfile
            >>> tmp = tempfile.TemporaryDirectory(); path = os.path.join(tmp.name, "x.ckpt")
            >>> io = TorchckptIO(); io.save_checkpoint({"global_step": 1}, path); io.remove_checkpoint(path)
            >>> os.listdir(tmp.name)
            []
            >>> tmp.cleanup()
        """
        location = _location(path, "remove_checkpoint")
        if not _is_local(location):
            fs = get_filesystem(location)
            if fs.exists(location):
                fs.rm(location, recursive=True)
            return
        if os.path.islink(location) or os.path.isfile(location):
            os.remove(location)  # save_last="link"'s symlink, or a file of another plugin
            return
        if not os.path.isdir(location):
            return
        parent, name = os.path.split(os.path.abspath(location))
        trash = os.path.join(parent, f".trash-{name}-{uuid.uuid4().hex[:8]}")
        os.rename(location, trash)  # [removal is a rename first]
        shutil.rmtree(trash)


def _location(path: object, where: str) -> str:
    if isinstance(path, bytes) or not isinstance(path, (str, os.PathLike)):
        raise TypeError(f"{where}: path must be a str or os.PathLike, got {type(path).__qualname__} ({path!r})")
    text = os.fspath(path)
    if not isinstance(text, str) or not text:
        raise ValueError(f"{where}: path must be a non-empty text path, got {path!r}")
    return text


def _is_local(location: str) -> bool:
    return "://" not in location


def _refuse_regular_file(location: str, action: str) -> None:
    if _is_local(location) and os.path.isfile(location):
        raise CheckpointMismatchError(
            f"cannot {action} {location}: it is a regular file, not a torchckpt checkpoint directory; most likely "
            "Lightning's default TorchCheckpointIO wrote it with torch.save (a pickle), which torchckpt never "
            "opens. Fix: point ModelCheckpoint(dirpath=...) at a fresh directory, or move the file away; to "
            "convert a trusted file, load it with Lightning's default plugin and trainer.save_checkpoint it "
            "again with TorchckptIO."
        )


def _split(checkpoint: Mapping[str, Any], location: str) -> dict[str, dict[str, Any]]:
    """Items ``model`` (Lightning's ``state_dict``, or empty) and ``lightning`` (the rest, a placeholder in
    ``state_dict``'s place when it went to ``model``)."""
    for key in checkpoint:
        if not isinstance(key, str):
            raise UnsupportedStateError(f"{location}: Lightning checkpoint key {key!r} is a "
                                        f"{type(key).__qualname__}; top-level keys must be str. Fix: use a str key "
                                        "in on_save_checkpoint().")
    state_dict = checkpoint.get(_STATE_DICT_KEY)
    if isinstance(state_dict, Mapping) and all(isinstance(key, str) for key in state_dict):
        placeholder = {_MARK: "state_dict is item 'model'", "keys": list(state_dict),
                       "ordered": isinstance(state_dict, OrderedDict)}  # item "model" keeps neither
        rest = {key: (placeholder if key == _STATE_DICT_KEY else value) for key, value in checkpoint.items()}
        return {_REST_ITEM: rest, _MODEL_ITEM: dict(state_dict)}
    return {_REST_ITEM: dict(checkpoint), _MODEL_ITEM: {}}  # no (usual) state_dict: it stays where it was


def _state_dict_back(value: Any, model: Mapping[str, Any]) -> Any:
    """Lightning's ``state_dict`` from item ``model``, in its key order and type, where the placeholder is."""
    if not (isinstance(value, dict) and _MARK in value):
        return value
    entries = [(key, model[key]) for key in value["keys"]]
    return OrderedDict(entries) if value["ordered"] else dict(entries)


def _check_representable(items: Mapping[str, dict[str, Any]], location: str) -> None:
    for name, tree in items.items():
        try:
            split_tensors(tree, name)
        except UnsupportedStateError as error:
            where = "checkpoint['state_dict']" if name == _MODEL_ITEM else "the checkpoint"
            raise UnsupportedStateError(
                f"{location}: {where} holds a value torchckpt cannot store without pickle ({error}) The path "
                "is the key's path inside it, joined by '.'. In Lightning: return plain values from "
                "state_dict()/on_save_checkpoint() (and convert back in load_state_dict()/on_load_checkpoint()), "
                "or drop the key there."
            ) from None


def _global_step(checkpoint: Mapping[str, Any]) -> int:
    value = checkpoint.get("global_step", 0)
    if isinstance(value, torch.Tensor) and value.numel() == 1 and not value.is_floating_point():
        value = int(value.item())
    return value if isinstance(value, int) and not isinstance(value, bool) and value >= 0 else 0


def _metrics(checkpoint: Mapping[str, Any]) -> dict[str, int]:
    return {key: value for key in ("epoch", "global_step") if type(value := checkpoint.get(key)) is int}


def _mapper(map_location: Any) -> Callable[[torch.Tensor], torch.Tensor]:
    if isinstance(map_location, (str, torch.device)):
        device = torch.device(map_location)
        return lambda tensor: tensor.to(device)
    if isinstance(map_location, Mapping):
        target = map_location.get("cpu")  # tensors are stored from host memory: their location is "cpu"
        return (lambda tensor: tensor.to(torch.device(target))) if target is not None else (lambda tensor: tensor)
    if callable(map_location):
        return lambda tensor: _call_storage_mapper(map_location, tensor)
    raise TypeError(f"load_checkpoint(map_location={map_location!r}): expected None, a torch.device, a device "
                    "string, a dict {'cpu': device}, or a function fn(storage, location) as for torch.load")


def _call_storage_mapper(fn: Callable[..., Any], tensor: torch.Tensor) -> torch.Tensor:
    result = fn(tensor.untyped_storage(), "cpu")
    device = getattr(result, "device", None)
    if not isinstance(device, torch.device):
        raise TypeError(f"map_location function returned {type(result).__qualname__}; expected a storage "
                        "(as torch.load's map_location functions return)")
    return tensor if device == tensor.device else tensor.to(device)


def _map_tensors(value: Any, fn: Callable[[torch.Tensor], torch.Tensor]) -> Any:
    if isinstance(value, torch.Tensor):
        return fn(value)
    if type(value) is dict:
        return {key: _map_tensors(item, fn) for key, item in value.items()}
    if type(value) is list:
        return [_map_tensors(item, fn) for item in value]
    if type(value) is tuple:
        return tuple(_map_tensors(item, fn) for item in value)
    return value
