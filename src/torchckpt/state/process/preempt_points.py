"""Where a preemption may save at once: the main thread waiting for data between two steps.

preemption.py's [dead workers wait for the safe point]: the handler calls :func:`on_request_for`'s
callback with the interrupted frame (and again every 50 ms until the process exits). When that frame
is inside a DataLoader iterator that waits on its data queue, the step the training loop last passed
to ``maybe_save``/``save`` is complete and nothing has changed it since (the loop is waiting for the
next batch), so it is saved there and the process exits with code 0, before the iterator can raise
about workers the same SIGTERM killed. The same check runs when an exception is raised inside that
wait (a trace function on ``_try_get_data`` frames only, installed once a preemption is requested and
only if no tracer or debugger is active): the iterator's "DataLoader worker ... exited unexpectedly"
becomes that save and exit.

The RNG streams saved depend on where the wait is. Inside ``__next__`` (the loader's iterator is the
one the loop is reading) they are those of the moment: nothing draws between the step and that wait,
and the saved iterator carries the seeds it drew. Inside a new epoch's iterator that is still starting
(``_reset``, waiting for its workers' first answer) the loader still reports the previous, finished
iterator, while the new one has already drawn its workers' base seed from torch's RNG; the resumed loop
starts that epoch again and draws it again, so the streams saved are those captured at the last
``maybe_save``/``save`` (kept with the resume point). Random numbers the loop itself draws between that
call and the next epoch's first batch are then not replayed (docs/state.md, preemption).

The Checkpointer is reached only through its public hook, :class:`SafePointSaver`.
"""

from __future__ import annotations

import sys
import weakref
from collections.abc import Callable
from types import FrameType
from typing import Any, Protocol

_LOADER_FILES = ("/torch/utils/data/dataloader.py", "/torchdata/stateful_dataloader/stateful_dataloader.py")


class SafePointSaver(Protocol):
    """What a preemption at a safe point needs of a Checkpointer: its public hook (the Checkpointer has it)."""

    @property
    def saves_collectively(self) -> bool:
        """True when the ranks of a process group save together: no rank saves at a safe point alone."""
        ...

    @property
    def has_resume_point(self) -> bool:
        """True once a step was passed to ``maybe_save``/``save``: the last complete one."""
        ...

    def save_resume_point_and_exit(self, *, rng_of_resume_point: bool) -> None:
        """Save the last complete step and exit 0 (raises ``SystemExit``); ``rng_of_resume_point``: save the RNG
        streams captured with that step, not this moment's."""
        ...


def waiting_for_data(frame: FrameType | None) -> bool:
    """True when ``frame`` (or a caller of it) is a DataLoader iterator waiting on its data queue
    (``_try_get_data``): nothing of the iterator's own bookkeeping is half done there.

    Example:
        >>> import sys
        >>> waiting_for_data(sys._getframe())
        False
    """
    while frame is not None:
        if _is_wait(frame):
            return True
        frame = frame.f_back
    return False


def starting_epoch(frame: FrameType | None) -> bool:
    """True when ``frame`` (or a caller of it) is a DataLoader iterator's ``_reset``: a new epoch's iterator
    waiting for its workers to start (or, with persistent workers, to resume), before its first batch.

    Example:
        >>> import sys
        >>> starting_epoch(sys._getframe())
        False
    """
    while frame is not None:
        if frame.f_code.co_name == "_reset" and frame.f_code.co_filename.endswith(_LOADER_FILES):
            return True
        frame = frame.f_back
    return False


def _is_wait(frame: FrameType) -> bool:
    code = frame.f_code
    return code.co_name == "_try_get_data" and code.co_filename.endswith(_LOADER_FILES)


def on_request_for(ckpt: SafePointSaver) -> Callable[[FrameType | None], None]:
    """The preemption callback of ``ckpt`` (held weakly: a signal handler never keeps it alive).

    Example:
        >>> class Job:
        ...     saves_collectively = has_resume_point = False
        ...     def save_resume_point_and_exit(self, *, rng_of_resume_point): raise SystemExit(0)
        >>> job = Job(); callback = on_request_for(job); callback(None)  # not waiting for data: nothing
    """
    ref = weakref.ref(ckpt)
    busy: list[bool] = []
    traced: list[bool] = []

    def on_exception(frame: FrameType, event: str, arg: Any) -> Any:
        if event == "exception" and issubclass(arg[0], Exception):
            on_request(frame)  # raises SystemExit(0) after saving, which replaces the loader's error
        return on_exception

    def on_call(frame: FrameType, event: str, arg: Any) -> Any:
        return on_exception if event == "call" and _is_wait(frame) else None

    def on_request(frame: FrameType | None) -> None:
        target = ref()
        if target is not None and target.saves_collectively:
            return  # a sharded save is collective: the ranks save together at the next maybe_save
        if not traced and sys.gettrace() is None:
            traced.append(True)
            sys.settrace(on_call)
            caller = frame
            while caller is not None:  # the wait already running, if any
                if _is_wait(caller):
                    caller.f_trace = on_exception
                caller = caller.f_back
        if not busy and target is not None and target.has_resume_point and waiting_for_data(frame):
            busy.append(True)  # a later tick must not start a second save from inside this one
            if traced and sys.gettrace() is on_call:
                sys.settrace(None)
            # A new epoch's iterator that is still starting drew from torch's RNG already, and the loader
            # still reports the previous (finished) iterator: save the streams of the last complete step.
            target.save_resume_point_and_exit(rng_of_resume_point=starting_epoch(frame))  # SystemExit(0)

    return on_request
