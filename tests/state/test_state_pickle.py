"""A pickle that would run code is refused wherever it is placed, and its code never runs."""

from __future__ import annotations

import json
import os
import pickle
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from cli_helpers import run_cli
from state_helpers import tiny_model

from torchckpt.state import (
    CheckpointCorruptError,
    Checkpointer,
    UnsafeFileError,
    import_torch_save,
)
from torchckpt.state.format.hashing import hash_bytes
from torchckpt.state.format.layout import parse_step_dir_name, step_dir_name
from torchckpt.state.format.manifest import canonical_json


class _Payload:
    """Unpickling this creates ``marker``: proof that code from the file ran."""

    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self):
        return (open, (self.marker, "w"))


def _malicious_bytes(marker: str) -> bytes:
    return pickle.dumps({"weight": _Payload(marker)}, protocol=4)


def test_payload_is_live(tmp_path):
    """Control: plain pickle.loads of the payload does run its code (in a throwaway process)."""
    marker = tmp_path / "control-ran"
    data = _malicious_bytes(str(marker))
    code = "import pickle, sys; pickle.loads(sys.stdin.buffer.read())"
    subprocess.run([sys.executable, "-c", code], input=data, check=True)
    assert marker.exists()


def _plant(step_dir: str, name: str, data: bytes) -> None:
    """Replace a checkpoint file and rewrite the manifest so sizes and hashes match it."""
    Path(step_dir, name).write_bytes(data)
    manifest_path = os.path.join(step_dir, "manifest.json")
    body = json.loads(Path(manifest_path).read_text())
    body["files"][name] = {"size_bytes": len(data), "hash": hash_bytes(data, body["hash_algorithm"])}
    body.pop("manifest_hash")
    body["manifest_hash"] = hash_bytes(canonical_json(body), "sha256")
    Path(manifest_path).write_text(json.dumps(body))


@pytest.mark.parametrize("target", ["model.safetensors", "optimizer.json", "optimizer.safetensors", "state.json"])
def test_planted_pickle_is_refused_and_never_runs(run_dir, tmp_path, target):
    model = tiny_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model(torch.randn(3, 4)).sum().backward()
    optimizer.step()
    with Checkpointer(run_dir) as ckpt:
        ckpt.save(1, model=model, optimizer=optimizer)
    marker = tmp_path / f"ran-{target}"
    _plant(os.path.join(run_dir, step_dir_name(1)), target, _malicious_bytes(str(marker)))

    expected = f"{target}: expected a torchckpt file, found a Python pickle"
    with Checkpointer(run_dir) as ckpt, pytest.raises(UnsafeFileError, match=expected) as caught:
        ckpt.restore(model=model, optimizer=optimizer, fallback=False)
    assert isinstance(caught.value, CheckpointCorruptError)
    assert "refused unread" in str(caught.value)
    assert not marker.exists()


def test_import_refuses_code_carrying_torch_save_file(tmp_path, capsys):
    marker = tmp_path / "ran-import"
    source = tmp_path / "evil.pt"
    torch.save({"model": {"w": torch.ones(2)}, "hook": _Payload(str(marker))}, source)
    with pytest.raises(UnsafeFileError, match=r"evil\.pt: torch\.load\(weights_only=True\) refused it"):
        import_torch_save(source, tmp_path / "run")
    assert run_cli(["import", str(source), str(tmp_path / "run")]) == 2
    err = capsys.readouterr().err
    assert "refused it" in err and "Traceback" not in err
    assert not marker.exists()
    run = tmp_path / "run"
    assert not run.exists() or not [n for n in os.listdir(run) if parse_step_dir_name(n) is not None]
