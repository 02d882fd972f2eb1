"""The Plan: the only value that crosses from planning to execution (typed, JSON at the edge, checked on load).

A plan names its blocks by module path, lists its schedule as typed pieces (:class:`PlannedBlock`,
:class:`PlannedRegion`), and carries a fingerprint of the model and the input shapes it was made for,
so it is refused on anything else. The solver's own pieces (``solve.Single``/``solve.Region``) point
into per-block menus; a plan's pieces carry the decision itself (which op outputs to keep), so a plan
needs no menu to be applied.

Schedule pieces in JSON (``to_json`` / ``from_json`` only; everywhere else they are typed):
    {"block": 3, "plain": true}                              run block 3 normally
    {"block": 4, "plain": false, "keep": [3, 12, 28]}        checkpoint block 4, keep those ops' outputs
    {"region": [5, 9], "inner": [ ...pieces for 5..8... ]}   checkpoint blocks 5..8 as one region
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_flatten

from torchckpt._units import check_index, format_bytes
from torchckpt.executor.compiled import uncompiled
from torchckpt.executor.policies import parse_occurrence
from torchckpt.planner.blocks import block_pieces, describe_paths, own_type, structure_key

__all__ = ["Plan", "PlanMismatchError", "PlanPiece", "PlannedBlock", "PlannedRegion", "fingerprint",
           "iter_blocks"]

FORMAT_VERSION = 6
# A plan is written as the lowest version that carries it, so that releases before an option read the plans
# without it the same way and refuse, by version, those with it instead of applying them without: version 1
# has none of the options below; version 2 adds a chunked loss head, nested pieces, the optimizer inside the
# backward pass and micro-batches; version 3 adds blocks run in slices of the batch; version 4 offloaded blocks;
# version 5 the optimizer's state in host memory; version 6 a nested block's pieces run in slices of the batch.
_WITHOUT_LOSS_HEAD_VERSION = 1
_WITHOUT_SLICES_VERSION = 2
_WITHOUT_OFFLOAD_VERSION = 3
_WITHOUT_OPTIMIZER_OFFLOAD_VERSION = 4
_WITHOUT_SLICED_PIECES_VERSION = 5
_OFFLOAD_KEYS = ("window_bytes", "host_budget_bytes", "predicted_host_peak_bytes", "inputs")


class PlanMismatchError(ValueError):
    """A plan was applied to, or loaded for, a model or input it was not made for."""


@dataclass(frozen=True)
class PlannedBlock:
    """One block of a plan: run plainly (``plain=True``), or checkpointed keeping the outputs of ``keep``.

    ``keep`` lists op indices in the executor's numbering (``OpCosts.index``); it is empty for a plain
    block and for one that recomputes everything. ``keep_ops`` names the same ops as ``"aten.mm#2:4096"``
    (the op, how many ops of that name ran before it in the block, its output bytes; ``"-"`` for one that
    cannot be named in a traced graph), which is how a block traced by ``torch.compile`` keeps them
    (Note: [compiled plans keep ops by name and occurrence]); empty in plans made before it existed, which
    then run eagerly only.

    Example:
        >>> PlannedBlock(block=4, plain=False, keep=(3, 12)).recomputes
        True
    """

    block: int
    plain: bool
    keep: tuple[int, ...] = ()
    keep_ops: tuple[str, ...] = ()
    nested: bool = False  # its pieces checkpointed inside it (costs.py's [pieces nested inside a block])
    slices: int = 1  # run in this many slices of the batch, keeping nothing (executor/batch_slices.py)
    slice_batch: int = 0  # ... of a batch this large (as profiled); another batch runs unsliced, with a warning
    offload: bool = False  # run plainly, its saved activations in host memory (costs.py's [offloaded blocks])
    # planner/batch_slices.py's [a refused block's pieces may run in slices]:
    sliced_pieces: tuple[int, ...] = ()  # nested: these of its pieces (blocks.block_pieces) run in slices ...
    piece_slices: int = 1  # ... this many, of a batch of slice_batch

    def __post_init__(self) -> None:
        check_index("PlannedBlock.block", self.block)
        sliced_pieces = tuple(self.sliced_pieces)
        for index in sliced_pieces:
            check_index("PlannedBlock.sliced_pieces[]", index)
        if isinstance(self.piece_slices, bool) or not isinstance(self.piece_slices, int) or self.piece_slices < 1 \
                or (self.piece_slices > 1) != bool(sliced_pieces) or (sliced_pieces and not self.nested) \
                or (sliced_pieces and self.slices > 1):
            raise ValueError(f"PlannedBlock(block={self.block}): sliced_pieces={list(sliced_pieces)} with "
                             f"piece_slices={self.piece_slices!r}: pieces run in slices only in a nested block that "
                             "is not itself sliced, and then piece_slices must be an int > 1 (else 1, no pieces)")
        object.__setattr__(self, "sliced_pieces", sliced_pieces)
        if not isinstance(self.offload, bool) or (self.offload and not self.plain):
            raise ValueError(f"PlannedBlock(block={self.block}).offload must be a bool, True only for a plain block "
                             f"(offload moves what a plainly run block saves); got offload={self.offload!r}, "
                             f"plain={self.plain!r}")
        if not isinstance(self.plain, bool):
            raise ValueError(f"PlannedBlock.plain must be a bool; got {self.plain!r}")
        if not isinstance(self.nested, bool):
            raise ValueError(f"PlannedBlock.nested must be a bool; got {self.nested!r}")
        if isinstance(self.slices, bool) or not isinstance(self.slices, int) or self.slices < 1:
            raise ValueError(f"PlannedBlock.slices must be an int >= 1; got {self.slices!r}")
        if isinstance(self.slice_batch, bool) or not isinstance(self.slice_batch, int) or self.slice_batch < 0:
            raise ValueError(f"PlannedBlock.slice_batch must be an int >= 0; got {self.slice_batch!r}")
        if (self.nested or self.slices > 1) and (self.plain or tuple(self.keep)):
            raise ValueError(f"PlannedBlock(block={self.block}) nests its pieces or runs in slices of the batch: it "
                             "must be checkpointed keeping nothing (plain=False, no keep)")
        keep = tuple(self.keep)
        for index in keep:
            check_index("PlannedBlock.keep[]", index)
        if self.plain and keep:
            raise ValueError(f"PlannedBlock(block={self.block}) is plain (nothing recomputed) and cannot also list "
                             f"ops to keep ({list(keep)}); give plain=False to checkpoint it keeping those ops")
        object.__setattr__(self, "keep", keep)
        keep_ops = tuple(self.keep_ops)
        for text in keep_ops:
            parse_occurrence(text)
        if keep_ops and len(keep_ops) != len(keep):
            raise ValueError(f"PlannedBlock(block={self.block}).keep_ops names {len(keep_ops)} ops for {len(keep)} "
                             "kept indices; give one 'name#k:bytes' (or '-') per index of keep, or none")
        object.__setattr__(self, "keep_ops", keep_ops)

    @property
    def recomputes(self) -> bool:
        """Whether the block runs under a checkpoint (recomputing what it does not keep)."""
        return not self.plain


@dataclass(frozen=True)
class PlannedRegion:
    """Blocks ``start .. stop-1`` checkpointed as one region whose inside runs ``inner``.

    Example:
        >>> inner = (PlannedBlock(block=0, plain=True), PlannedBlock(block=1, plain=False))
        >>> PlannedRegion(start=0, stop=2, inner=inner).stop
        2
    """

    start: int
    stop: int
    inner: tuple[PlanPiece, ...]

    def __post_init__(self) -> None:
        check_index("PlannedRegion.start", self.start)
        check_index("PlannedRegion.stop", self.stop)
        inner = tuple(self.inner)
        if self.stop - self.start < 2 or not inner:
            raise ValueError(f"PlannedRegion(start={self.start}, stop={self.stop}) must span at least 2 blocks "
                             "(stop is exclusive) and have inner pieces")
        covered = [piece.block for piece, _ in iter_blocks(inner)]
        if covered != list(range(self.start, self.stop)):
            raise ValueError(f"PlannedRegion({self.start}, {self.stop}).inner covers blocks {covered}; it must cover "
                             f"{list(range(self.start, self.stop))} in order")
        object.__setattr__(self, "inner", inner)


PlanPiece = PlannedBlock | PlannedRegion


def iter_blocks(pieces: Sequence[PlanPiece],
                region: tuple[int, int] | None = None) -> Iterator[tuple[PlannedBlock, tuple[int, int] | None]]:
    """Every block of ``pieces`` in forward order, with the outermost region it runs in (or None).

    Example:
        >>> inner = (PlannedBlock(block=0, plain=True), PlannedBlock(block=1, plain=True))
        >>> [(b.block, r) for b, r in iter_blocks((PlannedRegion(start=0, stop=2, inner=inner),))]
        [(0, (0, 2)), (1, (0, 2))]
    """
    for piece in pieces:
        if isinstance(piece, PlannedRegion):
            yield from iter_blocks(piece.inner, region or (piece.start, piece.stop))
        else:
            yield piece, region


def _piece_to_json(piece: PlanPiece) -> dict[str, Any]:
    if isinstance(piece, PlannedRegion):
        return {"region": [piece.start, piece.stop], "inner": [_piece_to_json(p) for p in piece.inner]}
    entry: dict[str, Any] = {"block": piece.block, "plain": piece.plain}
    if piece.nested:
        entry["nested"] = True
    if piece.offload:
        entry["offload"] = True
    if piece.slices > 1 or piece.sliced_pieces:
        entry.update({"slices": piece.slices} if piece.slices > 1 else {
            "sliced_pieces": list(piece.sliced_pieces), "piece_slices": piece.piece_slices})
        entry["slice_batch"] = piece.slice_batch
    if not piece.plain:
        entry["keep"] = list(piece.keep)
        if piece.keep_ops:
            entry["keep_ops"] = list(piece.keep_ops)
    return entry


def _piece_from_json(entry: Any) -> PlanPiece:
    if not isinstance(entry, dict):
        raise ValueError(f"a schedule piece must be a JSON object; got {entry!r}")
    if "region" in entry:
        start, stop = entry["region"]
        return PlannedRegion(start=start, stop=stop, inner=tuple(_piece_from_json(p) for p in entry["inner"]))
    return PlannedBlock(block=entry["block"], plain=entry["plain"], keep=tuple(entry.get("keep", ())),
                        keep_ops=tuple(entry.get("keep_ops", ())), nested=entry.get("nested", False),
                        slices=entry.get("slices", 1), slice_batch=entry.get("slice_batch", 0),
                        offload=entry.get("offload", False), sliced_pieces=tuple(entry.get("sliced_pieces", ())),
                        piece_slices=entry.get("piece_slices", 1))


def fingerprint(model: nn.Module, example_inputs: tuple | dict, block_paths: list[str]) -> dict[str, Any]:
    """What a plan must match: model structure, block paths, input shapes and dtypes.

    Example:
        >>> fp = fingerprint(nn.Linear(2, 2), (torch.ones(3, 2),), [])
        >>> fp["inputs"]
        [[[3, 2], 'torch.float32']]
    """
    model = uncompiled(model)  # Note: [a compiled model is planned through its original]
    digest = hashlib.sha256(repr(structure_key(model)).encode()).hexdigest()[:16]
    inputs = [[list(t.shape), str(t.dtype)] for t in tree_flatten(example_inputs)[0] if isinstance(t, torch.Tensor)]
    return {"model": own_type(model).__name__, "structure": digest, "blocks": list(block_paths), "inputs": inputs}


@dataclass(frozen=True, kw_only=True)
class Plan:
    """A checkpointing plan for one model and input shape.

    Attributes:
        budget_bytes: the budget the plan was solved for (the whole step's peak).
        predicted_peak_bytes: the cost model's peak for this plan.
        predicted_extra_time_s: predicted recomputation time per step.
        schedule: typed pieces in forward order (:class:`PlannedBlock`, :class:`PlannedRegion`).
        block_paths: module path of each block, in forward order.
        fingerprint: see :func:`fingerprint`.
        reference: named reference figures (e.g. ``no_checkpointing_peak_bytes``, ``step_time_s``).
        notes: named remarks on how the plan was made, shown by :meth:`table` (e.g. ``regions``: why the
            plan has no regions).
        loss_head: empty, or ``{"path", "chunk_tokens"}``: the LM head at that module path computes its
            logits and cross-entropy in chunks of that many tokens (``executor/loss_head.py``).
        optimizer_in_backward: the plan was measured with the optimizer's update run per parameter inside the
            backward pass (``executor/optimizer_in_backward.py``); ``apply`` then needs the optimizer.
        optimizer_offload: the plan was measured with the optimizer's state in host memory between steps
            (``executor/optimizer_offload.py``); ``apply`` then needs the optimizer.
        micro_batches: backward passes per optimizer step (gradient accumulation) the plan was measured for;
            its peaks hold on every micro-batch (Note: [a later micro-batch peaks highest]).
        offload: empty, or, for a plan with offloaded blocks (``PlannedBlock.offload``), the executor's
            ``window_bytes`` and ``host_budget_bytes``, the plan's ``predicted_host_peak_bytes``, and ``inputs`` (1:
            what a block saves of its input is offloaded too; planner/offload_step.py's [inputs move only along a
            chain]) (costs.py's [offloaded blocks]).
    """

    budget_bytes: int
    predicted_peak_bytes: int
    predicted_extra_time_s: float
    schedule: tuple[PlanPiece, ...]
    block_paths: tuple[str, ...]
    fingerprint: dict[str, Any]
    reference: dict[str, float] = field(default_factory=dict)
    notes: dict[str, str] = field(default_factory=dict)
    loss_head: dict[str, Any] = field(default_factory=dict)
    optimizer_in_backward: bool = False
    micro_batches: int = 1
    offload: dict[str, int] = field(default_factory=dict)
    optimizer_offload: bool = False

    def __post_init__(self) -> None:
        offload = self.offload
        if not isinstance(offload, dict) or (offload and (set(offload) != set(_OFFLOAD_KEYS) or not all(
                isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in offload.values()))):
            raise ValueError(f"Plan.offload must be {{}} or map {list(_OFFLOAD_KEYS)} to ints >= 0; got {offload!r}")
        if isinstance(self.micro_batches, bool) or not isinstance(self.micro_batches, int) or self.micro_batches < 1:
            raise ValueError(f"Plan.micro_batches must be an int >= 1; got {self.micro_batches!r}")
        for name in ("optimizer_in_backward", "optimizer_offload"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"Plan.{name} must be a bool; got {getattr(self, name)!r}")
        head = self.loss_head
        if not isinstance(head, dict) or (head and (set(head) != {"path", "chunk_tokens"}
                                                    or not isinstance(head["path"], str)
                                                    or isinstance(head["chunk_tokens"], bool)
                                                    or not isinstance(head["chunk_tokens"], int)
                                                    or head["chunk_tokens"] < 1)):
            raise ValueError("Plan.loss_head must be {} or {'path': str, 'chunk_tokens': int >= 1}; "
                             f"got {head!r}")
        schedule = tuple(self.schedule)
        wrong = [piece for piece in schedule if not isinstance(piece, (PlannedBlock, PlannedRegion))]
        if wrong:
            raise TypeError(f"Plan.schedule holds PlannedBlock/PlannedRegion pieces; got {type(wrong[0]).__name__} "
                            f"{wrong[0]!r} (JSON pieces are read with Plan.from_json)")
        object.__setattr__(self, "schedule", schedule)

    # ------------------------------------------------------------------ views
    def decisions(self) -> list[dict[str, Any]]:
        """One entry per block: ``{"block", "path", "decision", "region"}`` in forward order.

        Example:
            >>> plan = Plan(budget_bytes=1, predicted_peak_bytes=1, predicted_extra_time_s=0.0,
            ...             schedule=(PlannedBlock(block=0, plain=True),), block_paths=("blocks.0",), fingerprint={})
            >>> plan.decisions()[0]["decision"]
            'keep all'
        """
        rows: list[dict[str, Any]] = []
        for piece, region in iter_blocks(self.schedule):
            index = piece.block
            if piece.offload:
                decision = "keep all, offloaded to host"
            elif piece.plain:
                decision = "keep all"
            elif piece.slices > 1:
                pieces = ", pieces nested" if piece.nested else ""
                decision = f"recompute all{pieces}, in {piece.slices} slices of the batch"
            elif piece.nested:
                sliced = f" ({len(piece.sliced_pieces)} in {piece.piece_slices} slices of the batch)" \
                    if piece.sliced_pieces else ""
                decision = f"recompute all, pieces nested{sliced}"
            elif piece.keep:
                decision = f"recompute, keep {len(piece.keep)} ops"
            else:
                decision = "recompute all"
            rows.append({"block": index, "path": self.block_paths[index], "decision": decision, "region": region})
        return rows

    def table(self) -> str:
        """The plan as a table: the blocks planned (``describe_paths``), per block its module path, decision
        and region, then the predictions.

        Example:
            >>> plan = Plan(budget_bytes=1, predicted_peak_bytes=1, predicted_extra_time_s=0.0,
            ...             schedule=(PlannedBlock(block=0, plain=True),), block_paths=("blocks.0",), fingerprint={})
            >>> plan.table().splitlines()[0]
            'blocks: blocks.0 (1 block)'
        """
        width = max([28, *(len(path) for path in self.block_paths)])
        lines = [f"blocks: {describe_paths(self.block_paths)}",
                 f"{'block':<6} {'module':<{width}} {'decision':<28} region"]
        for row in self.decisions():
            region = f"blocks {row['region'][0]}-{row['region'][1] - 1} recomputed together" if row["region"] else ""
            lines.append(f"{row['block']:<6} {row['path']:<{width}} {row['decision']:<28} {region}".rstrip())
        lines.append(f"budget {format_bytes(self.budget_bytes)}; "
                     f"predicted peak {format_bytes(self.predicted_peak_bytes)}; "
                     f"predicted extra time {self.predicted_extra_time_s * 1e3:.1f} ms per step")
        reference = self.reference.get("no_checkpointing_peak_bytes")
        if reference:
            lines.append(f"no checkpointing would peak at {format_bytes(reference)}; this plan's predicted peak is "
                         f"{self.predicted_peak_bytes / reference:.0%} of that")
        if self.micro_batches > 1:
            lines.append(f"gradient accumulation: {self.micro_batches} micro-batches per optimizer step; the peak "
                         "holds on every one")
        if self.offload:
            lines.append(f"host memory: offloaded activations predicted to peak at "
                         f"{format_bytes(self.offload['predicted_host_peak_bytes'])} (host budget "
                         f"{format_bytes(self.offload['host_budget_bytes'])})")
        if self.optimizer_in_backward:
            lines.append("optimizer: its update runs per parameter inside the backward pass (apply(model, plan, "
                         "optimizer=...))")
        if self.optimizer_offload:
            lines.append("optimizer: its state stays in host memory between steps, one parameter's on the device at a "
                         "time (apply(model, plan, optimizer=...))")
        lines.extend(f"{name}: {text}" for name, text in sorted(self.notes.items()))
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.table()

    # ------------------------------------------------------------------ checks and I/O
    def check_fits(self, model: nn.Module, example_inputs: tuple | dict | None = None) -> None:
        """Raise :class:`PlanMismatchError` naming what differs if this plan was made for something else."""
        found = fingerprint(model, example_inputs if example_inputs is not None else (), list(self.block_paths))
        if self.loss_head:
            try:
                head = model.get_submodule(self.loss_head["path"])
            except AttributeError:
                head = None
            if not isinstance(head, nn.Linear):
                raise PlanMismatchError(f"this plan computes the loss head {self.loss_head['path']!r} in chunks, "
                                        "but the model has no nn.Linear at that path; make a new plan with "
                                        "torchckpt.plan(model, inputs, budget=...)")
        for key in ("model", "structure", "blocks") + (("inputs",) if example_inputs is not None else ()):
            if found[key] != self.fingerprint.get(key):
                raise PlanMismatchError(
                    f"this plan was made for a different {key}: the plan has {self.fingerprint.get(key)!r}, the model "
                    f"and inputs given have {found[key]!r}; "
                    "make a new plan with torchckpt.plan(model, inputs, budget=...)")
        for piece, _ in iter_blocks(self.schedule):
            count = len(block_pieces(model.get_submodule(self.block_paths[piece.block]))) if piece.sliced_pieces else 0
            if piece.sliced_pieces and max(piece.sliced_pieces) >= count:
                raise PlanMismatchError(f"this plan runs pieces {list(piece.sliced_pieces)} of block "
                                        f"{self.block_paths[piece.block]} in slices, but it has {count} pieces; make "
                                        "a new plan with torchckpt.plan(model, inputs, budget=...)")

    def to_json(self) -> str:
        """JSON text (round-trips exactly through :meth:`from_json`)."""
        nested = any(piece.nested for piece, _ in iter_blocks(self.schedule))
        newer = self.loss_head or nested or self.optimizer_in_backward or self.micro_batches > 1
        sliced = any(piece.slices > 1 for piece, _ in iter_blocks(self.schedule))
        offloaded = any(piece.offload for piece, _ in iter_blocks(self.schedule))
        sliced_pieces = any(piece.sliced_pieces for piece, _ in iter_blocks(self.schedule))
        version = FORMAT_VERSION if sliced_pieces else _WITHOUT_SLICED_PIECES_VERSION if self.optimizer_offload else \
            _WITHOUT_OPTIMIZER_OFFLOAD_VERSION if offloaded else \
            _WITHOUT_OFFLOAD_VERSION if sliced else \
            _WITHOUT_SLICES_VERSION if newer else _WITHOUT_LOSS_HEAD_VERSION
        payload = {"format": "torchckpt.plan", "version": version, "budget_bytes": self.budget_bytes,
                   "predicted_peak_bytes": self.predicted_peak_bytes,
                   "predicted_extra_time_s": self.predicted_extra_time_s,
                   "schedule": [_piece_to_json(piece) for piece in self.schedule],
                   "block_paths": list(self.block_paths), "fingerprint": self.fingerprint,
                   "reference": self.reference, "notes": self.notes,
                   **({"loss_head": self.loss_head} if self.loss_head else {}),
                   **({"optimizer_in_backward": True} if self.optimizer_in_backward else {}),
                   **({"optimizer_offload": True} if self.optimizer_offload else {}),
                   **({"micro_batches": self.micro_batches} if self.micro_batches > 1 else {}),
                   **({"offload": self.offload} if self.offload else {})}
        return json.dumps(payload, indent=1)

    @classmethod
    def from_json(cls, text: str) -> Plan:
        """Parse a plan; errors name the problem (not a plan, a newer version)."""
        try:
            payload = json.loads(text)
        except json.JSONDecodeError as error:
            raise ValueError(f"not a torchckpt plan: invalid JSON ({error})") from None
        if not isinstance(payload, dict) or payload.get("format") != "torchckpt.plan":
            raise ValueError("not a torchckpt plan: the JSON has no \"format\": \"torchckpt.plan\" field")
        if payload.get("version") not in (_WITHOUT_LOSS_HEAD_VERSION, _WITHOUT_SLICES_VERSION, _WITHOUT_OFFLOAD_VERSION,
                                          _WITHOUT_OPTIMIZER_OFFLOAD_VERSION, _WITHOUT_SLICED_PIECES_VERSION,
                                          FORMAT_VERSION):
            raise ValueError(f"plan format version {payload.get('version')!r} is not supported by this torchckpt "
                             f"(reads versions {_WITHOUT_LOSS_HEAD_VERSION} to {FORMAT_VERSION}); upgrade torchckpt "
                             "or re-create the plan")
        try:
            return cls(budget_bytes=payload["budget_bytes"], predicted_peak_bytes=payload["predicted_peak_bytes"],
                       predicted_extra_time_s=payload["predicted_extra_time_s"],
                       schedule=tuple(_piece_from_json(entry) for entry in payload["schedule"]),
                       block_paths=tuple(payload["block_paths"]), fingerprint=payload["fingerprint"],
                       reference=payload.get("reference", {}), notes=payload.get("notes", {}),
                       loss_head=payload.get("loss_head", {}),
                       optimizer_in_backward=payload.get("optimizer_in_backward", False),
                       optimizer_offload=payload.get("optimizer_offload", False),
                       micro_batches=payload.get("micro_batches", 1), offload=payload.get("offload", {}))
        except (KeyError, TypeError, ValueError) as error:
            raise ValueError(f"not a complete torchckpt plan: missing or malformed field {error}; re-create the "
                             "plan with torchckpt.plan(...)") from None

    def save(self, path: str | Path) -> None:
        """Write the plan as JSON."""
        Path(path).write_text(self.to_json())

    @classmethod
    def load(cls, path: str | Path, model: nn.Module | None = None, example_inputs: tuple | dict | None = None) -> Plan:
        """Read a plan; with ``model`` (and inputs) given, refuse it unless it fits them."""
        plan = cls.from_json(Path(path).read_text())
        if model is not None:
            plan.check_fits(model, example_inputs)
        return plan

