"""The CUDA validation kit runs end to end on the CPU (``--device cpu --quick``), so that a session lent a
GPU spends its minutes on the GPU's numbers, not on the script's bugs. Each figure is checked against an
exact reference: analytic bytes, the plan's own budget, the uncheckpointed gradients, the saved state."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow  # 22 s; the CUDA check script's dry run
def test_the_dry_run_passes_every_section(tmp_path: Path) -> None:
    env = {**os.environ, "PY": sys.executable}
    done = subprocess.run(["bash", str(ROOT / "bench" / "cuda_check.sh"), "--device", "cpu", "--quick",
                           "--out", str(tmp_path)], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    [path] = tmp_path.glob("cuda-*.json")
    results = json.loads(path.read_text())
    sections = results["sections"]
    assert {name: record["status"] for name, record in sections.items()} == dict.fromkeys(
        ("meter", "decoder", "speed", "offload", "state", "optimizer_offload"), "ok"), {
            n: r.get("error") for n, r in sections.items()}
    assert sections["meter"]["meter_peak_bytes"] == sections["meter"]["analytic_peak_bytes"] == 48 << 20
    decoder = sections["decoder"]
    assert decoder["within_budget"] and decoder["measured_peak_bytes"] <= decoder["budget_bytes"]
    assert decoder["gradients_equal"] and decoder["buffers_equal"]  # bitwise on the CPU
    speed = sections["speed"]["methods"]
    assert set(speed) == {"no checkpointing", "torch.utils.checkpoint every block", "selective op (torchtitan)",
                          "torchckpt plan at every block's peak"}
    assert all(row["steps"] == 2 for row in speed.values())
    assert speed["torchckpt plan at every block's peak"]["peak_bytes"] <= sections["speed"]["every_block_peak_bytes"]
    offload = sections["offload"]
    for where in ("at_every_block_peak", "at_floor"):
        verified = offload[where]
        assert verified["within_budget"] and verified["gradients_equal"] and verified["buffers_equal"], where
        assert verified["measured_peak_bytes"] <= verified["predicted_peak_bytes"], where
        assert verified["measured_host_peak_bytes"] == verified["predicted_host_peak_bytes"], where
    assert offload["floor_bytes"] <= offload["every_block_peak_bytes"]
    assert {"no checkpointing", "torchckpt plan with offload"} <= set(offload["methods"])
    moved = sections["optimizer_offload"]  # AdamW's state in host memory: a lower floor, the step within its budget
    floors = moved["floors"]
    assert floors["state in host memory"] < floors["state on the device"] <= moved["every_block_peak_bytes"]
    assert moved["at_floor"]["within_budget"] and moved["at_floor"]["parameters_equal"]
    steps = moved["steps"]
    assert steps["torchckpt, state in host memory, at its floor"]["peak_bytes"] <= floors["state in host memory"]
    state = sections["state"]
    assert state["valid"] == [True] and state["model_bitwise"] and state["optimizer_bitwise"]
    assert len(results["commit"]) == 40 or results["commit"] == "unknown"


def test_cuda_without_a_gpu_is_one_clear_line(tmp_path: Path) -> None:
    import torch

    from cuda_check import main

    if torch.cuda.is_available():
        pytest.skip("a GPU is here")
    with pytest.raises(SystemExit, match="CUDA is not available here; pass --device cpu for a dry run"):
        main(["--out", str(tmp_path)])
    with pytest.raises(SystemExit, match="--device tpu: use cuda, cuda:N or cpu"):
        main(["--device", "tpu", "--out", str(tmp_path)])
