"""Opt-in preemption handling: SIGTERM/SIGINT request a save at the next safe point.

Rules kept here (named in ``docs/design.md``):

1. **[the handler only records]** The signal handler only records the request.
   Saving inside a handler could capture a half-updated optimizer; the save
   happens in ``maybe_save`` or ``save``, between training steps, where state is
   consistent (or where the loop waits for a DataLoader batch: rule 3).
2. **[a second signal stops]** A second signal of the same kind restores the
   previous handler and re-delivers the signal, so a user pressing Ctrl-C twice
   still stops the job.
3. **[dead workers wait for the safe point]** A SIGTERM sent to the whole process
   group (Slurm, Kubernetes) also kills DataLoader workers, and torch's SIGCHLD
   handler would raise "DataLoader worker ... is killed by signal" at an arbitrary
   point of the step. Once a preemption is requested, SIGCHLD is handled by a no-op
   until :meth:`uninstall`, so the step finishes and reaches its ``maybe_save``/``save``,
   which saves and exits. ``on_request`` is called with the interrupted frame when
   the signal lands and then every 50 ms (a ``SIGALRM`` timer, only if nothing else
   handles ``SIGALRM``); preempt_points.py saves when the main thread waits for a
   DataLoader batch (between steps: the state is that of the last ``maybe_save``),
   before the iterator can raise about its dead workers.
4. **[an orphaned handler steps aside]** Python changes signal handlers only in the main
   thread, but a Checkpointer dropped while its async save is in flight is finalized in
   the save thread. There, :meth:`uninstall` stops the 50 ms timer (``setitimer`` is
   process-wide and works from any thread) and marks the handler orphaned; the next
   signal it receives, always in the main thread, puts the previous handlers back and
   re-delivers SIGTERM/SIGINT to them, so the process stops (or raises
   ``KeyboardInterrupt``) as if the Checkpointer had never been there.
"""

from __future__ import annotations

import os
import signal
import threading
from collections.abc import Callable, Sequence
from types import FrameType
from typing import Any


def parse_signals(names: Sequence[str]) -> tuple[signal.Signals, ...]:
    """Signals from names such as ``"SIGTERM"``.

    Example:
        >>> parse_signals(["SIGTERM"])
        (<Signals.SIGTERM: 15>,)
    """
    parsed = []
    for name in names:
        try:
            parsed.append(signal.Signals[name])
        except KeyError:
            raise ValueError(f"preemption signal {name!r} is unknown; expected names like 'SIGTERM'") from None
    return tuple(parsed)


class PreemptionHandler:
    """Installs handlers that set :attr:`requested` ([the handler only records]); :meth:`uninstall` puts
    the old ones back."""

    def __init__(
        self, signals: Sequence[signal.Signals], on_request: Callable[[FrameType | None], None] | None = None
    ) -> None:
        if threading.current_thread() is not threading.main_thread():
            raise RuntimeError(
                "save_on_preemption=True needs the Checkpointer to be built in the main thread "
                "(Python delivers signals there). Fix: build it in the main thread."
            )
        self.requested: signal.Signals | None = None
        self._previous: dict[signal.Signals, Any] = {}
        self._on_request = on_request
        self._orphaned = False  # uninstall() was called off the main thread ([an orphaned handler steps aside])
        for sig in signals:
            self._previous[sig] = signal.signal(sig, self._handle)

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        sig = signal.Signals(signum)
        if self._orphaned:
            self._step_aside(sig)
            return
        if self.requested is None:
            self.requested = sig
            if hasattr(signal, "SIGCHLD") and signal.SIGCHLD not in self._previous:
                self._previous[signal.SIGCHLD] = signal.signal(signal.SIGCHLD, self._child)  # [dead workers wait ...]
            if self._on_request is not None:
                self._start_ticks()
                self._on_request(frame)
            return
        signal.signal(sig, self._previous.get(sig, signal.SIG_DFL))  # [a second signal stops]
        os.kill(os.getpid(), sig)

    def _start_ticks(self) -> None:
        if not hasattr(signal, "SIGALRM") or signal.getsignal(signal.SIGALRM) is not signal.SIG_DFL:
            return  # the program uses SIGALRM itself: only the step's maybe_save/save will save
        self._previous[signal.SIGALRM] = signal.signal(signal.SIGALRM, self._tick)
        signal.setitimer(signal.ITIMER_REAL, 0.05, 0.05)

    def _tick(self, signum: int, frame: FrameType | None) -> None:
        if self._orphaned:  # a tick already pending when the timer stopped: ours, so not re-delivered
            self._step_aside(None)
            return
        if self._on_request is not None:
            self._on_request(frame)

    def _child(self, signum: int, frame: FrameType | None) -> None:
        """SIGCHLD while a preemption is pending: worker deaths are left for the safe point."""
        if self._orphaned:
            self._step_aside(signal.Signals(signum))

    def _step_aside(self, sig: signal.Signals | None) -> None:
        """[an orphaned handler steps aside]: in the main thread (where every handler runs) put the previous
        handlers back, then re-deliver ``sig`` (None: nothing) to the one that was there before."""
        previous = self._previous.get(sig, signal.SIG_DFL) if sig is not None else None
        self.uninstall()
        if sig is not None:  # set again: once stepped aside, this handler must never be the one re-delivered to
            signal.signal(sig, signal.SIG_DFL if previous is None else previous)
            os.kill(os.getpid(), sig)

    def uninstall(self) -> None:
        """Restore the handlers that were there before (idempotent).

        Off the main thread (a finalizer in a save thread) handlers cannot be changed: the timer is stopped
        and the handler marked orphaned; it uninstalls itself at the next signal ([an orphaned handler steps
        aside]).
        """
        if signal.SIGALRM in self._previous:
            signal.setitimer(signal.ITIMER_REAL, 0)  # process-wide: allowed in any thread
        if threading.current_thread() is not threading.main_thread():
            self._orphaned = True
            return
        for sig, previous in list(self._previous.items()):
            signal.signal(sig, signal.SIG_DFL if previous is None else previous)
        self._previous.clear()

