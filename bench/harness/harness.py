"""Run every method on every model, each in its own process, interleaved; collect one JSON-able result.

Order of work for one model (numbered so bench/README.md can refer to it):

1. Peers: for each peer, start its process (build, apply, warm up) and take the measured step (peak
   memory; the ``none`` process saves the reference gradients, every other process compares bitwise
   with them). One process works at a time; the others wait idle on their pipe.
2. Planner: a separate process profiles the model and solves for each peer's measured peak and for
   ``sweep_points`` budgets from the floor to the predicted plain peak, timing both.
3. torchckpt: one process per distinct plan (plans with identical schedules share one), as in 1.
4. Timing: ``repeats`` rounds; in each round every live process takes one timed step, in an order
   rotated by one each round, so that machine noise falls on all methods alike.
5. All processes are closed; a model's failures are recorded in its results, never raised.
"""

from __future__ import annotations

import datetime
import multiprocessing
import os
import platform
import statistics
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from torchckpt._units import check_positive_int

from .methods import PEER_KINDS, MethodSpec
from .models import (
    FULL_MODELS,
    QUICK_MODELS,
    get_model,
    uses_transformers,
)
from .provenance import git_commit
from .worker import method_worker, planner_worker

__all__ = ["PEER_LABELS", "BenchConfig", "run_benchmark"]

PEER_LABELS: dict[str, str] = {
    "none": "no checkpointing",
    "every_block": "every block (HF)",
    "sequential": "checkpoint_sequential sqrt(L)",
    "selective_op": "selective op (torchtitan)",
    "dots_saveable": "dots_saveable (JAX)",
}
_MMAP_THRESHOLD = "65536"


@dataclass(frozen=True, kw_only=True)
class BenchConfig:
    """Options of one benchmark run; checked when built.

    Example:
        >>> BenchConfig.quick_preset(out_dir="/tmp/x").models
        ('gpt-tiny', 'hf-llama-tiny')
        >>> BenchConfig(repeats=0)
        Traceback (most recent call last):
        ...
        ValueError: BenchConfig.repeats must be >= 1; got BenchConfig.repeats=0. Pass a positive count.
    """

    models: tuple[str, ...] = FULL_MODELS
    peers: tuple[str, ...] = PEER_KINDS
    repeats: int = 3
    sweep_points: int = 4
    warmup_steps: int = 1
    threads: int = 1
    with_compile: bool = False
    compile_budgets: tuple[float, ...] = (0.1, 0.3, 0.5, 0.7)
    name: str = "bench"
    out_dir: str = "bench/results"
    time_cap_s: float = 1800.0
    command_timeout_s: float = 900.0
    quick: bool = False
    extra: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        for option in ("repeats", "warmup_steps", "threads"):
            check_positive_int(f"BenchConfig.{option}", getattr(self, option))
        if not isinstance(self.sweep_points, int) or self.sweep_points < 2:
            raise ValueError(f"BenchConfig.sweep_points must be an int >= 2 (the floor and the plain peak); "
                             f"got {self.sweep_points!r}")
        if not self.models:
            raise ValueError("BenchConfig.models is empty; name at least one model, e.g. ('gpt-small',)")
        for name in self.models:
            get_model(name)  # raises, listing the registered names
        unknown = [kind for kind in self.peers if kind not in PEER_KINDS]
        if unknown or "none" not in self.peers:
            raise ValueError(f"BenchConfig.peers={self.peers!r}: use kinds from {', '.join(PEER_KINDS)}, always "
                             "including 'none' (the reference for gradients and step-time ratios)")
        for budget in self.compile_budgets:
            if not 0 <= budget <= 1:
                raise ValueError(f"BenchConfig.compile_budgets: {budget!r} is outside [0, 1]")
        if not self.name or "/" in self.name:
            raise ValueError(f"BenchConfig.name must be a file name without '/'; got {self.name!r}")
        if self.time_cap_s <= 0 or self.command_timeout_s <= 0:
            raise ValueError("BenchConfig.time_cap_s and command_timeout_s must be positive")

    @classmethod
    def quick_preset(cls, **overrides: Any) -> BenchConfig:
        """Tiny models, two budgets, one repetition: what CI runs (tests/bench/test_bench_quick.py)."""
        options: dict[str, Any] = {"models": QUICK_MODELS, "repeats": 1, "sweep_points": 2, "name": "quick",
                                   "quick": True, "command_timeout_s": 120.0}
        options.update(overrides)
        return cls(**options)


class _Process:
    """A worker process and the parent's end of its pipe; every wait has a timeout."""

    def __init__(self, context: Any, target: Callable[..., None], args: tuple) -> None:
        self.conn, child = context.Pipe()
        # Not daemonic: torch.compile may start its own compile subprocesses.
        self.process = context.Process(target=target, args=(child, *args), daemon=False)
        self.process.start()
        child.close()

    def receive(self, timeout_s: float) -> tuple[str, Any]:
        if not self.conn.poll(timeout_s):
            self.kill()
            return "error", f"no answer within {timeout_s:.0f} s; the process was stopped"
        try:
            return self.conn.recv()
        except (EOFError, ConnectionError):
            self.process.join(5)
            return "error", f"the process died (exit code {self.process.exitcode}; killed for memory?)"

    def request(self, command: str, argument: Any, timeout_s: float) -> tuple[str, Any]:
        try:
            self.conn.send((command, argument))
        except (BrokenPipeError, ConnectionError):
            return "error", f"the process is gone (exit code {self.process.exitcode})"
        return self.receive(timeout_s)

    def close(self) -> None:
        if self.process.is_alive():
            self.request("close", None, 30.0)
        self.process.join(10)
        if self.process.is_alive():
            self.kill()
        self.conn.close()

    def kill(self) -> None:
        if self.process.is_alive():
            self.process.kill()  # this process only, by its own handle
        self.process.join(10)


def _context(models: tuple[str, ...]) -> Any:
    """A forkserver that has imported torch (and transformers) once: workers start clean and fast."""
    os.environ.setdefault("MALLOC_MMAP_THRESHOLD_", _MMAP_THRESHOLD)  # read by glibc when the server starts
    context = multiprocessing.get_context("forkserver")
    preload = ["torch", f"{__package__}.worker"]  # this package, however it was imported
    if uses_transformers(models):
        preload += ["transformers", "transformers.models.llama.modeling_llama",
                    "transformers.models.gpt2.modeling_gpt2", "transformers.models.t5.modeling_t5"]
    context.set_forkserver_preload(preload)
    return context


def _stats(values: list[float]) -> dict[str, Any]:
    return {"median": statistics.median(values), "min": min(values), "max": max(values), "all": values}


class _ModelBench:
    """Steps 1-5 of the module docstring for one model."""

    def __init__(self, context: Any, model_name: str, config: BenchConfig, log: Callable[[str], None]) -> None:
        self.context, self.name, self.config, self.log = context, model_name, config, log
        self.workdir = tempfile.mkdtemp(prefix=f"torchckpt-bench-{model_name}-")
        self.reference = str(Path(self.workdir) / "reference_grads.pt")
        self.runs: list[dict[str, Any]] = []
        self.live: list[tuple[dict[str, Any], _Process]] = []
        self.result: dict[str, Any] = {"name": model_name, "description": get_model(model_name).description}

    def run(self) -> dict[str, Any]:
        try:
            self._peers()
            if not self._reference_ok():
                return self._finish()
            self._plans()
            self._time()
        finally:
            for _, process in self.live:
                process.close()
        return self._finish()

    # ----------------------------------------------------------------- steps 1 and 3
    def _peer_specs(self) -> list[MethodSpec]:
        specs = [MethodSpec(kind=kind, label=PEER_LABELS[kind]) for kind in PEER_KINDS if kind in self.config.peers]
        if self.config.with_compile:
            specs += [MethodSpec(kind="compile", label=f"torch.compile budget {b:g}", compile_budget=b)
                      for b in self.config.compile_budgets]
        return specs

    def _peers(self) -> None:
        for spec in self._peer_specs():
            self._start(spec, {"label": spec.label, "kind": spec.kind, "compile_budget": spec.compile_budget})

    def _reference_ok(self) -> bool:
        none = self.runs[0]
        if none["status"] != "ok":
            self.result["error"] = f"no checkpointing failed, so nothing can be compared: {none.get('reason')}"
        return none["status"] == "ok"

    def _start(self, spec: MethodSpec, run: dict[str, Any]) -> None:
        self.runs.append(run)
        timeout = self.config.command_timeout_s
        self.log(f"  {self.name}: {spec.label} ...")
        start = time.perf_counter()
        process = _Process(self.context, method_worker, (self.name, spec, self.config.warmup_steps,
                                                               self.config.threads))
        status, info = process.receive(timeout)
        run["start_s"] = time.perf_counter() - start
        if status != "ready":
            run.update(status="n/a" if status == "n/a" else "error", reason=str(info))
            process.close()
            self.log(f"    {run['status']}: {info}")
            return
        run.update(info)
        began = time.perf_counter()
        status, answer = process.request("measure", {"save": spec.kind == "none", "path": self.reference}, timeout)
        run["measure_s"] = time.perf_counter() - began
        if status != "ok":
            run.update(status="error", reason=f"measured step: {answer}")
            process.close()
            self.log(f"    error: {answer}")
            return
        run.update(answer)
        run["status"] = "ok"
        run["step_s"], run["peak_rss_bytes_all"], run["rss_before_bytes_all"] = [], [], []
        self.live.append((run, process))

    # ----------------------------------------------------------------- step 2
    def _plans(self) -> None:
        peer_budgets = {run["label"]: run["peak_bytes"] for run in self.runs
                        if run["status"] == "ok" and run.get("peak_bytes") is not None}
        self.log(f"  {self.name}: planning (profile once, {len(peer_budgets) + self.config.sweep_points} budgets) ...")
        process = _Process(self.context, planner_worker,
                           (self.name, {f"at {k} peak": v for k, v in peer_budgets.items()},
                            self.config.sweep_points, self.workdir, self.config.threads))
        status, answer = process.receive(self.config.command_timeout_s)
        process.close()
        if status != "ok":
            self.result["planning"] = {"error": f"planner: {answer}"}
            self.log(f"    planner: {answer}")
            return
        self.result["planning"] = {k: v for k, v in answer.items() if k != "plans"}
        by_schedule: dict[str, dict[str, Any]] = {}
        for item in answer["plans"]:
            target = item["label"][3:-5] if item["label"].startswith("at ") else None
            run = {"label": f"torchckpt {item['label']}", "kind": "torchckpt", "target": target,
                   **{k: v for k, v in item.items() if k not in ("label", "schedule")}}
            if "error" in item:
                run.update(status="error", reason=f"planner: {item['error']}")
                self.runs.append(run)
                continue
            key = repr(item["schedule"])
            if key in by_schedule:  # the same plan as an earlier budget: measured once, reported for both
                run["same_plan_as"] = by_schedule[key]["label"]
                self.runs.append(run)
                continue
            by_schedule[key] = run
            spec = MethodSpec(kind="torchckpt", label=run["label"], plan_path=item["plan_path"],
                              budget_bytes=item["budget_bytes"])
            self._start(spec, run)

    # ----------------------------------------------------------------- step 4
    def _time(self) -> None:
        for round_index in range(self.config.repeats):
            live = list(self.live)
            if not live:
                return
            shift = round_index % len(live)
            self.log(f"  {self.name}: timing round {round_index + 1}/{self.config.repeats} ({len(live)} methods)")
            for run, process in live[shift:] + live[:shift]:
                status, answer = process.request("time", round_index, self.config.command_timeout_s)
                if status != "ok":
                    run.update(status="error", reason=f"timed step: {answer}")
                    process.close()
                    self.live.remove((run, process))
                    continue
                run["step_s"].append(answer["step_s"])
                self.log(f"    {run['label']}: {answer['step_s']:.3f} s")
                run["peak_rss_bytes_all"].append(answer["peak_rss_bytes"])
                run["rss_before_bytes_all"].append(answer["rss_before_bytes"])

    # ----------------------------------------------------------------- derived figures
    def _finish(self) -> dict[str, Any]:
        by_label = {run["label"]: run for run in self.runs}
        for run in self.runs:
            source = by_label.get(run.get("same_plan_as", ""))
            if source is not None:
                for key in ("status", "reason", "peak_bytes", "baseline_bytes", "optimizer_peak_bytes", "equal",
                            "max_abs_diff", "step_s", "peak_rss_bytes_all", "rss_before_bytes_all", "parameters",
                            "blocks"):
                    if key in source:
                        run[key] = source[key]
        none = self.runs[0] if self.runs else {}
        none_time = statistics.median(none["step_s"]) if none.get("step_s") else None
        for run in self.runs:
            if run.get("step_s"):
                run["step_time"] = _stats(run["step_s"])
                run["ratio_to_none"] = run["step_time"]["median"] / none_time if none_time else None
                run["peak_rss_bytes"] = max(run["peak_rss_bytes_all"])
                # What a step adds to the process (compiled code and imported modules are in both figures).
                run["rss_step_growth_bytes"] = max(peak - before for peak, before in
                                                   zip(run["peak_rss_bytes_all"], run["rss_before_bytes_all"]))
            elif run.get("status") == "ok":
                run.update(status="error", reason="no timed step finished")
            if run["kind"] == "torchckpt" and run.get("peak_bytes") is not None:
                run["within_budget"] = run["peak_bytes"] <= run["budget_bytes"]
                run["prediction_error"] = (run["predicted_peak_bytes"] - run["peak_bytes"]) / run["peak_bytes"]
        planning = self.result.get("planning", {})
        if none_time and "profile_s" in planning:
            solves = [run["solve_s"] for run in self.runs if "solve_s" in run]
            planning["plain_step_s"] = none_time
            planning["solve_s_median"] = statistics.median(solves) if solves else 0.0
            planning["planning_in_steps"] = (planning["profile_s"] + planning["solve_s_median"]) / none_time
        self.result["runs"] = self.runs
        return self.result


def _machine() -> dict[str, Any]:
    try:
        import transformers
        transformers_version = transformers.__version__
    except ImportError:
        transformers_version = None
    return {"platform": platform.platform(), "python": platform.python_version(), "torch": torch.__version__,
            "transformers": transformers_version, "cpu_count": os.cpu_count(),
            "malloc_mmap_threshold": os.environ.get("MALLOC_MMAP_THRESHOLD_"),
            "load_average_at_start": list(os.getloadavg())}


def run_benchmark(config: BenchConfig, log: Callable[[str], None] = print,
                  after_model: Callable[[dict[str, Any]], object] | None = None) -> dict[str, Any]:
    """Run the benchmark described by ``config``; return the results (not yet written; see ``report``).

    Models left when ``config.time_cap_s`` has passed are recorded as skipped, not run.
    ``after_model(results)`` is called after each model (the command line writes partial reports there);
    what it returns is ignored.

    Example:
        >>> results = run_benchmark(BenchConfig.quick_preset(models=("gpt-tiny",)), log=lambda s: None)
        ... # doctest: +SKIP
        >>> results["models"][0]["runs"][0]["label"]  # doctest: +SKIP
        'no checkpointing'
    """
    context = _context(config.models)
    started = time.monotonic()
    machine = {**_machine(), "threads": config.threads}
    results: dict[str, Any] = {"name": config.name, "commit": git_commit(Path(__file__).parent),
                               "config": asdict(config), "machine": machine,
                               "started": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                               "models": []}
    for name in config.models:
        elapsed = time.monotonic() - started
        if elapsed > config.time_cap_s:
            results["models"].append({"name": name, "description": get_model(name).description,
                                      "skipped": f"time cap of {config.time_cap_s:.0f} s reached after {elapsed:.0f} s",
                                      "runs": []})
            log(f"{name}: skipped (time cap)")
            continue
        log(f"{name}: {get_model(name).description}")
        model_start = time.monotonic()
        result = _ModelBench(context, name, config, log).run()
        result["wall_s"] = time.monotonic() - model_start
        results["models"].append(result)
        results["wall_s"] = time.monotonic() - started
        if after_model is not None:
            after_model(results)
    results["wall_s"] = time.monotonic() - started
    results["machine"]["load_average_at_end"] = list(os.getloadavg())
    return results
