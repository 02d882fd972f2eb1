"""``torchckpt ls / verify / export / import`` print what the files hold."""

from __future__ import annotations

import os

import pytest
import safetensors.torch
import torch
from cli_helpers import run_cli
from state_helpers import tiny_model, trained
from state_workers import bitwise_equal

from torchckpt.state import Checkpointer
from torchckpt.state.format.layout import step_dir_name


def test_ls_shows_steps_sizes_metrics_validity(run_dir, capsys):
    model = tiny_model()
    with Checkpointer(run_dir) as ckpt:
        ckpt.save(10, model=model, metrics={"loss": 0.5})
        ckpt.save(20, model=model, metrics={"loss": 0.25})
    with open(os.path.join(run_dir, step_dir_name(20), "model.safetensors"), "ab") as handle:
        handle.write(b"x")
    assert run_cli(["ls", run_dir]) == 0
    out = capsys.readouterr().out
    lines = [line for line in out.splitlines() if "│" in line]
    row_10 = next(line for line in lines if "│ 10 " in line)
    row_20 = next(line for line in lines if "│ 20 " in line)
    assert "loss=0.5" in row_10 and "yes" in row_10 and "KiB" in row_10
    assert "loss=0.25" in row_20 and "NO" in row_20


def test_ls_and_verify_on_empty_directory(tmp_path, capsys):
    assert run_cli(["ls", str(tmp_path)]) == 0
    assert "no checkpoints" in capsys.readouterr().out
    assert run_cli(["verify", str(tmp_path)]) == 1
    assert run_cli(["verify", str(tmp_path), "--step", "4"]) == 2
    assert "no step 4" in capsys.readouterr().err


def test_export_writes_model_weights_under_state_dict_keys(run_dir, tmp_path, capsys):
    model = tiny_model()
    optimizer = torch.optim.AdamW(model.parameters())
    with Checkpointer(run_dir) as ckpt:
        ckpt.save(1, model=model, optimizer=optimizer)
        trained(model, optimizer)
        ckpt.save(2, model=model, optimizer=optimizer)
    out = str(tmp_path / "model.safetensors")
    assert run_cli(["export", run_dir, "--out", out]) == 0
    assert "exported step 2" in capsys.readouterr().out
    exported = safetensors.torch.load_file(out)
    assert sorted(exported) == sorted(model.state_dict())
    assert bitwise_equal(dict(sorted(exported.items())), dict(sorted(model.state_dict().items())))


def test_import_torch_save_file_then_restore(tmp_path, capsys):
    model = tiny_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    trained(model, optimizer)
    source = tmp_path / "legacy.pt"
    legacy = {"model_state_dict": model.state_dict(), "optimizer": optimizer.state_dict(), "step": 12, "epoch": 3}
    torch.save(legacy, source)
    run_dir = str(tmp_path / "run")
    assert run_cli(["import", str(source), run_dir]) == 0
    assert "as step 12" in capsys.readouterr().out
    restored = tiny_model(5)
    restored_opt = torch.optim.SGD(restored.parameters(), lr=0.1, momentum=0.9)
    extras: dict = {}
    with Checkpointer(run_dir) as ckpt:
        assert ckpt.restore(model=restored, optimizer=restored_opt, extras=extras) == 12
    assert bitwise_equal(restored.state_dict(), model.state_dict())
    assert bitwise_equal(restored_opt.state_dict(), optimizer.state_dict())
    assert extras == {"epoch": 3}


def test_commands_plug_into_the_torchckpt_entry_point(run_dir, monkeypatch, capsys):
    import torchckpt.cli.main as entry

    with Checkpointer(run_dir) as ckpt:
        ckpt.save(4, model=tiny_model())
    assert entry.main(["verify", run_dir]) == 0
    assert "step 4: OK" in capsys.readouterr().out


def test_a_run_directory_stands_for_its_checkpoints_folder(tmp_path, capsys):
    """`torchckpt ls/verify/export runs/demo` find runs/demo/checkpoints (what `torchckpt train` writes)."""
    run = tmp_path / "runs" / "demo"
    (run / "run.json").parent.mkdir(parents=True)
    (run / "run.json").write_text("{}")
    with Checkpointer(str(run / "checkpoints")) as ckpt:
        ckpt.save(3, model=tiny_model())
    assert run_cli(["ls", str(run)]) == 0
    assert "│ 3 " in capsys.readouterr().out
    assert run_cli(["verify", str(run)]) == 0
    assert "step 3: OK" in capsys.readouterr().out
    assert run_cli(["export", str(run), "--out", str(tmp_path / "w.safetensors")]) == 0
    assert safetensors.torch.load_file(str(tmp_path / "w.safetensors")).keys() == tiny_model().state_dict().keys()
    capsys.readouterr()
    assert run_cli(["ls", str(tmp_path / "runs")]) == 0  # the folder above: no checkpoints, names the runs in it
    assert f"run directories in it: {run}" in capsys.readouterr().out


@pytest.mark.parametrize("command", [["ls"], ["verify"], ["export", "--out", "x.safetensors"]])
def test_a_missing_path_is_bad_input(tmp_path, capsys, command):
    missing = str(tmp_path / "runs" / "nope")
    assert run_cli([command[0], missing, *command[1:]]) == 2
    assert f"{missing}: no such directory; give a run directory" in capsys.readouterr().err
