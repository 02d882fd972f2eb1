"""What runs inside each benchmark process: one method on one model, or the planner.

Protocol (the parent is ``harness._Process``): the worker builds its model, applies its method, runs
the warm-up steps and answers ``("ready", info)``; then it answers each command ``(name, argument)``
with ``("ok", result)`` or ``("error", message)`` until ``close``. A method that does not apply to the
model answers ``("n/a", reason)`` instead of ready and exits.

Fairness rules kept here (bench/README.md lists them all; named in ``docs/design.md``):

1. **[same seed, same steps]** Every process builds the model and batch from the same seed, uses
   AdamW(lr=1e-4) and runs the same sequence of steps: ``warmup`` training steps, one measured step (its
   gradients are compared), then timed steps. Each step seeds the RNG first (same dropout masks
   everywhere); so methods that compute exactly the same gradients keep exactly the same parameters
   throughout.
2. **[peak on its own step]** Peak memory is measured on its own step (the meter's dispatch mode slows a
   step down); timed steps run without it. The reference gradients are loaded after the forward+backward
   peak is read. A timed step is forward, backward, ``optimizer.step()`` and ``zero_grad``.
3. **[RSS around every timed step]** Peak process RSS is read around every timed step (high-water mark
   reset first).
"""

from __future__ import annotations

import json
import sys
import time
import traceback
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import torch

import torchckpt
from torchckpt._host import host_bytes
from torchckpt._progress import phase
from torchckpt.memory import MemoryMeter
from torchckpt.memory.rss import read_rss_bytes, reset_peak_rss
from torchckpt.planner import StepRunner, block_paths
from torchckpt.planner.verify import compare_gradients, loss_head_parameters

from .methods import MethodSpec, NotApplicableError, apply_method
from .models import count_parameters, get_model

__all__ = ["LEARNING_RATE", "method_worker", "planner_worker"]

LEARNING_RATE = 1e-4
_WARMUP_SEED, _MEASURED_SEED, _TIMED_SEED = 100, 300, 400


def _short_error(error: BaseException) -> str:
    lines = traceback.format_exception_only(type(error), error)
    return " ".join(line.strip() for line in lines)[:2000]


class _MethodRun:
    """One model under one method, with its optimizer; the commands the parent sends."""

    def __init__(self, model_name: str, spec: MethodSpec, warmup: int) -> None:
        entry = get_model(model_name)
        self.spec = spec
        start = time.perf_counter()
        self.model, self.inputs = entry.build()
        blocks = entry.blocks(self.model)
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=LEARNING_RATE)
        runnable, _ = apply_method(spec, self.model, blocks, self.inputs)
        self.runner = StepRunner(runnable, self.inputs)
        self.info: dict[str, Any] = {"parameters": count_parameters(self.model), "blocks": len(blocks),
                                     "threads": torch.get_num_threads()}
        for k in range(warmup):
            self._train_step(_WARMUP_SEED + k)
        self.info["warmup_steps"] = warmup
        self.info["warmup_s"] = time.perf_counter() - start

    def _forward_backward(self, seed: int) -> None:
        torch.manual_seed(seed)
        self.runner.forward_backward()

    def _train_step(self, seed: int) -> None:
        self._forward_backward(seed)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)

    def measure(self, argument: dict) -> dict:
        """One training step, measured: the forward+backward peak (MemoryMeter), its gradients saved as
        the reference or compared bitwise with it, then the optimizer step's own peak."""
        torch.manual_seed(_MEASURED_SEED)
        result: dict[str, Any] = {}
        if self.spec.kind == "compile":
            self.runner.forward_backward()
            result.update(peak_bytes=None, baseline_bytes=None, optimizer_peak_bytes=None,
                          meter_note="MemoryMeter sees tensors made through the dispatcher; inductor's compiled "
                                     "code allocates its buffers outside it, so only RSS is reported")
        else:
            with MemoryMeter() as meter:
                self.runner.forward_backward()
            result.update(peak_bytes=meter.peak_bytes, baseline_bytes=meter.baseline_bytes)
        result.update(self._compare_gradients(argument))
        if self.spec.kind == "compile":
            self.optimizer.step()
        else:
            with MemoryMeter() as optimizer_meter:
                self.optimizer.step()
            result["optimizer_peak_bytes"] = optimizer_meter.peak_bytes
        self.optimizer.zero_grad(set_to_none=True)
        return result

    def _compare_gradients(self, argument: dict) -> dict:
        grads = [p.grad for p in self.model.parameters()]
        if argument["save"]:
            torch.save(grads, argument["path"])
            return {"equal": True, "max_abs_diff": 0.0}
        reference = torch.load(argument["path"], weights_only=True)
        # A chunked loss head's weight gradient is compared to rounding, as verify_plan does; after the warm-up's
        # optimizer steps that rounding has reached every parameter, so all are compared so.
        rounding: set[int] = set()
        if self.spec.kind == "torchckpt" and self.spec.plan_path:
            plan = torchckpt.Plan.load(self.spec.plan_path)
            head = {index for index, _ in loss_head_parameters(self.model, plan)}
            rounding = set(range(len(grads))) if head and self.info.get("warmup_steps") else head

        def host(tensors: list) -> list:
            return [(None if t is None else host_bytes(t), p.dtype) for t, p in zip(tensors, self.model.parameters())]

        equal, difference, relative = compare_gradients(host(grads), host(reference), rounding)
        return {"equal": bool(equal and len(reference) == len(grads)), "max_abs_diff": float(difference),
                "to_rounding": bool(rounding), "relative_diff": float(relative)}

    def time(self, index: int) -> dict:
        """One timed training step (seeded by ``index``, the same in every process) and its peak RSS."""
        before, _ = read_rss_bytes()
        reset_peak_rss()
        start = time.perf_counter()
        self._train_step(_TIMED_SEED + index)
        elapsed = time.perf_counter() - start
        return {"step_s": elapsed, "peak_rss_bytes": read_rss_bytes()[1], "rss_before_bytes": before}


def _serve(conn: Connection, target: Any) -> None:
    while True:
        command, argument = conn.recv()
        if command == "close":
            conn.send(("ok", None))
            return
        try:
            conn.send(("ok", getattr(target, command)(argument)))
        except Exception as error:  # noqa: BLE001 - reported to the parent, which records it
            conn.send(("error", _short_error(error)))


def method_worker(conn: Connection, model_name: str, spec: MethodSpec, warmup: int, threads: int) -> None:
    """Process entry point: run ``spec`` on ``model_name`` with ``threads`` torch threads and serve commands."""
    torch.set_num_threads(threads)
    try:
        run = _MethodRun(model_name, spec, warmup)
    except NotApplicableError as reason:
        conn.send(("n/a", str(reason)))
        return
    except Exception as error:  # noqa: BLE001 - reported to the parent, which records it
        conn.send(("error", _short_error(error)))
        return
    conn.send(("ready", run.info))
    _serve(conn, run)


# --------------------------------------------------------------------------------------------- planner
def make_plans(model_name: str, peer_budgets: dict[str, int], sweep_points: int, out_dir: str) -> dict:
    """Profile ``model_name`` once (with AdamW) and solve for each peer's budget and a sweep of budgets.

    Returns timings, the floor, the predicted plain peak and one entry per budget: the plan's file,
    predicted peak and extra time, the least extra time any schedule could have there
    (``lower_bound_s``: ``solve.recompute_lower_bound``, None where its relaxation fits nothing), solve
    time, or the error (an infeasible budget names the floor).

    Example:
        >>> import tempfile
        >>> result = make_plans("gpt-tiny", {}, 2, tempfile.mkdtemp())
        >>> len(result["plans"]), result["plans"][0]["label"]
        (2, 'sweep 1/2')
    """
    from torchckpt.planner import fingerprint, no_checkpointing_schedule, plan_from_costs, profile
    from torchckpt.planner import solve as solver
    from torchckpt.planner.from_costs import floor_over_options, lower_bound_over_options, resolve_margin

    entry = get_model(model_name)
    model, inputs = entry.build()
    blocks = entry.blocks(model)
    paths = block_paths(model, blocks)
    optimizer = torch.optim.AdamW(model.parameters(), lr=LEARNING_RATE)
    start = time.perf_counter()
    costs = profile(model, inputs, optimizer=optimizer, blocks=blocks)
    profile_s = time.perf_counter() - start
    floor = int(floor_over_options(costs, allow_regions=True, margin_bytes=costs.margin_bytes))
    plain, _ = solver.evaluate(costs, no_checkpointing_schedule(costs))
    model_print = fingerprint(model, inputs, paths)
    budgets = dict(peer_budgets)
    for k in range(sweep_points):
        fraction = k / max(1, sweep_points - 1)
        budgets[f"sweep {k + 1}/{sweep_points}"] = int(floor + (int(plain) - floor) * fraction)
    plans = []
    for i, (label, budget) in enumerate(budgets.items()):
        item: dict[str, Any] = {"label": label, "budget_bytes": int(budget)}
        phase(f"solving for {label} ({i + 1}/{len(budgets)})")
        start = time.perf_counter()
        try:
            made = plan_from_costs(costs, int(budget), block_paths=paths, model_fingerprint=model_print)
        except ValueError as error:  # InfeasibleBudgetError names the floor
            item["error"] = _short_error(error)
        else:
            path = Path(out_dir) / f"plan-{i}.json"
            made.save(path)
            margin = resolve_margin("auto", costs, int(budget))
            item.update(plan_path=str(path), predicted_peak_bytes=made.predicted_peak_bytes,
                        predicted_extra_time_s=made.predicted_extra_time_s,
                        lower_bound_s=lower_bound_over_options(costs, int(budget), margin_bytes=margin),
                        schedule=json.loads(made.to_json())["schedule"], table=made.table())
        item["solve_s"] = time.perf_counter() - start
        plans.append(item)
    return {"profile_s": profile_s, "floor_bytes": floor, "plain_predicted_peak_bytes": int(plain),
            "headroom_bytes": int(costs.notes.get("headroom_bytes", 0)), "chain": costs.notes.get("chain"),
            "plans": plans}


def planner_worker(conn: Connection, model_name: str, peer_budgets: dict[str, int], sweep_points: int,
                   out_dir: str, threads: int) -> None:
    """Process entry point: :func:`make_plans`, answered as ``("ok", result)`` or ``("error", message)``; its
    phases (each profiling step, each budget solved) as plain lines on stdout, beside the benchmark's log."""
    from torchckpt.train.status import reported

    torch.set_num_threads(threads)
    try:
        with reported(f"  {model_name}: planning", live=False, stream=sys.stdout):
            conn.send(("ok", make_plans(model_name, peer_budgets, sweep_points, out_dir)))
    except Exception as error:  # noqa: BLE001 - recorded as "planner: <error>"
        conn.send(("error", _short_error(error)))
