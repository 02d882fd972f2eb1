"""Loading a decoded step into live objects, and ``load``: the newest valid step, loaded without a lock.

Rules kept here (named in ``docs/design.md``):

1. **[the whole step checks before anything changes]** Only the files the asked-for
   items need are read; every one of them, and the RNG entry, is decoded and
   checked before any live object or RNG stream is touched (step.py). Then every item is
   checked against its live object as far as that can be done without loading it
   (live/capture.py's [no half restore]: kinds, module keys and shapes, optimizer groups,
   CUDA device count of the RNG streams to restore); items only loading can check
   are loaded before the checked ones, and RNG streams last.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

import torch

from torchckpt.state.errors import CheckpointMismatchError
from torchckpt.state.format.layout import STATE_NAME, step_dir_name
from torchckpt.state.format.snapshot import Snapshot
from torchckpt.state.live.capture import apply_item, check_item, check_item_name, check_rng_devices, restore_rng
from torchckpt.state.read.newest import read_newest_valid
from torchckpt.state.read.step import check_verify_mode
from torchckpt.state.storage.backends import open_storage


@torch.inference_mode(False)  # under inference_mode, loaded or copied tensors would break a later backward()
def apply_snapshot(snapshot: Snapshot, items: Mapping[str, Any], rng: bool | None, state_path: str) -> None:
    """Load a decoded step into live objects and the RNG streams; every check runs before anything changes.

    ``rng``: True requires saved RNG streams and restores them, None restores them when the step has
    them, False leaves this process's streams alone.

    Example:
        >>> from torchckpt.state.format.snapshot import decode_snapshot, encode_snapshot, join_files
        >>> files = join_files(encode_snapshot(step=2, items={"extras": ("dict", {"epoch": 3})}, rng=None, metrics={}))
        >>> extras = {}; apply_snapshot(decode_snapshot(files, str), {"extras": extras}, False, "state.json"); extras
        {'epoch': 3}
    """
    missing = [name for name in items if name not in snapshot.item_names]
    if missing:
        raise CheckpointMismatchError(
            f"{state_path}: no item(s) {missing}; the checkpoint holds {list(snapshot.item_names)}. "
            "Fix: pass only items that were saved (names must match the save call)."
        )
    if rng and snapshot.rng is None:
        raise CheckpointMismatchError(f"{state_path}: saved without RNG streams (capture_rng=False or imported). "
                                      "Fix: pass rng=None (restore them only when saved) or rng=False.")
    for name, obj in items.items():  # a compiled model's keys are named before any item is loaded
        check_compiled_keys(name, obj, snapshot.items[name][1], state_path)
    certain = {name: check_item(name, obj, *snapshot.items[name], state_path) for name, obj in items.items()}
    streams = snapshot.rng if rng is not False else None  # the RNG streams to restore, if any
    if streams is not None:
        check_rng_devices(streams, state_path)
    # live/capture.py's [no half restore]: items only their own loading can check go first (a stable sort)
    for name in sorted(items, key=lambda item: certain[item]):
        kind, state = snapshot.items[name]
        apply_item(name, items[name], kind, state, state_path)
    if streams is not None:
        restore_rng(streams, state_path)


_COMPILED_PREFIX = "_orig_mod."


def check_compiled_keys(name: str, obj: object, state: Any, source: str) -> None:
    """Name a torch.compile ``_orig_mod.`` prefix when it is all that separates saved and live module keys.

    Example:
        >>> check_compiled_keys("model", torch.nn.Linear(1, 1), {"_orig_mod.weight": 0, "_orig_mod.bias": 0},
        ...                     "state.json")  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        torchckpt.state.errors.CheckpointMismatchError: state.json: item 'model': the saved keys carry ...
    """
    if not isinstance(obj, torch.nn.Module) or not isinstance(state, Mapping):
        return
    live, saved = set(obj.state_dict()), set(state)
    if live == saved:
        return
    strip = {key.removeprefix(_COMPILED_PREFIX) for key in saved}
    if strip == live and strip != saved:
        raise CheckpointMismatchError(
            f"{source}: item {name!r}: the saved keys carry torch.compile's {_COMPILED_PREFIX!r} prefix (e.g. "
            f"{sorted(saved)[0]!r}) but the live module's do not: it was saved from a compiled model. Fix: pass "
            "the compiled model (or model._orig_mod when saving), the same kind of object both times.")
    added = {_COMPILED_PREFIX + key for key in saved}
    if added == live:
        raise CheckpointMismatchError(
            f"{source}: item {name!r}: the live module's keys carry torch.compile's {_COMPILED_PREFIX!r} prefix "
            f"(e.g. {sorted(live)[0]!r}) but the saved ones do not. Fix: restore into model._orig_mod (the "
            "module that was compiled), or save and restore the same kind of object.")


def load(
    directory: str | os.PathLike[str],
    step: int | None = None,
    *,
    verify: str = "full",
    fallback: bool = True,
    rng: bool = False,
    **items: Any,
) -> int | None:
    """Load the newest valid step (or ``step``) into ``items`` without a lock, e.g. in an evaluation job or from
    read-only storage; returns the step, or None if the directory has no checkpoint.

    It never sees a half-written step (a commit is a rename), skips a step a live writer deletes meanwhile
    ([a vanished step is gone, not corrupt]), and reads only the files the given items need. ``rng=True``
    also restores the RNG streams; by default this process's RNG is left alone.

    Example:
        >>> import tempfile
        >>> from torchckpt.state import Checkpointer
        >>> tmp = tempfile.TemporaryDirectory(); saved = torch.nn.Linear(2, 2)
        >>> with Checkpointer(tmp.name) as ckpt:
        ...     ckpt.save(7, model=saved)
        >>> model = torch.nn.Linear(2, 2)
        >>> load(tmp.name, model=model), torch.equal(model.weight, saved.weight)
        (7, True)
        >>> tmp.cleanup()
    """
    check_verify_mode(verify)
    for name in items:
        check_item_name(name)
    storage = open_storage(directory)
    snapshot = read_newest_valid(storage, step=step, verify=verify, fallback=fallback, wanted=set(items))
    if snapshot is None:
        return None
    apply_snapshot(snapshot, items, rng, storage.path_of(step_dir_name(snapshot.step), STATE_NAME))
    return snapshot.step
