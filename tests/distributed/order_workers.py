"""Workers of the torchtitan-order tests: a plan made on the unsharded model by rank 0 and sent to every rank as
JSON (a plan "loaded from a file"), applied, optionally compiled, then ``fully_shard``; its steps are compared
bitwise with the same sharded model (same compile) without a plan. Each rank writes ``out_dir/<rank>.json``."""

from __future__ import annotations

import copy
import datetime
import json
import os
import time
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

STEPS = 2


def _loss(model: nn.Module, batch: Any) -> torch.Tensor:
    output = model(**batch) if isinstance(batch, dict) else model(*batch)
    return output.loss if hasattr(output, "loss") else output


def _rolled(batch: Any, shift: int) -> Any:
    """``batch`` with every tensor rolled by ``shift`` along its last dimension (another batch on each rank)."""
    if isinstance(batch, dict):
        return {k: v.roll(shift, -1) if isinstance(v, torch.Tensor) else v for k, v in batch.items()}
    return tuple(v.roll(shift, -1) if isinstance(v, torch.Tensor) else v for v in batch)


def _shard(model: nn.Module, blocks: list[nn.Module], compiled: bool) -> None:
    from torch.distributed.fsdp import fully_shard

    for block in blocks:  # torchtitan's order: checkpointing (already applied), compile, then fully_shard
        if compiled:
            block.compile(backend="aot_eager")  # inductor matches to 1e-5, not bitwise (docs/planner.md)
        fully_shard(block)
    fully_shard(model)


def _steps(model: nn.Module, batch: Any) -> tuple[list[float], list[list[torch.Tensor]]]:
    """``STEPS`` SGD steps from one seed; the losses and each step's gradients, whole (a collective)."""
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    torch.manual_seed(1234)  # the same dropout masks in both runs
    losses = []
    grads: list[list[torch.Tensor]] = []
    for _ in range(STEPS):
        loss = _loss(model, batch)
        loss.backward()
        losses.append(loss.item())
        grads.append([p.grad.full_tensor() for p in model.parameters()])  # type: ignore[union-attr]
        optimizer.step()
        optimizer.zero_grad()
    return losses, grads


def _unequal(grads: list[torch.Tensor], reference: list[torch.Tensor], rounding: set[int]) -> list[int]:
    """Indices of ``grads`` that differ from ``reference``: bitwise, or for those in ``rounding`` (a chunked loss
    head's weight, summed chunk by chunk) by more than verify.ROUNDING_EPS_FACTOR epsilons of its largest entry."""
    from torchckpt.planner.verify import ROUNDING_EPS_FACTOR

    def differs(index: int, a: torch.Tensor, b: torch.Tensor) -> bool:
        if index not in rounding:
            return not torch.equal(a, b)
        gap = (a.double() - b.double()).abs().max().item() / max(b.double().abs().max().item(), 1e-300)
        return not gap <= ROUNDING_EPS_FACTOR * torch.finfo(b.dtype).eps  # NaN differs
    return [i for i, (a, b) in enumerate(zip(grads, reference)) if differs(i, a, b)]


def hand_plan(model: nn.Module, batch: Any, paths: list[str]) -> Any:
    """A plan written by hand, as a user or another tool might save one: blocks 0 and 1 a region (block 1
    recomputed inside it), block 2 recomputed keeping nothing, the rest plain; no profiling."""
    from torchckpt.planner.plan import Plan, PlannedBlock, PlannedRegion, fingerprint

    inner = (PlannedBlock(block=0, plain=True), PlannedBlock(block=1, plain=False))
    rest = tuple(PlannedBlock(block=i, plain=i != 2) for i in range(2, len(paths)))
    return Plan(budget_bytes=1 << 30, predicted_peak_bytes=1 << 29, predicted_extra_time_s=0.0,
                schedule=(PlannedRegion(start=0, stop=2, inner=inner), *rest), block_paths=tuple(paths),
                fingerprint=fingerprint(model, batch, paths))


def order_worker(rank: int, port: int, out_dir: str, world: int, model_names: list[str], budget: str,
                 compiled: bool) -> None:
    """Rank ``rank`` of ``world``, for each of ``model_names``: plan (rank 0; ``budget="hand"``: ``hand_plan``) ->
    JSON -> apply -> [compile] -> fully_shard, against the same without the plan."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=60))
    try:
        records = {name: _one(rank, name, budget, compiled) for name in model_names}
        Path(out_dir, f"{rank}.json").write_text(json.dumps(records))
    finally:
        dist.destroy_process_group()


def _one(rank: int, model_name: str, budget: str, compiled: bool) -> dict[str, Any]:
    """One model's planned and plain runs on this rank."""
    import torchckpt
    from torchckpt.models.registry import BatchShape, get_model
    from torchckpt.planner.layout import PlanLayoutWarning
    from torchckpt.planner.plan import Plan, PlannedRegion

    entry = get_model(model_name)
    small = budget == "hand"  # a profiled plan needs activations large enough to be worth recomputing
    model, batch = entry.build(seed=0, shape=BatchShape(batch_size=2 if small else 4, seq_len=32 if small else 128))
    batch = _rolled(batch, rank)  # each rank its own batch, the same model
    started = time.monotonic()
    reference = copy.deepcopy(model)
    if budget == "hand":
        paths = [name for name, module in model.named_modules() if any(module is b for b in entry.blocks(model))]
        made = hand_plan(model, batch, paths)
    else:
        made = torchckpt.plan(model, batch, budget=budget, blocks=entry.blocks(model)) if rank == 0 else None
    sent: list[Any] = [made.to_json() if rank == 0 else None]
    dist.broadcast_object_list(sent, src=0)
    plan = Plan.from_json(sent[0])
    head = [] if not plan.loss_head else [  # its weight's gradient is summed chunk by chunk (equal to rounding)
        index for index, parameter in enumerate(model.parameters())
        if any(parameter is p for p in model.get_submodule(plan.loss_head["path"]).parameters())]
    handle = torchckpt.apply(model, plan)
    _shard(model, entry.blocks(model), compiled)
    _shard(reference, entry.blocks(reference), compiled)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        planned_losses, planned_grads = _steps(model, batch)
    plain_losses, plain_grads = _steps(reference, batch)
    handle.remove()
    said = [str(w.message) for w in caught if issubclass(w.category, PlanLayoutWarning)]
    # with a chunked head the weights differ to rounding after the first update, so only its gradients compare
    steps = range(STEPS) if not head else range(1)
    return {"rank": rank, "losses_equal": planned_losses == plain_losses if not head else all(  # summed chunk by chunk
                abs(a - b) <= 1e-5 * abs(b) for a, b in zip(planned_losses, plain_losses)),
            "losses": planned_losses, "grads": len(plain_grads[-1]), "loss_head": bool(head),
            "grads_unequal": [i for step in steps for i in _unequal(planned_grads[step], plain_grads[step], set(head))],
            "regions": sum(1 for piece in plan.schedule if isinstance(piece, PlannedRegion)),
            "recomputed": sum(1 for piece in plan.schedule if getattr(piece, "recomputes", True)),
            "layout_warnings": said, "seconds": time.monotonic() - started}
