"""PyTorch Distributed Checkpoint directories in and out (state/checkpointer/dcp_interchange.py): a step exported
as DCP is what ``dcp.load`` reads, bitwise; a DCP directory is imported only with the trust flag (its ``.metadata``
is a pickle), its tensors bitwise, what is not a tensor named as left out; the safetensors export says
``"format": "pt"`` (transformers 4.x needs it)."""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest
import safetensors
import torch
import torch.distributed.checkpoint as dcp

from torchckpt.cli.main import main
from torchckpt.state import (
    Checkpointer,
    CheckpointNotFoundError,
    UnsafeFileError,
    export_dcp,
    export_model_weights,
    import_dcp,
)

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.LayerNorm(3))


@pytest.mark.parametrize("sharded", [False, True])
def test_a_step_exported_as_dcp_is_what_dcp_load_reads(tmp_path: Path, sharded: bool) -> None:
    model = _model()
    with Checkpointer(tmp_path / "run", sharded=sharded) as ckpt:
        ckpt.save(5, model=model)
    assert export_dcp(tmp_path / "run", tmp_path / "out") == 5
    loaded = {key: torch.empty_like(value) for key, value in model.state_dict().items()}
    dcp.load(loaded, checkpoint_id=str(tmp_path / "out"))
    assert all(torch.equal(loaded[key], value) for key, value in model.state_dict().items())
    with pytest.raises(Exception, match="exists; a DCP export writes a new directory"):
        export_dcp(tmp_path / "run", tmp_path / "out")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out", "run"]  # no temp directory left


def test_safetensors_export_says_format_pt(tmp_path: Path) -> None:
    with Checkpointer(tmp_path / "run") as ckpt:
        ckpt.save(2, model=_model())
    export_model_weights(tmp_path / "run", tmp_path / "w.safetensors")
    with safetensors.safe_open(str(tmp_path / "w.safetensors"), "pt") as handle:
        assert handle.metadata()["format"] == "pt"


def test_a_dcp_directory_is_imported_only_when_trusted(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    model = _model()
    source = tmp_path / "dcp"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save({"model": model.state_dict(), "note": "a python object"}, checkpoint_id=str(source), no_dist=True)
    with pytest.raises(UnsafeFileError, match="--trust-dcp-metadata"):
        import_dcp(source, tmp_path / "refused")
    assert not (tmp_path / "refused").exists()  # nothing read, nothing written
    assert main(["import", str(source), str(tmp_path / "refused")]) != 0
    assert "--trust-dcp-metadata" in capsys.readouterr().err

    assert main(["import", str(source), str(tmp_path / "run"), "--step", "3", "--trust-dcp-metadata"]) == 0
    assert "left out, not tensors: note" in capsys.readouterr().out
    fresh = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.LayerNorm(3))
    with Checkpointer(tmp_path / "run") as ckpt:
        assert ckpt.restore(model=fresh) == 3
    assert all(torch.equal(a, b) for a, b in zip(fresh.state_dict().values(), model.state_dict().values()))


def test_restoring_from_a_dcp_directory_names_the_import_and_touches_nothing(tmp_path: Path) -> None:
    source = tmp_path / "dcp"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save({"model": _model().state_dict()}, checkpoint_id=str(source), no_dist=True)
    before = sorted((p.name, p.stat().st_size) for p in source.iterdir())
    with pytest.raises(CheckpointNotFoundError, match=r"a torch.distributed.checkpoint \(DCP\) directory.*"
                                                      r"--trust-dcp-metadata.*import_dcp"):
        with Checkpointer(source) as ckpt:
            ckpt.restore(model=_model())
    assert sorted((p.name, p.stat().st_size) for p in source.iterdir()) == before


def test_cli_exports_dcp(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    model = _model()
    with Checkpointer(tmp_path / "run") as ckpt:
        ckpt.save(4, model=model)
    assert main(["export", str(tmp_path / "run"), "--dcp", "--out", str(tmp_path / "dcp")]) == 0
    assert "exported step 4" in capsys.readouterr().out
    step, left_out = import_dcp(tmp_path / "dcp", tmp_path / "back", trust_pickle=True)  # and back in
    assert (step, left_out) == (0, [])
