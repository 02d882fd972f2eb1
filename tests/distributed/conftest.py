"""Shared by the tests that start gloo ranks themselves: run ``worker(rank, port, out_dir, *args)`` on two (or
``world``) spawned processes; each writes ``out_dir/<rank>.json``, returned in rank order."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest
import torch.multiprocessing as mp

from torchckpt._testing import free_port


@pytest.fixture
def two_ranks(tmp_path: Path) -> Callable[..., list[dict]]:
    def run(worker: Callable[..., None], *args: object) -> list[dict]:
        mp.start_processes(worker, args=(free_port(), str(tmp_path), *args), nprocs=2, join=True,
                           start_method="spawn")
        return [json.loads((tmp_path / f"{rank}.json").read_text()) for rank in range(2)]

    return run


@pytest.fixture
def spawn_ranks(tmp_path: Path) -> Callable[..., list[dict]]:
    """``run(worker, world, *args)``: ``worker(rank, port, out_dir, world, *args)`` on ``world`` processes."""
    calls = [0]

    def run(worker: Callable[..., None], world: int, *args: object) -> list[dict]:
        calls[0] += 1
        out_dir = tmp_path / f"run-{calls[0]}"
        out_dir.mkdir()
        mp.start_processes(worker, args=(free_port(), str(out_dir), world, *args), nprocs=world, join=True,
                           start_method="spawn")
        return [json.loads((out_dir / f"{rank}.json").read_text()) for rank in range(world)]

    return run
