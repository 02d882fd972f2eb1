"""The README's quickstart runs as written."""

from __future__ import annotations

import re
from pathlib import Path

README = Path(__file__).resolve().parents[1] / "README.md"


def test_readme_opens_with_the_two_commands() -> None:
    first_block = README.read_text().split("```")[1]
    commands = [line.split("#")[0].strip() for line in first_block.splitlines()[1:] if line.strip()]
    assert commands == ["make demo", "make test"]


def test_quickstart_runs() -> None:
    text = README.read_text()
    quickstart = text.split("## Quickstart", 1)[1].split("\n## ", 1)[0]
    blocks = re.findall(r"```python\n(.*?)```", quickstart, flags=re.S)
    assert blocks, "the quickstart has no python block"
    namespace: dict = {}
    exec(compile("\n".join(blocks), str(README), "exec"), namespace)  # noqa: S102 - our own README
    assert namespace["meter"].peak_bytes > namespace["meter"].baseline_bytes
    assert all("forward" not in vars(block) for block in namespace["model"].blocks)
    plan = namespace["plan"]
    assert plan.predicted_peak_bytes <= plan.budget_bytes < plan.reference["no_checkpointing_peak_bytes"]
