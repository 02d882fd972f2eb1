"""bench/below_every_block.py on a tiny decoder, into tmp_path: floors per option, a verified plan at the floor,
interleaved timings at every block's peak, and AdamW floors with and without the optimizer in backward or its state
in host memory."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "bench" / "below_every_block.py"


@pytest.mark.slow  # 19 s; tests/bench/test_bench_quick.py runs the harness fast
def test_writes_floors_a_verified_plan_and_timings(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    pytest.importorskip("transformers")
    spec = importlib.util.spec_from_file_location("bench_below_every_block", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    assert module.main(["--models", "hf-llama-tiny", "--repeats", "1", "--out-dir", str(tmp_path)]) == 0
    results = json.loads((tmp_path / "below_every_block.json").read_text())
    assert len(results["commit"]) == 40 or results["commit"] == "unknown"
    (model,) = results["models"]
    floors = model["floors"]
    assert floors["both"] <= min(floors["pieces nested"], floors["loss head in chunks"]) <= floors["before"]
    assert floors["before"] <= model["every_block_peak_bytes"]
    for key in ("at_floor", "at_sliced_floor"):  # with batch slices too: within budget, predicted, gradients
        at_floor = model[key]
        assert at_floor["within_budget"] and at_floor["gradients_equal"] and abs(at_floor["prediction_error"]) <= 0.01
    assert floors["batch slices (4)"] <= floors["both"] and "slices of the batch" in model["batch_slices_note"]
    times = model["at_every_block_peak"]["times"]
    assert set(times) == {"no checkpointing", "every block", "torchckpt"}
    assert all(t["median_s"] > 0 for t in times.values())
    adamw = model["adamw"]
    assert adamw["floor_in_backward_bytes"] > 0
    parts = adamw["floor_parts"]  # the AdamW floor's parts sum to it, and to the floor the bench reports
    assert parts["floor_bytes"] == adamw["floor_bytes"] == sum(parts[key] for key in (
        "parameters_bytes", "optimizer_state_bytes", "outside_bytes", "checkpoint_bytes", "other_held_bytes",
        "own_bytes", "margin_bytes"))
    assert parts["optimizer_state_bytes"] == adamw["state_bytes"]["optimizer_state"] > 0
    offloaded = adamw["floor_offload_parts"]  # the state in host memory: only AdamW's scalar step counters stay
    assert offloaded["optimizer_state_bytes"] < parts["optimizer_state_bytes"] // 100
    assert adamw["floor_offload_bytes"] == offloaded["floor_bytes"] < adamw["floor_bytes"]
    at_floor = adamw["at_offload_floor"]  # a whole step, the update inside: within budget, parameters bitwise
    assert at_floor["within_budget"] and at_floor["gradients_equal"] and abs(at_floor["prediction_error"]) <= 0.01
    text = (tmp_path / "below_every_block.md").read_text()
    assert text.startswith("# Below every block") and "## What the AdamW floor is made of" in text
    assert "hf-llama-tiny" in capsys.readouterr().out
