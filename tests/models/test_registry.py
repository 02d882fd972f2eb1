"""The one model registry: every entry builds deterministically, blocks are the planner's blocks, and a
bad spec raises one ModelSpecError naming the problem."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from torchckpt.models import MODELS, BatchShape, ModelEntry, ModelSpecError, get_model, load_model, register
from torchckpt.planner import find_blocks

BUILT_IN = [name for name in MODELS if not name.startswith("hf-") and name not in ("gpt-medium", "unet-medium")]


@pytest.mark.parametrize("name", BUILT_IN)
def test_built_in_entries_build_the_same_model_twice(name: str) -> None:
    entry = get_model(name)
    (first, batch), (second, again) = entry.build(), entry.build()
    assert first.training
    assert all(torch.equal(a, b) for a, b in zip(first.state_dict().values(), second.state_dict().values()))
    assert all(torch.equal(a, b) for a, b in zip(batch, again))
    blocks = entry.blocks(first)
    assert blocks and all(isinstance(block, torch.nn.Module) for block in blocks)
    if name.startswith(("gpt", "mlp")):  # the registry's blocks are the planner's automatic ones
        assert find_blocks(first)[1] == blocks


def test_hf_entry_builds_with_a_shape_given() -> None:
    model, inputs = get_model("hf-llama-tiny").build(shape=BatchShape(batch_size=3, seq_len=16))
    assert tuple(inputs["input_ids"].shape) == (3, 16) and inputs["use_cache"] is False
    assert len(get_model("hf-llama-tiny").blocks(model)) == 4


def test_shape_overrides_the_entry_default() -> None:
    _, batch = load_model("gpt-tiny", BatchShape(batch_size=3, seq_len=8))
    assert tuple(batch[0].shape) == (3, 8)
    _, images = load_model("unet-tiny", BatchShape(batch_size=1, image_size=16))
    assert tuple(images[0].shape)[0] == 1 and tuple(images[0].shape)[-1] == 16


def test_a_factory_file_is_loaded(tmp_path: Path) -> None:
    path = tmp_path / "mine.py"
    path.write_text("import torch\n\ndef pair():\n    return torch.nn.Linear(2, 2), (torch.ones(1, 2),)\n")
    model, inputs = load_model(f"{path}:pair")
    assert isinstance(model, torch.nn.Linear) and tuple(inputs[0].shape) == (1, 2)


@pytest.mark.parametrize(("spec", "message"), [
    ("gpt-huge", "unknown; use one of gpt-small"),
    ("missing.py:make", "file missing.py not found; give path/to/file.py:factory"),
    ("{file}:nope", "has no callable 'nope'"),
    ("{file}:bare", "the model has no example_batch(); return (model, example_inputs)"),
])
def test_bad_specs_name_the_problem(tmp_path: Path, spec: str, message: str) -> None:
    path = tmp_path / "user.py"
    path.write_text("import torch\n\ndef bare():\n    return torch.nn.Linear(2, 2)\n")
    with pytest.raises(ModelSpecError) as caught:
        load_model(spec.replace("{file}", str(path)))
    assert message in str(caught.value)


def test_registry_refuses_a_duplicate_name_and_bad_shapes() -> None:
    entry = get_model("gpt-tiny")
    with pytest.raises(ValueError, match="'gpt-tiny' is already registered"):
        register(entry)
    with pytest.raises(ValueError, match="ModelEntry.name must be a non-empty word"):
        ModelEntry(name="two words", description="", make=entry.make, shape=entry.shape, blocks=entry.blocks,
                   family="gpt")
    with pytest.raises(ValueError, match=r"BatchShape\.batch_size must be >= 1; got BatchShape\.batch_size=0"):
        BatchShape(batch_size=0)
    with pytest.raises(ModelSpecError, match="unknown model 'nope'; choose from gpt-small"):
        get_model("nope")
