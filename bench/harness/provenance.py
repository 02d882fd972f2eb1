"""Where a benchmark's numbers come from: the commit they ran on (every results file records it)."""

from __future__ import annotations

import json
import os
import platform
import subprocess
import time
from pathlib import Path
from typing import Any

import torch

__all__ = ["git_commit", "run_record", "write_results"]


def git_commit(cwd: str | Path | None = None) -> str:
    """The ``git rev-parse HEAD`` of the checkout at ``cwd`` (default: the current directory), or ``"unknown"``
    outside a git checkout or without git.

    Example:
        >>> commit = git_commit(Path(__file__).parent)
        >>> len(commit) == 40 or commit == "unknown"
        True
    """
    try:
        found = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, timeout=10, check=False,
                               cwd=cwd)
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return found.stdout.strip() if found.returncode == 0 and found.stdout.strip() else "unknown"


def run_record(where: str | Path | None = None, **settings: Any) -> dict[str, Any]:
    """The head of a results file: commit, start time, machine, torch, the load average now, and ``settings``.

    Example:
        >>> record = run_record(rounds=3)
        >>> sorted(record)[:4], record["rounds"]
        (['commit', 'cpu_count', 'load_before', 'machine'], 3)
    """
    return {"commit": git_commit(where), "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            "machine": platform.processor() or platform.machine(), "cpu_count": os.cpu_count(),
            "torch": torch.__version__, "malloc_mmap_threshold": os.environ.get("MALLOC_MMAP_THRESHOLD_"),
            "load_before": os.getloadavg(), **settings}


def write_results(results: dict[str, Any], folder: str | Path, name: str) -> Path:
    """Add the load average now (``load_after``) and write ``results`` as ``folder/name`` (JSON); returns the path.

    Example:
        >>> import tempfile
        >>> write_results(run_record(), tempfile.mkdtemp(), "x.json").name
        'x.json'
    """
    results["load_after"] = os.getloadavg()
    out = Path(folder)
    out.mkdir(parents=True, exist_ok=True)
    path = out / name
    path.write_text(json.dumps(results, indent=1))
    return path
