"""Shared by the tests that start two gloo ranks themselves: run ``worker(rank, port, out_dir, *args)`` on two
spawned processes; each writes ``out_dir/<rank>.json``, returned in rank order."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest
import torch.multiprocessing as mp

from torchckpt.bench.distributed import free_port


@pytest.fixture
def two_ranks(tmp_path: Path) -> Callable[..., list[dict]]:
    def run(worker: Callable[..., None], *args: object) -> list[dict]:
        mp.start_processes(worker, args=(free_port(), str(tmp_path), *args), nprocs=2, join=True,
                           start_method="spawn")
        return [json.loads((tmp_path / f"{rank}.json").read_text()) for rank in range(2)]

    return run
