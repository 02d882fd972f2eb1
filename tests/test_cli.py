"""The ``torchckpt`` command: help, version, and the demo end to end on the tiny GPT."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

import torchckpt
from torchckpt.cli.main import main


def _torchckpt(*args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="65536", COLUMNS="120")
    return subprocess.run([sys.executable, "-m", "torchckpt.cli.main", *args], check=False, capture_output=True,
                          text=True, timeout=600, env=env)


def test_version_and_help(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["--version"])
    assert exit_info.value.code == 0
    assert capsys.readouterr().out.strip() == f"torchckpt {torchckpt.__version__}"
    assert main([]) == 0
    out = capsys.readouterr().out
    assert "demo" in out and "train" in out


def test_demo_reports_memory_saving_and_equal_gradients() -> None:
    result = _torchckpt("demo", "--size", "tiny", "--batch-size", "4", "--seq-len", "64", "--steps", "2")
    assert result.returncode == 0, result.stderr
    lines = {line.split("│")[1].strip(): line for line in result.stdout.splitlines() if line.count("│") > 5}
    assert set(lines) == {"no checkpointing", "every block, recompute all", "every block, keep matmuls"}
    assert all(line.count("equal") == 2 for line in lines.values())
    saving = int(lines["every block, recompute all"].split("│")[3].strip().rstrip("%"))
    assert saving < 100  # recomputing every block lowers the measured peak


def test_bad_option_is_explained() -> None:
    result = _torchckpt("demo", "--steps", "0")
    assert result.returncode == 2
    assert "must be a positive integer; got 0" in result.stderr


def test_plan_and_frontier_commands(tmp_path) -> None:
    out = tmp_path / "plan.json"
    result = _torchckpt("plan", "--model", "gpt-tiny", "--batch-size", "4", "--seq-len", "128", "--budget", "75%",
                        "--out", str(out), "--plot", str(tmp_path / "plan.png"))
    assert result.returncode == 0, result.stderr
    assert "predicted peak" in result.stdout and out.is_file() and (tmp_path / "plan.png").stat().st_size > 0
    # stderr is a pipe: plain lines, each phase in the order it ran (ticks and "still running" lines between)
    progress = [line.split("] torchckpt plan: gpt-tiny: ", 1)[1] for line in result.stderr.splitlines()
                if line.startswith("[")]
    phases = ["checking which blocks can be recomputed", "profiling step 1: 2 blocks", "profiling step 2",
              "profiling steps 3-4", "profiling step 5", "profiling step 6", "solving"]
    starts = [next(i for i, line in enumerate(progress) if line.startswith(text)) for text in phases]
    assert starts == sorted(set(starts))  # every phase shown, in order
    assert progress[-1] == "done"
    result = _torchckpt("plan", "--model", "gpt-tiny", "--batch-size", "2", "--seq-len", "32", "--budget", "1000")
    assert result.returncode == 2 and "smallest feasible peak" in result.stderr


@pytest.mark.slow  # 20 s; the fast tier runs `plan` above and the frontier in-process (tests/planner)
def test_frontier_command_and_a_unet_plan(tmp_path) -> None:
    result = _torchckpt("plan", "--model", "unet-tiny", "--batch-size", "2", "--image-size", "16", "--budget", "80%")
    assert result.returncode == 0 and "predicted peak" in result.stdout, result.stderr
    result = _torchckpt("frontier", "--model", "gpt-tiny", "--batch-size", "2", "--seq-len", "32", "--points", "3",
                        "--plot", str(tmp_path / "front.png"))
    assert result.returncode == 0, result.stderr
    assert "checkpoint every block" in result.stdout and (tmp_path / "front.png").stat().st_size > 0


def _exit_code(argv: list[str]) -> int:
    try:
        return main(argv)
    except SystemExit as exit_info:  # argparse's usage errors
        return int(exit_info.code or 0)


def test_exit_codes_are_the_same_across_commands_and_documented(tmp_path, capsys: pytest.CaptureFixture[str]) -> None:
    """0 success, 1 a problem found, 2 bad usage or input: for every command (README's "Command line")."""
    missing = str(tmp_path / "nope")
    bad_input = [["nope"], ["train", "--steps", "0"], ["demo", "--size", "huge"], ["plan", "--model", "nope"],
                 ["frontier", "--points", "1"], ["ls", missing], ["verify", missing],
                 ["export", missing, "--out", str(tmp_path / "w.safetensors")], ["import", missing, str(tmp_path)],
                 ["bench"]]
    assert {" ".join(argv[:1]): _exit_code(argv) for argv in bad_input} == {argv[0]: 2 for argv in bad_input}
    torch = pytest.importorskip("torch")
    from torchckpt.state import Checkpointer

    with Checkpointer(str(tmp_path / "run" / "checkpoints")) as ckpt:
        ckpt.save(1, model=torch.nn.Linear(2, 2))
    assert _exit_code(["verify", str(tmp_path / "run")]) == 0
    next((tmp_path / "run" / "checkpoints").glob("step-*/*.safetensors")).write_bytes(b"not safetensors")
    assert _exit_code(["verify", str(tmp_path / "run")]) == 1
    capsys.readouterr()
    assert _exit_code(["--help"]) == 0
    shown = " ".join(capsys.readouterr().out.split())
    readme = " ".join((Path(__file__).resolve().parents[1] / "README.md").read_text().split())
    for text in (shown, readme):
        assert all(code in text for code in ("exit codes: 0 success", "1 a problem found", "2 bad usage or input"))


def test_every_listed_command_is_registered_by_its_module_and_help_lists_them_without_loading_any() -> None:
    from torchckpt.cli import COMMANDS
    from torchckpt.cli.main import build_parser

    def commands(parser) -> dict:  # noqa: ANN001 - argparse's parser
        return next(action.choices for action in parser._actions if isinstance(action.choices, dict))

    full = commands(build_parser())
    assert set(full) == set(COMMANDS) and all(full[name].format_help() for name in COMMANDS)
    listed = commands(build_parser(commands=[]))
    assert set(listed) == set(COMMANDS) and "--full" not in listed["ls"].format_help()
