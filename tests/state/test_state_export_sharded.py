"""``torchckpt export`` on a sharded step (state/sharded/): the model item is consolidated into full tensors
under its state_dict keys, bitwise what the ranks held, exactly as an unsharded step exports; any other item is
refused by name; a corrupt newest step is skipped with a warning, as for unsharded steps."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import safetensors
import safetensors.torch
import torch
import torch.multiprocessing as mp
from cli_helpers import run_cli
from state_helpers import tiny_model, trained

from torchckpt._testing import free_port
from torchckpt.state import Checkpointer, CheckpointFallbackWarning, export_model_weights
from torchckpt.state.errors import CheckpointCorruptError, CheckpointMismatchError
from torchckpt.state.format.layout import step_dir_name
from torchckpt.state.read.step import read_manifest
from torchckpt.state.sharded.shard_storage import INDEX_NAME, chunk_key, decode_index
from torchckpt.state.storage.backends import open_storage

DISTRIBUTED = str(Path(__file__).resolve().parent.parent / "distributed")
if DISTRIBUTED not in sys.path:
    sys.path.insert(0, DISTRIBUTED)  # sharded_workers: importable by name in the spawned ranks too

from sharded_workers import save_worker  # noqa: E402


def _assert_bitwise(exported: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> None:
    assert sorted(exported) == sorted(expected)
    for key, tensor in expected.items():
        assert exported[key].dtype == tensor.dtype and torch.equal(exported[key], tensor), key


@pytest.fixture(scope="module")
def fsdp2_step(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, dict[str, torch.Tensor]]:
    """Step 3 saved by two FSDP2 ranks, and the full model state the ranks gathered at save time."""
    root = tmp_path_factory.mktemp("fsdp2")
    directory = str(root / "ckpt")
    mp.start_processes(save_worker, args=(free_port(), str(root), 2, "fsdp2", directory, {}), nprocs=2,
                       join=True, start_method="spawn")
    reference = safetensors.torch.load_file(str(root / "ref.safetensors"))
    return directory, {key[len("model."):]: t for key, t in reference.items() if key.startswith("model.")}


def test_two_fsdp2_ranks_export_to_full_tensors_bitwise(fsdp2_step, tmp_path, capsys) -> None:
    directory, reference = fsdp2_step
    assert len(reference) == 6  # three Linear layers, each sharded unevenly (33 rows on 2 ranks)
    assert read_manifest(open_storage(directory), 3).world_size == 2
    out = str(tmp_path / "model.safetensors")
    assert run_cli(["export", directory, "--out", out]) == 0
    assert f"exported step 3 (model weights) to {out}" in capsys.readouterr().out
    _assert_bitwise(safetensors.torch.load_file(out), reference)
    with safetensors.safe_open(out, "pt") as handle:
        assert handle.metadata() == {"format": "pt", "torchckpt_step": "3"}  # "pt": transformers 4.x needs it
    assert export_model_weights(directory, tmp_path / "again.safetensors", step=3) == 3
    _assert_bitwise(safetensors.torch.load_file(str(tmp_path / "again.safetensors")), reference)


def test_one_process_sharded_step_exports_like_an_unsharded_one(tmp_path) -> None:
    model = tiny_model()
    optimizer = torch.optim.AdamW(model.parameters())
    trained(model, optimizer)
    with Checkpointer(tmp_path / "sharded", sharded=True) as ckpt:
        ckpt.save(3, model=model, optimizer=optimizer)
    with Checkpointer(tmp_path / "plain") as ckpt:
        ckpt.save(3, model=model, optimizer=optimizer)
    assert export_model_weights(tmp_path / "sharded", tmp_path / "sharded.safetensors") == 3
    assert export_model_weights(tmp_path / "plain", tmp_path / "plain.safetensors") == 3
    sharded = safetensors.torch.load_file(str(tmp_path / "sharded.safetensors"))
    _assert_bitwise(sharded, model.state_dict())  # num_batches_tracked (int64) too
    _assert_bitwise(sharded, safetensors.torch.load_file(str(tmp_path / "plain.safetensors")))


def test_an_item_other_than_a_module_is_refused_naming_the_module_items(fsdp2_step, tmp_path, capsys) -> None:
    directory, _ = fsdp2_step
    out = tmp_path / "w.safetensors"
    for item, what in [("optimizer", "an optimizer"), ("extras", "a rank-local item"), ("nope", "not in this step")]:
        with pytest.raises(CheckpointMismatchError, match=f"item '{item}' is {what}.*Module items: \\['model'\\]; "
                                                          "every item: \\['extras', 'model', 'optimizer'\\]"):
            export_model_weights(directory, out, item=item)
    assert run_cli(["export", directory, "--out", str(out), "--item", "optimizer"]) == 2
    assert "is an optimizer" in capsys.readouterr().err
    assert not out.exists() and not list(tmp_path.iterdir())  # nothing written, no temp file left


def test_a_corrupt_sharded_step_is_skipped_with_a_warning(tmp_path) -> None:
    model = tiny_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    run = tmp_path / "run"
    with Checkpointer(run) as ckpt:  # an older unsharded step: export falls back across formats
        ckpt.save(1, model=model)
    before = {key: t.clone() for key, t in model.state_dict().items()}
    trained(model, optimizer)
    with Checkpointer(run, sharded=True) as ckpt:
        ckpt.save(2, model=model, optimizer=optimizer)
    step_dir = os.path.join(run, step_dir_name(2))
    _, locations = decode_index(Path(step_dir, INDEX_NAME).read_bytes(), INDEX_NAME)
    where = locations[chunk_key("model.0.weight", [0, 0])]
    with open(os.path.join(step_dir, where.file), "r+b") as handle:  # same size: only the block hashes tell
        handle.seek(where.offset + 5)
        byte = handle.read(1)
        handle.seek(where.offset + 5)
        handle.write(bytes([byte[0] ^ 0xFF]))
    out = tmp_path / "w.safetensors"
    with pytest.raises(CheckpointCorruptError, match="step 2 is corrupt, nothing was exported.*hash mismatch"):
        export_model_weights(run, out, step=2)
    with pytest.warns(CheckpointFallbackWarning, match="exported step 1; skipped corrupt newer step"):
        assert export_model_weights(run, out) == 1
    _assert_bitwise(safetensors.torch.load_file(str(out)), before)
