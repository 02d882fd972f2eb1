"""torchckpt.integrations.hf_trainer: a transformers.Trainer run killed with SIGKILL resumes through torchckpt with
every logged loss bitwise that of the run that never stopped; controls show the comparison can fail; what is
saved (and that nothing is a pickle); refusals name the fix; docs/hf.md's example runs as written."""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("transformers")
pytest.importorskip("accelerate", reason="transformers.Trainer needs accelerate (pip install accelerate)")

import transformers  # noqa: E402
from hf_trainer_worker import build, read_losses  # noqa: E402

from torchckpt.integrations import hf_trainer  # noqa: E402
from torchckpt.state import CheckpointNotFoundError, list_checkpoints, load  # noqa: E402

WORKER = str(Path(__file__).with_name("hf_trainer_worker.py"))
DOCS = Path(__file__).resolve().parents[2] / "docs" / "hf.md"
# The chain: killed in step 14 (last save 12: an epoch boundary, right after an evaluation), resumed and killed
# in step 22 (last save 20: mid-epoch, 2 of 6 batches in, right after an evaluation), resumed to step 30.
KILLS = (14, 22)


def _env() -> dict[str, str]:
    return dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", PYTHONHASHSEED="0")


def _start(run_dir: Path, losses: Path, kill_at: int, mode: str = "torchckpt") -> subprocess.Popen:
    return subprocess.Popen([sys.executable, WORKER, str(run_dir), str(losses), str(kill_at), mode], env=_env(),
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)


def _finish(process: subprocess.Popen, expect_kill: bool) -> None:
    _, stderr = process.communicate(timeout=300)
    expected = -signal.SIGKILL if expect_kill else 0
    assert process.returncode == expected, f"worker {process.args[2:]} exited {process.returncode}:\n{stderr[-3000:]}"


def _by_step(lines: list[tuple[str, int, str]]) -> dict[tuple[str, int], str]:
    return {(kind, step): value for kind, step, value in lines if kind != "start"}


def _segments(lines: list[tuple[str, int, str]]) -> list[list[tuple[str, int, str]]]:
    """The lines of each process, split at its ``start`` line."""
    out: list[list[tuple[str, int, str]]] = []
    for line in lines:
        if line[0] == "start":
            out.append([])
        out[-1].append(line)
    return out


@pytest.fixture(scope="module")
def chain(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """The reference run (plain ``trainer.train()``, no torchckpt, running beside the chain) and the chain of
    three processes in one directory; a copy of the directory as the second kill left it (for the controls)."""
    root = tmp_path_factory.mktemp("hf_trainer")
    reference = _start(root / "reference", root / "reference.txt", -1, "plain")
    run_dir, losses = root / "run", root / "run.txt"
    steps_at_kill = []
    for kill_at in KILLS:
        _finish(_start(run_dir, losses, kill_at), expect_kill=True)
        steps_at_kill.append([info.step for info in list_checkpoints(str(run_dir / "torchckpt")) if info.valid])
        if kill_at == KILLS[-1]:
            shutil.copytree(run_dir, root / "after-second-kill")
    _finish(_start(run_dir, losses, -1), expect_kill=False)
    _finish(reference, expect_kill=False)
    return {"root": root, "run_dir": run_dir, "reference": read_losses(str(root / "reference.txt")),
            "run": read_losses(str(losses)), "steps_at_kill": steps_at_kill}


@pytest.mark.slow
def test_sigkilled_run_resumes_with_bitwise_equal_losses(chain: dict[str, Any]) -> None:
    reference = _by_step(chain["reference"])
    assert [key for key in reference if key[0] == "loss"] == [("loss", s) for s in range(1, 31)]
    assert sorted(s for kind, s in reference if kind == "eval") == [4, 8, 12, 16, 20, 24, 28, 30]
    # The kills landed between saves: the newest committed step then was 12, then 20 (keep_last=2).
    assert chain["steps_at_kill"] == [[8, 12], [16, 20]]
    segments = _segments(chain["run"])
    assert [segment[0][1] for segment in segments] == [0, 12, 20]  # each process started at the last saved step
    for segment, first, last in zip(segments, (1, 13, 21), (13, 21, 30)):  # a killed step logs nothing
        assert [s for kind, s, _ in segment if kind == "loss"] == list(range(first, last + 1))
        for kind, step, value in segment[1:]:
            assert value == reference[(kind, step)], f"{kind} of step {step} differs from the uninterrupted run"
    assert _by_step(chain["run"]).keys() == reference.keys()  # every loss and evaluation of the reference


@pytest.mark.slow
def test_controls_show_the_comparison_can_fail(chain: dict[str, Any]) -> None:
    """Resuming step 20 without the RNG streams, without the data position, or with the save taken before
    step 20's evaluation drew from torch's RNG gives other losses from step 21 on (the real resume: equal)."""
    root, reference = chain["root"], _by_step(chain["reference"])
    runs = {}
    for mode in ("no-rng", "no-skip"):
        shutil.copytree(root / "after-second-kill", root / mode)
        runs[mode] = _start(root / mode, root / f"{mode}.txt", 23, mode)
    eager = root / "eager"
    _finish(_start(eager, root / "eager.txt", 22, "eager"), expect_kill=True)  # saves at on_step_end
    runs["eager"] = _start(eager, root / "eager.txt", 23, "eager")
    for mode, process in runs.items():
        _finish(process, expect_kill=True)
        segment = _segments(read_losses(str(root / f"{mode}.txt")))[-1]
        assert segment[0][1] == 20, mode
        losses = {step: value for kind, step, value in segment if kind == "loss"}
        assert sorted(losses) == [21, 22], mode
        assert all(losses[s] != reference[("loss", s)] for s in losses), f"control {mode} did not change the losses"
    assert _by_step(chain["run"])[("loss", 21)] == reference[("loss", 21)]


@pytest.mark.slow
def test_what_is_saved_and_nothing_is_a_pickle(chain: dict[str, Any]) -> None:
    run_dir = chain["run_dir"]
    steps = list_checkpoints(str(run_dir / "torchckpt"))
    assert [(info.step, info.valid) for info in steps] == [(24, True), (28, True)]
    step_dir = Path(steps[-1].path)
    assert {"model.safetensors", "optimizer.safetensors", "state.json", "manifest.json"} <= set(os.listdir(step_dir))
    assert steps[-1].metrics["epoch"] == pytest.approx(28 / 6) and steps[-1].metrics["loss"] > 0
    everything = [p for p in run_dir.rglob("*") if p.is_file()]
    assert not [p for p in everything if p.suffix in {".pt", ".pth", ".bin", ".pkl", ".pickle"}]
    assert not [p for p in everything if p.read_bytes()[:2] in (b"\x80\x02", b"\x80\x04", b"\x80\x05")]
    state: dict[str, Any] = {}
    assert load(str(run_dir / "torchckpt"), trainer_state=state) == 28
    assert state["global_step"] == 28 and state["epoch"] == pytest.approx(28 / 6) and state["max_steps"] == 30
    # Saved after step 28's evaluation (rule [a step is saved where Trainer's resume restores it]).
    assert state["log_history"][-1]["step"] == 28 and "eval_loss" in state["log_history"][-1]
    reference = _by_step(chain["reference"])
    assert [float.fromhex(reference[("loss", s)]) for s in range(1, 29)] == [
        entry["loss"] for entry in state["log_history"] if "loss" in entry]
    assert "TrainerControl" in state["stateful_callbacks"]


class Crash(transformers.TrainerCallback):
    """Raises in step ``at`` after its backward pass (an in-process crash)."""

    def __init__(self, at: int) -> None:
        self.at = at

    def on_pre_optimizer_step(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if state.global_step + 1 == self.at:
            raise KeyboardInterrupt(f"crash in step {self.at}")


def _losses(trainer: transformers.Trainer) -> dict[int, float]:
    return {entry["step"]: entry["loss"] for entry in trainer.state.log_history if "loss" in entry}


@pytest.mark.parametrize(("async_save", "grad_accum"), [(False, 2), (True, 1)], ids=["sync-accum2", "async"])
def test_crash_and_resume_in_process(tmp_path: Path, async_save: bool, grad_accum: int) -> None:
    """Gradient accumulation (the skip counts micro-batches) and async saves; the second Trainer is new."""
    def trainer(name: str, mode: str = "torchckpt") -> transformers.Trainer:
        return build(str(tmp_path / name), str(tmp_path / f"{name}.txt"), mode=mode, max_steps=10,
                     grad_accum=grad_accum, async_save=async_save)

    plain = trainer("reference", mode="plain")
    plain.train()
    crashing = trainer("run")
    crashing.add_callback(Crash(at=7))
    with pytest.raises(KeyboardInterrupt, match="crash in step 7"):
        hf_trainer.train(crashing)
    assert not {"_load_rng_state", "_load_from_checkpoint"} & set(vars(crashing))  # the loaders are put back
    assert [info.step for info in list_checkpoints(str(tmp_path / "run" / "torchckpt"))] == [4]
    resumed = trainer("run")
    assert hf_trainer.train(resumed, resume=True).global_step == 10
    assert [segment[0][1] for segment in _segments(read_losses(str(tmp_path / "run.txt")))] == [0, 4]
    assert _losses(crashing) == {s: v for s, v in _losses(plain).items() if s <= 6}
    assert _losses(resumed) == _losses(plain)  # steps 1..4 from the restored log_history, 5..10 trained again
    # nothing in the run directory is a pickle (the slow SIGKILL chain checks the same on a longer run)
    everything = [p for p in (tmp_path / "run").rglob("*") if p.is_file()]
    assert any(p.name == "model.safetensors" for p in everything)
    assert not [p for p in everything if p.suffix in {".pt", ".pth", ".bin", ".pkl", ".pickle"}]
    assert not [p for p in everything if p.read_bytes()[:2] in (b"\x80\x02", b"\x80\x04", b"\x80\x05")]


def test_a_missing_directory_starts_fresh_and_resume_flags_are_checked(tmp_path: Path) -> None:
    first = build(str(tmp_path / "does" / "not" / "exist"), str(tmp_path / "a.txt"), max_steps=4)
    directory = tmp_path / "does" / "not" / "exist" / "torchckpt"
    assert not directory.exists()
    with pytest.raises(CheckpointNotFoundError, match=r"holds no checkpoint\. Fix:"):
        hf_trainer.train(first, resume=True)
    assert hf_trainer.train(first).global_step == 4  # resume=None: nothing there, a fresh start
    assert [info.step for info in list_checkpoints(str(directory))] == [4]
    with pytest.raises(ValueError, match=r"already holds step 4\. Fix: pass resume=None"):
        hf_trainer.train(first, resume=False)
    with pytest.raises(TypeError, match="expected None"):
        hf_trainer.train(first, resume="yes")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="torchckpt chooses the step"):
        hf_trainer.train(first, resume_from_checkpoint=True)


def test_refusals_name_the_fix(tmp_path: Path) -> None:
    with pytest.raises(TypeError, match=r"expected a str or os.PathLike.*Fix: pass e\.g\."):
        hf_trainer.TorchckptCallback(42, save_steps=4)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="got bytes"):
        hf_trainer.TorchckptCallback(b"runs", save_steps=4)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="non-empty"):
        hf_trainer.TorchckptCallback("", save_steps=4)
    for bad in (0, -1, True, 2.5, None):
        with pytest.raises(ValueError, match=r"save_steps=.*expected an int >= 1"):
            hf_trainer.TorchckptCallback("runs", save_steps=bad)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="verify='quick'"):
        hf_trainer.TorchckptCallback("runs", save_steps=4, verify="quick")
    with pytest.raises((TypeError, ValueError), match="keep_last"):
        hf_trainer.TorchckptCallback("runs", save_steps=4, keep_last=0)
    assert not os.path.exists("runs")  # building a callback touches no directory

    with pytest.raises(TypeError, match="expected a transformers.Trainer"):
        hf_trainer.train("trainer")  # type: ignore[arg-type]
    plain = build(str(tmp_path), str(tmp_path / "plain.txt"), mode="plain", max_steps=2)
    with pytest.raises(ValueError, match=r"holds no TorchckptCallback.*Fix: transformers.Trainer\(\.\.\., "
                                         r"callbacks=\[TorchckptCallback"):
        hf_trainer.train(plain)
    twice = build(str(tmp_path), str(tmp_path / "twice.txt"), max_steps=2)
    twice.add_callback(hf_trainer.TorchckptCallback(str(tmp_path / "other"), save_steps=1))
    with pytest.raises(ValueError, match="holds 2 TorchckptCallbacks"):
        hf_trainer.train(twice)
    direct = build(str(tmp_path / "direct"), str(tmp_path / "direct.txt"), max_steps=2)
    with pytest.raises(RuntimeError, match=r"started with trainer.train\(\).*hf_trainer.train\(trainer\)"):
        direct.train()
    assert not list_checkpoints(str(tmp_path / "direct" / "torchckpt"))  # nothing was saved
    sharded = build(str(tmp_path / "sharded"), str(tmp_path / "sharded.txt"), max_steps=2)
    sharded.is_fsdp_enabled = True
    with pytest.raises(NotImplementedError, match="FSDP are not supported"):
        hf_trainer.train(sharded)


def test_docs_example_runs_as_written_and_resumes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """docs/hf.md's section: the example trains 12 steps; run again, it resumes from step 12 with nothing left."""
    section = DOCS.read_text().split("## Resuming a `transformers.Trainer` run with torchckpt", 1)[1]
    block = re.findall(r"```python\n(.*?)```", section, flags=re.DOTALL)[0]
    monkeypatch.chdir(tmp_path)
    first: dict[str, Any] = {}
    exec(compile(block, str(DOCS), "exec"), first)  # noqa: S102 - our own docs
    assert first["output"].global_step == 12
    assert [info.step for info in list_checkpoints("runs/exp1/torchckpt")] == [8, 12]
    again: dict[str, Any] = {}
    exec(compile(block, str(DOCS), "exec"), again)  # noqa: S102 - our own docs
    assert again["output"].global_step == 12 and again["trainer"].state.global_step == 12
    assert _losses(again["trainer"]) == _losses(first["trainer"])  # log_history came back from step 12
