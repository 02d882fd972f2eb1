"""Which manifest hash: throughput of each candidate against the time a save spends writing.

Usage: .venv/bin/python bench/state/bench_hash.py [--mib 256] [--repeats 3]

Prints a markdown table (the one in docs/state.md) and writes bench/state/results/hash.json.
Timing is measured here, never asserted in tests (Note: [timing is never asserted]); compare ratios within one run.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time

import torch

from torchckpt.state import Checkpointer
from torchckpt.state.format.hashing import HASH_ALGORITHMS, hash_bytes
from torchckpt.state.storage.local import LocalStorage


def _median_s(action, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        action()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _available_algorithms() -> list[str]:
    names = []
    for name in HASH_ALGORITHMS:
        try:
            hash_bytes(b"x", name)
            names.append(name)
        except ValueError:  # an optional library (xxhash) is missing
            pass
    return names


def _write_time_s(data: bytes, directory: str, repeats: int) -> float:
    storage = LocalStorage(directory)

    def write_one() -> None:
        writer = storage.begin_step(0)
        writer.write("blob.safetensors", [data], len(data))
        writer.abort()

    return _median_s(write_one, repeats)


def _model_state(mib: int) -> torch.nn.Module:
    width = int((mib * (1 << 20) / 4 / 3 / 4) ** 0.5)  # 4 square layers; params + 2 AdamW moments
    model = torch.nn.Sequential(*[torch.nn.Linear(width, width, bias=False) for _ in range(4)])
    return model


def _save_times_s(algorithm: str, model, optimizer, directory: str, repeats: int,
                  async_save: bool) -> tuple[float, float]:
    """(time save() blocks, total time until committed), medians."""
    blocking, total = [], []
    with Checkpointer(os.path.join(directory, f"{algorithm}-{async_save}"), hash_algorithm=algorithm,
                      keep_last=1, async_save=async_save) as ckpt:
        for step in range(1, repeats + 1):
            start = time.perf_counter()
            ckpt.save(step, model=model, optimizer=optimizer)
            blocking.append(time.perf_counter() - start)
            ckpt.wait()
            total.append(time.perf_counter() - start)
    return statistics.median(blocking), statistics.median(total)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mib", type=int, default=256, help="bytes hashed and written per measurement")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--dir", default=None, help="where to write (default: a temp dir on /tmp's disk)")
    args = parser.parse_args()
    torch.manual_seed(0)
    data = torch.randn(args.mib * (1 << 20) // 4).numpy().tobytes()
    directory = args.dir or tempfile.mkdtemp(prefix="torchckpt-bench-")
    write_s = _write_time_s(data, directory, args.repeats)
    rows = []
    for name in _available_algorithms():
        hash_s = _median_s(lambda name=name: hash_bytes(data, name), args.repeats)
        rows.append({"algorithm": name, "hash_mib_per_s": args.mib / hash_s, "hash_s": hash_s,
                     "write_fsync_s": write_s, "hash_over_write": hash_s / write_s})
    model = _model_state(args.mib)
    optimizer = torch.optim.AdamW(model.parameters())
    model(torch.randn(2, model[0].in_features)).sum().backward()
    optimizer.step()
    for row in rows:
        row["save_sync_s"] = _save_times_s(row["algorithm"], model, optimizer, directory, args.repeats, False)[1]
        blocking_s, total_s = _save_times_s(row["algorithm"], model, optimizer, directory, args.repeats, True)
        row["save_async_blocking_s"], row["save_async_total_s"] = blocking_s, total_s
    print(f"{args.mib} MiB per measurement; write+fsync {args.mib / write_s:.0f} MiB/s ({write_s:.3f} s)\n")
    print("| hash | MiB/s | hash s | hash / write | full save (sync) s | async save blocks s | async total s |")
    print("|---|---|---|---|---|---|---|")
    for row in rows:
        print(f"| {row['algorithm']} | {row['hash_mib_per_s']:.0f} | {row['hash_s']:.3f} "
              f"| {row['hash_over_write']:.2f} | {row['save_sync_s']:.3f} | {row['save_async_blocking_s']:.3f} "
              f"| {row['save_async_total_s']:.3f} |")
    out_dir = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, "hash.json"), "w") as handle:
        json.dump({"mib": args.mib, "repeats": args.repeats, "cpu_count": os.cpu_count(), "rows": rows}, handle,
                  indent=1)


if __name__ == "__main__":
    main()
