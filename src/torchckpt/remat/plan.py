"""The Plan: the only value that crosses from planning to execution (JSON, typed, checked on load).

A plan names its blocks by module path, lists pieces in the solver's schedule form, and carries a
fingerprint of the model and the input shapes it was made for, so it is refused on anything else.

Schedule pieces in JSON:
    {"block": 3, "plain": true}                              run block 3 normally
    {"block": 4, "plain": false, "keep": [3, 12, 28]}        checkpoint block 4, keep those ops' outputs
    {"region": [5, 9], "inner": [ ...pieces for 5..8... ]}   checkpoint blocks 5..8 as one region
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_flatten

from torchckpt._units import format_bytes
from torchckpt.remat.blocks import structure_key

__all__ = ["Plan", "PlanMismatchError", "fingerprint"]

FORMAT_VERSION = 1


class PlanMismatchError(ValueError):
    """A plan was applied to, or loaded for, a model or input it was not made for."""


def fingerprint(model: nn.Module, example_inputs: tuple | dict, block_paths: list[str]) -> dict[str, Any]:
    """What a plan must match: model structure, block paths, input shapes and dtypes.

    Example:
        >>> fp = fingerprint(nn.Linear(2, 2), (torch.ones(3, 2),), [])
        >>> fp["inputs"]
        [[[3, 2], 'torch.float32']]
    """
    digest = hashlib.sha256(repr(structure_key(model)).encode()).hexdigest()[:16]
    inputs = [[list(t.shape), str(t.dtype)] for t in tree_flatten(example_inputs)[0] if isinstance(t, torch.Tensor)]
    return {"model": type(model).__name__, "structure": digest, "blocks": list(block_paths), "inputs": inputs}


@dataclass(frozen=True, kw_only=True)
class Plan:
    """A checkpointing plan for one model and input shape.

    Attributes:
        budget_bytes: the budget the plan was solved for (the whole step's peak).
        predicted_peak_bytes: the cost model's peak for this plan.
        predicted_extra_time_s: predicted recomputation time per step.
        schedule: pieces (see module docstring).
        block_paths: module path of each block, in forward order.
        fingerprint: see :func:`fingerprint`.
        reference: named reference figures (e.g. ``no_checkpointing_peak_bytes``, ``step_time_s``).
    """

    budget_bytes: int
    predicted_peak_bytes: int
    predicted_extra_time_s: float
    schedule: tuple[dict, ...]
    block_paths: tuple[str, ...]
    fingerprint: dict[str, Any]
    reference: dict[str, float] = field(default_factory=dict)

    # ------------------------------------------------------------------ views
    def decisions(self) -> list[dict[str, Any]]:
        """One entry per block: ``{"block", "path", "decision", "region"}`` in forward order.

        Example:
            >>> plan = Plan(budget_bytes=1, predicted_peak_bytes=1, predicted_extra_time_s=0.0,
            ...             schedule=({"block": 0, "plain": True},), block_paths=("blocks.0",), fingerprint={})
            >>> plan.decisions()[0]["decision"]
            'keep all'
        """
        rows: list[dict[str, Any]] = []
        for piece, region in _walk(self.schedule, None):
            index = piece["block"]
            if piece["plain"]:
                decision = "keep all"
            elif piece.get("keep"):
                decision = f"recompute, keep {len(piece['keep'])} ops"
            else:
                decision = "recompute all"
            rows.append({"block": index, "path": self.block_paths[index], "decision": decision, "region": region})
        return rows

    def table(self) -> str:
        """The plan as a table: per block its decision and region, then the predictions."""
        lines = [f"{'block':<6} {'module':<28} {'decision':<28} region"]
        for row in self.decisions():
            region = f"blocks {row['region'][0]}-{row['region'][1] - 1} recomputed together" if row["region"] else ""
            lines.append(f"{row['block']:<6} {row['path']:<28} {row['decision']:<28} {region}")
        lines.append(f"budget {format_bytes(self.budget_bytes)}; predicted peak {format_bytes(self.predicted_peak_bytes)}; "
                     f"predicted extra time {self.predicted_extra_time_s * 1e3:.1f} ms per step")
        reference = self.reference.get("no_checkpointing_peak_bytes")
        if reference:
            lines.append(f"no checkpointing would peak at {format_bytes(reference)} "
                         f"({self.predicted_peak_bytes / reference:.0%} of it)")
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.table()

    # ------------------------------------------------------------------ checks and I/O
    def check_fits(self, model: nn.Module, example_inputs: tuple | dict | None = None) -> None:
        """Raise :class:`PlanMismatchError` naming what differs if this plan was made for something else."""
        found = fingerprint(model, example_inputs if example_inputs is not None else (), list(self.block_paths))
        for key in ("model", "structure", "blocks") + (("inputs",) if example_inputs is not None else ()):
            if found[key] != self.fingerprint.get(key):
                raise PlanMismatchError(
                    f"this plan was made for a different {key}: the plan has {self.fingerprint.get(key)!r}, the model "
                    f"and inputs given have {found[key]!r}; make a new plan with torchckpt.plan(model, inputs, budget=...)")

    def to_json(self) -> str:
        """JSON text (round-trips exactly through :meth:`from_json`)."""
        payload = {"format": "torchckpt.plan", "version": FORMAT_VERSION, "budget_bytes": self.budget_bytes,
                   "predicted_peak_bytes": self.predicted_peak_bytes,
                   "predicted_extra_time_s": self.predicted_extra_time_s, "schedule": list(self.schedule),
                   "block_paths": list(self.block_paths), "fingerprint": self.fingerprint,
                   "reference": self.reference}
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
        if payload.get("version") != FORMAT_VERSION:
            raise ValueError(f"plan format version {payload.get('version')!r} is not supported by this torchckpt "
                             f"(reads version {FORMAT_VERSION}); re-create the plan")
        try:
            return cls(budget_bytes=payload["budget_bytes"], predicted_peak_bytes=payload["predicted_peak_bytes"],
                       predicted_extra_time_s=payload["predicted_extra_time_s"], schedule=tuple(payload["schedule"]),
                       block_paths=tuple(payload["block_paths"]), fingerprint=payload["fingerprint"],
                       reference=payload.get("reference", {}))
        except (KeyError, TypeError) as error:
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


def _walk(pieces: tuple[dict, ...] | list[dict], region: tuple[int, int] | None) -> Iterator[tuple[dict, Any]]:
    for piece in pieces:
        if "region" in piece:
            yield from _walk(piece["inner"], tuple(piece["region"]))
        else:
            yield piece, region
