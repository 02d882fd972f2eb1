"""The benchmark's harness for the tests: ``bench/`` on ``sys.path``, as for ``python bench/<name>.py``.

Tests import ``harness`` (bench/harness/) and ``cuda_check`` (bench/cuda_check.py) as the scripts do. Appended,
not prepended: a script's name in ``bench/`` never hides an installed module. Processes the harness and the
tests spawn inherit the parent's ``sys.path``.
"""

from __future__ import annotations

import sys
from pathlib import Path

BENCH = str(Path(__file__).resolve().parents[1] / "bench")
if BENCH not in sys.path:
    sys.path.append(BENCH)
