"""Planning a model that trains in a process group (DDP, FSDP2): every rank measures, all get one plan.

Rules (collected in ``docs/design.md``):

1. **[a distributed model is planned by all its ranks]** A model wrapped in
   ``DistributedDataParallel``, or with modules under FSDP2's ``fully_shard`` (parameters are
   ``DTensor``s), runs collectives in every forward and backward pass, so ``profile``/``plan`` run on
   every rank of its group, in step. Each rank measures its own step: its shard of the parameters,
   gradients and optimizer state, the all-gathered parameters of the blocks FSDP2 has unsharded at
   once (the current one and the prefetched one), unsharded gradients before their reduce-scatter,
   DDP's gradient buckets. The budget is per rank.
2. **[FSDP2 units are checkpointed one by one]** Blocks that are FSDP2 units get plans without
   regions (``sharded_blocks_note``); each checkpointed block recomputes inside its own unit's
   backward, after that unit's all-gather, so a plan adds no collective.
3. **[ranks agree on the costs]** Before any decision, the ranks check that they measured the same
   model (same blocks, same ops) and then take, figure by figure, the largest any rank measured
   (bytes and seconds; a block holds its input when plain if it does on any rank; regions only if
   every rank allows them). The solver is deterministic, so every rank then makes the same plan from
   the same costs and the collectives of the checkpointed step never diverge. Decisions that change
   which profiling steps run are agreed first, so no rank waits in a collective the others skip: the
   region step runs only if every rank found a chain (``agree_flag``), and a check that fails after a
   step on one rank fails on every rank, naming it (``same_outcome``).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import asdict
from typing import Any, TypeVar

import torch
from torch import nn

from torchckpt.planner.from_costs import ChainCosts

T = TypeVar("T")

__all__ = ["agree_costs", "agree_flag", "collective_device", "engine_of", "process_group_of", "same_outcome",
           "sharded_blocks_note"]


def _distributed() -> Any:
    import torch.distributed as dist

    return dist if dist.is_available() and dist.is_initialized() else None


def process_group_of(model: nn.Module) -> Any:
    """The process group ``model`` trains in, or None for a model that runs alone.

    ``DistributedDataParallel``: its ``process_group``. FSDP2 (``fully_shard``, parameters are
    ``DTensor``): its mesh's group, or the default group for a mesh of several dimensions (HSDP). None
    when ``torch.distributed`` is not initialised or the model has neither.

    Example:
        >>> process_group_of(nn.Linear(2, 2)) is None
        True
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"process_group_of(model) takes an nn.Module; got {type(model).__name__}")
    dist = _distributed()
    if dist is None:
        return None
    from torch.distributed.tensor import DTensor
    from torch.nn.parallel import DistributedDataParallel

    if isinstance(model, DistributedDataParallel):
        return model.process_group
    for param in model.parameters():
        if isinstance(param, DTensor):
            mesh = param.device_mesh
            if mesh.ndim == 1:
                return mesh.get_group()
            if mesh.mesh.numel() == dist.get_world_size():  # HSDP over every rank: plan over all of them
                return dist.group.WORLD
            raise ValueError(f"the model's parameters are DTensors on a {mesh.ndim}-dimensional mesh of "
                             f"{mesh.mesh.numel()} of the {dist.get_world_size()} ranks (tensor or pipeline "
                             "parallel); torchckpt plans models under DDP and FSDP2 only, for now. Fix: plan the "
                             "model under FSDP2 or DDP alone, or checkpoint by hand (torchckpt.checkpoint_modules)")
    return None


def engine_of(model: nn.Module) -> str | None:
    """``"FSDP2"`` (parameters are ``DTensor`` shards), ``"DDP"`` (``DistributedDataParallel``), or None.

    Example:
        >>> engine_of(nn.Linear(2, 2)) is None
        True
    """
    from torch.nn.parallel import DistributedDataParallel

    if isinstance(model, DistributedDataParallel):
        return "DDP"
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:
        return None
    return "FSDP2" if any(isinstance(p, DTensor) for p in model.parameters()) else None


def collective_device(group: Any = None) -> torch.device:
    """Where a tensor for a collective of ``group`` must live: the current CUDA device under NCCL, else CPU.

    Example:
        >>> collective_device().type  # no process group
        'cpu'
    """
    dist = _distributed()
    if dist is not None and "nccl" in str(dist.get_backend(group)) and torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def agree_flag(value: bool, group: Any = None) -> bool:
    """True on every rank of ``group`` when ``value`` is True on every rank (a collective); ``value`` alone
    without a process group (``group`` None, even where ``torch.distributed`` is initialised: a model planned by
    one rank alone, as torchtitan's recipe plans on rank 0, takes part in no collective).

    Example:
        >>> agree_flag(True)
        True
    """
    dist = _distributed()
    if dist is None or group is None:
        return bool(value)
    flag = torch.tensor([1 if value else 0], dtype=torch.int32, device=collective_device(group))
    dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=group)
    return bool(flag.item())


def ranks_on_this_host(group: Any = None) -> int:
    """How many processes of the job share this host: the ranks of ``group`` here (a collective: every rank calls
    it), or, where more, the launcher's ``LOCAL_WORLD_SIZE`` (torchrun sets it; a model planned by rank 0 alone
    has no group but shares the host with the others); 1 without either.

    Example:
        >>> ranks_on_this_host() >= 1
        True
    """
    import os

    try:
        launched = max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
    except ValueError:
        launched = 1
    dist = _distributed()
    if dist is None or group is None:
        return launched
    import socket

    hosts: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(hosts, socket.gethostname(), group=group)
    return max(launched, hosts.count(socket.gethostname()))


def same_outcome(action: Callable[[], T], group: Any = None) -> T:
    """Run ``action`` on every rank; if it raised on any rank, raise on every rank (a collective).

    For checks that fail after the step's collectives completed (a block that ran twice, blocks out of
    order): without this, the rank that raised would leave the others waiting in the next collective. A
    rank whose own ``action`` raised re-raises its error (a ``BlockOrderError`` only when every rank saw the
    same order, so a retry stays in step); the others raise ValueError naming the ranks and their errors.
    Without a process group (``group`` None) it is ``action()`` alone, as for ``agree_flag``.

    Example:
        >>> same_outcome(lambda: 3)  # no process group
        3
    """
    dist = _distributed()
    if dist is None or group is None:
        return action()
    error: Exception | None = None
    result: Any = None
    try:
        result = action()
    except Exception as raised:  # noqa: BLE001 - shared with every rank below, then raised again
        error = raised
    said: list[Any] = [None] * dist.get_world_size(group)
    mine = None if error is None else (type(error).__name__, str(error), list(getattr(error, "ran", []) or []))
    dist.all_gather_object(said, mine, group=group)
    failed = [(rank, entry) for rank, entry in enumerate(said) if entry is not None]
    if not failed:
        return result
    if error is not None and not (type(error).__name__ == "BlockOrderError" and len(failed) == len(said)
                                  and all(entry == said[0] for entry in said)):
        if type(error).__name__ == "BlockOrderError":  # ranks differ: a retry would not stay in step
            raise ValueError(f"{error} (ranks {[rank for rank, _ in failed]} of {len(said)} saw this)") from error
        raise error
    if error is not None:
        raise error
    named = "; ".join(f"rank {rank}: {entry[0]}: {entry[1]}" for rank, entry in failed)
    raise ValueError(f"profiling failed on another rank, so every rank stops here: {named}")


def sharded_blocks_note(blocks: list[nn.Module]) -> str | None:
    """[FSDP2 units are checkpointed one by one]: why plans have no regions when blocks are FSDP2 units,
    else None.

    FSDP2 all-gathers a unit's parameters in hooks around that unit's own call; a region runs its later
    blocks inside the first block's call, where their parameters would still be sharded. Plans for such
    blocks checkpoint single blocks (each recomputed inside its own unit's backward, after its
    all-gather), which adds no all-gather.

    Example:
        >>> sharded_blocks_note([nn.Linear(2, 2)]) is None
        True
    """
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:
        return None
    sharded = [type(b).__name__ for b in blocks if isinstance(b, FSDPModule)]
    if not sharded:
        return None
    return (f"off: {len(sharded)} blocks are FSDP2 units (fully_shard), whose parameters are all-gathered around "
            "each block's own call; plans checkpoint them one by one")


_OFFLOAD_AGREED = (("window_bytes", 1), ("time_scale", 1), ("d2h_bytes_per_s", -1), ("h2d_bytes_per_s", -1),
                   ("host_budget_bytes", -1))


def _structure(costs: ChainCosts) -> str:
    """What must be equal on every rank: the blocks, their ops, the block paths."""
    return json.dumps({"paths": list(costs.block_paths),
                       "blocks": [(b.name, [(op.index, op.name, op.saved) for op in b.ops]) for b in costs.blocks]})


def _numbers(costs: ChainCosts) -> list[float]:
    """Every measured figure, in a fixed order; booleans as 0/1 so that the largest is "any rank"."""
    values: list[float] = [costs.fixed_bytes, costs.head_bytes, costs.region_recompute_bytes, costs.step_time_s,
                           costs.every_block_peak_bytes, costs.every_block_step_time_s, costs.margin_bytes,
                           0.0 if costs.chain else 1.0, costs.tail_bytes]
    # the offload's calibration (planner/offload_step.py): the largest window and time scale, the least bandwidths
    # and host budget (negated, so that the largest is the least)
    values += [float(costs.offload.get(key, 0)) * sign for key, sign in _OFFLOAD_AGREED]
    for b in costs.blocks:
        values += [b.input_bytes, b.output_bytes, b.saved_bytes, b.forward_time_s, b.forward_peak_bytes,
                   b.backward_peak_bytes, b.recompute_peak_bytes, float(b.input_held_when_plain),
                   b.freed_side_input_bytes, b.nested_recompute_peak_bytes, b.nested_held_bytes,
                   float(b.has_backward), b.checkpoint_residue_bytes, b.offload_held_bytes, b.offload_host_bytes,
                   b.offload_time_s, b.offload_backward_peak_bytes, float(b.offload_input_held)]
        for op in b.ops:
            values += [op.output_bytes, op.time_s, op.alive_bytes]
    return [float(v) for v in values]


def _rebuild(costs: ChainCosts, numbers: list[float], notes: dict[str, str]) -> ChainCosts:
    it = iter(numbers)

    def whole() -> int:
        return int(round(next(it)))

    data: dict[str, Any] = asdict(costs)
    data.update(fixed_bytes=whole(), head_bytes=whole(), region_recompute_bytes=whole(), step_time_s=next(it),
                every_block_peak_bytes=whole(), every_block_step_time_s=next(it), margin_bytes=whole())
    any_rank_not_chain = next(it) > 0
    data["tail_bytes"] = whole()
    agreed_offload = {key: next(it) * sign for key, sign in _OFFLOAD_AGREED}
    if "window_bytes" in costs.offload:  # measured on every rank (a rank that refused made it a note on all)
        data["offload"] = {**costs.offload, **{key: int(round(value)) if key.endswith("_bytes") else value
                                               for key, value in agreed_offload.items()}}
    if "note" in data["offload"]:  # rank 0's words, so the costs are the same on every rank
        data["offload"]["note"] = notes.get("offload", data["offload"]["note"])
    data["chain"] = costs.chain and not any_rank_not_chain
    for block in data["blocks"]:
        block.update(input_bytes=whole(), output_bytes=whole(), saved_bytes=whole(), forward_time_s=next(it),
                     forward_peak_bytes=whole(), backward_peak_bytes=whole(), recompute_peak_bytes=whole(),
                     input_held_when_plain=next(it) > 0, freed_side_input_bytes=whole(),
                     nested_recompute_peak_bytes=whole(), nested_held_bytes=whole(),
                     has_backward=next(it) > 0, checkpoint_residue_bytes=whole(), offload_held_bytes=whole(),
                     offload_host_bytes=whole(), offload_time_s=next(it), offload_backward_peak_bytes=whole(),
                     offload_input_held=next(it) > 0)
        for op in block["ops"]:
            op.update(output_bytes=whole(), time_s=next(it), alive_bytes=whole())
    data["notes"] = notes
    if not data["chain"] and "chain" not in notes:  # rank 0 found a chain, another did not
        data["notes"]["chain"] = "no: another rank's profile found the blocks are not a plain chain"
    if data["chain"]:  # each block's output is the next one's input: keep them equal after taking maxima
        for before, after in zip(data["blocks"], data["blocks"][1:]):
            before["output_bytes"] = after["input_bytes"] = max(before["output_bytes"], after["input_bytes"])
    return ChainCosts(**data)


def agree_costs(costs: ChainCosts, group: Any = None) -> ChainCosts:
    """[ranks agree on the costs]: the largest of each figure over the ranks of ``group`` (a collective:
    every rank calls it). Raises ValueError, on every rank, when ranks measured different models.

    Without an initialised process group, or in a group of one, returns ``costs`` unchanged.

    Example:
        >>> from torchckpt.planner.costs import BlockCosts
        >>> block = BlockCosts(name="b", input_bytes=4, output_bytes=4, saved_bytes=8, forward_time_s=1.0)
        >>> costs = ChainCosts(fixed_bytes=100, head_bytes=10, blocks=(block,))
        >>> agree_costs(costs) is costs  # no process group
        True
    """
    if not isinstance(costs, ChainCosts):
        raise TypeError(f"agree_costs(costs) takes a ChainCosts; got {type(costs).__name__}")
    dist = _distributed()
    if dist is None or dist.get_world_size(group) == 1:
        return costs
    world = dist.get_world_size(group)
    structures: list[Any] = [None] * world
    dist.all_gather_object(structures, _structure(costs), group=group)
    differing = [rank for rank, structure in enumerate(structures) if structure != structures[0]]
    if differing:
        raise ValueError(f"ranks {differing} profiled a different model from rank 0 (other blocks or ops); "
                         "every rank must plan the same model with the same blocks. Fix: build the model and "
                         "pass blocks identically on every rank (only the batch may differ)")
    numbers = torch.tensor(_numbers(costs), dtype=torch.float64, device=collective_device(group))
    dist.all_reduce(numbers, op=dist.ReduceOp.MAX, group=group)
    notes: list[Any] = [dict(costs.notes)]
    dist.broadcast_object_list(notes, src=dist.get_global_rank(group, 0) if group is not None else 0, group=group)
    agreed = dict(notes[0])
    agreed["ranks"] = (f"{world} ranks profiled; each figure is the largest any rank measured (the budget is "
                       "per rank)")
    return _rebuild(costs, numbers.cpu().tolist(), agreed)

