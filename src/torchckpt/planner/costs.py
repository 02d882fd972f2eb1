"""The planner's cost model: measured data only, decided nothing (``docs/design.md``, "The planner's model").

This module never imports torch: the profiler fills these values, the solver (pure numpy) reads them.
All sizes are bytes (ints), all times seconds (floats).

The peak model the solver evaluates (named so that solver, profiler and tests can point at it):

1. **[fixed bytes plus a chain]** A model is ``fixed_bytes`` (parameters, gradients, optimizer state,
   the batch, and activations outside the blocks that live through the backward pass, as measured: no
   headroom) plus a chain of blocks ``0..n-1``.
   Block ``i`` reads ``x_i = blocks[i].input_bytes`` and produces ``y_i = blocks[i].output_bytes``
   (``y_i == x_{i+1}``). The gradient of a tensor has the tensor's size.
   A model whose code between blocks is not a plain chain (U-Net skips, an encoder output read by
   every decoder block) has ``chain=False``: then ``x_i`` is what block ``i`` holds when checkpointed
   (its input plus what the code after it keeps, measured at block boundaries), ``y_i`` need not equal
   ``x_{i+1}``, and plans have single blocks only (no regions). So does a model whose regions the
   profiler cannot prove exact (``profile``'s [a region must be exact]; ``notes["chain"]`` says why).
2. **[a plan is a sequence of pieces]** A plan is a sequence of pieces covering the chain in order. A
   piece is a single block with a menu option, or a region of consecutive blocks checkpointed as a whole
   whose inside is again a plan.
3. **[what a piece holds]** After its forward pass a piece holds: a plain block ``saved_bytes``, plus
   ``x_i`` when ``input_held_when_plain``; a checkpointed block ``x_i + kept`` (``kept`` = bytes of the
   op outputs its option keeps); a region ``x_i`` of its first block. Inside a region, blocks can only
   be plain or keep nothing (checkpoint.py's [nested checkpoints keep nothing]).
   ``input_held_when_plain`` is measured: whether block ``i``'s input was still alive when its
   backward pass began in the plain step. Autograd keeps an input only if some op saves it: a linear
   layer whose weight needs no gradient saves its weight but not its input, so a post-norm block
   (BERT) with frozen weight matrices keeps nothing of its input, and its input is freed during the
   forward pass. (Measured in a plain step,
   the flag also covers an input the previous block saves as its own output; a plan that checkpoints
   that previous block then over-counts ``x_i``, which is safe.)
   A checkpoint keeps its inputs whatever the block saves, unless the block has no backward
   pass (``has_backward`` False: its output needs no gradient, as for frozen leading blocks fed a batch or a
   ``no_grad`` section): autograd then records no checkpoint, and it holds what it holds plainly
   (``BlockCosts.checkpoint_held_bytes``; the probe reads such a block's input liveness when the backward
   pass begins). A checkpointed block also holds ``checkpoint_residue_bytes``: what its forward pass left
   alive besides its outputs when every block was checkpointed (autocast caches its weights' casts until the
   autocast region ends: a GPT-2 block's bfloat16 weights, measured 3.5% of the step under-predicted without
   it; the RNG state torch's checkpoint stashes). It counts through the backward pass too, an over-count where
   it is freed at the end of the forward pass, which is safe. A region would hold it for every block inside
   it, which this model does not count, so the profiler allows no regions where any block leaves any (``profile``).
   A checkpointed block also holds ``freed_side_input_bytes``: its other tensor inputs (positional and
   keyword; each storage once, the first input's excluded) whose storage the plain step has already
   freed when the block's backward pass begins, such as an encoder output or a position bias read only
   by linear layers with frozen weights. The plain step's calibration ([backward peak]) absorbs their
   absence, so they are added back whenever a checkpoint keeps them. A storage read by several
   checkpointed blocks is counted once per block, an over-count, which is safe. A region holds the same
   bytes of its first block, as its context and after it.
4. **[forward-end peak]** Forward end: ``fixed_bytes + sum(held) + head_bytes`` (``head_bytes``: the
   loss, logits and their gradients above everything else, measured).
5. **[backward peak]** The backward pass visits pieces in reverse. With ``C`` the bytes live around the
   chain (top level: ``fixed_bytes + y_{n-1}``, the gradient arriving from the head) and ``H`` the bytes
   held by earlier pieces of the same chain, the backward of block ``i`` peaks at
   ``C + H + x_i + saved_bytes_i + backward_peak_bytes_i (+ recompute_peak_bytes_i if checkpointed;
   with its pieces nested, rule 11 replaces the last three terms)
   (+ y_i unless i is block n-1, whose incoming gradient is already in C)``, less ``x_i`` for a plain
   block without ``input_held_when_plain``. A block that keeps some ops' outputs adds its menu option's
   ``recompute_extra_bytes`` (solve/menu.py's [kept outputs wait for their op]): while the recompute runs
   from the block's input, each kept output waits in the cache until the recompute reaches its op, beside
   what the plain forward had alive there (``OpCosts.alive_bytes``), which can peak above the keep-nothing
   recompute (an early, large temporary recomputed while late kept outputs wait: DeBERTa's relative
   attention measured 1.2 MB over its prediction before this term).
   A region's inside is evaluated as a chain with ``C' = C + H + region_recompute_bytes`` (plus
   ``x_first``, the region's input, which the region holds through its backward pass, when its first
   block does not hold its input when plain, and the first block's ``freed_side_input_bytes``;
   conservative when that block is checkpointed inside), where
   ``region_recompute_bytes`` (a CostModel field) is what recomputing a region keeps alive beyond its
   blocks' own costs. The profiler measures it on a region over blocks ``0`` and ``1`` followed by plain
   blocks, and adds one block output, which measurements with checkpointed blocks nested in a
   region showed alive as well (see ``profile._region_residue``). The gradient arriving at a region is
   otherwise counted by its last block as ``y_i``.
6. **[forward peak]** The forward pass of a piece peaks at ``C + H + g + x_i + forward_peak_bytes_i``
   for a single block ``i``; a region runs its blocks holding only its first input, so it peaks at the
   largest over its blocks ``j`` of ``C + H + g + x_j + forward_peak_bytes_j (+ x_first if j is not the
   first)``. ``g`` is the gradient live meanwhile: 0 for pieces of the top-level chain (the model's
   forward pass); for pieces inside a region, which run again when the backward pass reaches it, the
   gradient of the region's output, ``y`` of its last block unless that block is n-1 (that gradient is
   in C).
7. **[predicted peak is the maximum]** The predicted peak is the maximum of [forward-end peak],
   [backward peak], [forward peak] over the plan and [backward-end peak]; extra time is the sum of recompute times: a
   checkpointed block's option time, a region's forward time plus its inside's extra time.
8. **[backward-end peak]** After block 0's backward pass the plan no longer matters: what runs then
   (the embeddings' backward pass, beside every parameter gradient) peaks at ``fixed_bytes + tail_bytes``,
   measured. It binds only once the rest of the step is small (a chunked loss head, many blocks recomputed).
9. **[measured schedules are predicted as measured]** Two schedules are measured when profiling: no
   checkpointing, which the rules above predict exactly by construction (the profiler's residues are
   fitted to that step), and every block checkpointed keeping nothing (what
   ``gradient_checkpointing_enable()`` does), whose measured peak is ``every_block_peak_bytes`` (0: not
   measured). The evaluator returns that figure for exactly that schedule, whatever rules 3-7 give
   (they over-count it slightly where ``recompute_peak_bytes`` is clamped at 0; the profiler's
   ``notes["every_block_peak"]`` shows both figures). Times are calibrated on that schedule too: block
   forward times (and so op times) are scaled by one factor so that its predicted extra time equals
   ``every_block_step_time_s - step_time_s``, both measured on one bare training step each (no meter,
   no hooks); ``notes["recompute_time_scale"]`` records the factor (1, uncalibrated, when timing noise
   made the checkpointed step no slower). ``step_time_s`` is the bare plain step. Only the peak of
   these two schedules and the extra time of the second are calibrated; every other plan's peak and
   time are predictions of rules 3-7 on those figures.
10. **[a margin only where a plan was not measured]** A plan is accepted for a budget when its predicted
   peak plus its margin is within the budget: 0 for the two measured schedules, ``margin_bytes`` (the
   profiler's suggestion: 64 KiB plus 0.5% of the plain step's activation bytes, ``profile.HEADROOM_*``;
   or what the caller asks for, ``from_costs.resolve_margin``) for every other schedule. A cost model with
   ``measured=False`` (a plan option the profiler measured only in part, such as the chunked loss head:
   ``from_costs.head_options``) gives every schedule the margin.
11. **[pieces nested inside a block]** A block checkpointed keeping nothing may also checkpoint its pieces
   (``blocks.block_pieces``: its direct children with parameters, such as attention, MLP and norms) inside
   its recomputation, so that recomputing it holds the pieces' inputs and one piece's activations at a
   time instead of all of its activations. It holds what keep-nothing holds plus ``nested_held_bytes`` (what
   its pieces' checkpoints keep alive through the forward pass, measured: a piece's input that the block made,
   such as a norm's output); its backward pass peaks at
   ``C + H + x_i (+ freed side inputs) + nested_held_bytes_i + nested_recompute_peak_bytes_i (+ y_i unless i is
   n-1)``: measured with
   every block so checkpointed, it replaces ``saved_bytes_i + backward_peak_bytes_i + recompute_peak_bytes_i``
   (-1: not measured, no such option; offered only where it is smaller); it recomputes its forward twice
   (``2 * forward_time_s``:
   the block, then each piece again; the pieces are most of the block's work). Not inside regions. With
   ``nested_slices`` k > 1 (``profile(..., batch_slices=k)``, where the block's outputs were measured bitwise
   equal run whole and in slices of the batch: planner/batch_slices.py) the option also runs the block as k
   checkpoints over slices of the batch (executor/batch_slices.py), so its recomputation rebuilds one slice's
   activations at a time, its pieces nested inside each slice unless ``nested_pieces`` is False (profiled with
   ``pieces=False``, or a block without pieces); the figures above are then measured so, and its forward pass,
   which then holds one slice's transients, peaks at ``x_i + nested_forward_peak_bytes_i (+ g)`` of [forward
   peak] (measured in the same step) instead of ``forward_peak_bytes_i``. A block not so sliced may instead run
   the pieces listed in ``nested_sliced_pieces`` (indices into ``blocks.block_pieces``), those measured exact, in
   ``nested_piece_slices`` slices each (planner/batch_slices.py's [a refused block's pieces may run in slices]);
   its figures and its forward peak are then measured so, in the same way.
12. **[offloaded blocks]** A block may run plainly with the activations its forward pass saves moved to host
   memory (executor/offload.py), nothing recomputed; what it saves of its input moves too. It then holds, after its
   forward pass, its input only if ``offload_input_held`` (measured in a step with every block so run: the input
   still alive when the block's backward pass begins, as ``input_held_when_plain`` is read) plus
   ``offload_held_bytes`` (measured in the same step: what its forward pass
   leaves on the device beyond its output; -1: not measured, no such option); its forward pass peaks as a plain
   block's, and its backward pass at ``C + H + x_i (if held so) + offload_held_bytes_i +
   offload_backward_peak_bytes_i (+ y_i unless i is n-1)`` plus ``offload["window_bytes"]`` (copies brought back
   ahead of use), the residue measured in the same step as with the other rules (-1: not measured; the plain
   block's backward terms then count, an over-count, as copies come back only as they are used). It holds
   ``offload_host_bytes`` of host memory from its forward pass to its backward pass; a plan's host peak is their
   sum over its offloaded blocks (all alive at the end of the forward pass), kept within
   ``offload["host_budget_bytes"]``. Its extra time is ``offload_time_s``: the copies' time not hidden behind
   compute, from the bandwidths measured at profile time, scaled so that the every-block-offloaded step's
   predicted extra time equals its measured one (``offload["time_scale"]``). Not inside regions.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, TypeVar

__all__ = ["OpCosts", "BlockCosts", "CostModel", "STATE_PARTS"]

STATE_PARTS = ("parameters", "gradients", "optimizer_state")  # CostModel.state_bytes' keys (StepRunner.state_bytes)

_Model = TypeVar("_Model", bound="CostModel")


def _check_non_negative(owner: str, **values: float) -> None:
    for name, value in values.items():
        if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0:
            raise ValueError(f"{owner}.{name} must be a number >= 0; got {value!r}")


_LOSS_HEAD_KEYS = {"path": str, "chunk_tokens": int, "head_bytes": int, "extra_time_s": float}


def _check_entry(owner: str, keys: dict[str, type], entry: object) -> bool:
    """A dict field that is empty, only a ``note`` (why the option is missing), or exactly ``keys`` with values of
    their types; True when it carries the keys (``owner`` is ``"Kind.field"``)."""
    if not isinstance(entry, dict):
        raise ValueError(f"{owner} must be a dict; got {entry!r}")
    if not entry or set(entry) == {"note"}:
        return False
    if set(entry) - {"note"} != set(keys):
        raise ValueError(f"{owner} must have the keys {sorted(keys)} (or only 'note'); got {sorted(entry)}")
    for key, kind in keys.items():
        value = entry[key]
        if isinstance(value, bool) or not isinstance(value, (int, float) if kind is float else kind):
            raise ValueError(f"{owner}[{key!r}] must be a {kind.__name__}; got {value!r}")
    return True


def _check_loss_head(owner: str, entry: object) -> None:
    if not _check_entry(f"{owner}.loss_head", _LOSS_HEAD_KEYS, entry):
        return
    assert isinstance(entry, dict)
    _check_non_negative(f"{owner}.loss_head", chunk_tokens=entry["chunk_tokens"] - 1, head_bytes=entry["head_bytes"],
                        extra_time_s=entry["extra_time_s"])


_OFFLOAD_KEYS = {"window_bytes": int, "host_budget_bytes": int, "d2h_bytes_per_s": float, "h2d_bytes_per_s": float,
                 "time_scale": float, "device": str}


def _check_offload(owner: str, entry: object) -> None:
    """[offloaded blocks]: ``CostModel.offload`` is empty, only a ``note`` (why there is no offload option), or the
    calibration and limits the offload options were measured with."""
    if not _check_entry(f"{owner}.offload", _OFFLOAD_KEYS, entry):
        return
    assert isinstance(entry, dict)
    _check_non_negative(f"{owner}.offload", window_bytes=entry["window_bytes"],
                        host_budget_bytes=entry["host_budget_bytes"], d2h_bytes_per_s=entry["d2h_bytes_per_s"],
                        h2d_bytes_per_s=entry["h2d_bytes_per_s"], time_scale=entry["time_scale"])


@dataclass(frozen=True, kw_only=True)
class OpCosts:
    """One op of a block's forward pass, at the position the executor's policies see (``OpInfo.index``).

    ``saved``: autograd keeps this op's output for the backward pass when the block runs plainly, so
    keeping it under checkpointing saves its recomputation without adding memory beyond ``saved_bytes``;
    and the executor can keep it (it is not a random, in-place or view op, and not written in place
    later). Only ``saved`` ops appear in menus, so every menu option is one the executor realises.
    ``alive_bytes``: what was alive in the block's plain forward pass just after this op ran, above what was
    alive when the block began (measured; -1: not measured, as in cost models written by hand), for
    [backward peak]'s kept outputs waiting in the cache.
    """

    index: int
    name: str
    output_bytes: int
    saved: bool
    time_s: float
    alive_bytes: int = -1  # bytes alive in the block's plain forward just after this op, above the block's start

    def __post_init__(self) -> None:
        _check_non_negative("OpCosts", index=self.index, output_bytes=self.output_bytes, time_s=self.time_s)
        if not isinstance(self.alive_bytes, int) or self.alive_bytes < -1:
            raise ValueError(f"OpCosts({self.name!r}).alive_bytes must be an int >= 0, or -1 (not measured); "
                             f"got {self.alive_bytes!r}")


@dataclass(frozen=True, kw_only=True)
class BlockCosts:
    """Measured costs of one block (see [fixed bytes plus a chain], [what a piece holds], [backward peak] and
    [forward peak] in the module docstring)."""

    name: str
    input_bytes: int
    output_bytes: int
    saved_bytes: int
    forward_time_s: float
    forward_peak_bytes: int = 0
    backward_peak_bytes: int = 0
    recompute_peak_bytes: int = 0
    ops: tuple[OpCosts, ...] = ()
    input_held_when_plain: bool = True
    freed_side_input_bytes: int = 0
    nested_recompute_peak_bytes: int = -1
    nested_held_bytes: int = 0
    nested_slices: int = 1  # the nested option runs the block in this many slices of the batch (rule 11)
    nested_pieces: bool = True  # the nested option checkpoints the block's pieces inside it (rule 11)
    nested_forward_peak_bytes: int = -1  # the nested option's forward peak, measured (rule 11); -1: forward_peak_bytes
    nested_slice_batch: int = 0  # the batch the sliced option was measured on (rule 11); 0: not sliced
    nested_sliced_pieces: tuple[int, ...] = ()  # the nested option runs these pieces in slices (rule 11) ...
    nested_piece_slices: int = 1  # ... this many
    plain_only: str = ""  # why the block may not be recomputed (planner/repeat.py); "": it may
    has_backward: bool = True  # False: its output needs no gradient (frozen, a no-grad input, a no_grad section)
    checkpoint_residue_bytes: int = 0  # what a checkpointed forward leaves alive besides its outputs (measured)
    offload_held_bytes: int = -1  # rule 12: device bytes left beyond its output when offloaded; -1: no such option
    offload_host_bytes: int = 0  # rule 12: host bytes its offloaded activations take
    offload_time_s: float = 0.0  # rule 12: the offload's visible time per step
    offload_backward_peak_bytes: int = -1  # rule 12: its backward pass's residue when offloaded; -1: not measured
    offload_input_held: bool = True  # rule 12: its input still alive at its backward pass when offloaded (measured)

    @property
    def checkpoint_held_bytes(self) -> int:
        """What a checkpoint of this block (or a region starting at it) holds: its input and the side inputs the
        plain step frees; for a block without a backward pass only what it holds plainly: autograd records no
        checkpoint node for it, so nothing is saved ([what a piece holds])."""
        if not self.has_backward:
            return self.input_bytes if self.input_held_when_plain else 0
        return self.input_bytes + self.freed_side_input_bytes + self.checkpoint_residue_bytes

    def __post_init__(self) -> None:
        if not isinstance(self.has_backward, bool):
            raise ValueError(f"BlockCosts({self.name!r}).has_backward must be a bool; got {self.has_backward!r}")
        if not isinstance(self.plain_only, str):
            raise ValueError(f"BlockCosts({self.name!r}).plain_only must be a str (a reason, or ''); got "
                             f"{self.plain_only!r}")
        if not isinstance(self.offload_input_held, bool):
            raise ValueError(f"BlockCosts({self.name!r}).offload_input_held must be a bool; got "
                             f"{self.offload_input_held!r}")
        for name in ("offload_held_bytes", "offload_backward_peak_bytes"):
            held = getattr(self, name)
            if isinstance(held, bool) or not isinstance(held, int) or held < -1:
                raise ValueError(f"BlockCosts({self.name!r}).{name} must be an int >= 0, or -1 (not measured); got "
                                 f"{held!r}")
        _check_non_negative(f"BlockCosts({self.name!r})", offload_host_bytes=self.offload_host_bytes,
                            offload_time_s=self.offload_time_s)
        nested = self.nested_recompute_peak_bytes
        if isinstance(nested, bool) or not isinstance(nested, int) or nested < -1:
            raise ValueError(f"BlockCosts({self.name!r}).nested_recompute_peak_bytes must be an int >= 0, or -1 (not "
                             f"measured); got {nested!r}")
        forward = self.nested_forward_peak_bytes
        if isinstance(forward, bool) or not isinstance(forward, int) or forward < -1:
            raise ValueError(f"BlockCosts({self.name!r}).nested_forward_peak_bytes must be an int >= 0, or -1 (not "
                             f"measured: forward_peak_bytes counts); got {forward!r}")
        if isinstance(self.nested_slice_batch, bool) or not isinstance(self.nested_slice_batch, int) or \
                self.nested_slice_batch < 0:
            raise ValueError(f"BlockCosts({self.name!r}).nested_slice_batch must be an int >= 0; got "
                             f"{self.nested_slice_batch!r}")
        slices = self.nested_slices
        if isinstance(slices, bool) or not isinstance(slices, int) or slices < 1:
            raise ValueError(f"BlockCosts({self.name!r}).nested_slices must be an int >= 1; got {slices!r}")
        if not isinstance(self.nested_pieces, bool) or not (self.nested_pieces or slices > 1):
            raise ValueError(f"BlockCosts({self.name!r}).nested_pieces must be a bool, False only with nested_slices "
                             f"> 1 (the option then runs the block in slices without nesting its pieces); got "
                             f"{self.nested_pieces!r}")
        object.__setattr__(self, "nested_sliced_pieces", tuple(self.nested_sliced_pieces))  # JSON gives a list
        if isinstance(self.nested_piece_slices, bool) or not isinstance(self.nested_piece_slices, int) or \
                self.nested_piece_slices < 1 or (self.nested_piece_slices > 1) != bool(self.nested_sliced_pieces):
            raise ValueError(f"BlockCosts({self.name!r}).nested_piece_slices must be an int > 1 with "
                             f"nested_sliced_pieces, else 1; got {self.nested_piece_slices!r} with "
                             f"{list(self.nested_sliced_pieces)}")
        if not isinstance(self.input_held_when_plain, bool):
            raise ValueError(f"BlockCosts({self.name!r}).input_held_when_plain must be a bool; got "
                             f"{self.input_held_when_plain!r}")
        _check_non_negative(f"BlockCosts({self.name!r})", input_bytes=self.input_bytes,
                            output_bytes=self.output_bytes, saved_bytes=self.saved_bytes,
                            forward_time_s=self.forward_time_s, forward_peak_bytes=self.forward_peak_bytes,
                            backward_peak_bytes=self.backward_peak_bytes,
                            recompute_peak_bytes=self.recompute_peak_bytes,
                            freed_side_input_bytes=self.freed_side_input_bytes,
                            checkpoint_residue_bytes=self.checkpoint_residue_bytes,
                            nested_held_bytes=self.nested_held_bytes)
        object.__setattr__(self, "ops", tuple(op if isinstance(op, OpCosts) else OpCosts(**op) for op in self.ops))


@dataclass(frozen=True, kw_only=True)
class CostModel:
    """The whole cost model: fixed bytes, the head's transient, and the chain of blocks (no torch needed).

    The solver reads it; ``torchckpt.planner.ChainCosts`` (what ``profile`` returns) adds ``plan(budget)``.

    Besides the terms of the peak model: ``step_time_s`` (a bare plain training step, seconds);
    ``every_block_peak_bytes`` and ``every_block_step_time_s`` (the measured peak and step time with
    every block checkpointed keeping nothing; 0 when not measured, see [measured schedules are predicted
    as measured]); ``loss_head`` (the LM head computed in chunks of tokens, a plan option: ``path``,
    ``chunk_tokens``, ``head_bytes`` replacing the plain ``head_bytes`` when chosen, ``extra_time_s``; or only a
    ``note`` saying why there is none; planner/head.py); ``margin_bytes`` (the margin ``margin="auto"`` gives
    plans that were not measured,
    [a margin only where a plan was not measured]); ``block_paths`` and ``fingerprint`` (the model's
    block module paths and ``plan.fingerprint``, recorded by ``profile`` so that ``ChainCosts.plan`` can make
    plans from these costs alone); ``state_bytes`` (what training keeps whatever the plan, for messages only:
    ``parameters``, ``gradients``, ``optimizer_state``, ``StepRunner.state_bytes``; parameters and optimizer state
    are inside ``fixed_bytes``, gradients arise in the backward pass; empty where not recorded);
    ``optimizer_offload`` (measured with the optimizer's state in host memory, executor/optimizer_offload.py: it is
    then not in ``fixed_bytes``, and ``tail_bytes`` includes the optimizer step's peak).

    Example:
        >>> block = BlockCosts(name="b", input_bytes=4, output_bytes=4, saved_bytes=8, forward_time_s=1.0)
        >>> costs = CostModel(fixed_bytes=100, head_bytes=10, blocks=(block, block), block_paths=("0", "1"))
        >>> CostModel.from_json(costs.to_json()) == costs
        True
    """

    fixed_bytes: int
    head_bytes: int
    blocks: tuple[BlockCosts, ...]
    region_recompute_bytes: int = 0
    step_time_s: float = 0.0
    chain: bool = True
    notes: dict[str, str] = field(default_factory=dict)
    every_block_peak_bytes: int = 0
    every_block_step_time_s: float = 0.0
    margin_bytes: int = 0
    block_paths: tuple[str, ...] = ()
    fingerprint: dict[str, Any] = field(default_factory=dict)
    loss_head: dict[str, Any] = field(default_factory=dict)
    tail_bytes: int = 0
    measured: bool = True
    optimizer_in_backward: bool = False
    micro_batches: int = 1
    state_bytes: dict[str, int] = field(default_factory=dict)
    offload: dict[str, Any] = field(default_factory=dict)
    optimizer_offload: bool = False

    def __post_init__(self) -> None:
        kind = type(self).__name__
        _check_offload(kind, self.offload)
        if not isinstance(self.state_bytes, dict) or not set(self.state_bytes) <= set(STATE_PARTS) or not all(
                isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in self.state_bytes.values()):
            raise ValueError(f"{kind}.state_bytes must map some of {STATE_PARTS} to int byte counts >= 0; "
                             f"got {self.state_bytes!r}")
        if isinstance(self.micro_batches, bool) or not isinstance(self.micro_batches, int) or self.micro_batches < 1:
            raise ValueError(f"{kind}.micro_batches must be an int >= 1; got {self.micro_batches!r}")
        _check_loss_head(kind, self.loss_head)
        _check_non_negative(kind, fixed_bytes=self.fixed_bytes, head_bytes=self.head_bytes,
                            region_recompute_bytes=self.region_recompute_bytes, step_time_s=self.step_time_s,
                            every_block_peak_bytes=self.every_block_peak_bytes,
                            every_block_step_time_s=self.every_block_step_time_s, margin_bytes=self.margin_bytes,
                            tail_bytes=self.tail_bytes)
        for name in ("every_block_peak_bytes", "margin_bytes"):
            if not isinstance(getattr(self, name), int):
                raise ValueError(f"{kind}.{name} must be an int number of bytes; got {getattr(self, name)!r}")
        paths = tuple(self.block_paths)
        if not all(isinstance(path, str) for path in paths):
            raise ValueError(f"{kind}.block_paths must be strings (module paths); got {self.block_paths!r}")
        if not isinstance(self.fingerprint, dict):
            raise ValueError(f"{kind}.fingerprint must be a dict (plan.fingerprint); got {self.fingerprint!r}")
        blocks = tuple(b if isinstance(b, BlockCosts) else BlockCosts(**b) for b in self.blocks)
        if not blocks:
            raise ValueError(f"{kind}.blocks is empty: a cost model needs at least one block")
        if not all(isinstance(flag, bool) for flag in (self.measured, self.optimizer_in_backward,
                                                        self.optimizer_offload)):
            raise ValueError(f"{kind}.measured, .optimizer_in_backward and .optimizer_offload must be bools; got "
                             f"{self.measured!r}, {self.optimizer_in_backward!r}, {self.optimizer_offload!r}")
        if not isinstance(self.chain, bool):
            raise ValueError(f"{kind}.chain must be a bool; got {self.chain!r}")
        for before, after in zip(blocks, blocks[1:] if self.chain else ()):
            if before.output_bytes != after.input_bytes:
                raise ValueError(f"{kind}: block {before.name!r} outputs {before.output_bytes} bytes but the next "
                                 f"block {after.name!r} reads {after.input_bytes}; blocks must form a chain "
                                 "(or pass chain=False: then regions are not allowed)")
        if paths and len(paths) != len(blocks):
            raise ValueError(f"{kind}.block_paths names {len(paths)} blocks but there are {len(blocks)}")
        object.__setattr__(self, "blocks", blocks)
        object.__setattr__(self, "block_paths", paths)

    def to_json(self) -> str:
        """Serialise to JSON (the round trip is exact)."""
        return json.dumps(asdict(self), indent=1, sort_keys=True)

    @classmethod
    def from_json(cls: type[_Model], text: str) -> _Model:
        """Read what :meth:`to_json` wrote."""
        return cls(**json.loads(text))

    def save(self, path: str | Path) -> None:
        """Write the JSON form to ``path``."""
        Path(path).write_text(self.to_json())

    @classmethod
    def load(cls: type[_Model], path: str | Path) -> _Model:
        """Read a cost model saved with :meth:`save`."""
        return cls.from_json(Path(path).read_text())
