"""``torchckpt plan`` / ``frontier`` flags: --loss, --step, --blocks, --plot without matplotlib, and every
bad value exiting with code 2 and one line naming the fix (no traceback), before profiling where it can."""

from __future__ import annotations

import sys
import textwrap
from pathlib import Path

import pytest

import torchckpt.planner
from torchckpt.cli.main import main

USER_MODEL = textwrap.dedent('''
    import torch
    import torch.nn.functional as F
    from torch import nn

    class Layer(nn.Module):
        def __init__(self):
            super().__init__()
            self.linear = nn.Linear(16, 16)

        def forward(self, x):
            return x + torch.tanh(self.linear(x))

    class Encoder(nn.Module):
        def __init__(self):
            super().__init__()
            self.layer = nn.ModuleList(Layer() for _ in range(3))

    class Classifier(nn.Module):          # BERT-like paths: encoder.layer.0 ...; returns logits, no loss
        def __init__(self):
            super().__init__()
            self.encoder = Encoder()
            self.extra = nn.ModuleList(Layer() for _ in range(4))   # the longest run: what 'auto' picks
            self.head = nn.Linear(16, 4)

        def forward(self, x):
            for layer in self.encoder.layer:
                x = layer(x)
            for layer in self.extra:
                x = layer(x)
            return self.head(x)

    LABELS = torch.arange(8) % 4

    def build():
        return Classifier(), (torch.randn(8, 16),)

    def loss(logits):
        return F.cross_entropy(logits, LABELS)

    def step(model, inputs):
        logits = model(*inputs)           # held through backward
        value = F.cross_entropy(logits, LABELS)
        value.backward()
        return value
''')


@pytest.fixture
def user_file(tmp_path: Path) -> str:
    path = tmp_path / "user_model.py"
    path.write_text(USER_MODEL)
    return str(path)


@pytest.fixture
def no_profiling(monkeypatch: pytest.MonkeyPatch) -> None:
    """These refusals must come before any profiling."""
    def refuse(*args: object, **kwargs: object) -> None:
        raise AssertionError("profiled before refusing a bad value")
    monkeypatch.setattr(torchckpt.planner, "profile", refuse)


def _run(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str]:
    code = main(list(args))
    out, err = capsys.readouterr()
    assert "Traceback" not in err
    return code, out, err


def test_loss_and_blocks_plan_a_user_model(capsys: pytest.CaptureFixture[str], user_file: str) -> None:
    code, _, err = _run(capsys, "plan", "--model", f"{user_file}:build", "--budget", "100%")
    assert code == 2 and "tensor of shape (8, 4), not a scalar loss" in err and "--loss file.py:fn" in err
    code, out, err = _run(capsys, "plan", "--model", f"{user_file}:build", "--budget", "100%",
                          "--loss", f"{user_file}:loss", "--blocks", "encoder.layer.*")
    assert code == 0, err
    assert "encoder.layer.0" in out and "encoder.layer.2" in out and "extra.0" not in out
    code, out, err = _run(capsys, "plan", "--model", f"{user_file}:build", "--budget", "100%",
                          "--loss", f"{user_file}:loss", "--blocks", "encoder.layer.1, extra.0")
    assert code == 0 and "encoder.layer.1" in out and "extra.0" in out and "encoder.layer.0" not in out, err


def test_step_plans_the_users_own_loop(capsys: pytest.CaptureFixture[str], user_file: str) -> None:
    code, out, err = _run(capsys, "frontier", "--model", f"{user_file}:build", "--step", f"{user_file}:step",
                          "--points", "2")
    assert code == 0 and "checkpoint every block" in out, err


@pytest.mark.parametrize(("flags", "message"), [
    (["--loss", "{f}:loss", "--step", "{f}:step"], "--loss and --step together"),
    (["--loss", "nowhere.py:loss"], "--loss nowhere.py:loss: file nowhere.py not found"),
    (["--loss", "{f}:missing"], "has no function 'missing'"),
    (["--step", "loss"], "--step loss: give path/to/file.py:function"),
    (["--budget", "lots"], "--budget='lots' is not a size; write a number with one of the units"),
    (["--budget", "150.5.%"], "--budget='150.5.%': a percentage must be a number followed by %"),
    (["--plot", "x.png", "--model", "gpt-tiny"], "pip install 'torchckpt[plot]'"),
    (["--host-budget", "1GiB"], "--host-budget bounds the host memory of offloaded activations: give --offload"),
    (["--offload", "--host-budget", "1XB"], "--host-budget='1XB' is not a size"),
])
def test_bad_values_exit_2_before_profiling(capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch,
                                           user_file: str, no_profiling: None, flags: list[str],
                                           message: str) -> None:
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # as if matplotlib were not installed: import fails
    args = [flag.replace("{f}", user_file) for flag in flags]
    model = [] if "--model" in args else ["--model", f"{user_file}:build"]
    code, _, err = _run(capsys, "plan", *model, *args)
    assert code == 2 and message in err, err


def test_frontier_plot_without_matplotlib_fails_before_profiling(capsys: pytest.CaptureFixture[str],
                                                                monkeypatch: pytest.MonkeyPatch,
                                                                no_profiling: None) -> None:
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    code, _, err = _run(capsys, "frontier", "--model", "gpt-tiny", "--plot", "front.png")
    assert code == 2 and "--plot needs matplotlib: pip install 'torchckpt[plot]'" in err


def test_bad_blocks_and_a_broken_file_exit_2(capsys: pytest.CaptureFixture[str], user_file: str,
                                            tmp_path: Path, no_profiling: None) -> None:
    code, _, err = _run(capsys, "plan", "--model", f"{user_file}:build", "--blocks", "model.layers.*")
    assert code == 2 and "--blocks model.layers.*: no module of the model has that path" in err
    assert "encoder.layer" in err  # the paths it has
    code, _, err = _run(capsys, "plan", "--model", f"{user_file}:build", "--blocks", "encoder.layer.*,")
    assert code == 2 and "an empty path" in err
    code, _, err = _run(capsys, "plan", "--model", f"{user_file}:build", "--blocks", "encoder.layer.*,encoder.layer.0")
    assert code == 2 and "a module is named twice" in err
    broken = tmp_path / "broken.py"
    broken.write_text("def loss(:\n")
    code, _, err = _run(capsys, "plan", "--model", f"{user_file}:build", "--loss", f"{broken}:loss")
    assert code == 2 and "importing" in err and "SyntaxError" in err
    code, _, err = _run(capsys, "plan", "--model", f"{broken}:loss")
    assert code == 2 and f"--model {broken}:loss: importing failed: SyntaxError" in err


def test_points_below_two_is_an_argparse_error(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["frontier", "--points", "1"])
    assert exit_info.value.code == 2
    assert "must be a whole number >= 2" in capsys.readouterr().err


def test_batch_slices_are_offered_where_exact_and_the_table_says_which(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = _run(capsys, "plan", "--model", "gpt-tiny", "--batch-size", "8", "--seq-len", "32",
                        "--batch-slices", "4", "--budget", "100%")
    assert code == 0 and "batch slices: 0 of 2 blocks may run in 4 slices" in out  # gpt-tiny trains with dropout
    assert "outputs differ run whole and in 4 slices" in out
    with pytest.raises(SystemExit) as caught:  # an argparse error: usage and one line, exit 2
        main(["plan", "--model", "gpt-tiny", "--batch-slices", "0"])
    assert caught.value.code == 2 and "--batch-slices: must be a positive integer" in capsys.readouterr().err


def test_offload_is_planned_and_its_host_memory_reported(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = _run(capsys, "plan", "--model", "gpt-tiny", "--batch-size", "2", "--seq-len", "32",
                        "--offload", "--host-budget", "1GiB", "--budget", "100%")
    assert code == 0 and "offload: every block offloaded measured" in out
