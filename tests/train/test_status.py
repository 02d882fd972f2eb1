"""The status line the commands draw for long work: plain lines in a log, throttled, and never silent."""

from __future__ import annotations

import io
import threading

from torchckpt._progress import Progress, advance, phase, reporting
from torchckpt.train.status import Status, reported


def _texts(out: io.StringIO) -> list[str]:
    return [line.split("] ", 1)[1] for line in out.getvalue().splitlines()]


def test_plain_lines_are_throttled_but_each_new_phase_shows() -> None:
    out = io.StringIO()
    with Status("x", stream=out, live=False, every_s=3600.0) as status:
        status(Progress("one"))
        status(Progress("", 1, 9, "blocks"))  # within the hour since the last line: not shown
        status(Progress("two"))
        status(Progress("two", 5, 10, "bytes"))  # not shown either
    assert _texts(out) == ["x: one", "x: two", "x: done"]


def test_every_tick_shows_with_every_s_zero_and_quick_work_prints_nothing() -> None:
    out = io.StringIO()
    with reported("x", live=False, stream=out, every_s=0.0):
        phase("saving step 3")
        advance("saving step 3", 1024, 2048, "bytes")
        advance("", 2, 2, "blocks")  # "": a count of the phase that started last
    assert _texts(out) == ["x: saving step 3", "x: saving step 3: 1.00 KiB of 2.00 KiB", "x: saving step 3: block 2/2",
                           "x: done"]
    quiet = io.StringIO()
    with reported("x", live=False, stream=quiet):
        pass
    assert quiet.getvalue() == ""  # nothing reported, nothing waited for: no line at all


def test_a_silent_phase_is_still_told_about() -> None:
    """A phase that reports nothing more (a timed step) gets a line from the status's own thread."""
    out = io.StringIO()
    told = threading.Event()

    class Stream(io.StringIO):
        def write(self, text: str) -> int:
            if "still running" in text:
                told.set()
            return out.write(text)

    with reported("x", live=False, stream=Stream(), every_s=0.0):
        phase("timing a plain step")
        assert told.wait(30)  # the heartbeat comes about a second later; the bound only stops a hang
    assert _texts(out)[0] == "x: timing a plain step"
    assert _texts(out)[1].startswith("x: timing a plain step: still running (")


def test_quiet_ranks_report_to_nobody() -> None:
    seen: list[Progress] = []
    with reporting(seen.append), reported("x", quiet=True) as status:
        phase("profiling step 1")
    assert status is None and seen == []


def test_a_live_line_never_reads_markup() -> None:
    """A path from disk may hold "[bold]": the live line shows it as written (rich Text, not markup)."""
    with Status("x", stream=io.StringIO(), live=True) as status:
        status(Progress("reading /runs/[bold]odd[/bold]"))
        status(Progress("reading /runs/[bold]odd[/bold]", 1, 2, "bytes"))
        shown = status._rich.status
    assert shown.plain == "x: reading /runs/[bold]odd[/bold]: 1 B of 2 B" and not shown.spans
