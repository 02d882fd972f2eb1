"""Sharded checkpoints, the restore: any world size reads a step that any world size wrote.

Each rank reads only the blocks of the shards it needs (shard_storage.py) into copies of its live tensors;
DCP's load planner finds the saved chunks that overlap each rank's new ones.

Rules kept here (named in ``docs/design.md``; the design notes they keep in parentheses):

1. **[restore loads into copies]** (capture.py's [no half restore]) DCP loads into fresh tensors shaped
   like the live ones; the live objects change only after every rank read and verified its part, and the
   ranks agree on the step: a step corrupt on one rank is skipped by all.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.distributed.checkpoint.api import CheckpointException

from torchckpt.state.capture import item_kind
from torchckpt.state.catalog import inspect_step, read_manifest
from torchckpt.state.codec import decode_json, join_tensors, split_tensors
from torchckpt.state.errors import CheckpointCorruptError, CheckpointError, CheckpointMismatchError, warn_fallback
from torchckpt.state.format import STATE_NAME, Manifest, hash_bytes, step_dir_name
from torchckpt.state.rank_group import RankGroup, RankLostError, dcp_failures
from torchckpt.state.rank_local import prepare_rank_local
from torchckpt.state.reader import candidate_steps
from torchckpt.state.shard_storage import INDEX_NAME, ShardReader
from torchckpt.state.sharded import forget_initialised_state, is_sharded_item, live_state, pair_optimizers
from torchckpt.state.storage import Storage

# ----- reading -------------------------------------------------------------------------------------


@dataclass
class ShardedStep:
    """A committed sharded step opened for reading: its manifest and ``state.json``."""

    storage: Storage
    manifest: Manifest
    state: dict[str, Any]
    sharded_items: dict[str, dict[str, Any]] = field(default_factory=dict)  # name -> kind, model, tree
    local_items: dict[str, dict[str, Any]] = field(default_factory=dict)  # name -> same_on_every_rank, ...

    @property
    def entry(self) -> str:
        return step_dir_name(self.manifest.step)

    def read_file(self, name: str) -> bytes:
        """One small file of the step, whole, checked against the manifest's size and hash (format.py keeps
        the manifest's names inside the step)."""
        expected = self.manifest.files.get(name)
        path = self.storage.path_of(self.entry, name)
        if expected is None:
            raise CheckpointCorruptError(f"{path}: missing from the manifest", {path: "missing from the manifest"})
        data = self.storage.read_range(self.entry, name, 0, expected.size_bytes + 1)
        data = bytes(data)  # a small file (JSON, the index): one copy is nothing
        if len(data) != expected.size_bytes or hash_bytes(data, self.manifest.hash_algorithm) != expected.hash:
            problem = f"size {len(data)} or hash differs from the manifest's ({expected.size_bytes} bytes)"
            raise CheckpointCorruptError(f"{path}: {problem}", {path: problem})
        return data


def open_sharded(storage: Storage, manifest: Manifest) -> ShardedStep:
    """Read and check ``state.json`` of a committed sharded step: its step and world size match the manifest,
    and each item is described by an object (a sharded item's with its kind and tree).

    Example:
        >>> open_sharded  # doctest: +ELLIPSIS
        <function open_sharded at ...>
    """
    step = ShardedStep(storage, manifest, {})
    path = storage.path_of(step.entry, STATE_NAME)
    state = decode_json(step.read_file(STATE_NAME), path)
    if type(state) is not dict or state.get("world_size") != manifest.world_size or state.get("step") != manifest.step:
        raise CheckpointCorruptError(f"{path}: does not match its manifest", {path: "does not match its manifest"})
    try:
        sharded, local = dict(state["sharded_items"]), dict(state["local_items"])
        if not all(type(meta) is dict and "tree" in meta and "kind" in meta for meta in sharded.values()) or not all(
                type(meta) is dict for meta in local.values()):
            raise ValueError("an item is not described by an object with its kind and tree")
    except (KeyError, TypeError, ValueError) as error:
        raise CheckpointCorruptError(f"{path}: malformed ({error!r})", {path: "malformed"}) from None
    step.state, step.sharded_items, step.local_items = state, sharded, local
    return step


@dataclass
class PreparedRestore:
    """A sharded step read and verified by this rank, not yet applied ([restore loads into copies])."""

    states: dict[str, Any]
    pairs: dict[str, str]
    apply_local: Callable[[], None]
    source: str


def prepare_restore(step: ShardedStep, ranks: RankGroup | None, items: Mapping[str, Any],
                    rng: bool | None) -> PreparedRestore:
    """Read and verify this rank's part of a committed sharded step into copies; nothing live changes.

    Example:
        >>> prepare_restore  # doctest: +ELLIPSIS
        <function prepare_restore at ...>
    """
    rank, world = (ranks.rank, ranks.world_size) if ranks is not None else (0, 1)
    source = step.storage.path_of(step.entry, STATE_NAME)
    sharded_meta, local_meta = step.sharded_items, step.local_items
    trees_saved = {name: meta["tree"] for name, meta in sharded_meta.items()}
    missing = [name for name in items if name not in sharded_meta and name not in local_meta]
    if missing:
        raise CheckpointMismatchError(
            f"{source}: no item(s) {missing}; the checkpoint holds {sorted([*sharded_meta, *local_meta])}. "
            "Fix: pass only items that were saved (names must match the save call).")
    for name, obj in items.items():
        wanted = "sharded" if name in sharded_meta else "rank-local"
        item_kind(name, obj)
        if (wanted == "sharded") != is_sharded_item(obj):
            raise CheckpointMismatchError(
                f"{source}: item {name!r} was saved as a {wanted} item but restore got a {type(obj).__qualname__}. "
                "Fix: pass the same kind of object that was saved.")
    pairs = pair_optimizers({n: o for n, o in items.items() if n in sharded_meta})
    for name, model in pairs.items():
        if sharded_meta[name].get("model") != model:
            raise CheckpointMismatchError(f"{source}: optimizer {name!r} was saved with model "
                                          f"{sharded_meta[name].get('model')!r}, restored with {model!r}. Fix: pass "
                                          "the same names as the save call.")
    names = [name for name in items if name in sharded_meta]
    fresh = {name: getattr(items[name], "_step_count", None) for name in names
             if isinstance(items[name], torch.optim.Optimizer) and not items[name].state}
    try:
        states = _read_sharded_items(step, ranks, items, names, pairs, trees_saved, source)
        local_items = {n: o for n, o in items.items() if n in local_meta}
        apply_local = prepare_rank_local(step, rank, world, local_items, local_meta, rng)
    except BaseException:
        for name, count in fresh.items():  # the live optimizer as it was: DCP initialised its state to read it
            forget_initialised_state(items[name], count)
        raise
    return PreparedRestore(states=states, pairs=pairs, apply_local=apply_local, source=source)


def _read_sharded_items(step: ShardedStep, ranks: RankGroup | None, items: Mapping[str, Any], names: list[str],
                        pairs: Mapping[str, str], trees_saved: Mapping[str, Any], source: str) -> dict[str, Any]:
    """Each sharded item's saved state, its tensors read (through DCP) into copies shaped like the live ones;
    the saved keys and parameter groups are checked against the live object's first."""
    targets: dict[str, torch.Tensor] = {}
    for name in names:
        live = live_state(name, items[name], items, pairs, keep_initialised=True)
        live_tree, live_tensors = split_tensors(live, name, sharded=True)
        saved_keys = tensor_keys(trees_saved[name])
        _check_keys(name, items[name], saved_keys, set(live_tensors), trees_saved[name], live_tree, source)
        # empty is safe: decode_index proved the saved chunks tile every tensor exactly (no gap, no overlap)
        targets.update({f"{name}.{key}": torch.empty_like(live_tensors[key]) for key in saved_keys})
    if targets:
        dcp_load(step, ranks, targets, source)
    states = {}
    for name in names:
        loaded = {key[len(name) + 1:]: t for key, t in targets.items() if key.startswith(name + ".")}
        states[name] = state = join_tensors(trees_saved[name], loaded, source)
        optimizer = isinstance(items[name], torch.optim.Optimizer)
        well_formed = isinstance(state, dict) and (
            isinstance(state.get("state"), dict) if optimizer else all(type(k) is str for k in state))
        if not well_formed:
            problem = f"the saved state of item {name!r} is not a {'optimizer' if optimizer else 'module'} state dict"
            raise CheckpointCorruptError(f"{source}: {problem}", {source: problem})
    return states


def tensor_keys(tree: Any) -> set[str]:
    """The tensor keys an encoded tree refers to (codec.py's tagged ``{"__torchckpt__": "tensor"}`` leaves).

    Example:
        >>> sorted(tensor_keys({"w": {"__torchckpt__": "tensor", "key": "w"}, "n": [1, {"lr": 0.1}]}))
        ['w']
    """
    found: set[str] = set()
    stack = [tree]
    while stack:
        node = stack.pop()
        if type(node) is dict:
            if node.get("__torchckpt__") == "tensor" and type(node.get("key")) is str:
                found.add(node["key"])
            else:
                stack.extend(node.values())
        elif type(node) is list:
            stack.extend(node)
    return found


def _check_keys(name: str, obj: Any, saved: set[str], live: set[str], saved_tree: Any, live_tree: Any,
                source: str) -> None:
    """A saved module must have the live module's keys; a saved optimizer its parameter groups (by parameter
    name) and no state for a parameter the live one lacks."""
    fix = "Fix: build the same model and optimizer (same parameter groups) as the run that saved it."
    if isinstance(obj, torch.optim.Optimizer):
        def groups(tree: Any) -> Any:
            try:
                return [group["params"] for group in tree["param_groups"]]
            except (KeyError, TypeError, IndexError):
                return None

        saved_groups, live_groups = groups(saved_tree), groups(live_tree)
        if saved_groups is None:
            raise CheckpointCorruptError(f"{source}: optimizer {name!r} has no parameter groups",
                                         {source: f"optimizer {name!r} has no parameter groups"})
        if saved_groups != live_groups:
            raise CheckpointMismatchError(
                f"{source}: optimizer {name!r} was saved with {len(saved_groups)} parameter group(s) "
                f"{_short(saved_groups)}; the live one has {len(live_groups or [])} {_short(live_groups)}. {fix}")
        unexpected = sorted(saved - live)
    else:  # a module: the saved entries (tensors and extra state alike) are exactly the live ones
        if type(saved_tree) is not dict or type(live_tree) is not dict or "__torchckpt__" in saved_tree:
            raise CheckpointCorruptError(f"{source}: the saved state of module {name!r} is not a state dict",
                                         {source: f"the saved state of module {name!r} is not a state dict"})
        unexpected = sorted(set(saved_tree) - set(live_tree))
        missing = sorted(set(live_tree) - set(saved_tree))
        if missing:
            raise CheckpointMismatchError(f"{source}: item {name!r}: the checkpoint lacks key(s) {missing[:10]}. {fix}")
    if unexpected:
        raise CheckpointMismatchError(f"{source}: item {name!r}: the checkpoint has key(s) the live object lacks: "
                                      f"{unexpected[:10]}. {fix}")


def _short(groups: Any) -> str:
    text = repr(groups)
    return text if len(text) <= 200 else text[:200] + "..."


def apply_restore(prepared: PreparedRestore, items: Mapping[str, Any]) -> None:
    """Load a prepared restore into the live objects: rank-local items and RNG streams, then models, then
    optimizers (an optimizer saved with no state is left with none).

    Example:
        >>> apply_restore  # doctest: +ELLIPSIS
        <function apply_restore at ...>
    """
    from torch.distributed.checkpoint.state_dict import set_model_state_dict, set_optimizer_state_dict

    prepared.apply_local()
    for pass_optimizers in (False, True):
        for name, state in prepared.states.items():
            obj = items[name]
            if isinstance(obj, torch.optim.Optimizer) != pass_optimizers:
                continue
            try:
                if pass_optimizers:
                    set_optimizer_state_dict(items[prepared.pairs[name]], obj, state)
                    if not state.get("state"):
                        forget_initialised_state(obj, getattr(obj, "_step_count", None))
                else:
                    set_model_state_dict(obj, state)
            except (RuntimeError, ValueError, KeyError, TypeError, AttributeError) as error:
                raise CheckpointMismatchError(
                    f"{prepared.source}: item {name!r} ({type(obj).__qualname__}) refused the restored state: "
                    f"{type(error).__name__}: {str(error)[:500]}. Fix: build the same model and optimizer as the "
                    "run that saved it.") from error


def shard_reader(step: ShardedStep) -> ShardReader:
    """DCP StorageReader over ``step``'s shards: its index read whole and checked against the manifest, only
    files the manifest lists read, in blocks verified before use (shard_storage.py).

    Example:
        >>> import tempfile
        >>> from torchckpt.state.catalog import read_manifest
        >>> from torchckpt.state.checkpointer import Checkpointer
        >>> from torchckpt.state.storage import open_storage
        >>> tmp = tempfile.TemporaryDirectory()
        >>> with Checkpointer(tmp.name, sharded=True, capture_rng=False) as ckpt:
        ...     ckpt.save(1, model=torch.nn.Linear(2, 1))
        >>> storage = open_storage(tmp.name)
        >>> sorted(shard_reader(open_sharded(storage, read_manifest(storage, 1))).metadata.state_dict_metadata)
        ['model.bias', 'model.weight']
        >>> tmp.cleanup()
    """
    index = step.read_file(INDEX_NAME)

    def read_range(name: str, offset: int, length: int) -> bytes | bytearray:
        if name not in step.manifest.files:
            path = step.storage.path_of(step.entry, name)
            raise CheckpointCorruptError(f"{path}: missing from the manifest", {path: "missing from the manifest"})
        return step.storage.read_range(step.entry, name, offset, length)

    reader = ShardReader(index, read_range, source=step.storage.path_of(step.entry))
    for key, where in reader.locations.items():  # every chunk inside a listed file: no size from the index
        listed = step.manifest.files.get(where.file)  # can make a read or an allocation larger than the files
        if listed is None or where.offset + where.length > listed.size_bytes:
            path = step.storage.path_of(step.entry, INDEX_NAME)
            problem = (f"chunk {key} lies outside {where.file} ({where.offset}+{where.length} bytes; the manifest "
                       f"lists {listed.size_bytes if listed else 'no such file'})")
            raise CheckpointCorruptError(f"{path}: {problem}", {path: problem})
    return reader


def dcp_load(step: ShardedStep, ranks: RankGroup | None, targets: dict[str, torch.Tensor], source: str,
             reader: ShardReader | None = None) -> None:
    """Load ``targets`` (index keys such as ``"model.0.weight"`` -> tensors of the saved shape and dtype, or
    DTensors) from ``step`` through DCP: every rank of ``ranks`` together, or this process alone (None).

    ``reader``: a :func:`shard_reader` of ``step`` already open (its metadata built ``targets``). A key the
    step lacks or a shape or dtype that differs is a :class:`CheckpointMismatchError` naming ``source``;
    a byte that fails its hash, a :class:`CheckpointCorruptError`.

    Example:
        >>> import tempfile
        >>> from torchckpt.state.catalog import read_manifest
        >>> from torchckpt.state.checkpointer import Checkpointer
        >>> from torchckpt.state.storage import open_storage
        >>> tmp = tempfile.TemporaryDirectory()
        >>> with Checkpointer(tmp.name, sharded=True, capture_rng=False) as ckpt:
        ...     ckpt.save(1, model=torch.nn.Linear(2, 1, bias=False))
        >>> storage = open_storage(tmp.name)
        >>> step = open_sharded(storage, read_manifest(storage, 1))
        >>> targets = {"model.weight": torch.empty(1, 2)}
        >>> dcp_load(step, None, targets, "state.json")
        >>> targets["model.weight"].shape
        torch.Size([1, 2])
        >>> tmp.cleanup()
    """
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import DefaultLoadPlanner

    reader = shard_reader(step) if reader is None else reader
    missing = sorted(set(targets) - set(reader.metadata.state_dict_metadata))
    if missing:
        raise CheckpointMismatchError(
            f"{source}: the checkpoint lacks {missing[:5]}{' ...' if len(missing) > 5 else ''} (saved keys "
            f"e.g. {sorted(reader.metadata.state_dict_metadata)[:3]}). Fix: build the same model and optimizer "
            "as the run that saved it.")
    for key, target in targets.items():
        saved = reader.metadata.state_dict_metadata[key]
        if tuple(saved.size) != tuple(target.shape) or saved.properties.dtype != target.dtype:  # type: ignore[union-attr]
            raise CheckpointMismatchError(
                f"{source}: {key}: saved {saved.properties.dtype} {list(saved.size)}, live {target.dtype} "  # type: ignore[union-attr]
                f"{list(target.shape)}. Fix: build the same model and optimizer as the run that saved it.")
    planner = DefaultLoadPlanner(flatten_state_dict=False, flatten_sharded_tensors=False)
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*assuming the intent is to load in a single process")
            dcp.load(targets, storage_reader=reader, planner=planner,
                     process_group=ranks.group if ranks is not None else None, no_dist=ranks is None)
    except CheckpointError:
        raise
    except (Exception, CheckpointException) as error:
        failures = dcp_failures(error)
        for failure in failures.values():  # the same on every rank: every rank falls back together
            if isinstance(failure, CheckpointError):
                raise failure from None
        if failures:
            rank_failed, first = min(failures.items())
            raise CheckpointError(f"restoring step {step.manifest.step}: rank {rank_failed} failed: "
                                  f"{type(first).__name__}: {first}") from first
        if ranks is not None and isinstance(error, RuntimeError):
            raise RankLostError(f"restoring step {step.manifest.step}: another rank is gone or stuck ({error})",
                                []) from error
        raise


def newest_is_sharded(storage: Storage, step: int | None) -> bool:
    """Whether the newest step with a readable manifest (or ``step``) is sharded.

    Example:
        >>> from torchckpt.state.storage import open_storage
        >>> newest_is_sharded(open_storage("/nonexistent"), None)
        False
    """
    for candidate in candidate_steps(storage, step):
        try:
            return read_manifest(storage, candidate).world_size is not None
        except CheckpointError:
            continue
    return False


def restore_newest_sharded(storage: Storage, ranks: RankGroup | None, step: int | None, fallback: bool,
                           items: dict[str, Any], rng: bool | None, verify: str) -> int | None:
    """Restore the newest step (or ``step``) that every rank reads and verifies ([restore loads into copies]);
    the ranks agree on it. An unsharded step is read the usual way in one process, refused with several.
    Returns the step, or None when the directory holds none.

    Example:
        >>> from torchckpt.state.storage import open_storage
        >>> print(restore_newest_sharded(open_storage("/nonexistent"), None, None, True, {}, None, "full"))
        None
    """
    from torchckpt.state.reader import apply_snapshot, read_newest_valid

    skipped: list[str] = []
    for candidate in candidate_steps(storage, step):
        code, prepared = 0, None
        problem: BaseException | None = None
        try:
            info = inspect_step(storage, candidate, "fast")
            if not info.valid:
                raise CheckpointCorruptError(info.problem or "invalid", dict(info.problems))
            manifest = read_manifest(storage, candidate)
            if manifest.world_size is None:
                if ranks is not None:
                    raise CheckpointMismatchError(
                        f"{info.path} was saved by one process in the unsharded format; a run with a process "
                        "group restores sharded steps only. Fix: restore it in one process with a "
                        "Checkpointer(..., sharded=True) and save it again (a sharded step any world size "
                        "reads), or restore with torchckpt.state.load on each rank.")
                prepared = None
            else:
                prepared = prepare_restore(open_sharded(storage, manifest), ranks, items, rng)
        except CheckpointCorruptError as error:
            code, problem = 1, error
        except BaseException as error:
            code, problem = 2, error
        if ranks is not None:
            agreed = ranks.agree(code, f"agree on restoring step {candidate}")
            if agreed == 2 and code != 2:
                raise CheckpointError(f"step {candidate}: another rank failed to restore it (its error is "
                                      "in its log); nothing was restored on this rank.")
            code = max(code, agreed)
        if code == 2:
            raise problem  # type: ignore[misc]
        if code == 1:
            skipped.append(f"step {candidate}: {problem or 'corrupt on another rank'}")
            if fallback and step is None:
                continue
            raise CheckpointCorruptError(f"step {candidate} is corrupt, nothing was restored: {skipped[-1]}")
        if prepared is None:  # an unsharded step, in one process with sharded=True
            snapshot = read_newest_valid(storage, step=candidate, verify=verify,
                                         fallback=False, wanted=set(items))
            assert snapshot is not None
            apply_snapshot(snapshot, items, rng,
                           storage.path_of(step_dir_name(candidate), "state.json"))
        else:
            apply_restore(prepared, items)
        if skipped:
            warn_fallback(f"restored step {candidate}; skipped corrupt newer step(s): " + " | ".join(skipped))
        return candidate
    if skipped:
        raise CheckpointCorruptError(f"{storage.location}: no valid checkpoint among {len(skipped)} step(s): "
                                     + " | ".join(skipped))
    return None
