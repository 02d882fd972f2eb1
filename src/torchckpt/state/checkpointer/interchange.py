"""Interchange with other formats: import a ``torch.save`` file, export model weights.

Rules kept here (named in ``docs/design.md``; the design notes they keep in parentheses):

1. **[torch.load only with weights_only]** (Note: [no pickle]) A ``torch.save`` file
   is read only with ``torch.load(weights_only=True)``, PyTorch's restricted unpickler
   that builds tensors and plain containers and refuses everything else (no code from
   the file runs). Refusals are explained.
2. **[export is atomic]** Export writes the model's tensors under their state_dict
   keys into one safetensors file, through a temp file and a rename, so a crash never
   leaves a half-written output.
3. **[an import never rewinds a run]** An import into a directory whose newest step
   is at or after the imported step is refused before anything is written: saving it
   would start a new branch and move the run's newer steps to ``abandoned/``
   (branches.py), so a file without a step key (step 0) would hide a whole run.
4. **[export consolidates shards]** A sharded step (sharded/save.py) is exported whole by this
   one process: full-size tensors are built from the shard index's shapes and dtypes and
   DCP fills them from every rank's shards, each byte verified against its block hash.
   Only a module item is exported (its state_dict, as the unsharded export writes it);
   an optimizer's state is named after parameters and rank-local items are per rank.
"""

from __future__ import annotations

import errno
import os
import pickle
import re
from collections.abc import Mapping
from typing import Any

import numpy as np
import safetensors.torch
import torch
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from torchckpt.state.checkpointer.checkpointer import Checkpointer
from torchckpt.state.errors import (
    CheckpointCorruptError,
    CheckpointError,
    CheckpointExistsError,
    CheckpointMismatchError,
    CheckpointNotFoundError,
    UnsafeFileError,
    fix_for_os_error,
    warn_fallback,
)
from torchckpt.state.format.codec import join_tensors
from torchckpt.state.format.layout import ABANDONED_DIR, STATE_NAME
from torchckpt.state.format.snapshot import Snapshot
from torchckpt.state.live.capture import RESERVED_ITEM_NAMES
from torchckpt.state.read.catalog import inspect_step
from torchckpt.state.read.newest import candidate_steps, newest_is_sharded, read_newest_valid
from torchckpt.state.read.step import StepGoneError, load_step, read_manifest
from torchckpt.state.sharded.step import ShardedStep, dcp_load, open_sharded, shard_reader
from torchckpt.state.storage.backends import open_storage
from torchckpt.state.storage.base import Storage

_MODEL_KEYS = ("model", "state_dict", "model_state_dict", "module", "net")
_OPTIMIZER_KEYS = ("optimizer", "optimizer_state_dict", "optim", "opt")
_SCHEDULER_KEYS = ("scheduler", "lr_scheduler", "scheduler_state_dict", "sched")
_STEP_KEYS = ("step", "global_step", "iteration", "iter")


class _StoredState:
    """An item holding an already-captured state_dict (what an import writes)."""

    def __init__(self, state: Any) -> None:
        self._state = state

    def state_dict(self) -> Any:
        return self._state

    def load_state_dict(self, state: Any) -> None:
        self._state = state


_GLOBAL_RE = re.compile(r"Unsupported global: GLOBAL ([\w.]+)")
_REASON_RE = re.compile(r"WeightsUnpickler error:\s*([^\n]+)")  # the reason may start on the next line


def _load_weights_only(path: str) -> Any:
    try:
        with open(path, "rb") as handle:
            head = handle.read(8)
    except FileNotFoundError:
        raise CheckpointNotFoundError(f"{path}: no such file") from None
    except IsADirectoryError:
        raise CheckpointMismatchError(f"{path}: a directory, not a torch.save file. Fix: pass the .pt file") from None
    if not (head.startswith(b"PK\x03\x04") or (len(head) >= 2 and head[0] == 0x80 and 2 <= head[1] <= 5)):
        raise CheckpointMismatchError(
            f"{path}: not a torch.save file (it starts with {head!r}; a torch.save file is a zip archive or a "
            "pickle). Fix: pass the .pt/.pth file written by torch.save"
        )
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except (pickle.UnpicklingError, RuntimeError, AttributeError, ValueError, EOFError, KeyError,
            IndexError, TypeError) as error:
        text = str(error).strip()
        refused = _GLOBAL_RE.search(text)
        reason = _REASON_RE.search(text)
        first_line = reason.group(1).strip() if reason else (text.splitlines()[0] if text else "")
        if refused:
            problem = (
                f"torch.load(weights_only=True) refused it (it needs {refused.group(1)}, which is neither a "
                f"tensor nor a plain container; {first_line}). The file holds objects other than tensors and "
                "plain containers; building them would run code named by the file, which torchckpt never "
                "does. Fix: in a trusted environment, load it with its own code and save the state_dicts "
                "with torchckpt.Checkpointer instead."
            )
        else:
            if isinstance(error, EOFError):
                first_line = "the file ends early, truncated" + (f": {first_line}" if first_line else "")
            problem = (
                f"torch.load(weights_only=True) could not read it ({first_line or type(error).__name__}): it is "
                "damaged, truncated, or holds objects other than tensors and plain containers, which "
                "torchckpt never builds (that would run code named by the file). Fix: check that the copy is "
                "complete; if it is and you trust it, load it with its own code and save the state_dicts "
                "with torchckpt.Checkpointer instead."
            )
        raise UnsafeFileError(f"{path}: {problem}", {path: problem}) from None


def _is_tensor_map(value: object) -> bool:
    return isinstance(value, Mapping) and bool(value) and all(
        isinstance(k, str) and isinstance(v, torch.Tensor) for k, v in value.items()
    )


def _first_key(loaded: Mapping[str, Any], names: tuple[str, ...]) -> str | None:
    return next((name for name in names if name in loaded), None)


def split_legacy_items(loaded: Any, path: str) -> tuple[dict[str, Any], int | None]:
    """Items (name -> state) and step found in a ``torch.save`` payload.

    Example:
        >>> items, step = split_legacy_items({"model": {"w": torch.ones(1)}, "step": 7, "epoch": 2}, "x.pt")
        >>> sorted(items), step
        (['extras', 'model'], 7)
    """
    if _is_tensor_map(loaded):
        return {"model": dict(loaded)}, None
    if not isinstance(loaded, Mapping) or not all(isinstance(k, str) for k in loaded):
        raise CheckpointMismatchError(
            f"{path}: expected a state_dict or a dict of state_dicts, found {type(loaded).__name__}. "
            "Fix: save a dict such as {'model': model.state_dict(), 'optimizer': opt.state_dict()}."
        )
    items: dict[str, Any] = {}
    sources: dict[str, str] = {}
    extras: dict[str, Any] = {}
    step_key = _first_key(loaded, _STEP_KEYS)
    for key, value in loaded.items():
        name = _item_name(key)
        if isinstance(value, Mapping) and name is not None:
            if name in sources:
                raise CheckpointMismatchError(
                    f"{path}: keys {sources[name]!r} and {key!r} would both become the item {name!r}, and one would "
                    "be lost. Fix: rename one of them in the file (or load it and save the items with a Checkpointer)."
                )
            items[name], sources[name] = dict(value), key
        elif key != step_key:
            extras[key] = value
    if extras:
        if "extras" in items:
            raise CheckpointMismatchError(
                f"{path}: key {sources['extras']!r} and the loose values {sorted(extras)} would both become the item "
                "'extras', and one would be lost. Fix: rename the 'extras' key in the file."
            )
        items["extras"] = extras
    step = _step_value(loaded[step_key], step_key, path) if step_key is not None else None
    return items, step


def _step_value(value: Any, key: str, path: str) -> int:
    if isinstance(value, torch.Tensor) and value.numel() == 1 and not value.dtype.is_floating_point \
            and not value.dtype.is_complex and value.dtype != torch.bool:
        return int(value.item())
    if isinstance(value, (int, np.integer)) and not isinstance(value, bool):
        return int(value)
    raise CheckpointMismatchError(
        f"{path}: key {key!r} holds {value!r} ({type(value).__name__}); expected an integer step (an int or a "
        "one-element integer tensor). Fix: pass the step explicitly (import_torch_save(step=...) / --step)."
    )


def _item_name(key: str) -> str | None:
    for canonical, aliases in (("model", _MODEL_KEYS), ("optimizer", _OPTIMIZER_KEYS), ("scheduler", _SCHEDULER_KEYS)):
        if key in aliases:
            return canonical
    cleaned = re.sub(r"[^A-Za-z0-9_]", "_", key)[:100]
    return cleaned if re.match(r"^[A-Za-z_]", cleaned) and cleaned not in RESERVED_ITEM_NAMES else None


def import_torch_save(path: str | os.PathLike[str], directory: str | os.PathLike[str], step: int | None = None) -> int:
    """Convert a ``torch.save`` file into a torchckpt checkpoint; returns its step.

    The file is read with ``weights_only=True`` only ([torch.load only with weights_only]).
    Items: ``model``, ``optimizer``, ``scheduler`` (from common key names), other dicts under their
    own names, and scalars in ``extras``. The step comes from ``step`` or a
    ``step``/``global_step`` key, else 0. Imported steps carry no RNG streams. A ``directory``
    holding a step at or after that one is refused ([an import never rewinds a run]).

    Example:
        >>> import tempfile
        >>> tmp = tempfile.TemporaryDirectory(); src = os.path.join(tmp.name, "old.pt")
        >>> torch.save({"model": torch.nn.Linear(2, 2).state_dict(), "step": 5}, src)
        >>> import_torch_save(src, os.path.join(tmp.name, "run"))
        5
        >>> tmp.cleanup()
    """
    source = os.fspath(path)
    items, found_step = split_legacy_items(_load_weights_only(source), source)
    chosen = step if step is not None else (found_step if found_step is not None else 0)
    stored: dict[str, Any] = {name: value if name == "extras" else _StoredState(value) for name, value in items.items()}
    return import_state_dict(stored, directory, chosen, source)


def import_state_dict(items: Mapping[str, Any], directory: str | os.PathLike[str], step: int, source: str) -> int:
    """Save ``items`` (objects with ``state_dict()``, and ``extras``) read from ``source`` as step ``step`` of
    ``directory``, without RNG streams; refused when ``directory`` already holds that step or a later one
    ([an import never rewinds a run]). Returns ``step``.

    Example:
        >>> import tempfile
        >>> tmp = tempfile.TemporaryDirectory()
        >>> import_state_dict({"model": torch.nn.Linear(2, 2)}, tmp.name, 4, "a test")
        4
        >>> tmp.cleanup()
    """
    with Checkpointer(directory, capture_rng=False) as checkpointer:
        newest = max((info.step for info in checkpointer.list()), default=None)  # valid or not: all would move
        if newest is not None and newest >= step:  # [an import never rewinds a run]
            abandoned = os.path.join(checkpointer.directory, ABANDONED_DIR)
            raise CheckpointExistsError(
                f"{checkpointer.directory} holds steps up to {newest}; importing {source} as step {step} would "
                f"start a new branch and move the steps after it to {abandoned}/. "
                f"Fix: import into a fresh directory, or pass a step greater than {newest} "
                "(import_torch_save(step=...) / --step)."
            )
        checkpointer.save(step, **items)
    return step


def export_model_weights(
    directory: str | os.PathLike[str],
    out: str | os.PathLike[str],
    step: int | None = None,
    item: str = "model",
) -> int:
    """Write the model weights of the newest valid step (or ``step``) to one safetensors file.

    Keys are the model's state_dict keys ([export is atomic]); non-tensor entries are left out.
    A sharded step is consolidated into full tensors ([export consolidates shards]); ``item`` must
    then be one of its module items. Returns the exported step.

    Example:
        >>> import tempfile
        >>> from torchckpt.state import Checkpointer
        >>> tmp = tempfile.TemporaryDirectory(); run = tmp.name
        >>> with Checkpointer(run) as ckpt:
        ...     ckpt.save(3, model=torch.nn.Linear(2, 2))
        >>> export_model_weights(run, os.path.join(run, "w.safetensors"))
        3
        >>> with Checkpointer(os.path.join(run, "sharded"), sharded=True) as ckpt:
        ...     ckpt.save(4, model=torch.nn.Linear(2, 2))
        >>> export_model_weights(os.path.join(run, "sharded"), os.path.join(run, "s.safetensors"))
        4
        >>> sorted(safetensors.torch.load_file(os.path.join(run, "s.safetensors")))
        ['bias', 'weight']
        >>> tmp.cleanup()
    """
    exported, tensors = model_weights(directory, step, item)
    # "format": "pt" is what transformers 4.x requires of a checkpoint it loads
    _write_safetensors_atomically(tensors, os.fspath(out), {"format": "pt", "torchckpt_step": str(exported)})
    return exported


def model_weights(directory: str | os.PathLike[str], step: int | None = None,
                  item: str = "model") -> tuple[int, dict[str, torch.Tensor]]:
    """The newest valid step (or ``step``) and its module item ``item``'s tensors, whole, under their state_dict keys
    (a sharded step consolidated: [export consolidates shards]); what every export writes.

    Example:
        >>> import tempfile
        >>> from torchckpt.state import Checkpointer
        >>> tmp = tempfile.TemporaryDirectory()
        >>> with Checkpointer(tmp.name) as ckpt:
        ...     ckpt.save(3, model=torch.nn.Linear(2, 2))
        >>> step, tensors = model_weights(tmp.name)
        >>> step, sorted(tensors)
        (3, ['bias', 'weight'])
        >>> tmp.cleanup()
    """
    storage = open_storage(directory)
    if newest_is_sharded(storage, step):
        return _newest_sharded_weights(storage, step, item)
    snapshot = read_newest_valid(storage, step=step, verify="full", fallback=True, wanted={item})
    if snapshot is None:
        raise CheckpointNotFoundError(f"{storage.location}: no checkpoint to export")
    return snapshot.step, _snapshot_weights(storage, snapshot, item)


def _snapshot_weights(storage: Storage, snapshot: Snapshot, item: str) -> dict[str, torch.Tensor]:
    if item not in snapshot.items:
        raise CheckpointMismatchError(f"{storage.location}: step {snapshot.step} has no item {item!r}; "
                                      f"it holds {list(snapshot.item_names)}")
    _, state = snapshot.items[item]
    tensors, seen = {}, set()
    for key, value in state.items():
        if not isinstance(value, torch.Tensor):
            continue
        memory = value.untyped_storage()
        if (memory.data_ptr() in seen or not value.is_contiguous()
                or memory.nbytes() != value.numel() * value.element_size()):
            value = value.contiguous().clone()  # a tie or a view (format/storages.py): safetensors wants its own
        seen.add(memory.data_ptr())
        tensors[key] = value
    return tensors


def _newest_sharded_weights(storage: Storage, step: int | None, item: str) -> tuple[int, dict[str, torch.Tensor]]:
    """The newest valid step's (or ``step``'s) weights, sharded or not; corrupt newer steps are skipped with
    a warning, as :func:`read_newest_valid` does."""
    skipped: list[str] = []
    for candidate in candidate_steps(storage, step):
        try:
            manifest = read_manifest(storage, candidate)
            if manifest.world_size is None:  # an older unsharded step, reached by falling back
                tensors = _snapshot_weights(storage, load_step(storage, candidate, "full", {item}), item)
            else:
                info = inspect_step(storage, candidate, "fast")  # sizes; sharded_weights verifies each byte read
                if info.gone:
                    raise StepGoneError(info.problem or f"{info.path}: gone")
                if not info.valid:
                    raise CheckpointCorruptError(info.problem or "not valid", dict(info.problems))
                tensors = sharded_weights(open_sharded(storage, manifest), item)
        except StepGoneError as error:
            if step is not None:
                raise CheckpointNotFoundError(str(error)) from None
            continue
        except CheckpointCorruptError as error:
            skipped.append(f"step {candidate}: {error}")
            if step is None:
                continue
            raise type(error)(f"step {candidate} is corrupt, nothing was exported: {error}", error.problems) from None
        if skipped:
            warn_fallback(f"exported step {candidate}; skipped corrupt newer step(s): " + " | ".join(skipped))
        return candidate, tensors
    if skipped:
        raise CheckpointCorruptError(f"{storage.location}: no valid checkpoint among {len(skipped)} step(s): "
                                     + " | ".join(skipped))
    raise CheckpointNotFoundError(f"{storage.location}: no checkpoint to export")


def sharded_weights(step: ShardedStep, item: str = "model") -> dict[str, torch.Tensor]:
    """Full CPU tensors of module item ``item`` of a sharded step, under its state_dict keys, loaded by this
    one process from every rank's shards ([export consolidates shards]).

    Example:
        >>> import tempfile
        >>> from torchckpt.state.read.step import read_manifest
        >>> from torchckpt.state import Checkpointer
        >>> tmp = tempfile.TemporaryDirectory(); model = torch.nn.Linear(2, 2)
        >>> with Checkpointer(tmp.name, sharded=True) as ckpt:
        ...     ckpt.save(1, model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1))
        >>> storage = open_storage(tmp.name)
        >>> step = open_sharded(storage, read_manifest(storage, 1))
        >>> torch.equal(sharded_weights(step)["weight"], model.weight)
        True
        >>> sharded_weights(step, "optimizer")  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        torchckpt.state.errors.CheckpointMismatchError: ...: item 'optimizer' is an optimizer, ...
        >>> tmp.cleanup()
    """
    source = step.storage.path_of(step.entry, STATE_NAME)
    sharded_meta, local_meta = step.sharded_items, step.local_items
    kinds = {name: meta["kind"] for name, meta in sharded_meta.items()}
    if kinds.get(item) != "module":
        modules = sorted(name for name, kind in kinds.items() if kind == "module")
        what = {"optimizer": "an optimizer"}.get(kinds.get(item) or "", "a rank-local item (each rank saved its own)"
                                                  if item in local_meta else "not in this step")
        raise CheckpointMismatchError(
            f"{source}: item {item!r} is {what}, and export writes a model's weights (a module item). Module "
            f"items: {modules}; every item: {sorted([*sharded_meta, *local_meta])}. Fix: pass one of {modules} "
            "(--item / item=).")
    reader = shard_reader(step)
    prefix = f"{item}."
    targets: dict[str, torch.Tensor] = {}
    for key, saved in reader.metadata.state_dict_metadata.items():
        if not key.startswith(prefix) or not isinstance(saved, TensorStorageMetadata):
            continue  # (decode_index proved the chunks tile each tensor, and shard_reader that they lie in files)
        targets[key] = torch.empty(saved.size, dtype=saved.properties.dtype)
    dcp_load(step, None, targets, source, reader=reader)
    state = join_tensors(sharded_meta[item]["tree"], {key[len(prefix):]: t for key, t in targets.items()}, source)
    if not isinstance(state, Mapping):
        raise CheckpointCorruptError(f"{source}: item {item!r} is not a state_dict", {source: "not a state_dict"})
    return {key: value for key, value in state.items() if isinstance(value, torch.Tensor)}


def _write_safetensors_atomically(tensors: Mapping[str, torch.Tensor], out: str, metadata: dict[str, str]) -> None:
    temp = f"{out}.tmp-{os.getpid()}"
    parent = os.path.dirname(os.path.abspath(out))
    try:
        if not os.path.isdir(parent):  # safetensors' own error would not say which part is wrong
            raise FileNotFoundError(errno.ENOENT, f"no directory {parent}")
        with open(temp, "wb"):  # the OS names a read-only disk or a permission problem here
            pass
        safetensors.torch.save_file(dict(tensors), temp, metadata=metadata)
        os.replace(temp, out)
    except safetensors.SafetensorError as error:
        if os.path.exists(temp):
            os.remove(temp)
        raise CheckpointError(f"{out}: could not write the export ({error}). Fix: check free space and the "
                              "path.") from None
    except OSError as error:
        if os.path.exists(temp):
            os.remove(temp)
        raise CheckpointError(
            f"{out}: could not write the export ({error}). Fix: {fix_for_os_error(error)}."
        ) from error
