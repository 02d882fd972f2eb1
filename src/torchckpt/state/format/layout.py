"""On-disk layout of a training-state checkpoint directory: the names of its entries.

Layout (``docs/design.md``, Note: [state layout])::

    runs/exp/
      step-000001200/
        model.safetensors        tensors of the item ``model``
        optimizer.safetensors    tensors of the item ``optimizer``
        optimizer.json           the rest of its state_dict (param_groups, ...)
        state.json               step, metrics, RNG streams, tensor-free items
        manifest.json            written last: every file with size and hash (manifest.py)
      .tmp-step-000001300-<id>/  a save in flight (local back end); removed at start-up
      abandoned/                 the steps of an abandoned branch (checkpointer/branches.py)
"""

from __future__ import annotations

import re

MANIFEST_NAME = "manifest.json"
STATE_NAME = "state.json"
LOCK_NAME = ".lock"
TMP_PREFIX = ".tmp-"
TRASH_PREFIX = ".trash-"
CORRUPT_PREFIX = ".corrupt-"
ABANDONED_DIR = "abandoned"  # where the steps of an abandoned branch go (checkpointer/branches.py)
_STEP_RE = re.compile(r"^step-(\d{9,})$")


def step_dir_name(step: int) -> str:
    """Directory name of a committed step.

    Example:
        >>> step_dir_name(1200)
        'step-000001200'
    """
    return f"step-{step:09d}"


def parse_step_dir_name(name: str) -> int | None:
    """Step number of a committed step directory name, or None for anything else.

    Example:
        >>> parse_step_dir_name("step-000001200"), parse_step_dir_name(".tmp-step-000000001-ab")
        (1200, None)
    """
    match = _STEP_RE.match(name)
    return int(match.group(1)) if match else None
