"""Sharded checkpoints, the restore: any world size reads a step that any world size wrote.

Each rank reads only the blocks of the shards it needs (step.py, shard_storage.py) into copies of its live tensors;
DCP's load planner finds the saved chunks that overlap each rank's new ones.

Rules kept here (named in ``docs/design.md``; the design notes they keep in parentheses):

1. **[restore loads into copies]** (live/capture.py's [no half restore]) DCP loads into fresh tensors shaped
   like the live ones; the live objects change only after every rank read and verified its part, and the
   ranks agree on the step: a step corrupt on one rank is skipped by all.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from torchckpt.state.errors import (
    CheckpointCorruptError,
    CheckpointError,
    CheckpointMismatchError,
    CheckpointNewerFormatError,
    warn_fallback,
)
from torchckpt.state.format.codec import join_tensors, split_tensors
from torchckpt.state.format.layout import STATE_NAME, step_dir_name
from torchckpt.state.live.capture import item_kind
from torchckpt.state.read.catalog import inspect_step
from torchckpt.state.read.load import apply_snapshot
from torchckpt.state.read.newest import candidate_steps, read_newest_valid
from torchckpt.state.read.step import read_manifest
from torchckpt.state.sharded.items import forget_initialised_state, is_sharded_item, live_state, pair_optimizers
from torchckpt.state.sharded.optimizer_shapes import shape_like_saved
from torchckpt.state.sharded.rank_group import RankGroup
from torchckpt.state.sharded.rank_local import prepare_rank_local
from torchckpt.state.sharded.step import ShardedStep, dcp_load, open_sharded, shard_reader
from torchckpt.state.storage.base import Storage


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
    reader = shard_reader(step)
    for name in names:
        if isinstance(items[name], torch.optim.Optimizer):
            # optimizer_shapes.py's [a fresh optimizer is shaped, not stepped]: no optimizer step to make its state
            saved = {key[len(name) + 1:]: (md.size, md.properties.dtype)  # type: ignore[union-attr]
                     for key, md in reader.metadata.state_dict_metadata.items() if key.startswith(name + ".")}
            shape_like_saved(items[name], trees_saved[name], saved)
        live = live_state(name, items[name], items, pairs, keep_initialised=True)
        live_tree, live_tensors = split_tensors(live, name, sharded=True)
        saved_keys = tensor_keys(trees_saved[name])
        _check_keys(name, items[name], saved_keys, set(live_tensors), trees_saved[name], live_tree, source)
        # empty is safe: decode_index proved the saved chunks tile every tensor exactly (no gap, no overlap)
        targets.update({f"{name}.{key}": torch.empty_like(live_tensors[key]) for key in saved_keys})
    if targets:
        dcp_load(step, ranks, targets, source, reader=reader)
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
    """The tensor keys an encoded tree refers to (format/codec.py's tagged ``{"__torchckpt__": "tensor"}`` leaves).

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


def refuse_newer_step(storage: Storage, step: int) -> None:
    """Raise :class:`CheckpointNewerFormatError` if ``step`` was written by a newer torchckpt (inspect_step would
    report it as merely invalid, and restore would fall back past it); any other problem is left to inspect_step.

    Example:
        >>> from torchckpt.state.storage.backends import open_storage
        >>> refuse_newer_step(open_storage("/nonexistent"), 3)
    """
    try:
        read_manifest(storage, step)
    except CheckpointNewerFormatError:
        raise
    except CheckpointError:
        pass


@torch.inference_mode(False)  # restored tensors are normal ones, usable in a later backward()
def restore_newest_sharded(storage: Storage, ranks: RankGroup | None, step: int | None, fallback: bool,
                           items: dict[str, Any], rng: bool | None, verify: str) -> int | None:
    """Restore the newest step (or ``step``) that every rank reads and verifies ([restore loads into copies]);
    the ranks agree on it. An unsharded step is read the usual way in one process, refused with several.
    Returns the step, or None when the directory holds none.

    Example:
        >>> from torchckpt.state.storage.backends import open_storage
        >>> print(restore_newest_sharded(open_storage("/nonexistent"), None, None, True, {}, None, "full"))
        None
    """
    skipped: list[str] = []
    for candidate in candidate_steps(storage, step):
        code, prepared = 0, None
        problem: BaseException | None = None
        try:
            refuse_newer_step(storage, candidate)
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
        except CheckpointNewerFormatError as error:  # not damage: falling back would rewind the run
            code, problem = 2, error
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
