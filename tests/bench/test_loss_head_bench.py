"""bench/loss_head.py: the floor with the loss head in chunks and plans there, on a tiny decoder, into tmp_path."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "bench" / "loss_head.py"


def test_writes_the_floor_and_two_verified_plans(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    pytest.importorskip("transformers")
    spec = importlib.util.spec_from_file_location("bench_loss_head", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    assert module.main(["--models", "hf-llama-tiny", "--out-dir", str(tmp_path)]) == 0
    results = json.loads((tmp_path / "loss_head.json").read_text())
    assert len(results["commit"]) == 40 or results["commit"] == "unknown"
    (model,) = results["models"]
    assert model["loss_head"]["path"] == "lm_head" and model["floor_bytes"] < model["every_block_peak_bytes"]
    assert [p["label"] for p in model["plans"]] == ["floor", "0.6x every block"]
    for made in model["plans"]:
        assert made["within_budget"] and made["gradients_equal"] and abs(made["prediction_error"]) <= 0.01
        assert made["loss_head"]["path"] == "lm_head" and made["rounding_only"] == ["lm_head.weight"]
    assert (tmp_path / "loss_head.md").read_text().startswith("# The loss head in chunks")
    assert "hf-llama-tiny" in capsys.readouterr().out
