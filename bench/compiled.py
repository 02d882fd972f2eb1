"""torch.compile: torchckpt's compiled plan against compile's own ``activation_memory_budget``, at compile's peaks.

torch.compile's min-cut partitioner takes a memory budget as a fraction
(``torch._functorch.config.activation_memory_budget``: 1.0 keeps its default choices, 0.0 recomputes all it
can); its peak is not monotonic in that fraction (pytorch#197838), so each fraction's peak is measured. For
each fraction ``b``:

1. **bytes**: compile's step is measured with the ``aot_eager_decomp_partition`` backend (inductor's
   decompositions and partitioner, but every op of the compiled graphs dispatches through the meter, so
   ``MemoryMeter`` measures the compiled step exactly: meter.py's [compiled code is measured where its ops
   dispatch]); that peak ``P_b`` is the budget of a torchckpt plan (one eager profile, solved per budget),
   and the plan, applied and compiled the same way, is measured too (it must fit ``P_b``);
2. **time**: compile at ``b`` and the plan at ``P_b`` run under ``backend`` (inductor by default), each in
   its own process, steps interleaved across processes; median of the timed steps, min-max, and each
   process's peak RSS (``MALLOC_MMAP_THRESHOLD_=65536``; inductor's buffers are invisible to the meter).

Target (tracker: plans on torch's own machinery, item 2): at every compile fraction's measured peak the
torchckpt plan's compiled step is no slower (median ratio <= 1.0). Gradients of every method are compared
with compiled no-checkpointing under the same backend (max abs difference; inductor fuses differently).

    MALLOC_MMAP_THRESHOLD_=65536 .venv/bin/python bench/compiled.py           # gpt small 8 x 256, ~15 min
    .venv/bin/python bench/compiled.py --quick                                 # gpt tiny, aot_eager only, ~1 min

Results: ``bench/results/compiled.json`` (commit, machine, load average before and after).
"""

from __future__ import annotations

import argparse
import multiprocessing
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from harness.provenance import run_record, write_results

RESULTS = Path(__file__).parent / "results"
BYTES_BACKEND = "aot_eager_decomp_partition"


def _model(quick: bool) -> tuple[torch.nn.Module, tuple]:
    from torchckpt.models import gpt

    torch.manual_seed(0)
    model = gpt("tiny" if quick else "small", dropout=0.0)
    return model, model.example_batch(batch_size=4 if quick else 8, seq_len=64 if quick else 256)


def _worker(conn: Any, spec: dict[str, Any]) -> None:
    """One method in its own process: build, apply, compile, warm up; then answer "measure" / "time" / "stop"."""
    try:
        import torch._functorch.config as functorch_config

        import torchckpt
        from torchckpt.memory import MemoryMeter
        from torchckpt.memory.rss import read_rss_bytes, reset_peak_rss

        torch.set_num_threads(1)
        model, batch = _model(spec["quick"])
        if spec["kind"] == "compile":
            functorch_config.activation_memory_budget = spec["fraction"]
        if spec["kind"] == "torchckpt":
            torchckpt.apply(model, torchckpt.Plan.from_json(spec["plan"]))
        compiled = torch.compile(model, backend=spec["backend"])

        def step() -> None:
            model.zero_grad(set_to_none=True)
            compiled(*batch).backward()

        start = time.perf_counter()
        step()
        step()  # a second warm-up: some backends finish compiling the backward on first use
        conn.send(("ready", {"compile_s": time.perf_counter() - start}))
        while True:
            command, argument = conn.recv()
            if command == "measure":
                model.zero_grad(set_to_none=True)
                with MemoryMeter() as meter:
                    compiled(*batch).backward()
                np.savez(argument, *[p.grad.numpy() for p in model.parameters()])
                conn.send(("ok", {"peak_bytes": meter.peak_bytes}))
            elif command == "time":
                model.zero_grad(set_to_none=True)
                reset_peak_rss()
                start = time.perf_counter()
                compiled(*batch).backward()
                conn.send(("ok", {"step_s": time.perf_counter() - start, "peak_rss_bytes": read_rss_bytes()[1]}))
            else:
                conn.send(("ok", None))
                return
    except Exception as error:  # reported to the parent, which records it
        conn.send(("error", f"{type(error).__name__}: {error}"))


class _Method:
    def __init__(self, context: Any, label: str, spec: dict[str, Any]) -> None:
        self.label, self.spec = label, spec
        self.conn, child = context.Pipe()
        self.process = context.Process(target=_worker, args=(child, spec))
        self.process.start()
        status, info = self._receive()
        if status != "ready":
            self.close()
            raise RuntimeError(f"{label}: {info}")
        self.info = info

    def _receive(self, timeout_s: float = 1800) -> tuple[str, Any]:
        if not self.conn.poll(timeout_s):
            raise TimeoutError(f"{self.label}: no answer in {timeout_s:.0f} s")
        answer: tuple[str, Any] = self.conn.recv()
        return answer

    def ask(self, command: str, argument: Any = None) -> Any:
        self.conn.send((command, argument))
        status, answer = self._receive()
        if status != "ok":
            raise RuntimeError(f"{self.label}: {answer}")
        return answer

    def close(self) -> None:
        if self.process.is_alive():
            try:
                self.conn.send(("stop", None))
            except OSError:
                pass
            self.process.join(60)
        if self.process.is_alive():
            self.process.kill()


def _max_diff(path: str, reference: str) -> float:
    got, expected = np.load(path), np.load(reference)
    return max(float(np.abs(got[k] - expected[k]).max()) for k in expected.files)


def _stats(values: list[float]) -> dict[str, Any]:
    return {"median_s": statistics.median(values), "min_s": min(values), "max_s": max(values), "steps": len(values)}


def run(quick: bool, fractions: list[float], backend: str, rounds: int, log: Any = print) -> dict[str, Any]:
    """Both phases for one model; see the module docstring."""
    import torchckpt

    context = multiprocessing.get_context("spawn")
    work = tempfile.mkdtemp(prefix="torchckpt-compiled-")
    model, batch = _model(quick)
    torch.set_num_threads(1)
    costs = torchckpt.profile(model, batch)
    rows: list[dict[str, Any]] = []

    # phase 1: bytes, exact, under inductor's partitioner
    reference_bytes = f"{work}/none-bytes.npz"
    plain = _Method(context, "none", {"kind": "none", "backend": BYTES_BACKEND, "quick": quick})
    plain_peak = plain.ask("measure", reference_bytes)["peak_bytes"]
    plain.close()
    log(f"compiled no checkpointing ({BYTES_BACKEND}): peak {plain_peak}")
    for fraction in fractions:
        row: dict[str, Any] = {"fraction": fraction}
        peer = _Method(context, f"compile {fraction:g}", {"kind": "compile", "fraction": fraction,
                                                           "backend": BYTES_BACKEND, "quick": quick})
        row["compile_peak_bytes"] = peer.ask("measure", f"{work}/compile-{fraction}.npz")["peak_bytes"]
        peer.close()
        try:
            plan = costs.plan(row["compile_peak_bytes"])
        except torchckpt.InfeasibleBudgetError as error:
            row["plan_error"] = str(error).split(".")[0]
            rows.append(row)
            log(f"compile {fraction:g}: peak {row['compile_peak_bytes']}: no plan fits ({row['plan_error']})")
            continue
        row["plan"] = plan.to_json()
        row["predicted_peak_bytes"] = plan.predicted_peak_bytes
        ours = _Method(context, f"torchckpt at compile {fraction:g}", {"kind": "torchckpt", "plan": row["plan"],
                                                                      "backend": BYTES_BACKEND, "quick": quick})
        path = f"{work}/plan-{fraction}.npz"
        row["torchckpt_peak_bytes"] = ours.ask("measure", path)["peak_bytes"]
        row["torchckpt_max_grad_diff_vs_none"] = _max_diff(path, reference_bytes)
        ours.close()
        row["within_budget"] = row["torchckpt_peak_bytes"] <= row["compile_peak_bytes"]
        rows.append(row)
        log(f"compile {fraction:g}: peak {row['compile_peak_bytes']}; torchckpt plan at it: "
            f"{row['torchckpt_peak_bytes']} (predicted {row['predicted_peak_bytes']})")

    # phase 2: time (and RSS) under the backend users train with, interleaved
    methods = {"none": _Method(context, "none", {"kind": "none", "backend": backend, "quick": quick})}
    reference = f"{work}/none-time.npz"
    methods["none"].ask("measure", reference)
    for row in rows:
        if "plan" not in row:
            continue
        fraction = row["fraction"]
        methods[f"compile {fraction:g}"] = _Method(context, f"compile {fraction:g}", {
            "kind": "compile", "fraction": fraction, "backend": backend, "quick": quick})
        methods[f"torchckpt at compile {fraction:g}"] = _Method(context, f"torchckpt at compile {fraction:g}", {
            "kind": "torchckpt", "plan": row["plan"], "backend": backend, "quick": quick})
    times: dict[str, list[float]] = {label: [] for label in methods}
    rss: dict[str, int] = dict.fromkeys(methods, 0)
    diffs = {}
    for label, method in methods.items():
        if label != "none":
            path = f"{work}/{label.replace(' ', '_')}-time.npz"
            method.ask("measure", path)
            diffs[label] = _max_diff(path, reference)
    labels = list(methods)
    for r in range(rounds):
        log(f"timing round {r + 1}/{rounds}")
        for label in labels[r % len(labels):] + labels[:r % len(labels)]:
            answer = methods[label].ask("time")
            times[label].append(answer["step_s"])
            rss[label] = max(rss[label], answer["peak_rss_bytes"])
    for method in methods.values():
        method.close()
    timed = {label: {**_stats(t), "peak_rss_bytes": rss[label], "compile_s": methods[label].info["compile_s"],
                     "max_grad_diff_vs_none": diffs.get(label, 0.0)} for label, t in times.items()}
    for row in rows:
        if "plan" not in row:
            continue
        ours, theirs = timed[f"torchckpt at compile {row['fraction']:g}"], timed[f"compile {row['fraction']:g}"]
        row["ratio"] = ours["median_s"] / theirs["median_s"]
        row["met"] = row["ratio"] <= 1.0 and row["within_budget"]
        row["rss_torchckpt_minus_compile_bytes"] = ours["peak_rss_bytes"] - theirs["peak_rss_bytes"]
        del row["plan"]
    return {"model": "gpt tiny 4 x 64" if quick else "gpt small 8 x 256", "plain_peak_bytes": plain_peak,
            "backend": backend, "bytes_backend": BYTES_BACKEND, "budgets": rows, "timed": timed}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """Run the benchmark; write and return the results.

    Example:
        >>> import tempfile
        >>> out = main(["--quick", "--out", tempfile.mkdtemp()])  # doctest: +ELLIPSIS
        compiled ...
        >>> all(row["within_budget"] for row in out["results"]["budgets"] if "within_budget" in row)
        True
    """
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="gpt tiny, aot_eager_decomp_partition only, 2 rounds")
    parser.add_argument("--fractions", default=None, help="activation_memory_budget values (default 1,0.5,0.2,0)")
    parser.add_argument("--backend", default=None, help="backend of the timed steps (default inductor)")
    parser.add_argument("--rounds", type=int, default=None, help="timed rounds (default 7; 2 quick)")
    parser.add_argument("--out", default=str(RESULTS), help="folder for compiled.json")
    args = parser.parse_args(argv)
    try:
        fractions = [float(f) for f in (args.fractions or ("1,0" if args.quick else "1,0.5,0.2,0")).split(",")]
    except ValueError:
        raise SystemExit(f"compiled: --fractions {args.fractions!r}: give comma-separated numbers in [0, 1]") from None
    if not all(0 <= f <= 1 for f in fractions):
        raise SystemExit(f"compiled: --fractions {args.fractions!r}: every value must be in [0, 1]")
    backend = args.backend or (BYTES_BACKEND if args.quick else "inductor")
    rounds = args.rounds or (2 if args.quick else 7)
    results = run_record(Path(__file__).parent, threads=1, rounds=rounds, quick=args.quick)
    results["results"] = run(args.quick, fractions, backend, rounds, log=lambda line: print(line, flush=True))
    summary = "; ".join(f"at compile {row['fraction']:g}: {row['ratio']:.3f}x" for row in results["results"]["budgets"]
                        if "ratio" in row)
    print(f"compiled {results['results']['model']}: torchckpt / compile step time {summary}", flush=True)
    write_results(results, args.out, "compiled.json")
    return results


if __name__ == "__main__":
    main(sys.argv[1:])
    sys.exit(0)
