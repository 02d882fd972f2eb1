"""Process RSS against the exact meter, in a fresh process with glibc's mmap threshold lowered."""

from __future__ import annotations

import json
import os
import subprocess
import sys

_SCRIPT = r"""
import json, torch
from torchckpt.memory import MemoryMeter, read_rss_bytes
torch.manual_seed(0)
model = torch.nn.Sequential(*[torch.nn.Sequential(torch.nn.Linear(1024, 1024), torch.nn.ReLU()) for _ in range(12)])
x = torch.randn(4096, 1024)
# Warm-up step at full size, under a meter too: the first dispatch-mode step in a process pays one-off
# costs (lazy imports inside torch, kernel and thread-pool set-up) that are not tensor memory.
with MemoryMeter():
    model(x).sum().backward()
model.zero_grad(set_to_none=False)
with MemoryMeter() as meter:
    rss_start = read_rss_bytes()[0]
    model(x).sum().backward()
    rss_peak = meter.peak_rss_bytes
print(json.dumps({"meter": meter.peak_bytes - meter.baseline_bytes, "rss": rss_peak - rss_start}))
"""


def test_rss_follows_meter_within_ten_percent() -> None:
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="65536", OMP_NUM_THREADS="1")
    result = subprocess.run([sys.executable, "-c", _SCRIPT], env=env, capture_output=True, text=True, timeout=300,
                            check=True)
    figures = json.loads(result.stdout.strip().splitlines()[-1])
    assert figures["meter"] > 200 * 2**20, figures  # the step allocates more than 200 MB
    assert abs(figures["rss"] - figures["meter"]) <= 0.10 * figures["meter"], figures
