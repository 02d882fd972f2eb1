"""Plans under DDP and FSDP2, proved in real processes: per-rank budgets, measured peaks, exact gradients.

``prove(kind, model_name, world, budgets)`` starts ``world`` processes (``torch.multiprocessing``, the
gloo backend, CPU). Each builds the same model (seed 0) and its own batch (seed = rank), wraps it
(``"fsdp"``: ``fully_shard`` on every block, then on the root, as torchtitan does; ``"ddp"``:
``DistributedDataParallel``, optionally ``static_graph``), takes one AdamW step so the optimizer state
exists, profiles once (every rank, planner/distributed.py's [a distributed model is planned by all its
ranks]) and, for each
budget (a share of the per-rank plain peak), makes the plan and measures it with ``verify_plan``:
measured peak on this rank, predicted peak, gradients and buffers against the same distributed step
without the plan, bitwise. For FSDP2 it also counts the all-gathers of a plain and a planned step.

Example (2 processes, seconds):
    >>> records = prove("ddp", "gpt-tiny", 2, ("70%",))  # doctest: +SKIP
    >>> all(r["plans"][0]["gradients_equal"] for r in records)  # doctest: +SKIP
    True
"""

from __future__ import annotations

import datetime
import gc
import json
import os
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from torchckpt._testing import free_port

__all__ = ["KINDS", "prove"]

KINDS = ("ddp", "ddp-static", "fsdp")
_TIMEOUT = datetime.timedelta(seconds=180)
_STRAGGLER_S = 20.0
_DDP_STEPS = 3


class _CountAllGathers:
    """Counts FSDP2's all-gathers (``torch.distributed.all_gather_single``/``all_gather_into_tensor``)."""

    def __init__(self) -> None:
        import torch.distributed as dist

        self.count = 0
        self._dist = dist
        self._names = [n for n in ("all_gather_single", "all_gather_into_tensor") if hasattr(dist, n)]
        self._originals: dict[str, Any] = {}

    def __enter__(self) -> _CountAllGathers:
        for name in self._names:
            original = getattr(self._dist, name)
            self._originals[name] = original

            def counted(*args: Any, _original: Any = original, **kwargs: Any) -> Any:
                self.count += 1
                return _original(*args, **kwargs)

            setattr(self._dist, name, counted)
        return self

    def __exit__(self, *exc_info: Any) -> None:
        for name, original in self._originals.items():
            setattr(self._dist, name, original)


def _wrap(kind: str, model: torch.nn.Module, blocks: list[torch.nn.Module]) -> torch.nn.Module:
    if kind == "fsdp":
        from torch.distributed.fsdp import fully_shard

        for block in blocks:
            fully_shard(block)
        fully_shard(model)
        return model
    from torch.nn.parallel import DistributedDataParallel

    return DistributedDataParallel(model, static_graph=kind == "ddp-static")


def _rank_main(rank: int, world: int, port: int, kind: str, model_name: str, budgets: Sequence[str | int] | int,
               out_dir: str, offload: bool = False) -> None:
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=_TIMEOUT)
    torch.set_num_threads(1)
    record: dict[str, Any] = {"rank": rank, "world": world, "kind": kind, "model": model_name, "plans": []}
    try:
        _prove_on_rank(record, rank, kind, model_name, budgets, offload)
    except Exception as error:  # noqa: BLE001 - reported to the parent, named
        record["error"] = f"{type(error).__name__}: {error}"
    finally:
        # The model, its DDP reducer and FSDP state are gone with _prove_on_rank's frame (and the error's
        # traceback) before the group is: a DDP reducer destroyed after its group sometimes hung at exit.
        gc.collect()
        Path(out_dir, f".rank{rank}.tmp").write_text(json.dumps(record))  # whole, or not there: _wait reads it
        os.replace(Path(out_dir, f".rank{rank}.tmp"), Path(out_dir, f"rank{rank}.json"))
        dist.destroy_process_group()


def _prove_on_rank(record: dict[str, Any], rank: int, kind: str, model_name: str,
                   budgets: Sequence[str | int] | int, offload: bool = False) -> None:
    """One rank's part of ``prove``: fills ``record``."""
    from torchckpt.planner import apply_plan, profile, verify_plan
    from torchckpt.planner.runner import StepRunner

    from .models import get_model

    entry = get_model(model_name)
    model, _ = entry.build(seed=0)
    inputs = entry.build(seed=rank)[1]  # each rank its own batch (its model is dropped here)
    blocks = entry.blocks(model)
    record["parameter_bytes"] = sum(p.numel() * p.element_size() for p in model.parameters())
    wrapped = _wrap(kind, model, blocks)
    optimizer = torch.optim.AdamW(wrapped.parameters(), lr=1e-3)
    runner = StepRunner(wrapped, inputs, None, optimizer)
    _step(runner)
    runner.optimizer_step()  # the optimizer state exists, as in training
    costs = profile(wrapped, inputs, optimizer=optimizer, blocks=blocks, offload=offload)
    record.update(fixed_bytes=costs.fixed_bytes, notes=dict(costs.notes), offload=dict(costs.offload))
    if isinstance(budgets, int):  # a sweep from the floor to no checkpointing's predicted peak
        from torchckpt.planner import no_checkpointing_schedule
        from torchckpt.planner import solve as solver

        floor = solver.floor_bytes(costs, margin_bytes=costs.margin_bytes)  # with offload where measured
        plain, _ = solver.evaluate(costs, no_checkpointing_schedule(costs))
        budgets = [int(floor + (plain - floor) * k / max(1, budgets - 1)) for k in range(budgets)]
    for budget in budgets:
        made = costs.plan(budget)
        report = verify_plan(wrapped, made, inputs)
        item = {"budget": budget, "budget_bytes": made.budget_bytes,
                "predicted_peak_bytes": made.predicted_peak_bytes,
                "measured_peak_bytes": report.measured_peak_bytes,
                "no_checkpointing_peak_bytes": report.no_checkpointing_peak_bytes,
                "gradients_equal": report.gradients_equal, "buffers_equal": report.buffers_equal,
                "plan": made.to_json(), "offloaded": sum(1 for piece in made.schedule if getattr(piece, "offload", 0))}
        if kind == "fsdp":
            with _CountAllGathers() as gathers_plain:
                _step(runner)
            with apply_plan(wrapped, made), _CountAllGathers() as gathers_planned:
                _step(runner)
            runner.clear_grads()
            item.update(all_gathers_plain=gathers_plain.count, all_gathers_planned=gathers_planned.count)
        else:  # DDP (static_graph checks its graph from the second iteration on): steps in a row, plan applied
            with apply_plan(wrapped, made):
                for _ in range(_DDP_STEPS):
                    _step(runner)
            runner.clear_grads()
            item["ddp_steps_with_plan"] = _DDP_STEPS
        record["plans"].append(item)


def _wait(context: Any, out_dir: str, world: int, timeout_s: float, what: str) -> None:
    """Join the ranks of ``context``; kill them all and raise RuntimeError on a deadline (see ``prove``)."""
    started = time.monotonic()
    first_failure: float | None = None
    while not _joined(context, what):
        now = time.monotonic()
        if first_failure is None and any("error" in json.loads(path.read_text())
                                         for path in Path(out_dir).glob("rank*.json")):
            first_failure = now
        late = now - started > timeout_s or (first_failure is not None and now - first_failure > _STRAGGLER_S)
        if late:
            running = [rank for rank, process in enumerate(context.processes) if process.is_alive()]
            for process in context.processes:
                process.kill()
            for process in context.processes:
                process.join(5)
            finished = {p.stem for p in Path(out_dir).glob("rank*.json")}
            errors = [f"rank {r}: {json.loads(Path(out_dir, r + '.json').read_text()).get('error', 'finished')}"
                      for r in sorted(finished)]
            raise RuntimeError(f"{what}: ranks {running} were still running after "
                               f"{now - started:.0f} s and were killed; " + ("; ".join(errors) or "no rank finished"))
    if len(list(Path(out_dir).glob("rank*.json"))) != world:
        raise RuntimeError(f"{what}: a rank exited without its record")


def _joined(context: Any, what: str) -> bool:
    try:
        return bool(context.join(timeout=0.5))
    except Exception as error:  # a rank died (a signal, a crash outside the record's try): the rest are killed
        raise RuntimeError(f"{what}: {error}") from error


def _step(runner: Any) -> None:
    """One forward and backward (no optimizer step: the counted steps leave the parameters alone)."""
    runner.clear_grads()
    runner.forward_backward()


def prove(kind: str, model_name: str, world: int, budgets: Sequence[str | int] | int,
          timeout_s: float = 600.0, offload: bool = False) -> list[dict[str, Any]]:
    """Run ``world`` ranks of ``kind`` (``KINDS``) on ``model_name`` at ``budgets``; one record per rank.

    ``budgets``: budgets as ``torchckpt.plan`` takes them (per rank), or an int ``n``: ``n`` budgets evenly
    from the floor (the least feasible, margin included) to no checkpointing's predicted peak. ``offload``:
    profiled with ``offload=True`` (the floor then counts offloaded blocks).

    Raises ValueError for an unknown kind, a world below 2 or no budgets; RuntimeError naming the rank
    and its error when a rank failed, or the ranks still running after ``timeout_s`` seconds (or
    ``_STRAGGLER_S`` after another rank failed: it waits in a collective the failed rank will never
    join), which are then killed: a stuck rank never hangs the caller.
    """
    if kind not in KINDS:
        raise ValueError(f"prove(kind={kind!r}): expected one of {', '.join(KINDS)}")
    if isinstance(world, bool) or not isinstance(world, int) or world < 2:
        raise ValueError(f"prove(world={world!r}): a process group here has at least 2 ranks")
    if isinstance(budgets, bool) or (isinstance(budgets, int) and budgets < 1) or not budgets:
        raise ValueError(f"prove(budgets={budgets!r}): give budgets such as ('60%',) or a number of budgets >= 1")
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory() as out_dir:
        chosen = budgets if isinstance(budgets, int) else tuple(budgets)
        context = mp.start_processes(_rank_main, args=(world, free_port(), kind, model_name, chosen, out_dir, offload),
                                     nprocs=world, join=False, start_method="spawn")
        _wait(context, out_dir, world, timeout_s, f"{kind} on {model_name} with {world} ranks")
        records = [json.loads(Path(out_dir, f"rank{rank}.json").read_text()) for rank in range(world)]
    failed = [f"rank {r['rank']}: {r['error']}" for r in records if "error" in r]
    if failed:
        raise RuntimeError(f"{kind} on {model_name} with {world} ranks failed: " + "; ".join(failed))
    return records
