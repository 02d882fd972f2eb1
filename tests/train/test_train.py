"""``torchckpt train`` end to end on the tiny GPT: bit-exact resume after SIGTERM and SIGKILL (real
processes), a finished run is reported not retrained, more --steps continue it, and bad inputs give one
clear line. The reference for every resume test is one uninterrupted run of the same command."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from torchckpt.state.format.layout import parse_step_dir_name, step_dir_name
from torchckpt.train import TrainConfig, read_losses, train

# Tiny and single-threaded: on a shared 2-core machine, 2 OpenMP threads make tiny ops ~50x slower.
TINY = ["--size", "tiny", "--batch-size", "4", "--seq-len", "64", "--budget", "90%", "--save-every", "2",
        "--threads", "1"]
STEPS = 10


def _env() -> dict[str, str]:
    return dict(os.environ, MALLOC_MMAP_THRESHOLD_="65536", COLUMNS="120", OMP_NUM_THREADS="1")


def _train_command(run_dir: Path, *extra: str) -> list[str]:
    return [sys.executable, "-m", "torchckpt.cli.main", "train", *TINY, "--dir", str(run_dir), *extra]


def _run(run_dir: Path, *extra: str) -> subprocess.CompletedProcess:
    return subprocess.run(_train_command(run_dir, *extra), check=False, capture_output=True, text=True, timeout=300,
                          env=_env())


def _interrupt_at(run_dir: Path, step: int, sig: signal.Signals) -> subprocess.CompletedProcess:
    """Start a run and send ``sig`` once its loss log shows ``step``; return the finished process."""
    process = subprocess.Popen(_train_command(run_dir, "--steps", str(STEPS)), stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True, env=_env())
    deadline = time.monotonic() + 240
    while max(read_losses(run_dir), default=0) < step:
        assert process.poll() is None, process.communicate()
        assert time.monotonic() < deadline, "the run did not reach the step in time"
        time.sleep(0.02)
    process.send_signal(sig)
    out, err = process.communicate(timeout=120)
    return subprocess.CompletedProcess(process.args, process.returncode, out, err)


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> dict[int, str]:
    """Per-step losses (float.hex) of an uninterrupted run of STEPS steps."""
    run_dir = tmp_path_factory.mktemp("reference")
    result = _run(run_dir, "--steps", str(STEPS))
    assert result.returncode == 0, result.stderr
    losses = read_losses(run_dir)
    assert sorted(losses) == list(range(1, STEPS + 1))
    assert len(set(losses.values())) == STEPS  # the losses move: a repeated or skipped step would show
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["peak_bytes"] <= summary["budget_bytes"]
    assert summary["validation_loss"] > 0 and summary["sample"].startswith("def ")
    assert "validation loss" in result.stdout and "within budget" in result.stdout
    assert (run_dir / "plan.json").is_file()
    return losses


def test_sigterm_saves_resume_is_bit_exact_finished_run_is_reported_more_steps_continue(
        tmp_path: Path, reference: dict[int, str]) -> None:
    run_dir = tmp_path / "run"
    interrupted = _interrupt_at(run_dir, 3, signal.SIGTERM)
    assert interrupted.returncode == 0, interrupted.stderr
    assert "SIGTERM received; saved step" in interrupted.stderr
    stopped = max(read_losses(run_dir))
    assert stopped < 6
    resumed = _run(run_dir, "--steps", "6")  # resumes, and stops earlier than the reference
    assert resumed.returncode == 0, resumed.stderr
    assert f"resumed from {run_dir / 'checkpoints'}/{step_dir_name(stopped)}" in resumed.stdout
    assert f"plan reused from step {stopped} (made for one process, batch 4 x 64, --budget 90%)" in resumed.stdout
    assert "planning" not in resumed.stdout  # plan_record.py's [a plan follows the job]: nothing profiled
    again = _run(run_dir, "--steps", "6")
    assert again.returncode == 0, again.stderr
    assert "holds a finished run (step 6 of --steps 6); not training again" in again.stdout
    assert "planning" not in again.stdout and "validation loss" in again.stdout
    longer = _run(run_dir, "--steps", str(STEPS))  # continues: the LR schedule does not depend on --steps
    assert longer.returncode == 0, longer.stderr
    assert f"resumed from {run_dir / 'checkpoints'}/{step_dir_name(6)}" in longer.stdout
    assert read_losses(run_dir) == reference


def test_sigkill_mid_run_then_rerun_gives_the_same_losses(tmp_path: Path, reference: dict[int, str]) -> None:
    run_dir = tmp_path / "run"
    killed = _interrupt_at(run_dir, 5, signal.SIGKILL)
    assert killed.returncode == -signal.SIGKILL
    logged = max(read_losses(run_dir))
    resumed = _run(run_dir, "--steps", str(STEPS))
    assert resumed.returncode == 0, resumed.stderr
    restored = parse_step_dir_name(Path(resumed.stdout.split("resumed from ")[1].split()[0]).name)
    assert restored is not None, resumed.stdout
    assert 2 <= restored <= logged and restored % 2 == 0  # from a checkpoint of the killed run
    losses = read_losses(run_dir)
    assert losses == reference
    assert losses[STEPS] == reference[STEPS]


def test_in_process_run_and_option_mismatch(tmp_path: Path) -> None:
    import torch

    threads = torch.get_num_threads()
    config = TrainConfig(size="tiny", batch_size=2, seq_len=64, steps=3, save_every=3, budget="100%",
                         dir=str(tmp_path), threads=1)
    lines: list[str] = []
    try:
        summary = train(config, say=lines.append, live=False)
    finally:
        torch.set_num_threads(threads)
    assert summary["step"] == 3 and summary["checkpoint_steps"] == [3]
    assert any(line.startswith("block") for line in lines)  # the plan table was shown
    result = _run(tmp_path, "--steps", "3")  # TINY has --batch-size 4: not this run
    assert result.returncode == 2
    assert "holds a run with --batch-size 2; this command has --batch-size 4" in result.stderr
    assert "Traceback" not in result.stderr


@pytest.mark.slow  # 40 s; the fast tier holds the defaults to the measured floors (test_default_budgets.py)
def test_the_default_budget_is_below_checkpointing_every_block_and_the_run_fits_it(tmp_path: Path) -> None:
    """`make demo`'s defaults (gpt mini, 16 x 256, 28%): a budget torch.utils.checkpoint on every block cannot
    meet, which the plan meets, and the report says both (one step; the demo runs 100)."""
    import torch

    threads = torch.get_num_threads()
    defaults = TrainConfig()
    config = TrainConfig(steps=1, save=False, dir=str(tmp_path), threads=1)
    assert (config.size, config.budget, config.batch_size, config.seq_len) == (
        defaults.size, defaults.budget, defaults.batch_size, defaults.seq_len)
    lines: list[str] = []
    try:
        summary = train(config, say=lines.append, live=False)
    finally:
        torch.set_num_threads(threads)
    assert summary["peak_bytes"] <= summary["budget_bytes"] < summary["every_block_peak_bytes"], summary
    assert summary["every_block_peak_bytes"] < summary["plain_peak_bytes"]
    report = "\n".join(lines)
    assert "checkpointing every block (torch.utils.checkpoint)" in report and "does not fit this budget" in report


def test_train_at_the_no_checkpointing_budget_stays_within_it(tmp_path: Path) -> None:
    """A plan the profiler measured (no checkpointing, at 100%) keeps no margin: what the loader holds through an
    epoch (torchdata's sampler keeps its generator's 5,056-byte state) is counted when planning (it measured that
    much over the budget before)."""
    import torch

    threads = torch.get_num_threads()
    config = TrainConfig(size="tiny", batch_size=2, seq_len=64, steps=3, save_every=3, budget="100%",
                         dir=str(tmp_path), threads=1)
    try:
        summary = train(config, say=lambda line: None, live=False)
    finally:
        torch.set_num_threads(threads)
    assert summary["peak_bytes"] <= summary["budget_bytes"]


@pytest.mark.parametrize(("extra", "message"), [
    (["--budget", "lots"], "--budget='lots' is not a size"),
    (["--budget", "abc%"], "a percentage must be a number followed by %"),
    (["--budget", "1000"], "is below the smallest feasible peak"),
    (["--model", "missing.py:make"], "file missing.py not found"),
    (["--model", "{model_file}:nope"], "has no callable 'nope'"),
    (["--model", "{model_file}:broken"], "building the model failed with RuntimeError: boom"),
    (["--seq-len", "4096"], "--seq-len 4096 exceeds gpt('tiny')'s max_seq_len (256)"),
])
def test_bad_inputs_give_one_clear_line(tmp_path: Path, extra: list[str], message: str,
                                        capsys: pytest.CaptureFixture[str]) -> None:
    import torch

    from torchckpt.cli.main import main

    model_file = tmp_path / "user_model.py"
    model_file.write_text("def broken():\n    raise RuntimeError('boom')\n")
    extra = [part.replace("{model_file}", str(model_file)) for part in extra]
    threads = torch.get_num_threads()
    try:
        code = main(["train", *TINY, "--dir", str(tmp_path / "run"), *extra])  # an exception would fail here
    finally:
        torch.set_num_threads(threads)
    assert code == 2
    *progress, error = capsys.readouterr().err.splitlines()  # planning's progress lines may come first
    assert error.startswith("torchckpt train: error: ") and message in error
    assert all(line.startswith("[") and "] torchckpt train: " in line for line in progress)
    assert not (tmp_path / "run" / "run.json").exists()  # a failed start does not claim the directory


def test_a_bad_option_in_a_real_process_prints_one_line(tmp_path: Path) -> None:
    result = _run(tmp_path / "run", "--model", "missing.py:make")
    assert result.returncode == 2
    assert result.stderr.strip() == ("torchckpt train: error: --model missing.py:make: file missing.py not found; "
                                     "give path/to/file.py:factory")


def test_user_model_from_a_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    import torch

    from torchckpt.cli.main import main

    model_file = tmp_path / "my_model.py"
    model_file.write_text("from torchckpt.models import gpt\n\ndef make():\n"
                          "    return gpt('tiny', n_layer=3, dropout=0.0)\n")
    threads = torch.get_num_threads()
    try:
        code = main(["train", *TINY, "--dir", str(tmp_path / "run"), "--model", f"{model_file}:make", "--steps", "2"])
    finally:
        torch.set_num_threads(threads)
    out = capsys.readouterr().out
    assert code == 0, out
    assert f"{model_file}:make (GPT)" in out
    assert sorted(read_losses(tmp_path / "run")) == [1, 2]


def test_optimizer_offload_trains_within_budget_and_losses_stay_bitwise(tmp_path: Path) -> None:
    """The fast tier's `--optimizer-offload` run (the slow test below also lowers the floor with it and re-plans):
    AdamW's state in host memory, trained within the budget, losses bitwise those of a run without it."""
    import torch

    threads = torch.get_num_threads()
    shape = {"size": "tiny", "batch_size": 2, "seq_len": 32, "steps": 2, "threads": 1, "budget": "100%"}
    try:
        offloaded = train(TrainConfig(**shape, optimizer_offload=True, dir=str(tmp_path / "run")),
                          say=lambda line: None, live=False)
        train(TrainConfig(**shape, dir=str(tmp_path / "reference")), say=lambda line: None, live=False)
    finally:
        torch.set_num_threads(threads)
    assert offloaded["step"] == 2 and offloaded["peak_bytes"] <= offloaded["budget_bytes"], offloaded
    assert read_losses(tmp_path / "run") == read_losses(tmp_path / "reference")  # float.hex: bitwise


@pytest.mark.slow  # 41-51 s; the fast tier trains with --optimizer-offload in the test above
def test_optimizer_offload_fits_a_budget_adamw_alone_cannot_and_losses_stay_bitwise(tmp_path: Path) -> None:
    """`--optimizer-offload`: AdamW's state in host memory lowers the floor, so a budget below the floor with it on
    the device trains within it; the losses are bitwise those of a run without it; a later command with another
    planning option (--offload) re-plans, saying why, and continues bitwise within the budget."""
    import torch

    from torchckpt.planner import InfeasibleBudgetError

    threads = torch.get_num_threads()
    shape = {"size": "tiny", "batch_size": 4, "seq_len": 64, "save_every": 3, "threads": 1}
    lines: list[str] = []
    try:
        # The floors are measured, not written here: the meter counts every tensor alive in the process, and a
        # test worker may hold other tests' tensors (CI once measured 2.74 MiB for the floor without the state).
        # Alone in a process: 3.17 MiB with AdamW's state on the device and 2.16 MiB without.
        floors = []
        for where, offloaded in (("on-device", False), ("off-device", True)):
            with pytest.raises(InfeasibleBudgetError, match="optimizer state") as told:
                train(TrainConfig(**shape, steps=3, budget=1 << 20, optimizer_offload=offloaded,
                                  dir=str(tmp_path / where)), say=lines.append, live=False)
            floors.append(told.value.floor_bytes)
            del told  # its traceback holds that run's model and optimizer: alive, they would count in the next
        assert floors[1] + (1 << 19) < floors[0], floors  # the state (2 x 519 KiB) off the device lowers it
        budget = (floors[0] + floors[1]) // 2
        offloaded = train(TrainConfig(**shape, steps=3, budget=budget, optimizer_offload=True,
                                      dir=str(tmp_path / "run")), say=lines.append, live=False)
        assert offloaded["peak_bytes"] <= offloaded["budget_bytes"] == budget, offloaded
        lines.clear()
        resumed = train(TrainConfig(**shape, steps=5, budget=budget, optimizer_offload=True, offload=True,
                                    dir=str(tmp_path / "run")), say=lines.append, live=False)
        reference = train(TrainConfig(**shape, steps=5, budget="100%", dir=str(tmp_path / "reference")),
                          say=lambda line: None, live=False)
    finally:
        torch.set_num_threads(threads)
    assert any("the plan stored in step 3: it was made without --offload" in line for line in lines), lines
    assert resumed["step"] == reference["step"] == 5 and resumed["peak_bytes"] <= budget
    assert read_losses(tmp_path / "run") == read_losses(tmp_path / "reference")  # float.hex: bitwise
