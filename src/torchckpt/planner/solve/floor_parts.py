"""What the floor is made of, and which choices outside the plan would lower it (for messages).

Rule **[the floor is told in parts]**: the least-peak schedule's predicted peak is split, at the moment it is
reached (``evaluate.peak_parts``), into what training keeps whatever the plan (parameters and optimizer
state, from ``CostModel.state_bytes`` when the profiler recorded them), the rest alive outside the blocks
(the batch, embeddings), the inputs that checkpoints hold then, other activations held, the running piece's
own need and the margin; the parts sum to the floor exactly. Then the levers the plan cannot pull itself, each
named only where it applies: the optimizer's update inside the backward pass (gradients then never all live
at once), smaller micro-batches, and sharding the training state.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from torchckpt._units import format_bytes
from torchckpt.planner.costs import CostModel
from torchckpt.planner.solve._chain import Chain
from torchckpt.planner.solve._types import Piece
from torchckpt.planner.solve.evaluate import peak_parts
from torchckpt.planner.solve.floor import check_margin, floor_schedule

__all__ = ["describe_floor", "floor_parts"]


def describe_floor(costs: CostModel, *, allow_regions: bool = True, margin_bytes: int = 0) -> tuple[int, str]:
    """The floor (``floor.floor_bytes``) and what it is made of: ``"<floor> = <terms>. What would lower it: ..."``.

    Example:
        >>> from torchckpt.planner.costs import BlockCosts
        >>> block = BlockCosts(name="b", input_bytes=4, output_bytes=4, saved_bytes=8, forward_time_s=1.0)
        >>> floor, text = describe_floor(CostModel(fixed_bytes=100, head_bytes=10, blocks=(block,) * 3))
        >>> floor, text.split(" + ")[0]
        (124, '124 B = fixed 100 B (parameters, optimizer state, the batch, embeddings)')
    """
    chain = Chain.of(costs)
    floor, schedule = floor_schedule(chain, allow_regions=allow_regions, margin_bytes=check_margin(margin_bytes))
    text, _ = floor_parts(chain, schedule, chain.margin_of(schedule, margin_bytes))
    return floor, f"{format_bytes(floor)} = {text}"


def floor_parts(chain: Chain, schedule: Sequence[Piece], margin_bytes: int) -> tuple[str, dict[str, Any]]:
    """What ``schedule``'s peak (the floor's schedule) plus ``margin_bytes`` is made of, as a sum of named terms,
    and what would lower it; and the same figures as a dict (the infeasible-budget error's ``breakdown``).

    Example:
        >>> from torchckpt.planner.costs import BlockCosts, CostModel
        >>> block = BlockCosts(name="b", input_bytes=4, output_bytes=4, saved_bytes=8, forward_time_s=1.0)
        >>> costs = CostModel(fixed_bytes=100, head_bytes=10, blocks=(block,) * 3,
        ...                   state_bytes={"parameters": 60, "gradients": 60, "optimizer_state": 0})
        >>> chain = Chain.of(costs)
        >>> text, parts = floor_parts(chain, chain.every_block_schedule(), 0)
        >>> parts["checkpoints"], parts["checkpoint_bytes"], parts["own_bytes"]
        (1, 4, 16)
        >>> print(text)  # doctest: +NORMALIZE_WHITESPACE
        parameters 60 B + 40 B more alive outside the blocks (the batch, embeddings) + 1 checkpointed input
        held, 4 B + 4 B of other activations held (plain blocks' saved tensors, the gradient from the head) +
        16 B for the forward or backward pass of block 1 ('b') itself (its activations and the gradients made by
        then). What would lower it: optimizer_in_backward=True (plan(..., optimizer=your_optimizer,
        optimizer_in_backward=True)) frees each gradient as soon as it is applied (the gradients are 60 B in all);
        a smaller batch, or the same batch as micro-batches (plan(..., micro_batches=k)): 24 B of it are
        activations; batch_slices=k (plan(..., batch_slices=4)): each block whose outputs are exact in slices of the
        batch, or else its pieces that are (its attention, its MLP), is recomputed one slice at a time (their
        weights' gradients then equal to rounding); sharding
        parameters, gradients and optimizer state (FSDP/ZeRO); offload=True (plan(..., offload=True)): blocks may
        keep their saved activations in host memory instead of recomputing them.
    """
    costs = chain.costs
    parts = peak_parts(chain, schedule)
    state = costs.state_bytes
    kept = {name: state.get(name, 0) for name in ("parameters", "optimizer_state")}
    if sum(kept.values()) > parts.fixed_bytes:  # not recorded alike (a hand-made cost model): tell fixed whole
        kept = {name: 0 for name in kept}
    outside = parts.fixed_bytes - sum(kept.values())
    total = parts.peak_bytes + margin_bytes
    terms = [f"{name.replace('_', ' ')} {format_bytes(value)}" for name, value in kept.items() if value]
    terms.append(f"{format_bytes(outside)} more alive outside the blocks (the batch, embeddings)" if terms
                 else f"fixed {format_bytes(outside)} (parameters, optimizer state, the batch, embeddings)")
    if parts.checkpoints:
        plural = "s" if parts.checkpoints != 1 else ""
        terms.append(f"{parts.checkpoints} checkpointed input{plural} held, {format_bytes(parts.checkpoint_bytes)}")
    if parts.other_held_bytes:
        terms.append(f"{format_bytes(parts.other_held_bytes)} of other activations held (plain blocks' saved "
                     "tensors, the gradient from the head)")
    backward = "end of the forward pass" not in parts.event
    what = "its activations and the gradients made by then" if backward else "its activations"
    event = parts.event.removeprefix("the ")
    terms.append(f"{format_bytes(parts.own_bytes)} for the {event} itself ({what})")
    if margin_bytes:
        terms.append(f"a margin of {format_bytes(margin_bytes)} (this plan was not measured when profiling)")
    activations = parts.checkpoint_bytes + parts.other_held_bytes + parts.own_bytes
    levers = []
    gradients = state.get("gradients", 0)
    if gradients and backward and not costs.optimizer_in_backward and costs.micro_batches == 1:
        levers.append("optimizer_in_backward=True (plan(..., optimizer=your_optimizer, optimizer_in_backward=True)) "
                      f"frees each gradient as soon as it is applied (the gradients are {format_bytes(gradients)} "
                      "in all)")
    if activations > 0:
        levers.append(f"a smaller batch, or the same batch as micro-batches (plan(..., micro_batches=k)): "
                      f"{format_bytes(activations)} of it are activations")
    sliced = any(block.nested_slices > 1 for block in costs.blocks)
    if activations > 0 and not sliced and "batch slices" not in costs.notes and "engine" not in costs.notes:
        levers.append("batch_slices=k (plan(..., batch_slices=4)): each block whose outputs are exact in slices of the "
                      "batch, or else its pieces that are (its attention, its MLP), is recomputed one slice at a time "
                      "(their weights' gradients then equal to rounding)")
    engine = costs.notes.get("engine")  # set by a distributed profile
    if engine == "FSDP2":  # already sharded: more processes shard further
        levers.append("more processes to shard over (each holds 1/N of parameters, gradients and optimizer state)")
    elif engine == "DDP":  # every process holds a full replica
        levers.append("FSDP2 (fully_shard) instead of DDP, to shard parameters, gradients and optimizer state")
    else:
        levers.append("sharding parameters, gradients and optimizer state (FSDP/ZeRO)")
    optimizer_state = kept["optimizer_state"]
    if optimizer_state and not costs.optimizer_offload and engine is None:
        levers.append(f"optimizer_offload=True (plan(..., optimizer=your_optimizer, optimizer_offload=True)): the "
                      f"optimizer state, {format_bytes(optimizer_state)}, in host memory between steps, one "
                      "parameter's on the device at a time")
    if activations > 0 and engine is None and not any(block.offload_held_bytes >= 0 for block in costs.blocks):
        levers.append("offload=True (plan(..., offload=True)): blocks may keep their saved activations in host "
                      "memory instead of recomputing them")
    text = f"{' + '.join(terms)}. What would lower it: {'; '.join(levers)}."
    figures: dict[str, Any] = {"floor_bytes": total, "fixed_bytes": parts.fixed_bytes, **{
        f"{name}_bytes": value for name, value in kept.items()}, "outside_bytes": outside,
        "checkpoints": parts.checkpoints, "checkpoint_bytes": parts.checkpoint_bytes,
        "other_held_bytes": parts.other_held_bytes, "own_bytes": parts.own_bytes, "margin_bytes": margin_bytes,
        "binding": parts.event}
    return text, figures
