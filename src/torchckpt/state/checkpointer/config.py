"""A Checkpointer's options (``CheckpointerConfig``) and the checks of its call arguments.

Every option is checked when the config is built, so a bad option fails before any file is touched.
"""

from __future__ import annotations

from dataclasses import dataclass

from torchckpt._units import check_positive_int
from torchckpt.state.checkpointer.retention import RetentionPolicy
from torchckpt.state.format.hashing import DEFAULT_HASH_ALGORITHM, HASH_ALGORITHMS, new_hasher
from torchckpt.state.process.preemption import parse_signals
from torchckpt.state.read.step import check_verify_mode

__all__ = ["CheckpointerConfig", "check_metric_name", "check_step"]


@dataclass(frozen=True, kw_only=True)
class CheckpointerConfig:
    """Options of a :class:`Checkpointer`; checked when built.

    Example:
        >>> CheckpointerConfig(keep_last=3, save_every_steps=100).verify
        'full'
    """

    keep_last: int | None = None
    keep_best: tuple[str, str, int] | None = None
    keep_every: int | None = None
    async_save: bool = False
    async_staging: bool = False
    save_every_steps: int | None = None
    save_every_seconds: float | None = None
    verify: str = "full"
    fallback: bool = True
    capture_rng: bool = True
    hash_algorithm: str = DEFAULT_HASH_ALGORITHM
    save_on_preemption: bool = False
    preemption_signals: tuple[str, ...] = ("SIGTERM", "SIGINT")
    sharded: bool | None = None  # None: sharded when a process group is initialised (sharded/save.py)
    rank_timeout_s: float = 300.0  # how long a sharded save or restore waits for the other ranks
    # A step that does not fit on the disk first removes the steps retention would remove after it (room.py)
    remove_old_steps_when_full: bool = False

    def __post_init__(self) -> None:
        _ = self.retention  # validates keep_* options
        if self.async_staging and not self.async_save:
            raise ValueError("async_staging=True copies in the background thread of an async save; "
                             "pass async_save=True too")
        if self.save_every_steps is not None:
            check_positive_int("save_every_steps", self.save_every_steps)
        if self.save_every_seconds is not None and not (
            isinstance(self.save_every_seconds, (int, float)) and self.save_every_seconds > 0
        ):
            raise ValueError(f"save_every_seconds={self.save_every_seconds!r}: expected a positive number or None")
        check_verify_mode(self.verify)
        if self.hash_algorithm not in HASH_ALGORITHMS:
            raise ValueError(f"hash_algorithm={self.hash_algorithm!r}: expected one of {sorted(HASH_ALGORITHMS)}")
        new_hasher(self.hash_algorithm)  # fails early if the hash library is missing
        parse_signals(self.preemption_signals)
        if self.remove_old_steps_when_full not in (True, False):
            raise ValueError(f"remove_old_steps_when_full={self.remove_old_steps_when_full!r}: expected True or False")
        if self.sharded not in (None, True, False):
            raise ValueError(f"sharded={self.sharded!r}: expected None (sharded when a process group is "
                             "initialised), True or False")
        if isinstance(self.rank_timeout_s, bool) or not (
                isinstance(self.rank_timeout_s, (int, float)) and 0 < self.rank_timeout_s <= 86400):
            raise ValueError(f"rank_timeout_s={self.rank_timeout_s!r}: expected a number of seconds in (0, 86400]")

    def save_due(self, step: int, last_step: int | None, seconds_since_save: float,
                 by_time: bool | None = None) -> bool:
        """Whether ``maybe_save`` saves ``step`` (``by_time``: the ranks' agreed clock, else this process's).

        Example:
            >>> CheckpointerConfig(save_every_steps=2).save_due(4, last_step=2, seconds_since_save=9.0)
            True
        """
        if self.save_every_steps is None and self.save_every_seconds is None:
            if self.save_on_preemption:
                return False
            raise ValueError("maybe_save needs a policy: pass save_every_steps, save_every_seconds or "
                             "save_on_preemption=True to the Checkpointer (or call save directly)")
        if step == last_step:
            return False
        by_steps = self.save_every_steps is not None and step % self.save_every_steps == 0
        return by_steps or (self.due_by_time(seconds_since_save) if by_time is None else by_time)

    def due_by_time(self, seconds_since_save: float) -> bool:
        """Whether ``save_every_seconds`` have passed.

        Example:
            >>> CheckpointerConfig(save_every_seconds=60).due_by_time(61.0)
            True
        """
        return self.save_every_seconds is not None and seconds_since_save >= self.save_every_seconds

    @property
    def retention(self) -> RetentionPolicy:
        """The keep_* options as a retention policy."""
        return RetentionPolicy(keep_last=self.keep_last, keep_best=self.keep_best, keep_every=self.keep_every)


def check_metric_name(name: object) -> str:
    """Return ``name`` if it can name a metric (a str); raise TypeError otherwise.

    Example:
        >>> check_metric_name("loss")
        'loss'
    """
    if not isinstance(name, str):
        raise TypeError(f"metric name {name!r} is a {type(name).__name__}; expected a str")
    return name


def check_step(step: object) -> int:
    """Return ``step`` if it is a non-negative int (a step number); raise ValueError naming it otherwise.

    Example:
        >>> check_step(0)
        0
    """
    if type(step) is not int or step < 0:
        raise ValueError(f"step={step!r}: expected a non-negative int")
    return step
