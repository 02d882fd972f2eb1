"""docs/distributed.md as written: each Python recipe under torchrun on two processes, and every command line
(``torchckpt train --nproc``, torchrun on one machine, torchrun on two "machines" meeting at localhost)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from torchckpt._testing import free_port
from torchckpt.train import read_losses

PAGE = Path(__file__).parents[2] / "docs" / "distributed.md"
TORCHRUN = [sys.executable, "-m", "torch.distributed.run"]


def _env() -> dict[str, str]:
    return dict(os.environ, MALLOC_MMAP_THRESHOLD_="65536", OMP_NUM_THREADS="1", COLUMNS="120")


def _blocks(language: str, after: str = "") -> list[str]:
    text = PAGE.read_text()
    return re.findall(rf"```{language}\n(.*?)```", text.split(after, 1)[1] if after else text, flags=re.DOTALL)


def _command(line: str) -> list[str]:
    """A documented command as this interpreter runs it (``torchckpt`` and ``torchrun`` from this venv)."""
    words = line.split()
    if words[0] == "torchckpt":
        return [sys.executable, "-m", "torchckpt", *words[1:]]
    assert words[0] == "torchrun", line
    return TORCHRUN + words[1:]


@pytest.mark.parametrize("index", [pytest.param(0, marks=pytest.mark.slow), pytest.param(1, marks=pytest.mark.slow),
                                   pytest.param(2, marks=pytest.mark.slow)],  # 20 s each
                         ids=["fsdp2", "ddp", "torchtitan-order"])
def test_recipe_runs_on_two_processes(index: int, tmp_path: Path) -> None:
    recipes = _blocks("python")
    assert len(recipes) == 3
    script = tmp_path / "recipe.py"
    script.write_text(recipes[index])
    done = subprocess.run(TORCHRUN + ["--standalone", "--nproc-per-node=2", str(script)], check=False,
                          capture_output=True, text=True, timeout=280, env=_env(), cwd=tmp_path)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    for rank in (0, 1):
        assert re.search(rf"rank {rank}: \d+ <= \d+ bytes: True, gradients equal: True", done.stdout), done.stdout
        if index == 2:  # as the page says: gpt tiny's plan made unsharded is over its budget on 2 processes
            assert f"rank {rank}: the plan made unsharded is within its budget here: False" in done.stdout


@pytest.mark.slow  # the same job on two processes: tests/train/test_train_distributed.py
def test_training_commands_run_as_written(tmp_path: Path) -> None:
    one_machine, two_machines = _blocks("bash", after="## The training job on several processes")[:2]
    for line in one_machine.splitlines():
        done = subprocess.run(_command(line), check=False, capture_output=True, text=True, timeout=280, env=_env(),
                              cwd=tmp_path)
        assert done.returncode == 0, (line, done.stdout[-2000:], done.stderr[-2000:])
        assert "Traceback" not in done.stderr and done.stdout.count("torchckpt train: ") == 1
        assert "FSDP2 over 2 processes" in done.stdout and "regions: off: 2 blocks are FSDP2 units" in done.stdout
    summaries = {name: json.loads((tmp_path / "runs" / name / "summary.json").read_text()) for name in ("two",
                                                                                                       "torchrun")}
    for summary in summaries.values():
        assert summary["processes"] == 2 and summary["step"] == 4 and summary["checkpoint_steps"] == []
        assert summary["peak_bytes"] <= summary["budget_bytes"], summary  # the largest process's peak
    losses = {name: read_losses(tmp_path / "runs" / name) for name in summaries}
    assert len(losses["two"]) == 4 and losses["two"] == losses["torchrun"]  # bitwise: the plan changes nothing
    assert summaries["torchrun"]["peak_bytes"] < summaries["two"]["peak_bytes"]  # 75% frees memory
    assert not (tmp_path / "runs" / "two" / "checkpoints").exists()

    port = free_port()
    lines = [line.replace("localhost:29533", f"localhost:{port}") for line in two_machines.splitlines()]
    assert len(lines) == 2 and all("--nnodes 2" in line for line in lines)
    nodes = [subprocess.Popen(_command(line), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=_env(),
                              cwd=tmp_path) for line in lines]
    outputs = [node.communicate(timeout=280) for node in nodes]
    assert [node.returncode for node in nodes] == [0, 0], outputs
    summary = json.loads((tmp_path / "runs" / "nodes" / "summary.json").read_text())
    assert summary["processes"] == 2 and summary["peak_bytes"] <= summary["budget_bytes"]


def test_the_readme_shows_only_commands_this_page_runs() -> None:
    readme = (PAGE.parents[1] / "README.md").read_text()
    section = readme.split("### Several processes, several machines", 1)[1].split("\n### ", 1)[0]
    shown = [line for block in re.findall(r"```bash\n(.*?)```", section, flags=re.DOTALL)
             for line in block.splitlines() if line.strip()]
    run_here = {line for block in _blocks("bash") for line in block.splitlines() if line.strip()}
    assert len(shown) == 3 and set(shown) <= run_here


@pytest.mark.slow  # the API and CLI without training: tests/state/test_dcp_interchange.py
def test_dcp_export_and_import_commands_run_as_written(tmp_path: Path) -> None:
    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    block = _blocks("bash", after="**PyTorch's checkpoints in and out.**")[0]
    for line in block.splitlines():
        done = subprocess.run(_command(line), check=False, capture_output=True, text=True, timeout=280, env=_env(),
                              cwd=tmp_path)
        assert done.returncode == 0, (line, done.stdout[-2000:], done.stderr[-2000:])
    reader = dcp.FileSystemReader(str(tmp_path / "runs" / "dcp-export"))
    wanted = {key: torch.empty(meta.size, dtype=meta.properties.dtype)
              for key, meta in reader.read_metadata().state_dict_metadata.items()
              if isinstance(meta, TensorStorageMetadata)}
    dcp.load(wanted, storage_reader=reader, no_dist=True)
    assert "blocks.0.attn.qkv.weight" in wanted or any(key.startswith("blocks.0.") for key in wanted)
