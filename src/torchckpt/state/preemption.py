"""Opt-in preemption handling: SIGTERM/SIGINT request a save at the next safe point.

Rules kept here (named in ``docs/design.md``):

1. **[the handler only records]** The signal handler only records the request.
   Saving inside a handler could capture a half-updated optimizer; the save
   happens in ``maybe_save``, between training steps, where state is consistent.
2. **[a second signal stops]** A second signal of the same kind restores the
   previous handler and re-delivers the signal, so a user pressing Ctrl-C twice
   still stops the job.
"""

from __future__ import annotations

import os
import signal
import threading
from collections.abc import Sequence
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

    def __init__(self, signals: Sequence[signal.Signals]) -> None:
        if threading.current_thread() is not threading.main_thread():
            raise RuntimeError(
                "save_on_preemption=True needs the Checkpointer to be built in the main thread "
                "(Python delivers signals there). Fix: build it in the main thread."
            )
        self.requested: signal.Signals | None = None
        self._previous: dict[signal.Signals, Any] = {}
        for sig in signals:
            self._previous[sig] = signal.signal(sig, self._handle)

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        sig = signal.Signals(signum)
        if self.requested is None:
            self.requested = sig
            return
        signal.signal(sig, self._previous.get(sig, signal.SIG_DFL))  # [a second signal stops]
        os.kill(os.getpid(), sig)

    def uninstall(self) -> None:
        """Restore the handlers that were there before (idempotent)."""
        if threading.current_thread() is not threading.main_thread():
            return
        for sig, previous in self._previous.items():
            signal.signal(sig, previous)
        self._previous.clear()
