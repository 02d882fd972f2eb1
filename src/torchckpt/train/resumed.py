"""``torchckpt train`` resumes and says what it restored: every item and the RNG streams on the same world size;
on another, what the sharded restore left out (``ElasticResumeWarning``, rank_local.py's [the rank-local rule])
is named as not restored, and not listed as restored."""

from __future__ import annotations

import warnings
from collections.abc import Callable, Mapping
from typing import Any

from torchckpt.state import ElasticResumeWarning
from torchckpt.state.format.layout import step_dir_name

__all__ = ["LABELS", "restore_and_say"]

LABELS = {"model": "model", "optimizer": "AdamW", "scheduler": "LR schedule", "loader": "data position"}


def restore_and_say(checkpointer: Any, items: Mapping[str, Any], say: Callable[[str], None]) -> int:
    """Restore the newest step into ``items`` (``Checkpointer.restore``); say what was restored and what was not.
    Returns the step, 0 when there was none. Warnings other than ``ElasticResumeWarning`` pass through.

    Example:
        >>> import tempfile, torch
        >>> from torchckpt import Checkpointer
        >>> with tempfile.TemporaryDirectory() as tmp, Checkpointer(tmp) as ckpt:
        ...     model = torch.nn.Linear(2, 2)
        ...     ckpt.save(3, model=model)
        ...     restore_and_say(ckpt, {"model": model}, print)  # doctest: +ELLIPSIS
        resumed from .../step-000000003 (model, RNG)
        3
    """
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        step = checkpointer.restore(**items) or 0
    left_out: set[str] = set()
    rng = True
    for warning in caught:
        if isinstance(warning.message, ElasticResumeWarning):
            left_out.update(warning.message.not_restored)
            rng = rng and warning.message.rng_restored
        warnings.warn_explicit(warning.message, warning.category, warning.filename, warning.lineno)
    if step:
        named = [name for name in items if name in LABELS]
        restored = [LABELS[name] for name in named if name not in left_out] + (["RNG"] if rng else [])
        missing = [LABELS[name] for name in named if name in left_out] + ([] if rng else ["RNG"])
        say(f"resumed from {checkpointer.directory}/{step_dir_name(step)} ({', '.join(restored)}"
            + (f"; not restored: {', '.join(missing)}, as warned above" if missing else "") + ")")
    return step
