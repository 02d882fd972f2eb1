"""The README's quickstart runs as written."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

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


DEMO = README.parent / "bench" / "results" / "demo.txt"
TRAIN_MD = README.parent / "docs" / "train.md"
_NUMBER = re.compile(r"(?<![\w.])\d+(?:\.\d+)?")


def _numbers(text: str) -> list[str]:
    return _NUMBER.findall(text)


def test_the_demo_numbers_in_readme_and_train_md_are_those_of_bench_results_demo_txt() -> None:
    """Every number the README and docs/train.md tell of `make demo` is in bench/results/demo.txt (or is computed
    from it: the wall time in minutes, every block's share of the peak without checkpointing)."""
    demo = DEMO.read_text()
    recorded = set(_numbers(demo))
    summary = {line.split(":", 1)[0]: line for line in demo.splitlines() if line.startswith(("memory:", "time:"))}
    wall_s = float(re.search(r"^wall ([\d.]+) s", demo, flags=re.M)[1])

    readme = README.read_text()
    paragraph = readme.split("`make demo` runs `torchckpt train`", 1)[1].split("Run it again", 1)[0]
    quoted = re.findall(r"```\n(.*?)```", paragraph, flags=re.S)[0].splitlines()
    assert quoted == [summary["memory"], summary["time"]], "README's demo lines are not demo.txt's"
    took = re.search(r"took (\d+) min (\d+) s", paragraph)
    assert took and (int(took[1]), int(took[2])) == divmod(round(wall_s), 60), "README's demo wall time drifted"
    prose = paragraph.replace(took[0], "").split("```")[0]
    assert set(_numbers(prose)) <= recorded, f"README numbers not in demo.txt: {set(_numbers(prose)) - recorded}"

    intro = TRAIN_MD.read_text().split("It prints:", 1)[0].split("```", 2)[2]
    every_block, plain = (float(re.search(rf"{name} ([\d.]+) MiB", demo)[1]) for name in (
        "checkpointing every block \\(torch.utils.checkpoint\\)", "without checkpointing"))
    share = re.search(r"below the (\d+)% that checkpointing every block", intro)
    assert share and int(share[1]) == round(100 * every_block / plain), "train.md's every-block share drifted"
    numbers = set(_numbers(intro.replace(share[0], ""))) - {"1.3"}  # 1.3M parameters: demo.txt says 1.29M
    assert "1.29M parameters" in demo and numbers <= recorded, f"train.md numbers not in demo.txt: {numbers - recorded}"


def test_the_drift_check_can_fail(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "demo.txt").write_text(DEMO.read_text().replace("68.34 MiB", "113.00 MiB"))
    monkeypatch.setitem(globals(), "DEMO", tmp_path / "demo.txt")
    with pytest.raises(AssertionError, match="README's demo lines are not demo.txt's"):
        test_the_demo_numbers_in_readme_and_train_md_are_those_of_bench_results_demo_txt()


def test_the_policy_table_says_what_dots_saveable_keeps() -> None:
    """README: dots_saveable keeps matmul outputs, never a fused SDPA's; attention as bmm keeps its bmm outputs."""
    import torch
    import torch.nn.functional as F

    import torchckpt

    row = next(line for line in README.read_text().splitlines() if line.startswith('| `"dots_saveable"`'))
    assert "never a fused scaled dot-product attention's" in row and "keeps its two bmm outputs" in row
    q = torch.randn(1, 2, 8, 4, requires_grad=True)

    def kept(dropout_p: float) -> list[str]:
        torch.manual_seed(0)
        report = torchckpt.saved_residuals(
            lambda v: F.scaled_dot_product_attention(v, v, v, dropout_p=dropout_p) @ v.transpose(-1, -2), q,
            policy="dots_saveable")
        return sorted(r.source for r in report.residuals if r.source not in ("input", "parameter"))

    assert kept(0.0) == ["aten.bmm"]  # the matmul after attention; the fused attention's output is not kept
    assert kept(0.1) == ["aten.bmm", "aten.bmm", "aten.bmm"]  # attention as bmm, softmax, bmm on CPU


def _pip_section() -> tuple[str, str]:
    section = README.read_text().split("## pip install", 1)[1].split("\n## ", 1)[0]
    return section, re.findall(r"```python\n(.*?)```", section, flags=re.S)[0]


def test_pip_install_section_names_the_extras_and_a_short_quickstart() -> None:
    """The fast check of the section: its commands and the public names its Python uses (the slow test runs it)."""
    import torchckpt

    section, block = _pip_section()
    assert "pip install torchckpt " in section and "pip install 'torchckpt[all]'" in section
    assert len(block.strip().splitlines()) <= 14  # a dozen lines of work and the imports
    compile(block, str(README), "exec")
    used = set(re.findall(r"torchckpt\.(\w+)", block))
    assert used == {"plan", "verify_plan", "apply", "Checkpointer", "models"} and used <= set(torchckpt.__all__)


@pytest.mark.slow  # profiles and verifies a plan (seconds to a minute on 2 busy cores); the test above is fast
def test_pip_install_quickstart_runs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """README's "pip install" section: its Python runs as written (in a temporary directory)."""
    _, block = _pip_section()
    monkeypatch.chdir(tmp_path)
    namespace: dict = {}
    exec(compile(block, str(README), "exec"), namespace)  # noqa: S102 - our own README
    plan, ckpt = namespace["plan"], namespace["ckpt"]
    assert plan.predicted_peak_bytes <= plan.budget_bytes and ckpt.latest_step() == 1
    assert (tmp_path / "runs" / "quickstart" / "step-000000001").is_dir()
    namespace["handle"].remove()
