"""Helpers shared by the training-state tests (imported by name; conftest.py holds only fixtures)."""

from __future__ import annotations

import os
import subprocess
import sys

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
WORKERS = os.path.join(HERE, "state_workers.py")


def worker_env() -> dict[str, str]:
    """Environment for worker subprocesses: one thread each."""
    env = dict(os.environ)
    env.update({"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "PYTHONHASHSEED": "0"})
    return env


def run_worker(*args: str, timeout_s: float = 120) -> subprocess.CompletedProcess:
    """Run state_workers.py in a fresh process; fail the test with its stderr if it fails."""
    done = subprocess.run(
        [sys.executable, WORKERS, *args],
        check=False,
        capture_output=True,
        text=True,
        env=worker_env(),
        timeout=timeout_s,
    )
    assert done.returncode == 0, f"worker {args[0]} failed ({done.returncode}):\n{done.stderr[-4000:]}"
    return done


def tiny_model(seed: int = 0) -> torch.nn.Module:
    """A small MLP with a buffer-carrying layer (BatchNorm), for save/restore tests."""
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.BatchNorm1d(8), torch.nn.ReLU(), torch.nn.Linear(8, 2))


def trained(model: torch.nn.Module, optimizer: torch.optim.Optimizer, steps: int = 3) -> None:
    """Take a few optimizer steps so that optimizer state is non-trivial."""
    for _ in range(steps):
        loss = model(torch.randn(5, 4)).square().mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
