"""Internal: real processes for tests and benchmarks (``tests/``, ``bench/``); not public API.

A process group's rendezvous port (:func:`free_port`) and workers spawned each in its own process, each left to
live or die on its own (:func:`spawn_processes`). Nothing in ``torchckpt`` imports this module.

Example:
    >>> 0 < free_port() < 65536
    True
"""

from __future__ import annotations

import socket
import time
from typing import Any

__all__ = ["free_port", "spawn_processes"]


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago (for a process group's rendezvous).

    Example:
        >>> 0 < free_port() < 65536
        True
    """
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def spawn_processes(worker: Any, world: int, *args: Any, out_dir: str, deadline_s: float) -> list[int | None]:
    """``worker(rank, port, out_dir, world, *args)`` on ``world`` spawned processes, each left to live or die on
    its own (``torch.multiprocessing`` kills the rest when one dies: a fault test needs the survivors); returns
    the exit codes, None for a process still running at ``deadline_s``, which is then killed.

    Example (``worker`` must be importable by the spawned processes)::

        codes = spawn_processes(kill_worker, 3, directory, out_dir=out, deadline_s=120)  # e.g. [0, -9, 0]
    """
    import multiprocessing

    context = multiprocessing.get_context("spawn")
    port = free_port()
    processes = [context.Process(target=worker, args=(rank, port, out_dir, world, *args)) for rank in range(world)]
    for process in processes:
        process.start()
    end = time.monotonic() + deadline_s
    for process in processes:
        process.join(max(0.0, end - time.monotonic()))
    codes = [process.exitcode for process in processes]
    for process in processes:
        if process.is_alive():
            process.kill()
            process.join()
    return codes
