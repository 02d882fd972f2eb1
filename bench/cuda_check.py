"""The CUDA validation kit: the checks a session lent a GPU runs once (``bench/cuda_check.sh``).

Six sections, each recorded as ``ok`` or ``failed`` with the error, so that one failure loses nothing
else; the results file is rewritten after every section, so a run cut short keeps what it finished:

1. ``meter``: ``MemoryMeter`` on the device against analytic bytes and the caching allocator's own
   ``max_memory_allocated`` / ``max_memory_reserved``.
2. ``decoder``: an HF Llama built from a config (about 0.56 B parameters; a tiny one with ``--quick``),
   planned at ``--budget`` and checked with ``verify_plan``: predicted against measured peak (allocated),
   the reserved peak of a step under the plan, gradients and buffers against the model without a plan,
   and the time planning took.
3. ``speed``: the same model, steps interleaved over rounds: no checkpointing, ``torch.utils.checkpoint``
   around every block, torchtitan's selective-op checkpointing (both by torch's own mechanisms,
   ``harness.methods``) and a torchckpt plan made at the every-block method's measured peak; median step
   time with min-max, peaks, and the ratio to every block.
4. ``offload``: the same model profiled with ``offload=True`` (costs.py's [offloaded blocks]): a plan at every
   block's measured peak and one at the floor with offload, each verified (predicted against measured device
   peak, host bytes, gradients and buffers bitwise); the floor against every block's peak; then interleaved
   steps: no checkpointing, every block, the plan without offload and with it at every block's peak, and the
   offload peers at their own peaks (``save_on_cpu`` around every block, as HF's ``offload=True``; SAC's
   ``MUST_CPU_OFFLOAD`` on matmul outputs, in eager), each with its step time over no checkpointing.
5. ``state``: an async ``Checkpointer`` save of the CUDA model and its AdamW state (the staging buffer is
   pinned for CUDA tensors), restored bitwise into a fresh model; blocking and total save times.
6. ``optimizer_offload``: the same model with AdamW, profiled with its state on the device and in pinned host
   memory (``optimizer_offload=True``): both floors against every block's peak with the state on the device;
   the plan at the offloaded floor verified over a whole step (the update inside the measured peak, parameters
   after it compared bitwise); then whole training steps (forward, backward, ``optimizer.step()``) interleaved:
   every block with the state on the device, and the offloaded plan at every block's peak and at its floor, each
   with its peak and its time over the first.

``--device cpu --quick`` runs the same code on the CPU in seconds; ``tests/bench/test_cuda_check.py``
does, so every path but the CUDA calls themselves is exercised without a GPU.

Example:
    >>> import tempfile
    >>> out = tempfile.mkdtemp()
    >>> path = main(["--device", "cpu", "--quick", "--only", "meter", "--out", out])  # doctest: +ELLIPSIS
    cuda_check meter: ok (... s)
    >>> json.load(open(path))["sections"]["meter"]["status"]
    'ok'
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import os
import platform
import statistics
import tempfile
import time
import traceback
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

from harness.provenance import git_commit
from torchckpt.memory import MemoryMeter, synchronize

__all__ = ["SECTIONS", "main"]

SECTIONS = ("meter", "decoder", "speed", "offload", "state", "optimizer_offload")
_MIB = 1 << 20


def _reserved(device: torch.device) -> int | None:
    return torch.cuda.max_memory_reserved(device) if device.type == "cuda" else None


def check_meter(device: torch.device) -> dict[str, Any]:
    """Three allocations whose peak is known: 16 MiB + 16 MiB, free one, then 32 MiB (peak 48 MiB)."""
    n = 4 * _MIB  # float32 elements: 16 MiB
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        start_allocated = torch.cuda.memory_allocated(device)
    with MemoryMeter(device, include_existing=False) as meter:
        a = torch.empty(n, device=device)
        b = torch.empty(n, device=device)
        del a
        c = torch.empty(2 * n, device=device)
        del b, c
    result: dict[str, Any] = {"analytic_peak_bytes": 48 * _MIB, "meter_peak_bytes": meter.peak_bytes,
                              "meter_exact": meter.peak_bytes == 48 * _MIB}
    if device.type == "cuda":
        allocator_peak = torch.cuda.max_memory_allocated(device) - start_allocated
        result.update(allocator_peak_bytes=allocator_peak, reserved_peak_bytes=torch.cuda.max_memory_reserved(device),
                      meter_equals_allocator=meter.peak_bytes == allocator_peak)
    return result


def build_decoder(quick: bool, device: torch.device, batch_size: int, seq_len: int) -> tuple[Any, dict, list]:
    """An HF Llama from a config, on ``device``, with a batch of token ids as its own labels."""
    from transformers import LlamaConfig, LlamaForCausalLM

    sizes: dict[str, Any] = (dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
                  num_attention_heads=4, num_key_value_heads=2) if quick else
             dict(vocab_size=32000, hidden_size=1280, intermediate_size=3456, num_hidden_layers=24,
                  num_attention_heads=20, num_key_value_heads=4))
    sizes.update(max_position_embeddings=max(seq_len, 16), use_cache=False, attn_implementation="sdpa")
    config = LlamaConfig(**sizes)
    torch.manual_seed(0)
    model: Any = LlamaForCausalLM(config)
    model = model.to(device).train()
    ids = torch.randint(0, config.vocab_size, (batch_size, seq_len), device=device)
    return model, {"input_ids": ids, "labels": ids}, list(model.model.layers)


def _step(model: Any, batch: dict, device: torch.device) -> tuple[float, int, int | None]:
    """One forward and backward, gradients dropped: (seconds, allocated peak, reserved peak)."""
    from torchckpt.planner.runner import StepRunner

    runner = StepRunner(model, batch)
    if device.type == "cuda":  # the reserved peak of this step alone, not of blocks cached by earlier steps
        synchronize(device)
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
    synchronize(device)
    start = time.perf_counter()
    with MemoryMeter(device) as meter:  # synchronizes at exit on CUDA
        runner.forward_backward()
    elapsed = time.perf_counter() - start
    runner.clear_grads()
    return elapsed, meter.peak_bytes, _reserved(device)


def check_decoder(device: torch.device, quick: bool, budget: str, batch_size: int, seq_len: int) -> dict[str, Any]:
    """Plan the decoder at ``budget``, verify it, and measure the reserved peak of a step under the plan."""
    import torchckpt

    model, batch, _ = build_decoder(quick, device, batch_size, seq_len)
    parameters = sum(p.numel() for p in model.parameters())
    start = time.perf_counter()
    floor_note: dict[str, Any] = {}
    try:
        plan = torchckpt.plan(model, batch, budget=budget)
    except torchckpt.InfeasibleBudgetError as error:
        if not quick:
            raise
        # --quick's tiny decoder on CUDA: the cuBLAS workspaces (tens of MiB, counted by the allocator)
        # can put every fraction of the plain peak below the floor; plan at the floor the solver names.
        floor_note = {"requested_budget_infeasible": str(error).split(". ")[0], "planned_at": "floor"}
        plan = torchckpt.plan(model, batch, budget=error.floor_bytes)
    planning_s = time.perf_counter() - start
    report = torchckpt.verify_plan(model, plan, batch)
    handle = torchckpt.apply(model, plan)
    try:
        _, allocated, reserved = _step(model, batch, device)
    finally:
        handle.remove()
    return {**floor_note, "parameters": parameters, "batch": [batch_size, seq_len], "budget": budget,
            "budget_bytes": plan.budget_bytes, "predicted_peak_bytes": plan.predicted_peak_bytes,
            "measured_peak_bytes": report.measured_peak_bytes, "within_budget": report.within_budget,
            "prediction_error": report.prediction_error,
            "no_checkpointing_peak_bytes": report.no_checkpointing_peak_bytes,
            "step_peak_allocated_bytes": allocated, "step_peak_reserved_bytes": reserved,
            "gradients_equal": report.gradients_equal, "max_gradient_difference": report.max_gradient_difference,
            "buffers_equal": report.buffers_equal, "planning_s": planning_s,
            "plan_step_s": report.step_time_s, "plain_step_s": report.no_checkpointing_step_time_s}


def _applied(spec: Any, model: Any, blocks: list, batch: dict) -> Callable[[], None]:
    """Apply a peer method (``harness.methods``) to ``model``; returns its undo."""
    from harness.methods import apply_method

    return apply_method(spec, model, blocks, batch)[1]


def check_speed(device: torch.device, quick: bool, batch_size: int, seq_len: int, rounds: int) -> dict[str, Any]:
    """Interleaved steps of each method on one model; the plan gets every block's measured peak as budget."""
    import torchckpt
    from harness.methods import MethodSpec, apply_method

    model, batch, blocks = build_decoder(quick, device, batch_size, seq_len)
    every = MethodSpec(kind="every_block", label="torch.utils.checkpoint every block")
    _, undo = apply_method(every, model, blocks, batch)
    try:
        _step(model, batch, device)  # warm-up
        every_peak = _step(model, batch, device)[1]
    finally:
        undo()
    methods: dict[str, Callable[[], Callable[[], None]]] = {}
    for kind, label in (("none", "no checkpointing"), ("every_block", every.label),
                        ("selective_op", "selective op (torchtitan)")):
        methods[label] = functools.partial(_applied, MethodSpec(kind=kind, label=label), model, blocks, batch)
    result: dict[str, Any] = {"every_block_peak_bytes": every_peak}
    try:
        plan = torchckpt.plan(model, batch, budget=every_peak)
        methods["torchckpt plan at every block's peak"] = lambda: torchckpt.apply(model, plan).remove
        result["plan_predicted_peak_bytes"] = plan.predicted_peak_bytes
    except torchckpt.InfeasibleBudgetError as error:
        result["plan"] = f"n/a: {error}"
    samples: dict[str, list[tuple[float, int]]] = {label: [] for label in methods}
    for r in range(rounds + 1):  # round 0 warms every method up and is not counted
        labels = list(methods)
        for label in labels[r % len(labels):] + labels[:r % len(labels)]:
            remove = methods[label]()
            try:
                seconds, peak, _ = _step(model, batch, device)
            finally:
                remove()
            if r:
                samples[label].append((seconds, peak))
    rows = {label: {"median_s": statistics.median(s for s, _ in got), "min_s": min(s for s, _ in got),
                    "max_s": max(s for s, _ in got), "peak_bytes": max(p for _, p in got), "steps": len(got)}
            for label, got in samples.items()}
    base = rows[every.label]["median_s"]
    for row in rows.values():
        row["speedup_vs_every_block"] = base / row["median_s"]
    result["methods"] = rows
    return result


def _verified(model: Any, plan: Any, batch: dict) -> dict[str, Any]:
    import torchckpt

    report = torchckpt.verify_plan(model, plan, batch)
    return {"budget_bytes": plan.budget_bytes, "predicted_peak_bytes": report.predicted_peak_bytes,
            "measured_peak_bytes": report.measured_peak_bytes, "prediction_error": report.prediction_error,
            "within_budget": report.within_budget, "gradients_equal": report.gradients_equal,
            "buffers_equal": report.buffers_equal, "predicted_extra_time_s": plan.predicted_extra_time_s,
            "predicted_host_peak_bytes": report.predicted_host_peak_bytes,
            "measured_host_peak_bytes": report.measured_host_peak_bytes,
            "offloaded_blocks": sum(1 for d in plan.decisions() if "offloaded" in d["decision"]),
            "plan_step_s": report.step_time_s, "plain_step_s": report.no_checkpointing_step_time_s}


def check_offload(device: torch.device, quick: bool, batch_size: int, seq_len: int, rounds: int) -> dict[str, Any]:
    """Offload planned, verified and timed against recompute and the offload peers (module docstring, section 4)."""
    import torchckpt
    from harness.methods import MethodSpec, NotApplicableError
    from torchckpt.planner import solve

    model, batch, blocks = build_decoder(quick, device, batch_size, seq_len)
    start = time.perf_counter()
    costs = torchckpt.profile(model, batch, offload=True)
    result: dict[str, Any] = {"planning_s": time.perf_counter() - start, "offload": costs.offload,
                              "every_block_peak_bytes": costs.every_block_peak_bytes}
    floor = solve.floor_bytes(costs)
    without = dataclasses.replace(costs, blocks=tuple(dataclasses.replace(b, offload_held_bytes=-1)
                                                      for b in costs.blocks))  # the same costs, no offload option
    result["floor_bytes"] = floor
    result["floor_over_every_block"] = floor / max(costs.every_block_peak_bytes, 1)
    plan = costs.plan(costs.every_block_peak_bytes)
    result["at_every_block_peak"] = _verified(model, plan, batch)
    result["at_floor"] = _verified(model, costs.plan(floor), batch)
    plain_plan = without.plan(costs.every_block_peak_bytes)
    methods: dict[str, Callable[[], Callable[[], None]]] = {
        label: functools.partial(_applied, MethodSpec(kind=kind, label=label), model, blocks, batch)
        for kind, label in (("none", "no checkpointing"), ("every_block", "torch.utils.checkpoint every block"),
                            ("save_on_cpu", "save_on_cpu every block (HF offload=True)"),
                            ("sac_offload", "SAC MUST_CPU_OFFLOAD on matmuls (eager)"))}
    methods["torchckpt plan, no offload"] = lambda: torchckpt.apply(model, plain_plan).remove
    methods["torchckpt plan with offload"] = lambda: torchckpt.apply(model, plan).remove
    samples: dict[str, list[tuple[float, int]]] = {label: [] for label in methods}
    skipped: dict[str, str] = {}
    for r in range(rounds + 1):  # round 0 warms up, and drops a peer that cannot run here (recorded)
        labels = [label for label in methods if label not in skipped]
        for label in labels[r % len(labels):] + labels[:r % len(labels)]:
            try:
                remove = methods[label]()
                try:
                    seconds, peak, _ = _step(model, batch, device)
                finally:
                    remove()
            except (NotApplicableError, RuntimeError, NotImplementedError) as error:
                if r:
                    raise
                skipped[label] = f"n/a: {type(error).__name__}: {str(error)[:300]}"
                continue
            if r:
                samples[label].append((seconds, peak))
    rows: dict[str, Any] = {label: {"median_s": statistics.median(s for s, _ in got), "min_s": min(s for s, _ in got),
                                    "max_s": max(s for s, _ in got), "peak_bytes": max(p for _, p in got)}
                            for label, got in samples.items() if got}
    base = rows["no checkpointing"]["median_s"]
    for row in rows.values():
        row["over_no_checkpointing"] = row["median_s"] / base
    result["methods"] = {**rows, **skipped}
    return result


def check_optimizer_offload(device: torch.device, quick: bool, batch_size: int, seq_len: int,
                            rounds: int) -> dict[str, Any]:
    """AdamW's state in host memory: floors, a verified plan, whole steps timed (module docstring, section 6)."""
    import torchckpt
    from torchckpt.planner.from_costs import floor_over_options

    model, batch, blocks = build_decoder(quick, device, batch_size, seq_len)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5)
    on_device = torchckpt.profile(model, batch, optimizer=optimizer)
    start = time.perf_counter()
    offloaded = torchckpt.profile(model, batch, optimizer=optimizer, optimizer_offload=True)
    floors = {name: floor_over_options(costs, allow_regions=True, margin_bytes=costs.margin_bytes)
              for name, costs in (("state on the device", on_device), ("state in host memory", offloaded))}
    every = on_device.every_block_peak_bytes
    result: dict[str, Any] = {"planning_s": time.perf_counter() - start, "every_block_peak_bytes": every,
                              "floors": floors, "floor_over_every_block": {k: v / every for k, v in floors.items()},
                              "state_bytes": on_device.state_bytes}
    at_floor = offloaded.plan(floors["state in host memory"])
    report = torchckpt.verify_plan(model, at_floor, batch, optimizer=optimizer)
    result["at_floor"] = {"budget_bytes": at_floor.budget_bytes, "predicted_peak_bytes": report.predicted_peak_bytes,
                          "measured_peak_bytes": report.measured_peak_bytes, "within_budget": report.within_budget,
                          "prediction_error": report.prediction_error, "parameters_equal": report.gradients_equal}
    plans = {"torch.utils.checkpoint every block, state on the device": None,
             "torchckpt, state in host memory, at every block's peak": offloaded.plan(every),
             "torchckpt, state in host memory, at its floor": at_floor}
    samples: dict[str, list[tuple[float, int]]] = {label: [] for label in plans}
    for r in range(rounds + 1):  # round 0 warms up (and makes AdamW's state)
        labels = list(plans)
        for label in labels[r % len(labels):] + labels[:r % len(labels)]:
            plan = plans[label]
            handle = torchckpt.apply(model, plan, optimizer=optimizer) if plan is not None else \
                torchckpt.executor.checkpoint_modules(blocks)
            try:
                from torchckpt.planner.runner import StepRunner

                runner = StepRunner(model, batch)
                synchronize(device)
                begin = time.perf_counter()
                with MemoryMeter(device) as meter:
                    runner.forward_backward()
                    optimizer.step()
                elapsed = time.perf_counter() - begin
                optimizer.zero_grad()
            finally:
                handle.remove()
            if r:
                samples[label].append((elapsed, meter.peak_bytes))
    rows = {label: {"median_s": statistics.median(t for t, _ in got), "min_s": min(t for t, _ in got),
                    "max_s": max(t for t, _ in got), "peak_bytes": max(p for _, p in got)}
            for label, got in samples.items()}
    base = rows["torch.utils.checkpoint every block, state on the device"]["median_s"]
    for row in rows.values():
        row["over_every_block"] = row["median_s"] / base
    result["steps"] = rows
    return result


def check_state(device: torch.device) -> dict[str, Any]:
    """Async save of a model and AdamW state on ``device``, restore into a fresh model, compare bitwise."""
    from torchckpt.state import Checkpointer

    def build(seed: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
        torch.manual_seed(seed)
        model = torch.nn.Sequential(torch.nn.Linear(1024, 4096), torch.nn.GELU(), torch.nn.Linear(4096, 1024))
        model = model.to(device)
        return model, torch.optim.AdamW(model.parameters(), lr=1e-3)

    model, optimizer = build(0)
    model(torch.randn(8, 1024, device=device)).square().mean().backward()
    optimizer.step()
    with tempfile.TemporaryDirectory() as folder:
        with Checkpointer(folder, async_save=True) as ckpt:
            synchronize(device)
            start = time.perf_counter()
            ckpt.save(1, model=model, optimizer=optimizer)
            blocking_s = time.perf_counter() - start
            ckpt.wait()
            total_s = time.perf_counter() - start
            valid = [info.valid for info in ckpt.list(verify="full")]
        fresh, fresh_optimizer = build(1)
        with Checkpointer(folder, read_only=True) as reader:
            step = reader.restore(model=fresh, optimizer=fresh_optimizer)
    same_model = all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), fresh.state_dict().values()))
    saved, restored = optimizer.state_dict()["state"], fresh_optimizer.state_dict()["state"]
    same_optimizer = saved.keys() == restored.keys() and all(
        torch.equal(saved[k][name], restored[k][name]) for k in saved for name in saved[k])
    tensors = [*model.state_dict().values(), *(v for entry in saved.values() for v in entry.values())]
    state_bytes = sum(t.numel() * t.element_size() for t in tensors if isinstance(t, torch.Tensor))
    return {"state_bytes": state_bytes, "blocking_s": blocking_s, "total_s": total_s, "valid": valid,
            "restored_step": step, "model_bitwise": same_model, "optimizer_bitwise": same_optimizer,
            "restored_device": str(next(fresh.parameters()).device)}


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python bench/cuda_check.py", description=__doc__.split("\n")[0])
    parser.add_argument("--device", default="cuda", help="cuda (default), cuda:N, or cpu for a dry run")
    parser.add_argument("--quick", action="store_true", help="a tiny decoder and 2 rounds (seconds)")
    parser.add_argument("--budget", default=None, help="the decoder's budget (default 50%%; 85%% with --quick)")
    parser.add_argument("--batch-size", type=int, default=None, help="default 4 (2 with --quick)")
    parser.add_argument("--seq-len", type=int, default=None, help="default 2048 (32 with --quick)")
    parser.add_argument("--rounds", type=int, default=None, help="timed rounds per method; default 5 (2 with --quick)")
    parser.add_argument("--only", action="append", choices=SECTIONS, help="run only these sections (repeatable)")
    parser.add_argument("--out", default="bench/results", help="folder for cuda-*.json (default bench/results)")
    parser.add_argument("--commit", default=None, help="the commit tested (default: git rev-parse HEAD)")
    return parser


def main(argv: Sequence[str] | None = None) -> str:
    """Run the sections, write ``OUT/cuda-<device>-<time>.json`` after each, and return its path.

    Example: see the module docstring.
    """
    args = _parser().parse_args(argv)
    try:
        device = torch.device(args.device)
    except RuntimeError:
        device = torch.device("meta")  # refused just below, with the same message as any other device
    if device.type not in ("cpu", "cuda"):
        raise SystemExit(f"torchckpt cuda_check: --device {args.device}: use cuda, cuda:N or cpu")
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("torchckpt cuda_check: CUDA is not available here; pass --device cpu for a dry run")
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    batch_size = args.batch_size or (2 if args.quick else 4)
    seq_len = args.seq_len or (32 if args.quick else 2048)
    rounds = args.rounds or (2 if args.quick else 5)
    budget = args.budget or ("85%" if args.quick else "50%")
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu"
    results: dict[str, Any] = {
        "commit": args.commit or git_commit(), "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "device": str(device), "device_name": name, "torch": torch.__version__, "python": platform.python_version(),
        "host": platform.node(), "cpu_count": os.cpu_count(), "quick": args.quick, "sections": {}}
    stamp = time.strftime("%Y%m%d-%H%M%S")
    slug = "".join(ch if ch.isalnum() else "-" for ch in name.lower()).strip("-") or "device"
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"cuda-{slug}-{stamp}.json"
    checks: dict[str, Callable[[], dict[str, Any]]] = {
        "meter": lambda: check_meter(device),
        "decoder": lambda: check_decoder(device, args.quick, budget, batch_size, seq_len),
        "speed": lambda: check_speed(device, args.quick, batch_size, seq_len, rounds),
        "offload": lambda: check_offload(device, args.quick, batch_size, seq_len, rounds),
        "state": lambda: check_state(device),
        "optimizer_offload": lambda: check_optimizer_offload(device, args.quick, batch_size, seq_len, rounds),
    }
    for section in SECTIONS:
        if args.only and section not in args.only:
            continue
        start = time.perf_counter()
        try:
            record = {"status": "ok", **checks[section]()}
        except Exception as error:  # recorded, so that the other sections still run
            record = {"status": "failed", "error": f"{type(error).__name__}: {error}",
                      "traceback": traceback.format_exc(limit=8)}
        record["seconds"] = time.perf_counter() - start
        results["sections"][section] = record
        print(f"cuda_check {section}: {record['status']} ({record['seconds']:.1f} s)", flush=True)
        if device.type == "cuda":
            torch.cuda.empty_cache()
        path.write_text(json.dumps(results, indent=1, default=str))
    return str(path)


if __name__ == "__main__":
    print(main())
