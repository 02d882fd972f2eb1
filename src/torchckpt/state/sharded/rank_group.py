"""The ranks of a sharded save or restore: a gloo group and the process group's store, every wait bounded.

Rules kept here (named in ``docs/design.md``):

1. **[no rank waits forever]** Every wait of a sharded save or restore (the store's keys, DCP's collectives
   on a gloo group of ours) ends after ``rank_timeout_s``. A rank that died or hung is named: the survivors
   raise :class:`RankLostError` with the ranks that did not take their part, and no step is committed.
   The next writer deletes the temp directory at start-up.
"""

from __future__ import annotations

import datetime
import json
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.api import CheckpointException

from torchckpt.state.errors import CheckpointWriteError


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
    _control: Any = None
    _store: Any = None
    _session: str | None = None
    _count: int = 0

    @classmethod
    def current(cls, timeout_s: float) -> RankGroup | None:
        """The ranks of the initialised default process group (its groups built: a collective, so every rank
        calls it), or None without one."""
        if not (dist.is_available() and dist.is_initialized()):
            return None
        ranks = cls(rank=dist.get_rank(), world_size=dist.get_world_size(), timeout_s=timeout_s)
        ranks._connect()
        return ranks

    def _connect(self) -> None:
        """Two gloo groups (DCP's collectives, which an async save runs in its thread; and the agreements the
        caller's thread makes meanwhile), the store, a session id and rank 0's timeout for every rank."""
        timeout = datetime.timedelta(seconds=self.timeout_s)
        try:
            self._group = dist.new_group(backend="gloo", timeout=timeout)
            self._control = dist.new_group(backend="gloo", timeout=timeout)
        except RuntimeError as error:  # a store timeout: not every rank built a Checkpointer
            raise RankLostError(
                f"rank {self.rank}: building the Checkpointer's process groups failed ({str(error)[:300]}): with a "
                "process group initialised, every rank must build the Checkpointer (and call save and restore "
                "alike) to write sharded checkpoints. Fix: build it on every rank, or pass sharded=False to save "
                "whole tensors from one rank.", []) from error
        self._store = dist.distributed_c10d._get_default_store()
        token = torch.zeros(64, dtype=torch.uint8)
        if self.rank == 0:
            text = f"{uuid.uuid4().hex}|{self.timeout_s!r}".encode().ljust(64)
            token.copy_(torch.frombuffer(bytearray(text), dtype=torch.uint8))
        self._collective("agree on a session id", lambda: dist.broadcast(token, src=0, group=self._control))
        session, timeout_text = bytes(token.tolist()).decode().strip().split("|")
        self._session, self.timeout_s = session, float(timeout_text)  # rank 0's timeout: every rank waits alike

    @property
    def group(self) -> Any:
        """The gloo group of DCP's collectives; they time out after ``timeout_s`` ([no rank waits forever])."""
        return self._group

    def next_prefix(self, what: str) -> str:
        """Store key prefix of the next sharded operation (every rank counts the same operations)."""
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
        return self.agree_all([code], what)[0]

    def agree_all(self, codes: list[int], what: str) -> list[int]:
        """Element-wise the largest of ``codes`` over every rank (one collective with the timeout)."""
        value = torch.tensor(codes, dtype=torch.int64)
        self._collective(what, lambda: dist.all_reduce(value, op=dist.ReduceOp.MAX, group=self._control))
        return [int(v) for v in value.tolist()]

    def publish(self, key: str, value: dict[str, Any]) -> None:
        """Set ``key`` on the store to ``value`` as JSON."""
        try:
            self._store.set(key, json.dumps(value))
        except RuntimeError as error:  # the store lived in a process that is gone (rank 0 with mp.spawn)
            raise _store_gone(self.rank, 0, error) from error

    def gather(self, prefix: str, what: str, deadline: float) -> dict[int, dict[str, Any]]:
        """Every rank's value under ``prefix/R``, or :class:`RankLostError` naming the ranks missing at
        ``deadline`` ([no rank waits forever])."""
        keys = {rank: f"{prefix}/{rank}" for rank in range(self.world_size)}
        if not self._wait(list(keys.values()), deadline, owner=0):
            missing = [rank for rank, key in keys.items() if not self._check(key, 0)]
            raise RankLostError(
                f"rank(s) {missing} did not {what} within {self.timeout_s:g} s (dead or stuck); no step was "
                f"committed. Fix: see those ranks' logs; the job resumes from the last committed step. "
                f"(The wait is Checkpointer(rank_timeout_s=...).)", missing)
        return {rank: json.loads(self._store.get(key)) for rank, key in keys.items()}

    def await_acks(self, prefix: str, skip: set[int]) -> None:
        """Rank 0: wait (briefly) until the other ranks read the outcome, so that a process that holds the
        store (rank 0 under ``mp.spawn``) does not exit before they do."""
        keys = [f"{prefix}/{rank}" for rank in range(self.world_size) if rank not in skip]
        try:
            self._wait(keys, time.monotonic() + min(self.timeout_s, 30.0), owner=0)
        except RankLostError:
            pass  # best effort: a rank that died after voting cannot acknowledge

    def wait_one(self, key: str, what: str, deadline: float, owner: int = 0) -> dict[str, Any]:
        """The value of ``key`` (set by rank ``owner``), or :class:`RankLostError` at ``deadline``."""
        if not self._wait([key], deadline, owner):
            raise RankLostError(
                f"rank {owner} did not {what} within {self.timeout_s:g} s (dead or stuck); rank {self.rank} "
                f"gives up. Fix: see rank {owner}'s log; the job resumes from the last committed step.", [owner])
        return json.loads(self._store.get(key))

    def _wait(self, keys: list[str], deadline: float, owner: int) -> bool:
        """Block until every key is set (the store wakes the waiter at once): True, or False at ``deadline``."""
        if not keys:
            return True
        remaining = max(deadline - time.monotonic(), 0.001)
        try:
            self._store.wait(keys, datetime.timedelta(seconds=remaining))
            return True
        except RuntimeError:  # a timeout, or a store that is gone (then _check raises): tell them apart
            return all(self._check(key, owner) for key in keys)

    def _check(self, key: str, owner: int) -> bool:
        try:
            return bool(self._store.check([key]))
        except RuntimeError as error:  # the store lived in a process that is gone (rank 0 with mp.spawn)
            raise _store_gone(self.rank, owner, error) from error


def _store_gone(rank: int, owner: int, error: BaseException) -> RankLostError:
    return RankLostError(
        f"rank {rank}: the process group's store is unreachable ({str(error).splitlines()[0][:300]}); rank {owner} "
        "(or the launcher that held the store) is gone. The save or restore did not complete on this rank; a "
        "restart restores the newest committed step.", [owner])


def dcp_failures(error: BaseException) -> dict[int, BaseException]:
    """Each rank's exception in DCP's ``CheckpointException`` (a ``BaseException``), else {}.

    Example:
        >>> dcp_failures(ValueError("x"))
        {}
    """
    if not isinstance(error, CheckpointException):
        return {}
    return {rank: pair[0] if isinstance(pair, tuple) else pair for rank, pair in error.failures.items()}
