"""Sharded checkpoints, the save: every rank writes its part in parallel; a vote commits the step.

A Checkpointer built while a process group is initialised (or with ``sharded=True``) saves through here
(restore.py reads on any world size). Models and optimizers (items.py) go through
``torch.distributed.checkpoint.state_dict`` (``get_model_state_dict``, ``get_optimizer_state_dict``: keys are
parameter names, the same under DDP, FSDP2 or none) and DCP's planners, with shard_storage.py's pickle-free
storage layer. Every other item (scheduler, data loader, plain dicts) and the RNG streams are this rank's
own: each rank writes them to ``rank-R-of-W.*`` files.

Rules kept here (named in ``docs/design.md``; the design notes they keep in parentheses):

1. **[a sharded step commits by vote]** (Note: [no manifest, no checkpoint]) Rank 0 opens the temp
   directory and publishes its name on the process group's store; every rank writes and fsyncs its files
   there, then publishes their sizes and hashes (its vote). Rank 0 waits for every vote (rank_group.py's
   [no rank waits forever]), writes ``state.json`` and the manifest listing every rank's files, and commits
   (rename, or the manifest as commit mark on fsspec); then retention; then it publishes the outcome, which
   every other rank waits for, and waits until they read it. A step is committed only if every rank voted.
"""

from __future__ import annotations

import time
import warnings
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, TypeVar

import torch
from torch.distributed.checkpoint.api import CheckpointException

from torchckpt._host import local_part
from torchckpt.state.errors import CheckpointError, CheckpointWriteError
from torchckpt.state.format.codec import encode_json, split_tensors
from torchckpt.state.format.hashing import hash_bytes
from torchckpt.state.format.layout import STATE_NAME
from torchckpt.state.format.manifest import TAGGED_FORMAT_VERSION, FileEntry, Manifest, encode_manifest
from torchckpt.state.format.snapshot import encode_snapshot
from torchckpt.state.format.tensor_kinds import needs_format_3
from torchckpt.state.live.capture import capture_item, check_item_name
from torchckpt.state.live.staging import HostStaging
from torchckpt.state.sharded.items import is_data_position, is_sharded_item, live_state, pair_optimizers
from torchckpt.state.sharded.rank_group import RankGroup, RankLostError, dcp_failures, rank_prefix
from torchckpt.state.sharded.shard_storage import ShardWriter, write_hashed_bytes
from torchckpt.state.storage.base import StepWriter, Storage
from torchckpt.state.storage.hashed_write import write_files_hashed

_T = TypeVar("_T")


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
                     ranks: RankGroup | None, staging: HostStaging | None) -> ShardedSnapshot:
    """Capture this rank's part of a sharded save; with ``staging`` every tensor is copied first (async).

    Example:
        >>> snap = snapshot_sharded(1, {"model": torch.nn.Linear(2, 1), "extras": {"epoch": 1}}, {}, None, None, None)
        >>> sorted(snap.tensors), sorted(snap.local_files)
        (['model.bias', 'model.weight'], ['rank-00000-of-00001.state.json'])
    """
    pairs = pair_optimizers(items)
    tensors: dict[str, torch.Tensor] = {}
    trees, kinds, local = {}, {}, {}
    for name, obj in items.items():
        check_item_name(name)
        if is_sharded_item(obj):
            tree, item_tensors = split_tensors(live_state(name, obj, items, pairs), name, sharded=True)
            trees[name] = tree
            kinds[name] = "optimizer" if name in pairs else "module"
            tensors.update({f"{name}.{key}": tensor for key, tensor in item_tensors.items()})
        else:
            local[name] = capture_item(name, obj)
    digests = {name: _digest(*split_tensors(state, name)) for name, (_, state) in local.items()}
    if staging is not None:
        tensors = _staged(tensors, staging)
    # an async save copies the rank-local tensors too (small: schedulers and loaders hold none), in a buffer
    # of their own that lives as long as these files
    files = encode_snapshot(step=step, items=local, rng=rng, metrics=metrics,
                            staging=HostStaging() if staging is not None else None)
    prefix = rank_prefix(ranks.rank, ranks.world_size) if ranks is not None else rank_prefix(0, 1)
    return ShardedSnapshot(step=step, tensors=tensors, trees=trees, kinds=kinds, pairs=pairs,
                           local_files={prefix + n: list(chunks) for n, chunks in files.items()},
                           local_digests=digests, metrics=metrics,
                           data_position=[n for n in local if is_data_position(items[n])])


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


def start_together(ranks: RankGroup | None, step: object, prepare: Callable[[], _T]) -> _T:
    """Run this rank's checks and snapshot of ``step`` (``prepare``); with several ranks, every rank then
    learns whether any rank failed or passed another step, and all raise together, so that no rank waits
    for a save the others never start.

    Example:
        >>> start_together(None, 3, lambda: "prepared")
        'prepared'
    """
    if ranks is None or ranks.world_size == 1:
        return prepare()
    number = step if type(step) is int else -1
    prefix = ranks.next_prefix(f"start-{number}")
    try:
        result, problem = prepare(), None
    except BaseException as error:  # reported to the others first, then raised
        result, problem = None, error
        ranks.publish(f"{prefix}/error/{ranks.rank}", {"error": f"{type(error).__name__}: {error}"[:2000]})
    flags = [0] * ranks.world_size
    flags[ranks.rank] = int(problem is not None)
    *flags, highest, lowest = ranks.agree_all([*flags, number, -number], f"agree on step {step}")
    if problem is not None:
        raise problem
    if highest != -lowest:
        raise CheckpointError(f"the ranks passed different steps to save (from {-lowest} to {highest}); every "
                              "rank must save the same step. Nothing was saved.")
    failed = [rank for rank, flag in enumerate(flags) if flag]
    if failed:  # each failing rank's own error, published before the vote
        deadline = time.monotonic() + ranks.timeout_s
        said = "; ".join(f"rank {rank}: {ranks.wait_one(f'{prefix}/error/{rank}', 'say why', deadline, rank)['error']}"
                         for rank in failed)
        raise CheckpointWriteError(f"step {step} was not saved: {'a rank' if len(failed) == 1 else 'ranks'} could "
                                   f"not start it ({said}); nothing was written.")
    return result  # type: ignore[return-value]


# ----- writing -------------------------------------------------------------------------------------


def write_sharded(storage: Storage, ranks: RankGroup | None, snap: ShardedSnapshot, algorithm: str,
                  before_commit: Callable[[], object], after_commit: Callable[[], None]) -> None:
    """Write and commit one sharded step ([a sharded step commits by vote]); ``ranks`` None: one process.

    A failure on one rank reaches every rank: DCP's own errors are raised on all of them; a lost rank is
    named by all (:class:`RankLostError`); any other failure is a "failed" vote, and rank 0's outcome
    carries it to the others. Rank 0 removes the temp directory of a step that was not committed."""
    rank = ranks.rank if ranks is not None else 0
    prefix = ranks.next_prefix(f"save-{snap.step}") if ranks is not None else ""
    try:
        writer = _open_step(storage, ranks, prefix, snap.step)
    except BaseException as error:  # a rank that cannot join votes so: rank 0 need not wait for the timeout
        if ranks is not None and rank != 0 and not isinstance(error, RankLostError):
            _vote_failed(ranks, prefix, error)
            ranks.publish(f"{prefix}/ack/{rank}", {})
        raise
    try:
        try:
            vote = _write_part(writer, ranks, prefix, snap, algorithm)
        except _ReachedEveryRank:
            raise
        except BaseException as error:  # this rank alone failed: vote so, so nobody waits for the timeout
            if ranks is not None:
                _vote_failed(ranks, prefix, error)
                if rank == 0:
                    _publish_failure(ranks, prefix, error)
                else:
                    ranks.publish(f"{prefix}/ack/{rank}", {})  # it will not wait for rank 0's outcome
            raise
        if rank != 0:
            assert ranks is not None
            _await_outcome(ranks, prefix, snap.step)
            return
        try:
            votes = {0: vote} if ranks is None else ranks.gather(
                f"{prefix}/files", f"finish writing step {snap.step}", time.monotonic() + ranks.timeout_s)
            _commit(writer, snap, votes, ranks.world_size if ranks is not None else 1, algorithm, before_commit)
        except BaseException as error:
            if ranks is not None:
                _publish_failure(ranks, prefix, error)
            raise
    except BaseException as error:
        if rank == 0:
            writer.abort()
        if isinstance(error, _ReachedEveryRank):
            raise error.error from error.__cause__
        raise
    if ranks is not None:
        ranks.publish(f"{prefix}/outcome", {"committed": snap.step})
        ranks.await_acks(f"{prefix}/ack", skip={0})
    after_commit()  # retention, once the other ranks have gone back to training


class _ReachedEveryRank(Exception):
    """Carries an error every rank raises by itself (DCP gathered it, or every survivor named a lost rank)."""

    def __init__(self, error: CheckpointError) -> None:
        super().__init__(str(error))
        self.error = error


def _open_step(storage: Storage, ranks: RankGroup | None, prefix: str, step: int) -> StepWriter:
    """Rank 0 opens the temp directory and publishes it (or its failure); the others join it."""
    if ranks is None or ranks.rank == 0:
        try:
            writer = storage.begin_step(step)
        except BaseException as error:
            if ranks is not None:
                ranks.publish(f"{prefix}/temp", {"error": f"{type(error).__name__}: {error}"[:2000]})
            raise
        if ranks is not None:
            ranks.publish(f"{prefix}/temp", {"entry": writer.entry})
        return writer
    started = ranks.wait_one(f"{prefix}/temp", f"start step {step}", time.monotonic() + ranks.timeout_s)
    if "error" in started:
        raise CheckpointWriteError(f"step {step} was not saved: rank 0 could not start it: {started['error']}")
    return storage.join_step(step, started["entry"])


def _write_part(writer: StepWriter, ranks: RankGroup | None, prefix: str, snap: ShardedSnapshot,
                algorithm: str) -> dict[str, Any]:
    """This rank's shards (through DCP) and rank-local files, fsynced; returns its vote (published)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import DefaultSavePlanner

    rank, world = (ranks.rank, ranks.world_size) if ranks is not None else (0, 1)
    entries: dict[str, FileEntry] = {}
    shard_writer = ShardWriter(writer, rank=rank, world_size=world, algorithm=algorithm, on_written=entries.update)
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
            if isinstance(first, CheckpointError) and ranks is None:
                raise first from None
            raise _ReachedEveryRank(CheckpointWriteError(
                f"step {snap.step} was not saved: rank(s) {sorted(failures)} failed while writing their shards; "
                f"rank {rank_failed}: {type(first).__name__}: {first}")) from first
        if ranks is None or isinstance(error, CheckpointError):
            raise
        _vote_failed(ranks, prefix, error)
        raise _ReachedEveryRank(_lost_or_failed(ranks, prefix, snap.step, error)) from error
    entries.update(write_files_hashed(writer, snap.local_files, algorithm))
    # "format_3": this rank's files need format 3 (tensor_kinds.py's [sparse tensors are stored as their parts])
    vote = {"files": {n: [e.size_bytes, e.hash] for n, e in entries.items()},
            "trees": hash_bytes(encode_json(snap.trees), "sha256"), "local": snap.local_digests,
            "format_3": needs_format_3(snap.local_files)}
    if ranks is not None:
        ranks.publish(f"{prefix}/files/{rank}", vote)
    return vote


def _vote_failed(ranks: RankGroup, prefix: str, error: BaseException) -> None:
    """This rank's vote that it failed (with why), so that rank 0 need not wait for the timeout."""
    ranks.publish(f"{prefix}/files/{ranks.rank}", {"failed": f"{type(error).__name__}: {error}"[:2000]})


def _publish_failure(ranks: RankGroup, prefix: str, error: BaseException) -> None:
    """Rank 0: tell the others the step failed (naming lost ranks), and wait until they read it."""
    missing = getattr(error, "missing_ranks", [])
    ranks.publish(f"{prefix}/outcome", {"error": f"{error}"[:4000], "missing": missing})
    ranks.await_acks(f"{prefix}/ack", skip={0, *missing})


def _await_outcome(ranks: RankGroup, prefix: str, step: int) -> None:
    """A rank other than 0: wait for rank 0's outcome (rank 0 waits up to the timeout for the last vote, so
    twice as long), acknowledge it, and raise rank 0's error if the step failed."""
    outcome = ranks.wait_one(f"{prefix}/outcome", f"commit step {step}",
                             time.monotonic() + 2 * ranks.timeout_s + 30.0)
    ranks.publish(f"{prefix}/ack/{ranks.rank}", {})
    if "error" in outcome:
        message = f"step {step} was not saved: rank 0 reports: {outcome['error']}"
        if outcome.get("missing"):
            raise RankLostError(message, outcome["missing"])
        raise CheckpointWriteError(message)


def _lost_or_failed(ranks: RankGroup, prefix: str, step: int, error: BaseException) -> CheckpointError:
    """After a collective failed: name the ranks that did not report in time, or the rank that failed. Rank 0
    returns only once the other survivors named them too (the store may live in rank 0's process)."""
    grace = time.monotonic() + min(ranks.timeout_s, 10.0)
    missing: list[int] = []
    try:
        votes = ranks.gather(f"{prefix}/files", f"finish writing step {step}", grace)
        failed = {rank: vote["failed"] for rank, vote in votes.items() if "failed" in vote and rank != ranks.rank}
        reason = (f"rank(s) {sorted(failed)} failed: {failed[min(failed)]}" if failed else
                  f"a rank failed while writing its shards: {str(error).splitlines()[0][:300]}")
        result: CheckpointError = CheckpointWriteError(f"step {step} was not saved: {reason}")
    except RankLostError as lost:
        missing = lost.missing_ranks
        result = RankLostError(f"step {step} was not saved: {lost} (the exchange of shards failed on rank "
                               f"{ranks.rank}: {str(error).splitlines()[0][:300]})", missing)
    if ranks.rank == 0:
        ranks.await_acks(f"{prefix}/failed-ack", skip={0, *missing})
    elif 0 not in missing:
        ranks.publish(f"{prefix}/failed-ack/{ranks.rank}", {})
    return result


def _commit(writer: StepWriter, snap: ShardedSnapshot, votes: Mapping[int, Mapping[str, Any]], world: int,
            algorithm: str, before_commit: Callable[[], object]) -> None:
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
    state_json = encode_json(state)
    files[STATE_NAME] = write_hashed_bytes(writer, STATE_NAME, state_json, algorithm)
    tagged = needs_format_3({STATE_NAME: [state_json]}) or any(vote.get("format_3") for vote in votes.values())
    version = TAGGED_FORMAT_VERSION if tagged else None
    manifest = Manifest(step=snap.step, created_unix_s=time.time(), hash_algorithm=algorithm, files=files,
                        metrics=snap.metrics, world_size=world, format_version=version)
    before_commit()
    writer.commit(encode_manifest(manifest))
