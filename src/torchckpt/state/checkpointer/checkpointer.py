"""Checkpointer: save, restore, retention, async writes, save policies and preemption.

Rules kept here (named in ``docs/design.md``; the design notes they keep in parentheses):

1. **[restore takes the newest valid step]** (Note: [no manifest, no checkpoint])
   Restore reads only steps whose manifest validates; it takes the newest such
   step, reports every corrupt newer one, and falls back unless
   ``fallback=False``. If steps exist but none is valid it raises: starting from
   scratch silently would lose the run.
2. **[retention runs after a commit]** (Note: [retention spares the newest and the unfinished])
   Retention runs after a commit, on valid committed steps only, and always keeps
   the newest one. Temp directories of a save in flight are invisible to it.
3. **[one save in flight]** At most one save is in flight. ``save`` first waits
   for the previous one and re-raises its error; ``close``, ``restore`` and
   ``wait`` do the same.
4. **[async saves copy before returning]** An async ``save`` copies tensors to
   host memory (a reused staging buffer) before it returns, so training may mutate
   them while the background thread hashes and writes. A sync ``save`` writes CPU
   tensors from their own memory. With ``async_staging=True`` the parameters and
   optimizer state are copied by the background thread instead, and every
   optimizer step (a global pre-hook) waits until that copy is done (live/staging.py's
   [optimizer steps wait for staging]).
5. **[committed steps are immutable]** Saving a step that holds a valid (fully
   hashed) checkpoint is an error; one that fails verification is moved aside to
   ``.corrupt-*`` and written again. Steps newer than a saved N are abandoned (branches.py).
6. **[one writer per directory]** One writer per directory: the lock is taken when
   the Checkpointer is built and leftovers of interrupted saves are cleaned only
   then.
7. **[hash while writing]** Each file is hashed while it is written: piece k is
   handed to a hashing thread just before it is written (hashlib, zlib and xxhash
   release the GIL), so a save costs about max(hash, write), never their sum, and
   no byte is read twice from a joined copy.
8. **[ranks decide together]** With a process group of several ranks (sharded/), every rank calls
   ``save``/``restore`` with the same arguments; rank 0 alone holds the lock and cleans leftovers. A
   decision one rank could make alone (a preemption signal, ``save_every_seconds``) is agreed at every
   ``maybe_save`` (an all-reduce), so all ranks save the same step.
"""

from __future__ import annotations

import os
import sys
import threading
import time
from collections.abc import Callable, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from torch.optim.optimizer import register_optimizer_step_pre_hook

from torchckpt.state.checkpointer.branches import abandon_newer_steps
from torchckpt.state.checkpointer.config import CheckpointerConfig, check_metric_name, check_step
from torchckpt.state.checkpointer.retention import apply_retention
from torchckpt.state.checkpointer.unsharded import snapshot_unsharded, write_unsharded
from torchckpt.state.errors import CheckpointError
from torchckpt.state.format.layout import step_dir_name
from torchckpt.state.format.manifest import metric_value
from torchckpt.state.format.snapshot import FileChunks
from torchckpt.state.live.capture import capture_rng, check_item_name
from torchckpt.state.live.staging import HostStaging
from torchckpt.state.process.lifecycle import releaser, track
from torchckpt.state.process.preempt_points import on_request_for
from torchckpt.state.process.preemption import PreemptionHandler, parse_signals
from torchckpt.state.read.catalog import (
    CheckpointInfo,
    check_step_free,
    inspect_step,
    refuse_newer_format,
    valid_committed,
)
from torchckpt.state.read.load import apply_snapshot
from torchckpt.state.read.newest import newest_is_sharded, read_newest_valid
from torchckpt.state.read.step import VerifyMode, check_verify_mode
from torchckpt.state.sharded.rank_group import RankGroup
from torchckpt.state.sharded.restore import restore_newest_sharded
from torchckpt.state.sharded.save import snapshot_sharded, start_together, write_sharded
from torchckpt.state.storage.backends import open_storage, resolved_location


class Checkpointer:
    """Saves and restores training state in one directory (local path or fsspec URL).

    Example:
        >>> import tempfile, torch
        >>> model, tmp = torch.nn.Linear(2, 2), tempfile.TemporaryDirectory()
        >>> with Checkpointer(tmp.name, keep_last=2) as ckpt:
        ...     ckpt.restore(model=model) is None
        ...     ckpt.save(1, model=model, metrics={"loss": 0.5})
        ...     [info.step for info in ckpt.list()]
        True
        [1]
        >>> tmp.cleanup()
    """

    def __init__(self, directory: str | os.PathLike[str], config: CheckpointerConfig | None = None,
                 *, read_only: bool = False, **options: Any) -> None:
        if config is not None and options:
            raise TypeError(f"pass either config= or keyword options, not both (got {sorted(options)})")
        self.config = config if config is not None else CheckpointerConfig(**options)
        self._ranks = RankGroup.current(self.config.rank_timeout_s) if self.config.sharded is not False else None
        self._sharded = self._ranks is not None if self.config.sharded is None else self.config.sharded
        # A sharded save asks every rank whether its step exists: "fast" gives each the same answer cheaply.
        self._verify_for_existing: VerifyMode = "fast" if self._sharded else "full"
        if self._sharded and self.config.async_staging:
            raise ValueError("async_staging=True is not supported for sharded checkpoints (with a process group, "
                             "or sharded=True); async_save=True alone copies this rank's shard before save() returns")
        self._given, self._storage = os.fspath(directory), open_storage(resolved_location(directory))  # chdir-proof
        self._executor: ThreadPoolExecutor | None = None
        self._staging = HostStaging()  # used by async saves only ([async saves copy before returning])
        self._inflight: Future[None] | None = None
        self._staged: threading.Event | None = None  # set once background staging is done (live/staging.py)
        self._step_guard: Any = None  # the optimizer-step pre-hook handle while staging may be pending
        self.optimizer_wait_s = 0.0  # time optimizer steps spent waiting for background staging
        self._last_step: int | None = None
        # (step, metrics, items, RNG streams) of the last complete step (save_resume_point_and_exit)
        self._resume_point: tuple[int, Any, Mapping[str, Any], dict[str, Any] | None] | None = None
        self._closed = False
        self.read_only = read_only  # no lock, no cleaning, no save: restore/list only (read/newest.py's rules)
        if read_only:
            self._preemption = None
            self._last_save_monotonic_s = time.monotonic()
            self._finalizer = track(self, releaser(self._storage, None))
            return
        refuse_newer_format(self._storage)  # before the lock and cleaning: a newer run's directory stays as it is
        leader = self._ranks is None or self._ranks.rank == 0
        if leader:
            self._storage.acquire_lock()  # [one writer per directory]; in a sharded run rank 0 holds it for all
        try:
            if leader:
                self._storage.clean_leftovers()
            signals, wanted = parse_signals(self.config.preemption_signals), self.config.save_on_preemption
            self._preemption = PreemptionHandler(signals, on_request_for(self)) if wanted else None
        except BaseException:
            self._storage.release_lock()
            raise
        self._last_save_monotonic_s = time.monotonic()
        self._finalizer = track(self, releaser(self._storage, self._preemption))  # process/lifecycle.py

    @property
    def directory(self) -> str:
        """The checkpoint directory as given (path or URL); a relative path was resolved when this was built."""
        return self._given

    @property
    def preemption_requested(self) -> bool:
        """True once a preemption signal arrived (with ``save_on_preemption=True``)."""
        return self._preemption is not None and self._preemption.requested is not None

    def __enter__(self) -> Checkpointer:  # noqa: PYI034 (typing.Self needs Python 3.11; we support 3.10)
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def save(self, step: int, *, metrics: Mapping[str, object] | None = None, **items: Any) -> None:
        """Save ``items`` (objects with state_dict, or plain dicts) and RNG streams as ``step``.

        With ``async_save=True`` this returns once tensors are copied to host memory;
        the write finishes in the background and its error surfaces on the next call.

        Example:
            >>> import tempfile, torch
            >>> tmp = tempfile.TemporaryDirectory(); ckpt = Checkpointer(tmp.name)
            >>> ckpt.save(10, model=torch.nn.Linear(2, 2), extras={"epoch": 1}); ckpt.close(); tmp.cleanup()
        """
        self._check_open()
        if self.read_only:
            raise CheckpointError(f"this Checkpointer for {self.directory} is read-only (read_only=True): it "
                                  "cannot save. Fix: build it without read_only (that takes the writer's lock).")
        if self.preemption_requested:  # a pending SIGTERM is honoured here too, as in maybe_save
            self._save_and_exit(step, metrics, items)
        self._save(step, metrics, items)

    def _save(self, step: int, metrics: Mapping[str, object] | None, items: Mapping[str, Any],
              rng: dict[str, Any] | None = None) -> None:
        """Save ``step``; ``rng`` (the resume point's streams: save_resume_point_and_exit) replaces capturing them."""
        def prepare() -> tuple[Callable[[], None], Any, dict[str, float]]:
            self.wait()  # [one save in flight]
            check_step(step)
            streams = capture_rng() if rng is None and self.config.capture_rng else rng
            self._resume_point = (step, metrics, items, streams)  # this step is complete (a resume point)
            check_step_free(self._storage, step, self._verify_for_existing)
            checked = {check_metric_name(name): metric_value(name, value) for name, value in (metrics or {}).items()}
            staging = self._staging if self.config.async_save else None  # [async saves copy before returning]
            if self._sharded:
                snap, store, retention = snapshot_sharded(step, items, checked, streams, self._ranks, staging), \
                    self._storage, self.config.retention
                return (lambda: write_sharded(store, self._ranks, snap, self.config.hash_algorithm,
                                              before_commit=lambda: abandon_newer_steps(store, step),
                                              after_commit=lambda: apply_retention(store, retention))), None, checked
            files = snapshot_unsharded(step, items, checked, streams, staging, self.config.async_staging)
            return (lambda: self._write(step, files, checked)), files, checked

        write, files, checked_metrics = start_together(self._ranks if self._sharded else None, step, prepare)
        if self.config.async_staging and self._staging.deferred_count:
            self._staged = threading.Event()
            self._step_guard = register_optimizer_step_pre_hook(self._before_optimizer_step)
            self._inflight = self._pool().submit(self._stage_and_write, step, files, checked_metrics, self._staged)
        elif self.config.async_save:
            self._inflight = self._pool().submit(write)
        else:
            write()
        self._last_step = step
        self._last_save_monotonic_s = time.monotonic()

    def maybe_save(self, step: int, *, metrics: Mapping[str, object] | None = None, **items: Any) -> bool:
        """Save if a policy says so (every N steps / seconds); on preemption save and exit.

        Returns True when a save was started.

        Example:
            >>> import tempfile, torch
            >>> tmp = tempfile.TemporaryDirectory(); ckpt = Checkpointer(tmp.name, save_every_steps=2)
            >>> [ckpt.maybe_save(s, model=torch.nn.Linear(2, 2)) for s in (1, 2, 3)]
            [False, True, False]
            >>> ckpt.close(); tmp.cleanup()
        """
        self._check_open()
        by_time = None
        if self._ranks is not None and self._ranks.world_size > 1 and (
                self._preemption is not None or self.config.save_every_seconds is not None):
            # [ranks decide together]: a signal or a clock seen by one rank is acted on by every rank at this step
            since_s = time.monotonic() - self._last_save_monotonic_s
            preempted, by_time = self._ranks.agree_all(
                [int(self.preemption_requested), int(self.config.due_by_time(since_s))], f"agree on step {step}")
            if preempted and not self.preemption_requested:
                self._save_and_exit(step, metrics, items, signal_name="a preemption signal on another rank")
        if self.preemption_requested:
            self._save_and_exit(step, metrics, items)
        # This step is complete; its RNG streams are kept for a save while the next epoch's DataLoader
        # iterator starts (process/preempt_points.py: that iterator has drawn from torch's RNG already).
        rng = capture_rng() if self._preemption is not None and self.config.capture_rng else None
        self._resume_point = (step, metrics, items, rng)
        since_s = time.monotonic() - self._last_save_monotonic_s
        if not self.config.save_due(step, self._last_step, since_s, None if by_time is None else bool(by_time)):
            return False
        self.save(step, metrics=metrics, **items)
        return True

    def _save_and_exit(self, step: int, metrics: Mapping[str, object] | None, items: Mapping[str, Any],
                       rng: dict[str, Any] | None = None, signal_name: str | None = None) -> None:
        if signal_name is None:
            signal_name = self._preemption.requested.name  # type: ignore[union-attr]
        # Skipped only when step is already safe: saved by this Checkpointer, or a valid committed step. A
        # corrupt step-N directory, or a stray file named like one, is replaced ([committed steps are immutable]).
        if step != self._last_step and valid_committed(self._storage, step, self._verify_for_existing) is None:
            self._save(step, metrics, items, rng)
        self.close()
        print(
            f"torchckpt: {signal_name} received; saved step {step} to {self.directory}; exiting",
            file=sys.stderr,
        )
        raise SystemExit(0)

    # ----- preemption at a safe point: process/preempt_points.py's SafePointSaver ------------

    @property
    def saves_collectively(self) -> bool:
        """True when the ranks of a process group save together: then no rank saves at a safe point alone."""
        return self._ranks is not None and self._ranks.world_size > 1

    @property
    def has_resume_point(self) -> bool:
        """True once ``maybe_save``/``save`` was passed a step: the last complete one, which a preemption saves.

        Example:
            >>> import tempfile, torch
            >>> tmp = tempfile.TemporaryDirectory(); ckpt = Checkpointer(tmp.name)
            >>> before = ckpt.has_resume_point; ckpt.save(1, model=torch.nn.Linear(1, 1))
            >>> before, ckpt.has_resume_point, ckpt.saves_collectively
            (False, True, False)
            >>> ckpt.close(); tmp.cleanup()
        """
        return self._resume_point is not None

    def save_resume_point_and_exit(self, *, rng_of_resume_point: bool) -> None:
        """Save the last complete step (unless it is safe already) and exit 0: a preemption at a safe point.
        ``rng_of_resume_point`` saves the RNG streams captured with that step instead of this moment's."""
        if self._resume_point is None:
            raise CheckpointError("no step was passed to maybe_save/save yet: there is no resume point to save")
        step, metrics, items, rng = self._resume_point
        self._save_and_exit(step, metrics, items, rng if rng_of_resume_point else None)

    def _stage_and_write(
        self, step: int, files: Mapping[str, FileChunks], metrics: Mapping[str, float], staged: threading.Event
    ) -> None:
        try:
            changed = self._staging.finish()
        finally:
            staged.set()  # never leave an optimizer step waiting
        if changed:
            raise CheckpointError(
                f"step {step} was not saved: tensor(s) {changed[:5]} changed in place after save() returned and "
                "before the background copy finished, outside an optimizer step (async_staging=True lets "
                "training go on and only makes optimizer steps wait). Fix: call ckpt.wait_staged() before "
                "changing saved tensors outside optimizer.step() (an EMA update, a manual edit), or use "
                "async_staging=False, which copies them before save() returns."
            )
        self._write(step, files, metrics)

    def _before_optimizer_step(self, optimizer: object, args: object, kwargs: object) -> None:
        start = time.perf_counter()
        self.wait_staged()
        self.optimizer_wait_s += time.perf_counter() - start

    def wait_staged(self) -> None:
        """Block until the in-flight save no longer reads live tensors (``async_staging=True``).

        After this, every saved tensor may be changed in place. Optimizer steps call it
        themselves; without ``async_staging`` save() already returned after copying.

        Example:
            >>> import tempfile, torch
            >>> tmp = tempfile.TemporaryDirectory()
            >>> ckpt = Checkpointer(tmp.name, async_save=True, async_staging=True)
            >>> model = torch.nn.Linear(2, 2)
            >>> ckpt.save(1, model=model); ckpt.wait_staged()
            >>> with torch.no_grad(): _ = model.weight.zero_()  # safe now
            >>> ckpt.close(); tmp.cleanup()
        """
        if self._staged is not None:
            self._staged.wait()

    def _write(self, step: int, files: Mapping[str, FileChunks], metrics: Mapping[str, float]) -> None:
        write_unsharded(self._storage, step, files, metrics, self.config.hash_algorithm, self.config.retention,
                        self.config.remove_old_steps_when_full)

    def _pool(self) -> ThreadPoolExecutor:
        if self._executor is None:
            self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="torchckpt-save")
        return self._executor

    def wait(self) -> None:
        """Block until the in-flight save (if any) is committed; re-raise its error
        ([one save in flight]).

        Example:
            >>> import tempfile
            >>> tmp = tempfile.TemporaryDirectory(); ckpt = Checkpointer(tmp.name, async_save=True)
            >>> ckpt.wait(); ckpt.close(); tmp.cleanup()
        """
        inflight, self._inflight = self._inflight, None
        if self._step_guard is not None:
            self.wait_staged()
            self._step_guard.remove()  # here, not in the hook: the hooks' dict is iterated while they run
            self._step_guard = None
        if inflight is None:
            return
        try:
            inflight.result()
        except CheckpointError as error:
            raise type(error)(f"the background save failed: {error}", *error.args[1:]) from error

    # ----- restoring ----------------------------------------------------------------------

    def restore(
        self,
        *,
        step: int | None = None,
        verify: str | None = None,
        fallback: bool | None = None,
        rng: bool | None = None,
        **items: Any,
    ) -> int | None:
        """Load the newest valid step into ``items`` and the RNG streams; returns it, or None.

        ``step`` picks one step (no fallback); ``verify``/``fallback`` override the config.
        ``rng``: None restores RNG streams when the step has them (and ``capture_rng``
        is on), True requires them, False leaves this process's RNG streams alone.

        Example:
            >>> import tempfile, torch
            >>> tmp = tempfile.TemporaryDirectory(); ckpt = Checkpointer(tmp.name)
            >>> ckpt.restore(model=torch.nn.Linear(2, 2)) is None
            True
            >>> ckpt.close(); tmp.cleanup()
        """
        self._check_open()
        self.wait()
        verify = self.config.verify if verify is None else verify
        check_verify_mode(verify)
        for name in items:
            check_item_name(name)
        fallback = self.config.fallback if fallback is None else fallback
        rng_mode = rng if rng is not None else (None if self.config.capture_rng else False)
        if self._sharded or newest_is_sharded(self._storage, step):
            restored = restore_newest_sharded(self._storage, self._ranks, step, fallback, items, rng_mode, verify)
            if restored is not None:
                self._last_step = restored
            return restored
        snapshot = read_newest_valid(self._storage, step=step, verify=verify, fallback=fallback, wanted=set(items))
        if snapshot is None:
            return None
        apply_snapshot(snapshot, items, rng_mode, self._storage.path_of(step_dir_name(snapshot.step), "state.json"))
        self._last_step = snapshot.step
        return snapshot.step

    # ----- inspecting and closing ---------------------------------------------------------

    def list(self, verify: str = "fast") -> list[CheckpointInfo]:
        """Every step, oldest first, with size, metrics, and valid or why not.

        Example:
            >>> import tempfile
            >>> tmp = tempfile.TemporaryDirectory(); ckpt = Checkpointer(tmp.name)
            >>> ckpt.list()
            []
            >>> ckpt.close(); tmp.cleanup()
        """
        check_verify_mode(verify)
        return [inspect_step(self._storage, step, verify) for step in sorted(self._storage.step_entries())]  # type: ignore[arg-type]

    def latest_step(self) -> int | None:
        """The newest step whose manifest and file sizes validate, or None.

        Example:
            >>> import tempfile
            >>> tmp = tempfile.TemporaryDirectory(); ckpt = Checkpointer(tmp.name)
            >>> print(ckpt.latest_step())
            None
            >>> ckpt.close(); tmp.cleanup()
        """
        valid = [info.step for info in self.list("fast") if info.valid]
        return max(valid) if valid else None

    def close(self) -> None:
        """Wait for the in-flight save, release the lock and signal handlers; re-raise a save error.

        Example:
            >>> import tempfile
            >>> tmp = tempfile.TemporaryDirectory(); ckpt = Checkpointer(tmp.name)
            >>> ckpt.close(); ckpt.close(); tmp.cleanup()
        """
        if self._closed:
            return
        try:
            self.wait()
        finally:
            self._closed = True
            self._finalizer.detach()
            if self._executor is not None:
                self._executor.shutdown(wait=True)
            self._staging.release()
            if self._preemption is not None:
                self._preemption.uninstall()
            self._storage.release_lock()

    def forget_after_fork(self) -> None:
        """In a forked child: close this inherited copy without waiting or writing (process/lifecycle.py's
        [a forked child writes nothing]); the lock is dropped by process/lockfile.py."""
        self._closed, self._inflight, self._executor, self._step_guard = True, None, None, None
        self._finalizer.detach()
        if self._preemption is not None:
            self._preemption.uninstall()

    def _check_open(self) -> None:
        if self._closed:
            raise CheckpointError(f"this Checkpointer for {self.directory} is closed; build a new one")

