"""A Checkpointer's life in its process: interpreter exit, garbage collection and ``fork``.

Rules kept here (named in ``docs/design.md``; the design notes they keep in parentheses):

1. **[a save in flight finishes at exit]** (Note: [a run's own steps survive]) When the interpreter
   exits (the script ends, ``sys.exit``, an uncaught exception) every open Checkpointer is closed: its
   in-flight async save is waited for and committed, and if it fails the error is printed to stderr
   with the step and the directory, never dropped. This runs from ``threading._register_atexit``,
   i.e. before ``concurrent.futures`` refuses new work and joins its threads; a plain ``atexit``
   hook would run after that, when the write can no longer start its hashing thread.
2. **[a dropped Checkpointer lets go]** A Checkpointer that is garbage-collected without ``close()``
   releases its lock and puts the signal handlers back (``weakref.finalize``). Nothing global holds
   it strongly: the exit hook and the fork hook see it through weak references, and the signal
   handlers belong to its ``PreemptionHandler``, which never refers back to it.
3. **[a forked child writes nothing]** In a forked child (a DataLoader worker) the inherited copy
   of a Checkpointer is closed without waiting (the save thread does not exist there) and without
   touching the lock (lockfile.py closes the child's descriptor), so nothing the child does can
   write, delete or wait in the parent's directory.
"""

from __future__ import annotations

import concurrent.futures.thread  # noqa: F401 (its exit hook must be registered before ours runs after it)
import os
import sys
import threading
import weakref
from collections.abc import Callable
from typing import Any, Protocol


class Closable(Protocol):
    """What the hooks need of a Checkpointer."""

    @property
    def directory(self) -> str: ...

    def close(self) -> None: ...
    def forget_after_fork(self) -> None: ...


_LIVE: weakref.WeakSet[Any] = weakref.WeakSet()
_HOOKED = False


def _close_all_at_exit() -> None:
    for ckpt in list(_LIVE):
        try:
            ckpt.close()  # waits for the in-flight save ([a save in flight finishes at exit])
        except BaseException as error:  # noqa: BLE001 (reported, never dropped)
            print(
                f"torchckpt: error: the save in flight at exit to {ckpt.directory} failed and was not "
                f"committed: {type(error).__name__}: {error}",
                file=sys.stderr,
                flush=True,
            )


def _forget_all_in_child() -> None:
    for ckpt in list(_LIVE):
        ckpt.forget_after_fork()
    _LIVE.clear()


def _install_hooks() -> None:
    global _HOOKED
    if _HOOKED:
        return
    register: Callable[[Callable[[], None]], Any] | None = getattr(threading, "_register_atexit", None)
    try:
        if register is None:
            raise RuntimeError("threading._register_atexit is missing")
        register(_close_all_at_exit)  # runs before concurrent.futures' own exit hook (LIFO)
    except RuntimeError:  # shutdown already started, or another Python: atexit still reports errors
        import atexit

        atexit.register(_close_all_at_exit)
    if hasattr(os, "register_at_fork"):
        os.register_at_fork(after_in_child=_forget_all_in_child)
    _HOOKED = True


def track(ckpt: Closable, release: Callable[[], None]) -> weakref.finalize:
    """Watch ``ckpt`` until it is closed: close it at exit, forget it in forked children, and call
    ``release`` (which must not refer to ``ckpt``) if it is garbage-collected first.

    Returns the finalizer; ``close`` detaches it.

    Example:
        >>> class Job:
        ...     directory = "runs/x"
        ...     def close(self): pass
        ...     def forget_after_fork(self): pass
        >>> released = []
        >>> job = Job(); finalizer = track(job, lambda: released.append(True))
        >>> del job; released
        [True]
    """
    _install_hooks()
    _LIVE.add(ckpt)
    return weakref.finalize(ckpt, release)


def releaser(storage: Any, preemption: Any) -> Callable[[], None]:
    """What a dropped Checkpointer's finalizer calls: release ``storage``'s lock and restore the signal
    handlers of ``preemption`` (None: none installed). Refers to neither Checkpointer nor its items.

    Example:
        >>> class Lock:
        ...     def release_lock(self): print("released")
        >>> releaser(Lock(), None)()
        released
    """

    def release() -> None:
        if preemption is not None:
            preemption.uninstall()
        storage.release_lock()

    return release
