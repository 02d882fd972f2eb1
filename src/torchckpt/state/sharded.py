"""Sharded checkpoints: every rank writes its part in parallel; a vote commits the step; any world size reads it.

A Checkpointer built while a process group is initialised (or with ``sharded=True``) saves through here.
Models and optimizers go through ``torch.distributed.checkpoint.state_dict`` (``get_model_state_dict``,
``get_optimizer_state_dict``: keys are parameter names, the same under DDP, FSDP2 or none) and DCP's
planners, with shard_storage.py's pickle-free storage layer. Every other item (scheduler, data loader,
plain dicts) and the RNG streams are this rank's own: each rank writes them to ``rank-R-of-W.*`` files.

Rules kept here (named in ``docs/design.md``; the design notes they keep in parentheses):

1. **[a sharded step commits by vote]** (Note: [no manifest, no checkpoint]) Rank 0 opens the temp
   directory and publishes its name on the process group's store; every rank writes and fsyncs its files
   there, then publishes their sizes and hashes (its vote). Rank 0 waits for every vote, writes
   ``state.json`` and the manifest listing every rank's files, and commits (rename, or the manifest as
   commit mark on fsspec); then retention; then it publishes the outcome, which every other rank waits for.
   A step is committed only if every rank voted.
2. **[no rank waits forever]** Every wait (the store's keys, DCP's collectives on a gloo group of ours)
   ends after ``rank_timeout_s``. A rank that died or hung is named: the survivors raise
   :class:`RankLostError` with the ranks that did not vote, and no step is committed. The next writer
   deletes the temp directory at start-up.
3. **[the rank-local rule]** Restoring on the world size that saved: each rank gets its own rank-local
   items and RNG streams (bit-exact). On another world size: a rank-local item saved identically by every
   rank (a scheduler, an epoch counter) is restored on every rank; a data loader or sampler is not (its
   position is per rank: the loader starts its epoch again) and neither is an item whose ranks differed;
   RNG streams are not restored (each rank keeps its own); one warning names each such item.
4. **[restore loads into copies]** (capture.py's [no half restore]) DCP loads into fresh tensors shaped
   like the live ones; the live objects change only after every rank read and verified its part.
"""

from __future__ import annotations

import datetime
import json
import time
import uuid
import warnings
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.api import CheckpointException

from torchckpt._host import local_part
from torchckpt.state.capture import capture_item, item_kind
from torchckpt.state.codec import decode_json, encode_json, join_tensors, split_tensors
from torchckpt.state.errors import (
    CheckpointCorruptError,
    CheckpointError,
    CheckpointMismatchError,
    CheckpointWriteError,
)
from torchckpt.state.format import (
    STATE_NAME,
    FileEntry,
    Manifest,
    encode_manifest,
    hash_bytes,
    step_dir_name,
)
from torchckpt.state.hashed_write import write_hashed
from torchckpt.state.shard_storage import INDEX_NAME, ShardReader, ShardWriter, write_hashed_bytes
from torchckpt.state.snapshot import decode_snapshot, encode_snapshot
from torchckpt.state.staging import HostStaging
from torchckpt.state.storage import StepWriter, Storage

DEFAULT_RANK_TIMEOUT_S = 300.0
_POLL_S = 0.05


class RankLostError(CheckpointWriteError):
    """Some ranks did not take their part in a sharded save or restore within the timeout (dead or stuck)."""

    def __init__(self, message: str, missing_ranks: list[int]) -> None:
        super().__init__(message)
        self.missing_ranks = missing_ranks


def rank_prefix(rank: int, world_size: int) -> str:
    """Prefix of rank ``rank``'s own files in a sharded step.

    Example:
        >>> rank_prefix(2, 4)
        'rank-00002-of-00004.'
    """
    return f"rank-{rank:05d}-of-{world_size:05d}."


@dataclass
class RankGroup:
    """The processes taking part in sharded saves: a gloo group with a timeout, and the store to vote on.

    Example:
        >>> RankGroup.current(timeout_s=10.0) is None  # no process group in this process
        True
    """

    rank: int
    world_size: int
    timeout_s: float
    _group: Any = None
    _store: Any = None
    _session: str | None = None
    _count: int = 0

    @classmethod
    def current(cls, timeout_s: float) -> RankGroup | None:
        """The ranks of the initialised default process group, or None without one."""
        if not (dist.is_available() and dist.is_initialized()):
            return None
        return cls(rank=dist.get_rank(), world_size=dist.get_world_size(), timeout_s=timeout_s)

    @property
    def group(self) -> Any:
        """A gloo group over every rank whose collectives time out after ``timeout_s`` ([no rank waits forever]).

        Built by the first sharded save or restore (every rank calls it then: it is a collective)."""
        if self._group is None:
            self._group = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=self.timeout_s))
            self._store = dist.distributed_c10d._get_default_store()
            token = torch.zeros(32, dtype=torch.uint8)
            if self.rank == 0:
                token.copy_(torch.frombuffer(bytearray(uuid.uuid4().hex.encode()), dtype=torch.uint8))
            self._collective("agree on a session id", lambda: dist.broadcast(token, src=0, group=self._group))
            self._session = bytes(token.tolist()).decode()
        return self._group

    def next_prefix(self, what: str) -> str:
        """Store key prefix of the next sharded operation (every rank counts the same operations)."""
        _ = self.group
        self._count += 1
        return f"torchckpt/{self._session}/{self._count}/{what}"

    def _collective(self, what: str, action: Callable[[], Any]) -> Any:
        try:
            return action()
        except RuntimeError as error:
            raise RankLostError(f"rank {self.rank}: {what} failed: another rank is gone or stuck ({error}); "
                                f"no step was committed.", []) from error

    def agree(self, code: int, what: str) -> int:
        """The largest ``code`` any rank passed (every rank calls it; a collective with the timeout)."""
        value = torch.tensor([code], dtype=torch.int64)
        self._collective(what, lambda: dist.all_reduce(value, op=dist.ReduceOp.MAX, group=self.group))
        return int(value.item())

    def publish(self, key: str, value: dict[str, Any]) -> None:
        """Set ``key`` on the store to ``value`` as JSON."""
        self._store.set(key, json.dumps(value))

    def gather(self, prefix: str, what: str, deadline: float) -> dict[int, dict[str, Any]]:
        """Every rank's value under ``prefix/R``, or :class:`RankLostError` naming the ranks missing at
        ``deadline`` ([no rank waits forever])."""
        keys = {rank: f"{prefix}/{rank}" for rank in range(self.world_size)}
        missing = list(keys)
        while True:
            missing = [rank for rank in missing if not self._store.check([keys[rank]])]
            if not missing:
                break
            if time.monotonic() > deadline:
                raise RankLostError(
                    f"rank(s) {missing} did not {what} within {self.timeout_s:g} s (dead or stuck); no step was "
                    f"committed. Fix: see those ranks' logs; the job resumes from the last committed step. "
                    f"(The wait is Checkpointer(rank_timeout_s=...).)", missing)
            time.sleep(_POLL_S)
        return {rank: json.loads(self._store.get(key)) for rank, key in keys.items()}

    def await_acks(self, prefix: str, skip: set[int]) -> None:
        """Rank 0: wait (briefly) until the other ranks read the outcome, so that a process that holds the
        store (rank 0 under ``mp.spawn``) does not exit before they do."""
        deadline = time.monotonic() + min(self.timeout_s, 30.0)
        keys = [f"{prefix}/{rank}" for rank in range(self.world_size) if rank not in skip]
        while keys and time.monotonic() < deadline:
            keys = [key for key in keys if not self._store.check([key])]
            time.sleep(_POLL_S if keys else 0)

    def wait_one(self, key: str, what: str, deadline: float, owner: int = 0) -> dict[str, Any]:
        """The value of ``key`` (set by rank ``owner``), or :class:`RankLostError` at ``deadline``."""
        while not self._check(key, owner):
            if time.monotonic() > deadline:
                raise RankLostError(
                    f"rank {owner} did not {what} within {self.timeout_s:g} s (dead or stuck); rank {self.rank} "
                    f"gives up. Fix: see rank {owner}'s log; the job resumes from the last committed step.", [owner])
            time.sleep(_POLL_S)
        return json.loads(self._store.get(key))

    def _check(self, key: str, owner: int) -> bool:
        try:
            return bool(self._store.check([key]))
        except RuntimeError as error:  # the store lived in a process that is gone (rank 0 with mp.spawn)
            raise RankLostError(f"rank {self.rank}: the process group's store is unreachable ({error}); rank "
                                f"{owner} (or the launcher that held the store) is gone. No step was committed.",
                                [owner]) from error


# ----- items ---------------------------------------------------------------------------------------


def is_sharded_item(obj: object) -> bool:
    """True for items saved through DCP: modules and optimizers.

    Example:
        >>> is_sharded_item(torch.nn.Linear(1, 1)), is_sharded_item({"epoch": 1})
        (True, False)
    """
    return isinstance(obj, (torch.nn.Module, torch.optim.Optimizer))


def _is_data_position(obj: object) -> bool:
    return isinstance(obj, (torch.utils.data.DataLoader, torch.utils.data.Sampler))


def pair_optimizers(items: Mapping[str, Any]) -> dict[str, str]:
    """Each optimizer item's model item: the module holding all its parameters.

    Example:
        >>> model = torch.nn.Linear(2, 2)
        >>> pair_optimizers({"model": model, "opt": torch.optim.SGD(model.parameters(), lr=0.1)})
        {'opt': 'model'}
    """
    pairs = {}
    modules = {name: obj for name, obj in items.items() if isinstance(obj, torch.nn.Module)}
    for name, obj in items.items():
        if not isinstance(obj, torch.optim.Optimizer):
            continue
        wanted = {id(p) for group in obj.param_groups for p in group["params"]}
        owners = [m for m, module in modules.items() if wanted <= {id(p) for p in module.parameters()}]
        if not owners:
            raise ValueError(
                f"item {name!r} is an optimizer but no module item passed with it holds all its parameters; a "
                "sharded checkpoint names optimizer state by parameter name. Fix: pass the model in the same "
                f"call (e.g. model=model, {name}={name}).")
        pairs[name] = owners[0]
    return pairs


def _live_state(name: str, obj: Any, items: Mapping[str, Any], pairs: Mapping[str, str]) -> Any:
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

    if isinstance(obj, torch.optim.Optimizer):
        return get_optimizer_state_dict(items[pairs[name]], obj)
    return get_model_state_dict(obj)


def _digest(tree: Any, tensors: Mapping[str, torch.Tensor]) -> str:
    parts = [encode_json(tree)]
    for key, tensor in sorted(tensors.items()):
        memory = local_part(tensor).detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy()
        parts.append(key.encode() + bytes(memory))
    return hash_bytes(b"\0".join(parts), "sha256")


@dataclass
class ShardedSnapshot:
    """What one rank hands to the writer: tensors for DCP, JSON trees, and this rank's own files."""

    step: int
    tensors: dict[str, torch.Tensor]
    trees: dict[str, Any]
    kinds: dict[str, str]
    pairs: dict[str, str]
    local_files: dict[str, list[Any]]
    local_digests: dict[str, str]
    data_position: list[str]
    metrics: Mapping[str, float] = field(default_factory=dict)


def snapshot_sharded(step: int, items: Mapping[str, Any], metrics: Mapping[str, float], rng: Any,
                     rank: int, world_size: int, staging: HostStaging | None) -> ShardedSnapshot:
    """Capture this rank's part of a sharded save; with ``staging`` every tensor is copied first (async).

    Example:
        >>> snap = snapshot_sharded(1, {"model": torch.nn.Linear(2, 1), "extras": {"epoch": 1}}, {}, None, 0, 1, None)
        >>> sorted(snap.tensors), sorted(snap.local_files)
        (['model.bias', 'model.weight'], ['rank-00000-of-00001.state.json'])
    """
    pairs = pair_optimizers(items)
    tensors: dict[str, torch.Tensor] = {}
    trees, kinds, local = {}, {}, {}
    for name, obj in items.items():
        if is_sharded_item(obj):
            tree, item_tensors = split_tensors(_live_state(name, obj, items, pairs), name, sharded=True)
            trees[name] = tree
            kinds[name] = "optimizer" if name in pairs else "module"
            tensors.update({f"{name}.{key}": tensor for key, tensor in item_tensors.items()})
        else:
            local[name] = capture_item(name, obj)
    digests = {name: _digest(*split_tensors(state, name)) for name, (_, state) in local.items()}
    if staging is not None:
        tensors = _staged(tensors, staging)
    files = encode_snapshot(step=step, items=local, rng=rng, metrics=metrics, staging=None)
    prefix = rank_prefix(rank, world_size)
    return ShardedSnapshot(step=step, tensors=tensors, trees=trees, kinds=kinds, pairs=pairs,
                           local_files={prefix + n: list(chunks) for n, chunks in files.items()},
                           local_digests=digests, metrics=metrics,
                           data_position=[n for n in local if _is_data_position(items[n])])


def _staged(tensors: Mapping[str, torch.Tensor], staging: HostStaging) -> dict[str, torch.Tensor]:
    """Host copies of every tensor's local part, one buffer of this rank's shard bytes; DTensors rewrapped."""
    from torch.distributed.tensor import DTensor

    [copies] = staging.copy([{key: local_part(t).detach() for key, t in tensors.items()}])
    staged: dict[str, torch.Tensor] = {}
    for key, tensor in tensors.items():
        if isinstance(tensor, DTensor):
            staged[key] = DTensor.from_local(copies[key], tensor.device_mesh, tensor.placements,
                                             run_check=False, shape=tensor.shape, stride=tensor.stride())
        else:
            staged[key] = copies[key]
    return staged


# ----- writing -------------------------------------------------------------------------------------


def write_sharded(storage: Storage, ranks: RankGroup | None, snap: ShardedSnapshot, algorithm: str,
                  before_commit: Callable[[], None], after_commit: Callable[[], None]) -> None:
    """Write and commit one sharded step ([a sharded step commits by vote]); ``ranks`` None: one process."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import DefaultSavePlanner

    rank, world = (ranks.rank, ranks.world_size) if ranks is not None else (0, 1)
    prefix = ranks.next_prefix(f"save-{snap.step}") if ranks is not None else ""
    deadline = lambda: time.monotonic() + (ranks.timeout_s if ranks is not None else 0)  # noqa: E731
    writer: StepWriter
    if rank == 0:
        writer = storage.begin_step(snap.step)
        if ranks is not None:
            ranks.publish(f"{prefix}/temp", {"entry": writer.entry})
    else:
        assert ranks is not None
        entry = ranks.wait_one(f"{prefix}/temp", f"start step {snap.step}", deadline())["entry"]
        writer = storage.join_step(snap.step, entry)
    entries: dict[str, FileEntry] = {}
    try:
        shard_writer = ShardWriter(writer, rank=rank, world_size=world, algorithm=algorithm,
                                   on_written=entries.update)
        planner = DefaultSavePlanner(flatten_state_dict=False, flatten_sharded_tensors=False)
        try:
            with warnings.catch_warnings():
                warnings.filterwarnings("ignore", message=".*assuming the intent is to save in a single process")
                dcp.save(snap.tensors, storage_writer=shard_writer, planner=planner,
                         process_group=ranks.group if ranks is not None else None, no_dist=ranks is None)
        except (Exception, CheckpointException) as error:
            failures = dcp_failures(error)
            if failures:  # DCP gathered every rank's error: each rank raises the same one
                rank_failed, first = min(failures.items())
                if isinstance(first, CheckpointError) and len(failures) == 1 and ranks is None:
                    raise first from None
                raise CheckpointWriteError(
                    f"step {snap.step} was not saved: rank(s) {sorted(failures)} failed while writing their shards; "
                    f"rank {rank_failed}: {type(first).__name__}: {first}") from first
            if ranks is None or isinstance(error, CheckpointError):
                raise
            ranks.publish(f"{prefix}/files/{rank}", {"failed": f"{type(error).__name__}: {error}"[:2000]})
            raise _lost_or_failed(ranks, prefix, snap.step, error) from error
        with _hash_pool() as pool:
            for name, chunks in snap.local_files.items():
                entries[name] = write_hashed(writer, name, chunks, algorithm, pool)
        vote = {"files": {n: [e.size_bytes, e.hash] for n, e in entries.items()},
                "trees": hash_bytes(encode_json(snap.trees), "sha256"), "local": snap.local_digests}
        if ranks is None:
            votes = {0: vote}
        else:
            ranks.publish(f"{prefix}/files/{rank}", vote)
        if rank != 0:
            assert ranks is not None
            # rank 0 waits up to the timeout for the last vote, then commits: wait for it twice as long
            outcome = ranks.wait_one(f"{prefix}/outcome", f"commit step {snap.step}",
                                     deadline() + ranks.timeout_s + 30.0)
            ranks.publish(f"{prefix}/ack/{rank}", {})  # rank 0 may exit once every rank read the outcome
            if "error" in outcome:
                message = f"step {snap.step} was not saved: rank 0 reports: {outcome['error']}"
                if outcome.get("missing"):
                    raise RankLostError(message, outcome["missing"])
                raise CheckpointWriteError(message)
            return
        try:
            if ranks is not None:
                votes = ranks.gather(f"{prefix}/files", f"finish writing step {snap.step}", deadline())
            _commit(writer, snap, votes, world, algorithm, before_commit)
        except BaseException as error:
            if ranks is not None:
                missing = getattr(error, "missing_ranks", [])
                ranks.publish(f"{prefix}/outcome", {"error": str(error)[:4000], "missing": missing})
                ranks.await_acks(f"{prefix}/ack", skip={0, *missing})
            raise
        if ranks is not None:
            ranks.publish(f"{prefix}/outcome", {"committed": snap.step})
        after_commit()
        if ranks is not None:
            ranks.await_acks(f"{prefix}/ack", skip={0})
    except BaseException:
        if rank == 0:
            writer.abort()
        raise


def _hash_pool() -> Any:
    from concurrent.futures import ThreadPoolExecutor

    return ThreadPoolExecutor(max_workers=1, thread_name_prefix="torchckpt-hash")


def _lost_or_failed(ranks: RankGroup, prefix: str, step: int, error: BaseException) -> CheckpointError:
    """After a collective failed: name the ranks that did not report in time, or the rank that failed."""
    grace = time.monotonic() + min(ranks.timeout_s, 10.0)
    try:
        ranks.gather(f"{prefix}/files", f"finish writing step {step}", grace)
    except RankLostError as lost:
        return RankLostError(f"step {step} was not saved: {lost} (the exchange of shards failed on rank "
                             f"{ranks.rank}: {str(error).splitlines()[0][:300]})", lost.missing_ranks)
    return CheckpointWriteError(f"step {step} was not saved: a rank failed while writing its shards: {error}")


def _commit(writer: StepWriter, snap: ShardedSnapshot, votes: Mapping[int, Mapping[str, Any]], world: int,
            algorithm: str, before_commit: Callable[[], None]) -> None:
    failed = {rank: vote["failed"] for rank, vote in votes.items() if "failed" in vote}
    if failed:
        raise CheckpointWriteError(f"step {snap.step} was not saved: rank(s) failed: {failed}")
    tree_hashes = {vote["trees"] for vote in votes.values()}
    if len(tree_hashes) != 1:
        raise CheckpointWriteError(
            f"step {snap.step} was not saved: the non-tensor state of the models/optimizers (e.g. param_groups) "
            "differs between ranks. Fix: every rank must build the same optimizer with the same hyperparameters.")
    same = {name: len({vote["local"].get(name) for vote in votes.values()}) == 1 for name in snap.local_digests}
    files: dict[str, FileEntry] = {}
    for vote in votes.values():
        files.update({name: FileEntry(size_bytes=size, hash=digest) for name, (size, digest) in vote["files"].items()})
    state = {"step": snap.step, "metrics": dict(snap.metrics), "world_size": world,
             "sharded_items": {name: {"kind": snap.kinds[name], "model": snap.pairs.get(name), "tree": tree}
                               for name, tree in snap.trees.items()},
             "local_items": {name: {"same_on_every_rank": same[name], "data_position": name in snap.data_position}
                             for name in snap.local_digests}}
    files[STATE_NAME] = write_hashed_bytes(writer, STATE_NAME, encode_json(state), algorithm)
    manifest = Manifest(step=snap.step, created_unix_s=time.time(), hash_algorithm=algorithm, files=files,
                        metrics=snap.metrics, world_size=world)
    before_commit()
    writer.commit(encode_manifest(manifest))


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
        """One small file of the step, whole, checked against the manifest's size and hash."""
        expected = self.manifest.files.get(name)
        path = self.storage.path_of(self.entry, name)
        if expected is None:
            raise CheckpointCorruptError(f"{path}: missing from the manifest", {path: "missing from the manifest"})
        data = self.storage.read_range(self.entry, name, 0, expected.size_bytes + 1)
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
        _, live_tensors = split_tensors(_live_state(name, items[name], items, pairs), name, sharded=True)
        targets.update({f"{name}.{key}": torch.empty_like(t) for key, t in live_tensors.items()})
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

    def read_range(name: str, offset: int, length: int) -> bytes:
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


def dcp_failures(error: BaseException) -> dict[int, BaseException]:
    """Each rank's exception in DCP's ``CheckpointException`` (a ``BaseException``), else {}.

    Example:
        >>> dcp_failures(ValueError("x"))
        {}
    """
    if not isinstance(error, CheckpointException):
        return {}
    return {rank: pair[0] if isinstance(pair, tuple) else pair for rank, pair in error.failures.items()}


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

