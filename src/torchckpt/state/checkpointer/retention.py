"""Which committed steps to keep: keep_last, keep_best, keep_every (a pure function).

Rules kept here (named in ``docs/design.md``; the design notes they keep in parentheses):

1. **[the newest valid step is always kept]** (Note: [retention spares the newest and the unfinished])
   The newest valid step is always kept, whatever the policy.
2. **[only committed steps are candidates]** Only valid, committed steps are
   candidates for deletion; steps being written (temp directories) and corrupt
   steps are never passed in, so never deleted.
3. **[a step is kept if any policy keeps it]** A step is kept if any rule keeps
   it. With no rule set, every step is kept.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from torchckpt.state.read.catalog import inspect_step
from torchckpt.state.storage.base import Storage

KEEP_BEST_MODES = ("min", "max")


@dataclass(frozen=True, kw_only=True)
class RetentionPolicy:
    """What to keep; checked when built.

    Example:
        >>> RetentionPolicy(keep_last=2, keep_best=("val_loss", "min", 1)).keeps_everything
        False
    """

    keep_last: int | None = None
    keep_best: tuple[str, str, int] | None = None
    keep_every: int | None = None

    def __post_init__(self) -> None:
        for option in ("keep_last", "keep_every"):
            value = getattr(self, option)
            if value is not None and (type(value) is not int or value < 1):
                raise ValueError(f"{option}={value!r}: expected a positive int or None")
        if self.keep_best is not None:
            _check_keep_best(self.keep_best)

    @property
    def keeps_everything(self) -> bool:
        """True when no rule is set ([a step is kept if any policy keeps it])."""
        return self.keep_last is None and self.keep_best is None and self.keep_every is None


def _check_keep_best(keep_best: object) -> None:
    ok = (
        isinstance(keep_best, tuple)
        and len(keep_best) == 3
        and isinstance(keep_best[0], str)
        and keep_best[1] in KEEP_BEST_MODES
        and type(keep_best[2]) is int
        and keep_best[2] >= 1
    )
    if not ok:
        raise ValueError(
            f"keep_best={keep_best!r}: expected (metric name, 'min' or 'max', count >= 1), "
            "e.g. ('val_loss', 'min', 2)"
        )


def steps_to_keep(valid_steps: Mapping[int, Mapping[str, float]], policy: RetentionPolicy) -> set[int]:
    """Steps to keep among ``valid_steps`` (step -> metrics), per the rules above.

    Example:
        >>> steps = {10: {"loss": 3.0}, 20: {"loss": 1.0}, 30: {"loss": 2.0}, 40: {"loss": 4.0}}
        >>> sorted(steps_to_keep(steps, RetentionPolicy(keep_last=1, keep_best=("loss", "min", 1))))
        [20, 40]
    """
    if policy.keeps_everything or not valid_steps:
        return set(valid_steps)
    ordered = sorted(valid_steps)
    keep = {ordered[-1]}
    if policy.keep_last is not None:
        keep.update(ordered[-policy.keep_last :])
    if policy.keep_every is not None:
        keep.update(step for step in ordered if step % policy.keep_every == 0)
    if policy.keep_best is not None:
        keep.update(_best_steps(valid_steps, *policy.keep_best))
    return keep


def _best_steps(valid_steps: Mapping[int, Mapping[str, float]], metric: str, mode: str, count: int) -> list[int]:
    scored = [(metrics[metric], step) for step, metrics in valid_steps.items() if metric in metrics]
    sign = 1.0 if mode == "min" else -1.0
    scored.sort(key=lambda pair: (sign * pair[0], -pair[1]))  # ties: the newer step wins
    return [step for _, step in scored[:count]]


def apply_retention(storage: Storage, policy: RetentionPolicy) -> None:
    """Delete the valid committed steps ``policy`` does not keep (checkpointer.py's [retention runs after a
    commit]); steps that are not valid are left alone.

    Example:
        >>> from torchckpt.state.storage.backends import open_storage
        >>> apply_retention(open_storage("/nonexistent"), RetentionPolicy(keep_last=1))
    """
    if policy.keeps_everything:
        return
    infos = [inspect_step(storage, step, "fast") for step in storage.step_entries()]
    valid = {info.step: info.metrics for info in infos if info.valid}
    for step in sorted(set(valid) - steps_to_keep(valid, policy)):
        storage.remove_step(step)
