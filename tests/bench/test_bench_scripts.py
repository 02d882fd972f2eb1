"""The benchmark scripts whose runs are in the slow tier still start, and what they look up still exists.

``bench/sharded_io.py`` times parts of a save and a restore by wrapping functions it names by module and
attribute (newest layout first, older commits after): a renamed module would make a part silently read zero,
so the first name of every part must resolve on this commit.
"""

from __future__ import annotations

import importlib
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _resolves(module: str, attribute: str) -> bool:
    target: object = importlib.import_module(module)
    for name in attribute.split("."):
        if not hasattr(target, name):
            return False
        target = getattr(target, name)
    return callable(target)


def test_sharded_io_times_parts_that_exist() -> None:
    import sharded_io  # bench/ is on sys.path (tests/conftest.py)

    parts = {**sharded_io.SAVE_PARTS, **sharded_io.RESTORE_PARTS}
    assert len(parts) >= 6
    missing = [(label, where[0]) for label, where in parts.items() if not _resolves(*where[0])]
    assert missing == []
    assert not _resolves("torchckpt.state.sharded", "_no_such_function")  # the check can fail


@pytest.mark.parametrize("script", ["state/sharded_kill_soak.py", "compiled.py", "sharded_io.py",
                                    "state/kill9_soak.py"])
def test_script_starts(script: str) -> None:
    done = subprocess.run([sys.executable, str(ROOT / "bench" / script), "--help"], capture_output=True, text=True,
                          timeout=120, check=False)
    assert done.returncode == 0 and "usage:" in done.stdout, done.stderr[-2000:]
