"""Python examples in docs/ run as written (in a temporary directory)."""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest

DOCS = Path(__file__).resolve().parents[1] / "docs"


@pytest.mark.parametrize("page", ["planner.md", "loops.md"])
def test_first_python_example_runs(page: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    block = re.findall(r"```python\n(.*?)```", (DOCS / page).read_text(), flags=re.S)[0]
    monkeypatch.chdir(tmp_path)
    namespace: dict = {}
    exec(compile(block, str(DOCS / page), "exec"), namespace)  # noqa: S102 - our own docs
    if page == "planner.md":
        assert namespace["report"].within_budget and namespace["report"].gradients_equal
        assert (tmp_path / "frontier.png").stat().st_size > 0
    else:
        assert namespace["stats"].step_evaluations > 10_000
    assert os.getcwd() == str(tmp_path)
