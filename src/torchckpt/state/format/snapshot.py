"""A step's state as files: items split into ``NAME.safetensors`` / ``NAME.json`` / ``state.json``.

Rules kept here (named in ``docs/design.md``):

1. **[tensors to safetensors, the rest to JSON]** An item's tensors go to
   ``NAME.safetensors``. Its tree (the state_dict with tensors replaced by
   references) goes to ``NAME.json`` when it has tensors and is not simply a flat
   map of them (the optimizer's param_groups and step counts); a model needs no
   JSON; items without tensors (scheduler, data loader, user dicts) live in
   ``state.json`` with the step, metrics and RNG.
2. **[encoding is synchronous]** Encoding happens synchronously and produces each
   file as chunks to write: JSON bytes, safetensors headers and views of host
   tensor memory. For a sync save those views are the live tensors (no copy); for
   an async save they are views of the host staging buffer, filled here, which the
   background thread writes while training mutates the live tensors (live/staging.py).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from torchckpt.state.errors import CheckpointCorruptError
from torchckpt.state.format.codec import (
    decode_json,
    decode_safetensors,
    encode_json,
    join_tensors,
    split_tensors,
)
from torchckpt.state.format.layout import STATE_NAME
from torchckpt.state.format.storages import write_once
from torchckpt.state.format.tensor_chunks import safetensors_chunks
from torchckpt.state.live.staging import HostStaging, to_host

FileChunks = list[bytes | memoryview]
FileData = bytes | memoryview | Mapping[str, torch.Tensor]  # a file's bytes, or a tensor file read as its tensors


@dataclass(frozen=True, kw_only=True)
class Snapshot:
    """Decoded content of one step (only the items that were asked for).

    Example:
        >>> files = encode_snapshot(step=3, items={"extras": ("dict", {"epoch": 1})}, rng=None, metrics={})
        >>> decode_snapshot(join_files(files), lambda name: name).items["extras"]
        ('dict', {'epoch': 1})
    """

    step: int
    metrics: Mapping[str, float]
    rng: Mapping[str, Any] | None
    items: Mapping[str, tuple[str, Any]] = field(default_factory=dict)
    item_names: tuple[str, ...] = ()


def _is_flat(tree: Any) -> bool:
    return type(tree) is dict and all(
        type(v) is dict and len(v) == 2 and v.get("__torchckpt__") == "tensor" and v.get("key") == k  # no flags
        for k, v in tree.items()
    )


def _encode_item(
    name: str, kind: str, state: Any, files: dict[str, FileChunks], tensor_groups: dict[str, dict[str, torch.Tensor]]
) -> dict[str, Any]:
    # storages.py's [a storage is written once]
    tree, tensors = write_once(*split_tensors(state, name, keep_layout=True))
    meta: dict[str, Any] = {"kind": kind, "tensor_file": None, "tree_file": None, "tree": None}
    module_metadata = getattr(state, "_metadata", None)  # nn.Module versions, read by load_state_dict
    if module_metadata is not None:
        meta["module_metadata"] = split_tensors(dict(module_metadata), name)[0]
    if not tensors:
        meta["tree"] = tree
        return meta
    meta["tensor_file"] = f"{name}.safetensors"
    tensor_groups[meta["tensor_file"]] = tensors  # written below, once every item is encoded
    if not _is_flat(tree):
        meta["tree_file"] = f"{name}.json"
        files[meta["tree_file"]] = [encode_json(tree)]
    return meta


def encode_snapshot(
    *,
    step: int,
    items: Mapping[str, tuple[str, Any]],
    rng: Mapping[str, Any] | None,
    metrics: Mapping[str, float],
    staging: HostStaging | None = None,
    defer: Callable[[torch.Tensor], bool] | None = None,
) -> dict[str, FileChunks]:
    """Files (name -> chunks to write in order) of one step, ``state.json`` included
    ([tensors to safetensors, the rest to JSON], [encoding is synchronous]).

    With ``staging`` every tensor is copied into its buffer (an async save);
    without, the chunks view the tensors' own memory (a sync save). ``defer``
    picks tensors whose copy is left to ``staging.finish()`` (live/staging.py's
    [optimizer steps wait for staging]).

    Example:
        >>> sorted(encode_snapshot(step=1, items={"model": ("state_dict", {"w": torch.ones(1)})},
        ...                        rng=None, metrics={}))
        ['model.safetensors', 'state.json']
    """
    files: dict[str, FileChunks] = {}
    tensor_groups: dict[str, dict[str, torch.Tensor]] = {}
    items_meta = {
        name: _encode_item(name, kind, state, files, tensor_groups) for name, (kind, state) in items.items()
    }
    if staging is not None:
        hosted = dict(zip(tensor_groups, staging.copy(list(tensor_groups.values()), defer)))
    else:
        hosted = {name: to_host(tensors) for name, tensors in tensor_groups.items()}
    for name, tensors in hosted.items():  # deferred copies land later: their bytes cannot be joined now
        files[name] = safetensors_chunks(tensors, join_small=staging is None or staging.deferred_count == 0)
    rng_tree, rng_tensors = split_tensors(rng, "rng")
    assert not rng_tensors, "capture_rng returns JSON-able values only"
    state = {"step": step, "metrics": dict(metrics), "rng": rng_tree, "items": items_meta}
    files[STATE_NAME] = [encode_json(state)]
    return files


def join_files(files: Mapping[str, FileChunks]) -> dict[str, bytes]:
    """Each file's chunks joined into bytes (what reading the written files gives back).

    Example:
        >>> join_files({"a.json": [b"[1,", b"2]"]})
        {'a.json': b'[1,2]'}
    """
    return {name: b"".join(chunks) for name, chunks in files.items()}


def decode_snapshot(
    files: Mapping[str, FileData],
    path_of: Callable[[str], str],
    wanted: Collection[str] | None = None,
) -> Snapshot:
    """Decode a step's files; only items in ``wanted`` (default: all) are decoded.

    ``path_of`` turns a file name into the path shown in errors.

    Example:
        >>> files = encode_snapshot(step=5, items={}, rng=None, metrics={"loss": 1.0})
        >>> decode_snapshot(join_files(files), lambda name: name).metrics
        {'loss': 1.0}
    """
    state = decode_json(_json_file(files, STATE_NAME, path_of), path_of(STATE_NAME))
    try:
        step = state["step"]
        if type(step) is not int or step < 0:  # never a bool, a float or Infinity (manifest.py's exact types)
            raise ValueError(f"step is {step!r} ({type(step).__name__}); expected a non-negative int")
        items_meta: dict[str, Any] = dict(state["items"])
        names = tuple(items_meta)
        chosen = names if wanted is None else [n for n in names if n in wanted]
        items = {name: _decode_item(items_meta[name], files, path_of) for name in chosen}
        rng = join_tensors(state["rng"], {}, path_of(STATE_NAME))
        return Snapshot(step=step, metrics=dict(state["metrics"]), rng=rng, items=items, item_names=names)
    except (KeyError, TypeError, ValueError, OverflowError) as error:
        problem = f"malformed state.json ({error!r})"
        raise CheckpointCorruptError(f"{path_of(STATE_NAME)}: {problem}", {path_of(STATE_NAME): problem}) from None


def _decode_item(meta: Mapping[str, Any], files: Mapping[str, FileData],
                 path_of: Callable[[str], str]) -> tuple[str, Any]:
    kind, state = _decode_item_state(meta, files, path_of)
    if meta.get("module_metadata") is not None:
        state = OrderedDict(state)
        state._metadata = join_tensors(meta["module_metadata"], {}, path_of(STATE_NAME))  # type: ignore[attr-defined]
    return kind, state


def _decode_item_state(
    meta: Mapping[str, Any], files: Mapping[str, FileData], path_of: Callable[[str], str]
) -> tuple[str, Any]:
    tensors: Mapping[str, torch.Tensor] = {}
    if meta["tensor_file"] is not None:
        name = meta["tensor_file"]
        data = _file(files, name, path_of)
        tensors = data if isinstance(data, Mapping) else decode_safetensors(data, path_of(name))
    if meta["tree_file"] is not None:
        name = meta["tree_file"]
        tree = decode_json(_json_file(files, name, path_of), path_of(name))
        return meta["kind"], join_tensors(tree, tensors, path_of(name))
    if meta["tree"] is None:
        return meta["kind"], dict(tensors)  # a flat tensor map, keys as saved
    return meta["kind"], join_tensors(meta["tree"], tensors, path_of(STATE_NAME))


def _json_file(files: Mapping[str, FileData], name: str, path_of: Callable[[str], str]) -> bytes | memoryview:
    data = _file(files, name, path_of)
    if isinstance(data, Mapping):  # a crafted state.json naming a tensor file as a tree
        problem = "a tensor file where state.json expects JSON"
        raise CheckpointCorruptError(f"{path_of(name)}: {problem}", {path_of(name): problem})
    return data


def _file(files: Mapping[str, FileData], name: str, path_of: Callable[[str], str]) -> FileData:
    if name not in files:
        problem = "missing: state.json refers to it but the manifest does not list it"
        raise CheckpointCorruptError(f"{path_of(name)}: {problem}", {path_of(name): problem})
    return files[name]
