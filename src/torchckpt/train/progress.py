"""Live progress of a training run: a rich status line on a terminal, plain lines otherwise.

A ``Display`` is also a reporter of the library's long work (``torchckpt._progress``): a save between steps shows
its bytes on the live line or, once it has taken ``every_s`` seconds, as plain lines at most every ``every_s``
seconds (a quick save adds no line). Planning and restoring, before the steps, show through ``train/status.py``.
"""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass
from typing import TextIO

from torchckpt._progress import Progress
from torchckpt._units import format_bytes

__all__ = ["Display", "PlainDisplay", "QuietDisplay", "RichDisplay", "StepReport", "make_display"]


@dataclass(frozen=True, kw_only=True)
class StepReport:
    """What one training step shows."""

    step: int
    total_steps: int
    loss: float
    tokens_per_s: float
    peak_bytes: int
    budget_bytes: int
    next_checkpoint_step: int | None  # None: the run saves nothing (--no-save)
    next_checkpoint_s: float

    def line(self) -> str:
        """The report as one line.

        Example:
            >>> StepReport(step=3, total_steps=10, loss=2.5, tokens_per_s=1000.0, peak_bytes=2**20,
            ...            budget_bytes=2**21, next_checkpoint_step=5, next_checkpoint_s=1.5).line()
            'step 3/10  loss 2.5000  1,000 tok/s  peak 1.00 MiB / budget 2.00 MiB  checkpoint at step 5 in ~2 s'
        """
        saving = ("no checkpoints" if self.next_checkpoint_step is None
                  else f"checkpoint at step {self.next_checkpoint_step} in ~{self.next_checkpoint_s:.0f} s")
        return (f"step {self.step}/{self.total_steps}  loss {self.loss:.4f}  {self.tokens_per_s:,.0f} tok/s  "
                f"peak {format_bytes(self.peak_bytes)} / budget {format_bytes(self.budget_bytes)}  {saving}")


class Display:
    """Shows step reports and messages; ``close()`` ends a live display."""

    def step(self, report: StepReport) -> None:
        """Show one step."""
        raise NotImplementedError

    def message(self, text: str) -> None:
        """Show a line that stays (a checkpoint was written, ...)."""
        raise NotImplementedError

    def close(self) -> None:
        """Stop a live display (idempotent)."""

    def __call__(self, report: Progress) -> None:
        """Show one of the library's reports (``torchckpt._progress``): nothing unless a display says otherwise."""


class QuietDisplay(Display):
    """Shows nothing (the ranks other than 0 of a run on several processes).

    Example:
        >>> QuietDisplay().message("not shown")
    """

    def step(self, report: StepReport) -> None:
        """Show nothing."""

    def message(self, text: str) -> None:
        """Show nothing."""


class PlainDisplay(Display):
    """Plain lines (for logs and pipes): every ``every``-th step, the first and the last.

    Example:
        >>> import io
        >>> out = io.StringIO(); display = PlainDisplay(every=2, stream=out)
        >>> display.message("hello"); out.getvalue()
        'hello\\n'
    """

    def __init__(self, every: int = 1, stream: TextIO | None = None, every_s: float = 2.0) -> None:
        self.every = max(1, every)
        self.stream = stream
        self.every_s, self._last_s = every_s, 0.0

    def _print(self, text: str) -> None:
        print(text, file=self.stream or sys.stdout, flush=True)

    def step(self, report: StepReport) -> None:
        if report.step % self.every == 0 or report.step == report.total_steps or report.step == 1:
            self._print(report.line())

    def message(self, text: str) -> None:
        self._print(text)

    def __call__(self, report: Progress) -> None:
        """How far a phase got, as a line at most every ``every_s`` seconds from its start.

        Example:
            >>> import io
            >>> out = io.StringIO(); display = PlainDisplay(stream=out, every_s=0.0)
            >>> display(Progress("saving step 3")); display(Progress("saving step 3", 1024, 2048, "bytes"))
            >>> out.getvalue()
            'saving step 3: 1.00 KiB of 2.00 KiB\\n'
        """
        now = time.monotonic()
        if report.done is None:
            self._last_s = now
        elif now - self._last_s >= self.every_s:
            self._last_s = now
            self._print(f"{report.text}: {report.detail()}")


class RichDisplay(Display):
    """A live status line under the messages, redrawn every step (rich)."""

    def __init__(self) -> None:
        from rich.console import Console
        from rich.live import Live
        from rich.text import Text

        self._text = Text
        self.console = Console()
        self._live = Live(Text("starting ..."), console=self.console, refresh_per_second=4, transient=True)
        self._live.start()
        self._last: StepReport | None = None

    def step(self, report: StepReport) -> None:
        self._last = report
        self._live.update(self._text(report.line(), style="bold"))

    def message(self, text: str) -> None:
        self._live.console.print(text, highlight=False, markup=False)

    def __call__(self, report: Progress) -> None:
        """The report on the live line, until the next step."""
        self._live.update(self._text(f"{report.text}: {report.detail()}" if report.done is not None else report.text))

    def close(self) -> None:
        if self._live.is_started:
            self._live.stop()
            if self._last is not None:
                self.console.print(self._last.line(), highlight=False, markup=False)


def make_display(total_steps: int, live: bool | None = None) -> Display:
    """A rich live line when stdout is a terminal (and rich is installed), else plain lines.

    Example:
        >>> type(make_display(100, live=False)).__name__
        'PlainDisplay'
    """
    if live is None:
        live = sys.stdout.isatty()
    if live:
        try:
            return RichDisplay()
        except ImportError:
            pass
    return PlainDisplay(every=max(1, total_steps // 20))
