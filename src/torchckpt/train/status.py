"""What long work is doing, never silent for more than a few seconds: a rich status line on a terminal,
plain timestamped lines otherwise (a log, a pipe, CI).

``Status.update(text)`` says what starts now (a profiling step, solving); ``Status.tick(text)`` says how far it
got (a block's forward pass), shown live on a terminal and, as a plain line, only when ``every_s`` seconds
passed since the last line, so logs stay short. ``block_ticks`` ticks once per block's forward pass (not in
recomputation, which calls the block's forward directly) through forward pre-hooks, which neither allocate nor
change what the planner measures.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from types import TracebackType
from typing import Any, TextIO

from torch import nn

__all__ = ["Status", "block_ticks"]


class Status:
    """A status line: live (rich) when ``live`` (default: ``stream`` is a terminal), else plain lines.

    Example:
        >>> import io
        >>> out = io.StringIO()
        >>> with Status("gpt-tiny", stream=out, live=False) as status:
        ...     status.update("profiling step 1"); status.tick("block 1/2")
        >>> [line.split("] ", 1)[1] for line in out.getvalue().splitlines()]
        ['gpt-tiny: starting', 'gpt-tiny: profiling step 1', 'gpt-tiny: done']
    """

    def __init__(self, prefix: str, *, stream: TextIO | None = None, live: bool | None = None,
                 every_s: float = 2.0) -> None:
        self.prefix, self.stream, self.every_s = prefix, stream or sys.stderr, every_s
        self.live = self.stream.isatty() if live is None else live
        self._start = self._last = time.monotonic()
        self._message = "starting"
        self._rich: Any = None

    def __enter__(self) -> Status:
        if self.live:
            from rich.console import Console

            self._rich = Console(file=self.stream).status(f"{self.prefix} ...")
            self._rich.start()
        else:
            self._line(self._message)
        return self

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None, tb: TracebackType | None) -> None:
        if self._rich is not None:
            self._rich.stop()
        elif kind is None:
            self._line("done")

    def _line(self, text: str) -> None:
        self._last = time.monotonic()
        print(f"[{self._last - self._start:7.1f} s] {self.prefix}: {text}", file=self.stream, flush=True)

    def update(self, text: str) -> None:
        """Say what starts now (always shown)."""
        self._message = text
        if self._rich is not None:
            self._rich.update(f"{self.prefix}: {text}")
        else:
            self._line(text)

    def tick(self, text: str) -> None:
        """Say how far the current work got (plain: only when ``every_s`` passed since the last line)."""
        if self._rich is not None:
            self._rich.update(f"{self.prefix}: {self._message}: {text}")
        elif time.monotonic() - self._last >= self.every_s:
            self._line(f"{self._message}: {text}")


@contextmanager
def block_ticks(blocks: Sequence[nn.Module], status: Status) -> Iterator[None]:
    """Tick ``status`` at each block's forward pass (``block i/n``) while inside.

    Example:
        >>> import io
        >>> blocks = [nn.Linear(2, 2), nn.Linear(2, 2)]
        >>> status = Status("x", stream=io.StringIO(), live=False, every_s=0.0)
        >>> with block_ticks(blocks, status):
        ...     _ = blocks[1](blocks[0](__import__("torch").ones(1, 2)))
        >>> status.stream.getvalue().count("block ")
        2
    """
    count = len(blocks)
    handles = [block.register_forward_pre_hook(lambda *_, i=i: status.tick(f"block {i + 1}/{count}"))
               for i, block in enumerate(blocks)]
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()
