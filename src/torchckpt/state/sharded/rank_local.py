"""Rank-local state of a sharded step: each rank's own items and RNG streams, and what a new world size does
with them.

Rules kept here (named in ``docs/design.md``):

1. **[the rank-local rule]** Restoring on the world size that saved: each rank gets its own rank-local
   items and RNG streams (bit-exact). On another world size: a rank-local item saved identically by every
   rank (a scheduler, an epoch counter) is restored on every rank; a data loader or sampler is not (its
   position is per rank: the loader starts its epoch again) and neither is an item whose ranks differed;
   RNG streams are not restored (each rank keeps its own); one warning names each such item.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Mapping
from typing import Any

from torchckpt.state.errors import CheckpointMismatchError
from torchckpt.state.format.layout import STATE_NAME
from torchckpt.state.format.snapshot import decode_snapshot
from torchckpt.state.live.capture import check_rng
from torchckpt.state.read.load import apply_snapshot
from torchckpt.state.sharded.rank_group import rank_prefix
from torchckpt.state.sharded.step import ShardedStep


class ElasticResumeWarning(UserWarning):
    """A sharded step restored on a different world size: some rank-local state was not restored.

    ``not_restored``: the names of the items left as they were; ``rng_restored``: whether the RNG streams were.

    Example:
        >>> ElasticResumeWarning("saved by 2, restored on 1", not_restored=("loader",)).not_restored
        ('loader',)
    """

    def __init__(self, message: str, not_restored: tuple[str, ...] = (), rng_restored: bool = True) -> None:
        super().__init__(message)
        self.not_restored = tuple(not_restored)
        self.rng_restored = rng_restored


def prepare_rank_local(step: ShardedStep, rank: int, world: int, items: Mapping[str, Any],
                   local_meta: Mapping[str, Any], rng: bool | None) -> Callable[[], None]:
    """Read this rank's rank-local files (rank 0's on another world size) and return what applies them
    ([the rank-local rule]); nothing changes until that is called.

    Example:
        >>> prepare_rank_local  # doctest: +ELLIPSIS
        <function prepare_rank_local at ...>
    """
    saved_world = step.manifest.world_size or 1
    same_world = world == saved_world
    prefix = rank_prefix(rank if same_world else 0, saved_world)
    files = {name[len(prefix):]: step.read_file(name) for name in step.manifest.files if name.startswith(prefix)}
    path_of = lambda name: step.storage.path_of(step.entry, prefix + name)  # noqa: E731
    snapshot = decode_snapshot(files, path_of, set(items))
    if snapshot.rng is not None:
        check_rng(snapshot.rng, path_of(STATE_NAME))
    if rng and not same_world:
        raise CheckpointMismatchError(
            f"{step.storage.path_of(step.entry)}: saved by {saved_world} ranks, restored on {world}: RNG streams "
            "are per rank and are not carried across a world-size change. Fix: pass rng=None (or False).")
    chosen = dict(items)
    notes = []
    rng_dropped = False
    if not same_world:
        for name in list(chosen):
            meta = local_meta[name]
            if meta.get("data_position") or not meta.get("same_on_every_rank"):
                why = ("a data position, per rank: the loader starts its epoch again" if meta.get("data_position")
                       else "its saved state differed between ranks")
                notes.append(f"item {name!r} not restored ({why})")
                del chosen[name]
        if rng is not False and snapshot.rng is not None:
            notes.append("RNG streams not restored (each rank keeps its own)")
            rng_dropped = True
    streams = rng is not False and same_world and snapshot.rng is not None

    def apply() -> None:
        apply_snapshot(snapshot, chosen, streams, path_of(STATE_NAME))
        if notes and rank == 0:
            warnings.warn(ElasticResumeWarning(
                f"{step.storage.path_of(step.entry)} was saved by {saved_world} rank(s) and is restored on {world}: "
                "models and optimizers are resharded exactly; rank-local state follows the rule in docs/state.md "
                "(\"What changes with world size\"): " + "; ".join(notes) + ".",
                not_restored=tuple(name for name in items if name not in chosen), rng_restored=not rng_dropped),
                stacklevel=4)

    return apply
