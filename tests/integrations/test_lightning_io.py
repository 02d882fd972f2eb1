"""torchckpt.integrations.lightning.TorchckptIO with a real lightning Trainer (issue 14, "Integrations").

A run SIGKILLed mid-fit and resumed with ``ckpt_path="last"`` logs bitwise the losses of a run never
interrupted (and a control that loses the data position does not); what lies on disk is torchckpt
checkpoints only (no pickle), verified, pruned by ModelCheckpoint; Lightning's dict round-trips with its
types; bad inputs fail with errors that name the key or the fix; a kill -9 inside a save leaves the old
checkpoint or none at the path, never one holding no step. The worker is lightning_worker.py beside this file.
The module's docstring examples run in tests/test_docstrings.py (it collects every torchckpt module).
"""

from __future__ import annotations

import copy
import os
import random
import shutil
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("lightning")
pytest.importorskip("torchdata")

from lightning.fabric.plugins.io.torch_io import TorchCheckpointIO  # noqa: E402
from lightning_worker import EVERY, TOTAL_STEPS, build  # noqa: E402

from torchckpt.integrations.lightning import TorchckptIO  # noqa: E402
from torchckpt.state import (  # noqa: E402
    CheckpointMismatchError,
    CheckpointNotFoundError,
    UnsupportedStateError,
    export_model_weights,
    list_checkpoints,
    verify_checkpoint,
)

HERE = os.path.dirname(os.path.abspath(__file__))
WORKER = os.path.join(HERE, "lightning_worker.py")
KILL_AT = 13  # not a save step (saves every EVERY=5 steps): the newest checkpoint is step 10
BATCHES_PER_EPOCH = 6
TIMEOUT_S = 180


# ----- helpers ---------------------------------------------------------------------------------


def _env() -> dict[str, str]:
    return dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", PYTHONHASHSEED="0")


def _start(name: str, args: list[str], root: Path) -> tuple[subprocess.Popen, Path]:
    """Start a worker process; its output goes to ROOT/NAME.out (read on failure)."""
    out = root / f"{name}.out"
    with open(out, "w") as handle:
        process = subprocess.Popen(args, stdout=handle, stderr=subprocess.STDOUT, env=_env(), cwd=root)
    return process, out


def _finish(process: subprocess.Popen, out: Path) -> int:
    """Wait for a process started by _start; kill it (by its pid) and fail the test if it runs too long."""
    try:
        return process.wait(timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()
        pytest.fail(f"{process.args} ran past {TIMEOUT_S} s:\n{out.read_text()[-4000:]}")


def _run_all(runs: dict[str, list[str]], root: Path) -> dict[str, int]:
    """Run workers concurrently (one thread each: 2 cores run 2 at once); return their exit codes."""
    started = {name: _start(name, args, root) for name, args in runs.items()}
    return {name: _finish(*started[name]) for name in runs}


def _worker(run_dir: Path, losses: Path, *extra: str) -> list[str]:
    return [sys.executable, WORKER, str(run_dir), str(losses), *extra]


def _losses(path: Path) -> list[tuple[int, str]]:
    """The worker's log: (global_step, loss.hex()) per training step, in the order run."""
    return [(int(step), loss) for step, loss in (line.split() for line in path.read_text().splitlines())]


def _bitwise(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.equal(a.detach().reshape(-1).view(torch.uint8), b.detach().reshape(-1).view(torch.uint8))


def _assert_same(a: Any, b: Any, where: str = "checkpoint") -> None:
    """Equal with the same types all the way down: dict keys in the same order, tensors bitwise (dtype,
    shape, device too), floats by their bits."""
    assert type(a) is type(b), f"{where}: {type(a).__qualname__} != {type(b).__qualname__}"
    if isinstance(a, torch.Tensor):
        assert (a.dtype, a.shape, a.device) == (b.dtype, b.shape, b.device), where
        assert _bitwise(a, b), f"{where}: tensor values differ"
    elif isinstance(a, dict):
        assert list(a) == list(b), f"{where}: keys {list(a)} != {list(b)}"
        for key in a:
            _assert_same(a[key], b[key], f"{where}[{key!r}]")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), f"{where}: length {len(a)} != {len(b)}"
        for index, (x, y) in enumerate(zip(a, b)):
            _assert_same(x, y, f"{where}[{index}]")
    elif isinstance(a, float):
        assert a.hex() == b.hex(), f"{where}: {a!r} != {b!r}"
    else:
        assert a == b, f"{where}: {a!r} != {b!r}"


def _files(root: Path) -> list[Path]:
    return [Path(folder) / name for folder, _, names in os.walk(root) for name in names]


def _ckpt_names(ckpts: Path) -> set[str]:
    return set(os.listdir(ckpts))


@pytest.fixture
def lightning_in_process() -> Iterator[None]:
    """A Trainer(deterministic=True) in this process changes torch's global flags: put them back."""
    flags = (torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled())
    benchmark = torch.backends.cudnn.benchmark
    cublas = os.environ.get("CUBLAS_WORKSPACE_CONFIG")
    torch_rng, python_rng = torch.get_rng_state(), random.getstate()
    yield
    torch.use_deterministic_algorithms(flags[0], warn_only=flags[1])
    torch.backends.cudnn.benchmark = benchmark
    if cublas is None:
        os.environ.pop("CUBLAS_WORKSPACE_CONFIG", None)
    else:
        os.environ["CUBLAS_WORKSPACE_CONFIG"] = cublas
    torch.set_rng_state(torch_rng)
    random.setstate(python_rng)


# ----- kill -9 mid-fit, resume, control ------------------------------------------------------------


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """Four real processes, two at a time, all with fit(ckpt_path="last") (Lightning starts from scratch
    when there is no last checkpoint): an uninterrupted reference and a run SIGKILLed at the start of step
    13; then the killed run resumed, and (on a copy) the control resume that forgets the loader's position."""
    root = tmp_path_factory.mktemp("lightning_runs")
    first = _run_all({
        "reference": _worker(root / "reference", root / "reference.txt", "--ckpt-path", "last"),
        "killed": _worker(root / "killed", root / "killed.txt", "--ckpt-path", "last", "--kill-at", str(KILL_AT)),
    }, root)
    if first != {"reference": 0, "killed": -signal.SIGKILL}:
        pytest.fail(f"exit codes {first}:\n" + "\n".join((root / f"{n}.out").read_text()[-3000:] for n in first))
    last = root / "killed" / "ckpts" / "last.ckpt"
    before = {
        "last_steps": [info.step for info in list_checkpoints(last, verify="full") if info.valid],
        "last_global_step": TorchckptIO().load_checkpoint(last)["global_step"],
        "names": _ckpt_names(root / "killed" / "ckpts"),
    }
    shutil.copytree(root / "killed", root / "control")
    second = _run_all({
        "resumed": _worker(root / "killed", root / "resumed.txt", "--ckpt-path", "last"),
        "control": _worker(root / "control", root / "control.txt", "--ckpt-path", "last", "--drop", "combined_loader"),
    }, root)
    codes = {**first, **second}
    return {"root": root, "codes": codes, "before": before,
            **{name: _losses(root / f"{name}.txt") for name in ("reference", "killed", "resumed", "control")}}


def _check_codes(runs: dict[str, Any], *names: str) -> None:
    for name in names:
        expected = -signal.SIGKILL if name == "killed" else 0
        out = runs["root"] / f"{name}.out"
        assert runs["codes"][name] == expected, f"{name} exited {runs['codes'][name]}:\n{out.read_text()[-4000:]}"


def test_kill9_mid_fit_then_resume_logs_the_reference_losses_bitwise(runs: dict[str, Any]) -> None:
    _check_codes(runs, "reference", "killed", "resumed")
    reference = dict(runs["reference"])
    assert [step for step, _ in runs["reference"]] == list(range(TOTAL_STEPS))
    # The killed run died at the start of step 13, after its save at step 10 and before one at 15.
    assert [step for step, _ in runs["killed"]] == list(range(KILL_AT))
    last_saved = KILL_AT // EVERY * EVERY
    assert runs["before"]["last_steps"] == [last_saved] and runs["before"]["last_global_step"] == last_saved
    assert runs["before"]["names"] == {"epoch=0-step=5.ckpt", "epoch=1-step=10.ckpt", "last.ckpt"}
    # The resumed run starts exactly after the last saved step and finishes all 30 steps.
    assert [step for step, _ in runs["resumed"]] == list(range(last_saved, TOTAL_STEPS))
    for segment in ("killed", "resumed"):
        differing = [(step, loss, reference[step]) for step, loss in runs[segment] if loss != reference[step]]
        assert not differing, f"{segment} run's losses differ from the reference (step, got, want): {differing[:5]}"


def test_control_resume_without_the_loader_position_gives_other_losses(runs: dict[str, Any]) -> None:
    """The same resume, but the fit loop's "combined_loader" entry (the StatefulDataLoader's position) is
    dropped when loading: Lightning resumes at step 10 still, on other batches, so the comparison above
    can fail."""
    _check_codes(runs, "reference", "killed", "control")
    reference = dict(runs["reference"])
    last_saved = KILL_AT // EVERY * EVERY
    assert [step for step, _ in runs["control"]] == list(range(last_saved, TOTAL_STEPS))
    assert runs["control"][0][1] != reference[last_saved]  # the first resumed step already differs
    assert sum(loss != reference[step] for step, loss in runs["control"]) >= len(runs["control"]) // 2


def _expected_names(reference: dict[int, str]) -> set[str]:
    """ModelCheckpoint(every_n_train_steps=5, save_top_k=2, monitor="train_loss", mode="min", save_last=True):
    a save at global step s sees the loss logged at step s - 1."""
    saves = range(EVERY, TOTAL_STEPS + 1, EVERY)
    best = sorted(saves, key=lambda s: float.fromhex(reference[s - 1]))[:2]
    return {f"epoch={(s - 1) // BATCHES_PER_EPOCH}-step={s}.ckpt" for s in best} | {"last.ckpt"}


def test_what_is_on_disk_is_verified_torchckpt_checkpoints_without_pickle(runs: dict[str, Any]) -> None:
    _check_codes(runs, "reference", "killed", "resumed")
    io = TorchckptIO()
    finals = []
    for run in ("reference", "killed"):  # "killed" holds the resumed run's checkpoints
        ckpts = runs["root"] / run / "ckpts"
        names = _ckpt_names(ckpts)
        # Top-k pruning removed the other 4 of the 6 step saves (the resumed run also the killed run's two),
        # through remove_checkpoint, which leaves no .trash-* (or .tmp-*) entry behind.
        assert names == _expected_names(dict(runs["reference"])), (run, names)
        for name in names:
            path = ckpts / name
            assert path.is_dir(), f"{path} is not a torchckpt checkpoint directory"
            global_step = TOTAL_STEPS if name == "last.ckpt" else int(name.split("step=")[1].split(".")[0])
            infos = list_checkpoints(path, verify="full")
            assert [(info.step, info.valid, info.problem) for info in infos] == [(global_step, True, None)], path
            assert [info.valid for info in verify_checkpoint(path)] == [True], path
            assert infos[0].metrics["global_step"] == global_step
            assert sorted(os.listdir(path)) == [".lock", f"step-{global_step:09d}"], path
        for file in _files(runs["root"] / run):
            assert file.suffix in {".json", ".safetensors"} or file.name == ".lock", f"unexpected file {file}"
            head = file.read_bytes()[:4]
            assert not head.startswith(b"\x80"), f"{file} starts like a pickle"
            assert head != b"PK\x03\x04", f"{file} is a zip archive, as torch.save writes"
        finals.append(io.load_checkpoint(ckpts / "last.ckpt"))
    # The resumed run ends in the reference's final state, bitwise: weights, AdamW moments, scheduler.
    for key in ("state_dict", "optimizer_states", "lr_schedulers", "global_step", "epoch"):
        _assert_same(finals[1][key], finals[0][key], key)
    # Lightning's state_dict is item "model": `torchckpt export` (export_model_weights) reads it.
    out = runs["root"] / "weights.safetensors"
    assert export_model_weights(runs["root"] / "reference" / "ckpts" / "last.ckpt", out) == TOTAL_STEPS
    from safetensors.torch import load_file

    exported = load_file(out)
    assert exported.keys() == finals[0]["state_dict"].keys()
    assert all(_bitwise(exported[key], value) for key, value in finals[0]["state_dict"].items())


@pytest.mark.slow
def test_dropout_resumes_bitwise_only_when_the_global_rng_is_restored(tmp_path: Path) -> None:
    """Lightning's checkpoint holds no RNG state: with dropout, the resumed run's masks differ. The worker's
    RestoreGlobalRNG callback (RNG saved with the checkpoint, set in on_train_start) makes it bitwise."""
    codes = _run_all({
        "reference": _worker(tmp_path / "reference", tmp_path / "reference.txt", "--dropout", "0.25",
                             "--ckpt-path", "last"),
        "killed": _worker(tmp_path / "killed", tmp_path / "killed.txt", "--dropout", "0.25", "--rng",
                          "--ckpt-path", "last", "--kill-at", str(KILL_AT)),
    }, tmp_path)
    assert codes == {"reference": 0, "killed": -signal.SIGKILL}, codes
    shutil.copytree(tmp_path / "killed", tmp_path / "plain")
    codes = _run_all({
        "with_rng": _worker(tmp_path / "killed", tmp_path / "with_rng.txt", "--dropout", "0.25", "--rng",
                            "--ckpt-path", "last"),
        "plain": _worker(tmp_path / "plain", tmp_path / "plain.txt", "--dropout", "0.25", "--ckpt-path", "last"),
    }, tmp_path)
    assert codes == {"with_rng": 0, "plain": 0}, {n: (tmp_path / f"{n}.out").read_text()[-3000:] for n in codes}
    reference = dict(_losses(tmp_path / "reference.txt"))
    with_rng, plain = _losses(tmp_path / "with_rng.txt"), _losses(tmp_path / "plain.txt")
    last_saved = KILL_AT // EVERY * EVERY
    assert [s for s, _ in with_rng] == [s for s, _ in plain] == list(range(last_saved, TOTAL_STEPS))
    assert [loss for _, loss in with_rng] == [reference[s] for s, _ in with_rng]
    assert plain[0][1] != reference[last_saved]  # the first resumed step's dropout mask already differs


# ----- kill -9 inside a save -----------------------------------------------------------------------

_KILL_IN_SAVE = """
import os, signal, sys, torch
import torchckpt.state.checkpointer.unsharded as checkpointer
from torchckpt.integrations.lightning import TorchckptIO
path, first = sys.argv[1], sys.argv[2] == "first"
io = TorchckptIO()
if not first:
    io.save_checkpoint({"global_step": 5, "state_dict": {"w": torch.full((3,), 5.0)}}, path)
def kill(*args, **kwargs):  # the step's temp directory exists, its files are being written
    os.kill(os.getpid(), signal.SIGKILL)
checkpointer.write_files_hashed = kill
io.save_checkpoint({"global_step": 10, "state_dict": {"w": torch.full((3,), 10.0)}}, path)
"""


def test_kill9_inside_a_save_leaves_the_old_checkpoint_or_none(tmp_path: Path) -> None:
    (tmp_path / "first").mkdir()
    (tmp_path / "again").mkdir()
    first, again = tmp_path / "first" / "last.ckpt", tmp_path / "again" / "last.ckpt"
    codes = _run_all({"first": [sys.executable, "-c", _KILL_IN_SAVE, str(first), "first"],
                      "again": [sys.executable, "-c", _KILL_IN_SAVE, str(again), "again"]}, tmp_path)
    assert codes == {"first": -signal.SIGKILL, "again": -signal.SIGKILL}, (tmp_path / "first.out").read_text()
    io = TorchckptIO()
    # Killed inside the path's first save: no directory at the path (ckpt_path="last" would pick one that
    # holds no step and fail), only the hidden sibling it was written in.
    assert not os.path.lexists(first)
    assert [name.startswith(".tmp-last.ckpt-") for name in os.listdir(first.parent)] == [True]
    with pytest.raises(CheckpointNotFoundError, match="does not exist"):
        io.load_checkpoint(first)
    # Killed inside a later save: the path holds the previous checkpoint, whole and valid.
    loaded = io.load_checkpoint(again)
    assert loaded["global_step"] == 5 and torch.equal(loaded["state_dict"]["w"], torch.full((3,), 5.0))
    assert [(info.step, info.valid) for info in list_checkpoints(again, verify="full")] == [(5, True)]
    # Both paths take the next save as usual.
    for path in (first, again):
        io.save_checkpoint({"global_step": 15, "state_dict": {"w": torch.ones(3)}}, path)
        assert io.load_checkpoint(path)["global_step"] == 15
        assert sorted(os.listdir(path)) == [".lock", "step-000000015"]


# ----- Lightning's dict round-trips ------------------------------------------------------------------


class _RecordingIO(TorchckptIO):
    """TorchckptIO that keeps a deep copy of the last dict saved to each path."""

    def __init__(self) -> None:
        super().__init__()
        self.saved: dict[str, dict[str, Any]] = {}

    def save_checkpoint(self, checkpoint: dict[str, Any], path: Any, storage_options: Any | None = None) -> None:
        self.saved[os.fspath(path)] = copy.deepcopy(checkpoint)
        super().save_checkpoint(checkpoint, path, storage_options)


def test_a_real_trainers_checkpoints_round_trip_with_their_types(tmp_path: Path, lightning_in_process: None) -> None:
    io = _RecordingIO()
    trainer, module, loader = build(str(tmp_path), str(tmp_path / "losses.txt"), io=io)
    trainer.fit(module, loader)
    on_disk = sorted(str(tmp_path / "ckpts" / name) for name in os.listdir(tmp_path / "ckpts"))
    assert len(on_disk) == 3 and set(on_disk) < set(io.saved)  # top-k pruned some of the saved paths
    for path in on_disk:
        loaded = io.load_checkpoint(path)
        _assert_same(loaded, io.saved[path], path)
        assert loaded["optimizer_states"][0]["param_groups"][0]["betas"] == (0.9, 0.999)  # a tuple, as saved
        assert list(loaded["optimizer_states"][0]["state"]) == [0, 1, 2, 3]  # int keys, as saved


class OpaqueHandle:
    """A value the codec cannot store (it would need pickle)."""


def test_a_value_that_needs_pickle_names_its_key_and_nothing_is_written(
    tmp_path: Path, lightning_in_process: None
) -> None:
    trainer, module, loader = build(str(tmp_path), str(tmp_path / "losses.txt"))
    module.on_save_checkpoint = lambda checkpoint: checkpoint.update(extra={"handle": OpaqueHandle()})
    with pytest.raises(UnsupportedStateError, match=r"extra\.handle has type OpaqueHandle") as raised:
        trainer.fit(module, loader)
    assert "on_save_checkpoint()" in str(raised.value) and "epoch=0-step=5.ckpt" in str(raised.value)
    assert not (tmp_path / "ckpts").exists() or os.listdir(tmp_path / "ckpts") == []
    assert [f for f in _files(tmp_path) if f.name != "losses.txt"] == []


# ----- bad inputs, map_location, step numbers, removal ---------------------------------------------------


def test_a_regular_file_at_the_path_is_refused_naming_the_fix(tmp_path: Path) -> None:
    path = tmp_path / "last.ckpt"
    TorchCheckpointIO().save_checkpoint({"global_step": 3, "state_dict": {"w": torch.ones(2)}}, path)
    before = path.read_bytes()
    io = TorchckptIO()
    for call in (lambda: io.save_checkpoint({"global_step": 4}, path), lambda: io.load_checkpoint(path)):
        with pytest.raises(CheckpointMismatchError, match="regular file") as raised:
            call()
        assert "TorchCheckpointIO" in str(raised.value) and "Fix: point ModelCheckpoint(dirpath=...)" in str(
            raised.value)
    assert path.read_bytes() == before  # never opened as a pickle, never replaced


def test_missing_or_stepless_paths_and_bad_arguments(tmp_path: Path) -> None:
    io = TorchckptIO()
    with pytest.raises(CheckpointNotFoundError, match="does not exist"):
        io.load_checkpoint(tmp_path / "missing.ckpt")
    (tmp_path / "empty.ckpt").mkdir()
    with pytest.raises(CheckpointNotFoundError, match="holds no committed checkpoint"):
        io.load_checkpoint(tmp_path / "empty.ckpt")
    with pytest.raises(UnsupportedStateError, match="key 1 is a int"):
        io.save_checkpoint({1: "x"}, tmp_path / "intkey.ckpt")
    with pytest.raises(TypeError, match="storage options"):
        io.save_checkpoint({"global_step": 1}, tmp_path / "opts.ckpt", storage_options={"x": 1})
    with pytest.raises(ValueError, match="'full'"):
        TorchckptIO(verify="none")
    with pytest.raises(ValueError, match="hash_algorithm='nope'"):
        TorchckptIO(hash_algorithm="nope")
    assert sorted(os.listdir(tmp_path)) == ["empty.ckpt"]  # the refused saves wrote nothing


def test_map_location_variants(tmp_path: Path) -> None:
    io = TorchckptIO()
    path = tmp_path / "x.ckpt"
    io.save_checkpoint({"global_step": 1, "state_dict": {"w": torch.arange(3.0)},
                        "optimizer_states": [{"state": {0: {"exp_avg": torch.ones(3)}}}]}, path)

    def devices(checkpoint: dict[str, Any]) -> set[str]:
        return {checkpoint["state_dict"]["w"].device.type,
                checkpoint["optimizer_states"][0]["state"][0]["exp_avg"].device.type}

    assert devices(io.load_checkpoint(path)) == {"cpu"}
    assert devices(io.load_checkpoint(path, map_location="cpu", weights_only=True)) == {"cpu"}
    meta_storage = torch.empty(0, device="meta").untyped_storage()  # (a CPU storage cannot be moved to "meta")
    for where in ("meta", torch.device("meta"), {"cpu": "meta"}, lambda storage, location: meta_storage):
        assert devices(io.load_checkpoint(path, map_location=where)) == {"meta"}, where
    assert devices(io.load_checkpoint(path, map_location=lambda storage, location: storage)) == {"cpu"}
    assert devices(io.load_checkpoint(path, map_location={"cuda:0": "meta"})) == {"cpu"}  # nothing is on cuda:0
    assert torch.equal(io.load_checkpoint(path, map_location="cpu")["state_dict"]["w"], torch.arange(3.0))
    with pytest.raises(TypeError, match="map_location=3"):
        io.load_checkpoint(path, map_location=3)
    with pytest.raises(TypeError, match="expected a storage"):
        io.load_checkpoint(path, map_location=lambda storage, location: "cpu")


def test_step_numbers_only_grow_and_one_step_is_kept(tmp_path: Path) -> None:
    io = TorchckptIO(hash_algorithm="sha256", verify="fast")
    path = tmp_path / "last.ckpt"
    for global_step, expected in ((10, 10), (10, 11), (3, 12), (20, 20)):  # same step again; an older one
        io.save_checkpoint({"global_step": global_step, "epoch": 0, "state_dict": {"w": torch.ones(1)}}, path)
        infos = list_checkpoints(path, verify="full")
        assert [(info.step, info.valid) for info in infos] == [(expected, True)]
        assert infos[0].metrics == {"epoch": 0.0, "global_step": float(global_step)}
        assert io.load_checkpoint(path)["global_step"] == global_step
    manifest = (path / "step-000000020" / "manifest.json").read_text()
    assert '"hash_algorithm": "sha256"' in manifest


def test_remove_checkpoint(tmp_path: Path) -> None:
    io = TorchckptIO()
    kept, removed = tmp_path / "kept.ckpt", tmp_path / "removed.ckpt"
    for path in (kept, removed):
        io.save_checkpoint({"global_step": 1}, path)
    link = tmp_path / "link.ckpt"
    link.symlink_to(kept)  # ModelCheckpoint(save_last="link")
    io.remove_checkpoint(link)
    io.remove_checkpoint(removed)
    io.remove_checkpoint(tmp_path / "never.ckpt")  # a missing path is fine
    assert sorted(os.listdir(tmp_path)) == ["kept.ckpt"]  # no .trash-* left; the link's target is untouched
    assert io.load_checkpoint(kept)["global_step"] == 1
