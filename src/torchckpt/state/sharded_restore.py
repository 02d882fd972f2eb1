"""Sharded checkpoints, the restore: any world size reads a step that any world size wrote.

Each rank reads only the blocks of the shards it needs (shard_storage.py) into copies of its live tensors;
DCP's load planner finds the saved chunks that overlap each rank's new ones.

Rules kept here (named in ``docs/design.md``; the design notes they keep in parentheses):

1. **[the rank-local rule]** Restoring on the world size that saved: each rank gets its own rank-local
   items and RNG streams (bit-exact). On another world size: a rank-local item saved identically by every
   rank (a scheduler, an epoch counter) is restored on every rank; a data loader or sampler is not (its
   position is per rank: the loader starts its epoch again) and neither is an item whose ranks differed;
   RNG streams are not restored (each rank keeps its own); one warning names each such item.
2. **[restore loads into copies]** (capture.py's [no half restore]) DCP loads into fresh tensors shaped
   like the live ones; the live objects change only after every rank read and verified its part, and the
   ranks agree on the step: a step corrupt on one rank is skipped by all.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch.distributed.checkpoint.api import CheckpointException

from torchckpt.state.capture import item_kind
from torchckpt.state.catalog import inspect_step, read_manifest
from torchckpt.state.codec import decode_json, join_tensors, split_tensors
from torchckpt.state.errors import CheckpointCorruptError, CheckpointError, CheckpointMismatchError, warn_fallback
from torchckpt.state.format import STATE_NAME, Manifest, hash_bytes, step_dir_name
from torchckpt.state.rank_group import RankGroup, RankLostError, dcp_failures, rank_prefix
from torchckpt.state.reader import candidate_steps
from torchckpt.state.shard_storage import INDEX_NAME, ShardReader
from torchckpt.state.sharded import is_sharded_item, live_state, pair_optimizers
from torchckpt.state.snapshot import decode_snapshot
from torchckpt.state.storage import Storage

# ----- reading -------------------------------------------------------------------------------------


@dataclass
class ShardedStep:
    """A committed sharded step opened for reading: its manifest and ``state.json``."""

    storage: Storage
    manifest: Manifest
    state: dict[str, Any]

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
    """Read and check ``state.json`` of a committed sharded step.

    Example:
        >>> open_sharded  # doctest: +ELLIPSIS
        <function open_sharded at ...>
    """
    step = ShardedStep(storage, manifest, {})
    state = decode_json(step.read_file(STATE_NAME), storage.path_of(step.entry, STATE_NAME))
    path = storage.path_of(step.entry, STATE_NAME)
    if type(state) is not dict or state.get("world_size") != manifest.world_size or state.get("step") != manifest.step:
        raise CheckpointCorruptError(f"{path}: does not match its manifest", {path: "does not match its manifest"})
    step.state = state
    return step


@dataclass
class PreparedRestore:
    """A sharded step read and verified by this rank, not yet applied ([restore loads into copies])."""

    states: dict[str, Any]
    pairs: dict[str, str]
    apply_local: Callable[[], None]


def prepare_restore(step: ShardedStep, ranks: RankGroup | None, items: Mapping[str, Any],
                    rng: bool | None) -> PreparedRestore:
    """Read and verify this rank's part of a committed sharded step into copies; nothing live changes.

    Example:
        >>> prepare_restore  # doctest: +ELLIPSIS
        <function prepare_restore at ...>
    """
    rank, world = (ranks.rank, ranks.world_size) if ranks is not None else (0, 1)
    source = step.storage.path_of(step.entry, STATE_NAME)
    try:
        sharded_meta: dict[str, Any] = dict(step.state["sharded_items"])
        local_meta: dict[str, Any] = dict(step.state["local_items"])
        trees_saved = {name: meta["tree"] for name, meta in sharded_meta.items()}
    except (KeyError, TypeError, ValueError) as error:
        raise CheckpointCorruptError(f"{source}: malformed ({error!r})", {source: "malformed"}) from None
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
    targets: dict[str, torch.Tensor] = {}
    names = [name for name in items if name in sharded_meta]
    for name in names:
        _, live_tensors = split_tensors(live_state(name, items[name], items, pairs), name, sharded=True)
        # zeros, not empty: a part no saved chunk covers (a damaged index) reads as 0, never stale memory
        targets.update({f"{name}.{key}": torch.zeros_like(t) for key, t in live_tensors.items()})
    if targets:
        dcp_load(step, ranks, targets, source)
    states = {}
    for name in names:
        loaded = {key[len(name) + 1:]: t for key, t in targets.items() if key.startswith(name + ".")}
        states[name] = join_tensors(trees_saved[name], loaded, source)
    local_items = {n: o for n, o in items.items() if n in local_meta}
    apply_local = _prepare_local(step, rank, world, local_items, local_meta, rng)
    return PreparedRestore(states=states, pairs=pairs, apply_local=apply_local)


def apply_restore(prepared: PreparedRestore, items: Mapping[str, Any]) -> None:
    """Load a prepared restore into the live objects: rank-local items and RNG streams, then models, then
    optimizers.

    Example:
        >>> apply_restore  # doctest: +ELLIPSIS
        <function apply_restore at ...>
    """
    from torch.distributed.checkpoint.state_dict import set_model_state_dict, set_optimizer_state_dict

    prepared.apply_local()
    for name, state in prepared.states.items():
        if not isinstance(items[name], torch.optim.Optimizer):
            set_model_state_dict(items[name], state)
    for name, state in prepared.states.items():
        if isinstance(items[name], torch.optim.Optimizer):
            set_optimizer_state_dict(items[prepared.pairs[name]], items[name], state)


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

    return ShardReader(index, read_range, source=step.storage.path_of(step.entry))


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


def _prepare_local(step: ShardedStep, rank: int, world: int, items: Mapping[str, Any],
                   local_meta: Mapping[str, Any], rng: bool | None) -> Callable[[], None]:
    """Read this rank's rank-local files (rank 0's on another world size) and return what applies them
    ([the rank-local rule])."""
    from torchckpt.state.reader import apply_snapshot, check_rng

    saved_world = step.manifest.world_size or 1
    same_world = world == saved_world
    prefix = rank_prefix(rank if same_world else 0, saved_world)
    files = {name[len(prefix):]: step.read_file(name) for name in step.manifest.files if name.startswith(prefix)}
    path_of = lambda name: step.storage.path_of(step.entry, prefix + name)  # noqa: E731
    snapshot = decode_snapshot(files, path_of, set(items))
    if snapshot.rng is not None:
        check_rng(snapshot.rng, path_of(STATE_NAME))
    if rng and not same_world:
        raise CheckpointMismatchError(
            f"{step.storage.path_of(step.entry)}: saved by {saved_world} ranks, restored on {world}: RNG streams "
            "are per rank and are not carried across a world-size change. Fix: pass rng=None (or False).")
    chosen = dict(items)
    notes = []
    if not same_world:
        for name in list(chosen):
            meta = local_meta[name]
            if meta.get("data_position") or not meta.get("same_on_every_rank"):
                why = ("a data position, per rank: the loader starts its epoch again" if meta.get("data_position")
                       else "its saved state differed between ranks")
                notes.append(f"item {name!r} not restored ({why})")
                del chosen[name]
        if rng is not False and snapshot.rng is not None:
            notes.append("RNG streams not restored (each rank keeps its own)")
    streams = rng is not False and same_world and snapshot.rng is not None

    def apply() -> None:
        apply_snapshot(snapshot, chosen, streams, path_of(STATE_NAME))
        if notes and rank == 0:
            warnings.warn(
                f"{step.storage.path_of(step.entry)} was saved by {saved_world} rank(s) and is restored on {world}: "
                "models and optimizers are resharded exactly; rank-local state follows the rule in docs/state.md "
                "(\"What changes with world size\"): " + "; ".join(notes) + ".", ElasticResumeWarning, stacklevel=4)

    return apply


class ElasticResumeWarning(UserWarning):
    """A sharded step restored on a different world size: some rank-local state was not restored."""


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
