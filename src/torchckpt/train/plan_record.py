"""The plan a training job runs with, stored in every checkpoint step it saves, with what it was made for.

Rules kept here (named in ``docs/design.md``):

1. **[a plan follows the job]** Each step ``torchckpt train`` saves holds, as the item ``plan`` (a plain dict:
   JSON values only, written and checksummed with the step's other items, no pickle), the plan the run trained
   with, the ``--budget`` it was made for, the measured baseline (one uncheckpointed step) and the per-process
   layout: how many processes, how the model was sharded (none, or FSDP2), the batch each process runs. On
   resume the job reads that item first: at the same layout and budget it reuses the plan without profiling;
   at another layout (another world size, another sharding) or budget it plans again for the new per-process
   layout before the first step and says what changed (old and new layout, old and new predicted peak). A
   stored plan that cannot be read, or does not fit the model, is re-planned with the reason said; it never
   stops the run.
"""

from __future__ import annotations

import json
import warnings
from dataclasses import dataclass, field
from typing import Any

from torchckpt.planner import Plan
from torchckpt.state import CheckpointError

__all__ = ["RECORD_ITEM", "Layout", "StoredPlan", "read_stored_plan"]

RECORD_ITEM = "plan"  # the item name in each checkpoint step
_FORMAT, _VERSION = "torchckpt.train-plan", 1


@dataclass(frozen=True)
class Layout:
    """What a per-process plan depends on besides the model: ``world`` processes, the model's ``sharding``
    (``"none"`` or ``"FSDP2"``), and the ``batch`` (sequences, tokens per sequence) each process runs.

    Example:
        >>> Layout(world=2, sharding="FSDP2", batch=(4, 64)).describe()
        'FSDP2 over 2 processes, batch 4 x 64 per process'
        >>> Layout(world=1, sharding="none", batch=(4, 64)).describe()
        'one process, batch 4 x 64'
    """

    world: int
    sharding: str
    batch: tuple[int, int]

    def describe(self) -> str:
        """The layout in words."""
        if self.world == 1 and self.sharding == "none":
            return f"one process, batch {self.batch[0]} x {self.batch[1]}"
        return f"{self.sharding} over {self.world} processes, batch {self.batch[0]} x {self.batch[1]} per process"

    def to_dict(self) -> dict[str, Any]:
        """JSON values (what the stored record holds)."""
        return {"world": self.world, "sharding": self.sharding, "batch": list(self.batch)}

    @classmethod
    def from_dict(cls, value: Any) -> Layout:
        """The layout of a stored record; ``ValueError`` names what is malformed.

        Example:
            >>> Layout.from_dict({"world": 1, "sharding": "none", "batch": [2, 8]}).batch
            (2, 8)
            >>> Layout.from_dict({"world": "two"})  # doctest: +ELLIPSIS
            Traceback (most recent call last):
            ...
            ValueError: its layout is malformed: ...
        """
        try:
            world, sharding, batch = value["world"], value["sharding"], tuple(value["batch"])
        except (KeyError, TypeError) as error:
            raise ValueError(f"its layout is malformed: {value!r} lacks {error}") from None
        if (type(world) is not int or world < 1 or not isinstance(sharding, str) or len(batch) != 2
                or not all(type(n) is int and n > 0 for n in batch)):
            raise ValueError(f"its layout is malformed: {value!r}")
        return cls(world=world, sharding=sharding, batch=(batch[0], batch[1]))


@dataclass(frozen=True)
class StoredPlan:
    """A plan with the ``budget`` option, ``layout`` and ``baseline`` figures it was made with
    ([a plan follows the job]); ``record()`` is the checkpoint item, ``from_record`` reads it back.

    Example:
        >>> plan = Plan(budget_bytes=1, predicted_peak_bytes=1, predicted_extra_time_s=0.0, schedule=(),
        ...             block_paths=(), fingerprint={})
        >>> stored = StoredPlan(plan, "50%", Layout(1, "none", (2, 8)), {"peak_bytes": 3.0, "step_s": 0.1})
        >>> StoredPlan.from_record(stored.record()) == stored
        True
        >>> StoredPlan.from_record({"format": "something else"})  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        ValueError: it is not a torchckpt train plan record (format 'something else'...
    """

    plan: Plan
    budget: str | int
    layout: Layout
    baseline: dict[str, float] = field(default_factory=dict)

    def record(self) -> dict[str, Any]:
        """The item saved with each step: a dict of JSON values (the plan as its own JSON text)."""
        return {"format": _FORMAT, "version": _VERSION, "plan": self.plan.to_json(), "budget": self.budget,
                "layout": self.layout.to_dict(), "baseline": dict(self.baseline)}

    @classmethod
    def from_record(cls, record: Any) -> StoredPlan:
        """Read a stored record back; ``ValueError`` says why it cannot be used."""
        if not isinstance(record, dict) or record.get("format") != _FORMAT:
            found = record.get("format") if isinstance(record, dict) else type(record).__name__
            raise ValueError(f"it is not a torchckpt train plan record (format {found!r}, expected {_FORMAT!r})")
        if record.get("version") != _VERSION:
            raise ValueError(f"its record version {record.get('version')!r} is not one this torchckpt reads "
                             f"({_VERSION})")
        budget, baseline = record.get("budget"), record.get("baseline")
        if not isinstance(budget, (str, int)) or isinstance(budget, bool):
            raise ValueError(f"its budget {budget!r} is not a --budget value")
        if not isinstance(baseline, dict) or not all(
                isinstance(k, str) and isinstance(v, (int, float)) for k, v in baseline.items()):
            raise ValueError(f"its baseline {baseline!r} is not a dict of figures")
        text = record.get("plan")
        if not isinstance(text, str):
            raise ValueError(f"its plan is a {type(text).__name__}, not JSON text")
        plan = Plan.from_json(text)  # ValueError naming the problem
        return cls(plan, budget, Layout.from_dict(record.get("layout")), {k: float(v) for k, v in baseline.items()})

    def differs(self, layout: Layout, budget: str | int) -> str:
        """Why this stored plan is not for ``layout`` and ``budget`` (empty when it is).

        Example:
            >>> plan = Plan(budget_bytes=1, predicted_peak_bytes=1, predicted_extra_time_s=0.0, schedule=(),
            ...             block_paths=(), fingerprint={})
            >>> stored = StoredPlan(plan, "50%", Layout(2, "FSDP2", (2, 8)))
            >>> stored.differs(Layout(1, "none", (2, 8)), "50%")
            'the layout changed'
            >>> stored.differs(Layout(2, "FSDP2", (2, 8)), "60%")
            "the budget changed ('50%' -> '60%')"
        """
        if self.layout != layout:
            return "the layout changed"
        if self.budget != budget:
            return f"the budget changed ({self.budget!r} -> {budget!r})"
        return ""


def read_stored_plan(checkpointer: Any) -> tuple[int | None, StoredPlan | None, str]:
    """The newest valid step's stored plan: ``(step, stored, why_not)``; ``step`` is None when there is no
    checkpoint, ``stored`` None when the step holds no usable plan (``why_not`` says why). Never raises for a
    bad or missing record. A collective in a sharded job (``Checkpointer.restore``): every rank calls it.

    Example:
        >>> import tempfile
        >>> from torchckpt import Checkpointer
        >>> with tempfile.TemporaryDirectory() as tmp, Checkpointer(tmp) as ckpt:
        ...     print(read_stored_plan(ckpt))
        ...     ckpt.save(3, plan={"format": "mine"})
        ...     step, stored, why = read_stored_plan(ckpt); print(step, stored); print(why)
        (None, None, 'no checkpoint')
        3 None
        the plan stored in step 3 is unusable: it is not a torchckpt train plan record (format 'mine', ...
    """
    latest = checkpointer.latest_step()
    if latest is None:
        return None, None, "no checkpoint"
    holder: dict[str, Any] = {}
    with warnings.catch_warnings():  # the restore that follows warns (fallbacks, elastic resumes) for itself
        warnings.simplefilter("ignore")
        try:
            step = checkpointer.restore(rng=False, **{RECORD_ITEM: holder})
        except CheckpointError as error:
            text = str(error)
            if f"no item(s) ['{RECORD_ITEM}']" in text:
                return latest, None, f"step {latest} holds no stored plan (saved by an earlier torchckpt)"
            return latest, None, f"the stored plan could not be read ({text[:300]})"
    if step is None:
        return None, None, "no checkpoint"
    if not holder:  # a sharded step restored on another world size whose ranks stored different records
        return step, None, f"the plan stored in step {step} differed between the ranks that saved it"
    try:
        return step, StoredPlan.from_record(json.loads(json.dumps(holder))), ""
    except (ValueError, TypeError) as error:
        return step, None, f"the plan stored in step {step} is unusable: {error}"
