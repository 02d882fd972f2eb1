"""Progress of long work (profiling, solving, saving, restoring, verifying), told to whoever listens.

The library says what it is doing through :func:`phase` (a new part of the work starts), :func:`advance` (how far
the current part got: blocks, bytes) and :func:`counting_bytes` (bytes done of a known total, added piece by piece
from deep inside the readers and writers by :func:`add_bytes`). An application listens by installing a reporter
with :func:`reporting` (``torchckpt plan``, the state commands and ``torchckpt train`` do: ``train/status.py``
draws it).

1. **[quiet unless an application listens]** Without a reporter nothing is shown, and reporting costs one
   context-variable read: an API call (``torchckpt.plan(...)``, ``Checkpointer.save``) prints nothing. The
   reporter lives in a ``contextvars.ContextVar``, so it is scoped to the ``with reporting(...)`` block (and
   its thread: a save in a background thread reports to nobody).
2. **[reported per phase, never per op]** Reports come at phase boundaries, per block's forward pass (a
   forward pre-hook, installed only while a reporter listens and never around a timed step) and per
   piece of bytes (16 MiB): never per op, so what is measured or timed does not change.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from torchckpt._units import format_bytes

__all__ = ["Progress", "Reporter", "add_bytes", "advance", "block_ticks", "counting_bytes", "listening", "phase",
           "phases_to", "reporting"]


@dataclass(frozen=True)
class Progress:
    """One report: a phase starts (``done`` is None) or the current one got to ``done`` of ``total`` ``unit``."""

    text: str  # "": a count of the phase that started last
    done: int | None = None
    total: int | None = None
    unit: str = ""  # "bytes", or what is counted ("blocks")

    def detail(self) -> str:
        """How far, in words.

        Example:
            >>> Progress("saving", 3 << 20, 8 << 20, "bytes").detail(), Progress("step 1", 2, 4, "blocks").detail()
            ('3.00 MiB of 8.00 MiB', 'block 2/4')
        """
        if self.done is None:
            return ""
        if self.unit == "bytes":
            return f"{format_bytes(self.done)} of {format_bytes(self.total or 0)}"
        return f"{self.unit.removesuffix('s')} {self.done}/{self.total}"


Reporter = Callable[[Progress], None]
_reporter: contextvars.ContextVar[Reporter | None] = contextvars.ContextVar("torchckpt_reporter", default=None)
_bytes: contextvars.ContextVar[list[Any] | None] = contextvars.ContextVar("torchckpt_bytes", default=None)


@contextlib.contextmanager
def reporting(reporter: Reporter | None) -> Iterator[None]:
    """Send the library's reports to ``reporter`` inside the block (None: to nobody).

    Example:
        >>> seen = []
        >>> with reporting(seen.append):
        ...     phase("profiling step 1")
        >>> phase("not seen"); [report.text for report in seen]
        ['profiling step 1']
    """
    token = _reporter.set(reporter)
    try:
        yield
    finally:
        _reporter.reset(token)


def listening() -> bool:
    """Whether a reporter listens (work done only for the display, such as hooks, is skipped when not).

    Example:
        >>> listening()
        False
    """
    return _reporter.get() is not None


def phase(text: str) -> None:
    """Say that ``text`` starts now.

    Example:
        >>> phase("solving")  # nobody listens: nothing happens
    """
    reporter = _reporter.get()
    if reporter is not None:
        reporter(Progress(text))


def phases_to(callback: Callable[[str], None] | None) -> Callable[[str], None]:
    """A function that reports a phase (``phase``) and also passes it to ``callback`` (``profile(progress=...)``).

    Example:
        >>> seen = []
        >>> phases_to(seen.append)("solving")
        >>> seen
        ['solving']
    """
    def say(text: str) -> None:  # [quiet unless an application listens]
        phase(text)
        if callback is not None:
            callback(text)
    return say


def advance(text: str, done: int, total: int, unit: str) -> None:
    """Say that ``text`` got to ``done`` of ``total`` ``unit``.

    Example:
        >>> seen = []
        >>> with reporting(seen.append):
        ...     advance("profiling step 1", 1, 2, "blocks")
        >>> seen[0].detail()
        'block 1/2'
    """
    reporter = _reporter.get()
    if reporter is not None:
        reporter(Progress(text, done, total, unit))


@contextlib.contextmanager
def counting_bytes(text: str, total_bytes: int) -> Iterator[Callable[[int], None]]:
    """A phase of ``total_bytes`` bytes: yields ``reached(done)``, which sets how many are done; inside,
    :func:`add_bytes` adds to it from code that reads or writes a piece at a time.

    Example:
        >>> seen = []
        >>> with reporting(seen.append), counting_bytes("writing", 8) as reached:
        ...     add_bytes(3); reached(8)
        >>> [(report.text, report.done) for report in seen]
        [('writing', None), ('writing', 3), ('writing', 8)]
    """
    if not listening():
        yield lambda done: None
        return
    phase(text)
    counter = [text, 0, total_bytes]

    def reached(done: int) -> None:
        if done != counter[1]:
            counter[1] = done
            advance(text, done, total_bytes, "bytes")

    token = _bytes.set(counter)
    try:
        yield reached
    finally:
        _bytes.reset(token)


def add_bytes(count: int) -> None:
    """Add ``count`` bytes to the current :func:`counting_bytes` phase, if any.

    Example:
        >>> add_bytes(16)  # no phase counts bytes: nothing happens
    """
    counter = _bytes.get()
    if counter is not None and count:
        counter[1] += count
        advance(counter[0], counter[1], counter[2], "bytes")


@contextlib.contextmanager
def block_ticks(blocks: Sequence[Any]) -> Iterator[None]:
    """Inside, each forward pass of a block of ``blocks`` (``nn.Module``) advances the current phase by one block: a
    forward pre-hook, installed only while a reporter listens (recomputation calls ``forward`` directly and
    ticks nothing).

    Example:
        >>> import torch
        >>> blocks, seen = [torch.nn.Linear(2, 2), torch.nn.Linear(2, 2)], []
        >>> with reporting(seen.append), block_ticks(blocks):
        ...     _ = blocks[1](blocks[0](torch.ones(1, 2)))
        >>> [report.detail() for report in seen]
        ['block 1/2', 'block 2/2']
    """
    if not listening():
        yield
        return
    count = len(blocks)
    handles = [block.register_forward_pre_hook(lambda *_, i=i: advance("", i + 1, count, "blocks"))
               for i, block in enumerate(blocks)]
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()
