"""What long work is doing, never silent for more than a few seconds: a rich status line on a terminal,
plain timestamped lines otherwise (a log, a pipe, CI).

A ``Status`` is the reporter the applications install (``torchckpt._progress.reporting``): the library's phases
(a profiling step, solving, saving a step) always show; how far a phase got (a block's forward pass, bytes
written) shows live on a terminal and, as a plain line, at most once every ``every_s`` seconds, so logs stay
short. While nothing is reported (a timed step, one large file read whole), a plain ``Status`` says every
``every_s`` seconds what is still running and for how long, from a thread of its own that only prints. Plain
lines start with the first report (or the first ``every_s`` seconds), so quick work prints nothing. Text is
never read as rich markup.
"""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from types import TracebackType
from typing import Any, TextIO

from torchckpt._progress import Progress, reporting

__all__ = ["Status", "reported"]


class Status:
    """A status line: live (rich) when ``live`` (default: ``stream`` is a terminal and rich is installed), else
    plain lines on ``stream`` (default: ``sys.stderr`` at the time of each line).

    Example:
        >>> import io
        >>> out = io.StringIO()
        >>> with Status("gpt-tiny", stream=out, live=False) as status:
        ...     status.update("profiling step 1"); status.tick("block 1/2")
        >>> [line.split("] ", 1)[1] for line in out.getvalue().splitlines()]
        ['gpt-tiny: profiling step 1', 'gpt-tiny: done']
    """

    def __init__(self, prefix: str, *, stream: TextIO | None = None, live: bool | None = None,
                 every_s: float = 2.0) -> None:
        self.prefix, self._stream, self.every_s = prefix, stream, every_s
        self.live = self.stream.isatty() if live is None else live
        self._start = self._last = time.monotonic()
        self._message, self._since, self._pending = "starting", self._start, ""
        self._rich: Any = None
        self._shown = False
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._beat: threading.Thread | None = None

    @property
    def stream(self) -> TextIO:
        """Where plain lines go."""
        return self._stream or sys.stderr

    def __enter__(self) -> Status:
        if self.live:
            try:
                from rich.console import Console
            except ImportError:  # rich missing: plain lines
                self.live = False
            else:
                self._rich = Console(file=self.stream).status(self._text(f"{self.prefix} ..."))
                self._rich.start()
                return self
        self._beat = threading.Thread(target=self._heartbeat, name="torchckpt-status", daemon=True)
        self._beat.start()
        return self

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None, tb: TracebackType | None) -> None:
        self._stop.set()
        if self._beat is not None:
            self._beat.join()
        if self._rich is not None:
            self._rich.stop()
        elif kind is None and self._shown:
            self._line("done")

    def _line(self, text: str) -> None:
        with self._lock:
            self._last, self._shown = time.monotonic(), True
            print(f"[{self._last - self._start:7.1f} s] {self.prefix}: {text}", file=self.stream, flush=True)

    def _heartbeat(self) -> None:
        beat_s = max(self.every_s, 1.0)  # every_s=0 shows every tick, not a line per instant of silence
        while not self._stop.wait(beat_s / 4):
            now = time.monotonic()
            if now - self._last >= beat_s and not self._stop.is_set():
                self._line(f"{self._message}: {self._pending or 'still running'} ({now - self._since:.0f} s)")

    def update(self, text: str) -> None:
        """Say what starts now (always shown)."""
        self._message, self._since, self._pending = text, time.monotonic(), ""
        if self._rich is not None:
            self._rich.update(self._text(f"{self.prefix}: {text}"))
        else:
            self._line(text)

    def tick(self, text: str) -> None:
        """Say how far the current work got (plain: only when ``every_s`` passed since the last line)."""
        self._pending = text
        if self._rich is not None:
            self._rich.update(self._text(f"{self.prefix}: {self._message}: {text}"))
        elif time.monotonic() - self._last >= self.every_s:
            self._line(f"{self._message}: {text}")

    @staticmethod
    def _text(text: str) -> Any:
        from rich.text import Text

        return Text(text)  # never markup: a path may hold "[...]"

    def __call__(self, report: Progress) -> None:
        """Show one of the library's reports (``torchckpt._progress``)."""
        if report.done is None:
            self.update(report.text)
        elif report.text and report.text != self._message:  # a count without its phase line: the phase first
            self.update(report.text)
            self.tick(report.detail())
        else:
            self.tick(report.detail())


@contextmanager
def reported(prefix: str, *, live: bool | None = None, stream: TextIO | None = None, every_s: float = 2.0,
             quiet: bool = False) -> Iterator[Status | None]:
    """A ``Status`` that the library's reports go to, inside the block (``quiet``: none, the reports go nowhere).

    Example:
        >>> import io
        >>> from torchckpt._progress import phase
        >>> out = io.StringIO()
        >>> with reported("x", live=False, stream=out):
        ...     phase("solving")
        >>> [line.split("] ", 1)[1] for line in out.getvalue().splitlines()]
        ['x: solving', 'x: done']
    """
    if quiet:
        with reporting(None):
            yield None
        return
    with Status(prefix, stream=stream, live=live, every_s=every_s) as status, reporting(status):
        yield status
