"""What a training run writes beside its checkpoints: the loss log; and the stand-in for a run that saves
nothing (``--no-save``).

Rules kept here (named in ``docs/design.md``): the loss log keeps [everything the next step needs is saved]'s
promise that a resumed run reads as one uninterrupted run.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

__all__ = ["LossLog", "NotSaved", "read_losses"]


class LossLog:
    """losses.jsonl: one line per step, the loss as float.hex (bitwise) and as a number
    ([everything the next step needs is saved])."""

    def __init__(self, path: Path, keep_through_step: int) -> None:
        self.path = path
        lines = path.read_text().splitlines() if path.is_file() else []
        kept = [line for line in lines if line.strip() and json.loads(line)["step"] <= keep_through_step]
        path.write_text("".join(line + "\n" for line in kept))
        self._handle = path.open("a")

    def write(self, step: int, loss: float) -> None:
        self._handle.write(json.dumps({"step": step, "loss_hex": loss.hex(), "loss": loss}) + "\n")
        self._handle.flush()

    def close(self) -> None:
        self._handle.close()


def read_losses(run_dir: str | Path) -> dict[int, str]:
    """The run's per-step losses as ``{step: float.hex}`` (what resume tests compare bitwise).

    Example:
        >>> read_losses("/nonexistent")
        {}
    """
    path = Path(run_dir) / "losses.jsonl"
    if not path.is_file():
        return {}
    entries = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return {entry["step"]: entry["loss_hex"] for entry in entries}


class NotSaved:
    """The Checkpointer's part that ``train`` uses, for ``--no-save``: nothing is saved or restored.

    Example:
        >>> NotSaved().restore(model=None) is None, NotSaved().maybe_save(10)
        (True, False)
    """

    directory = "not saved: --no-save"

    def restore(self, **items: Any) -> None:
        return None

    def maybe_save(self, step: int, **items: Any) -> bool:
        return False

    def save(self, step: int, **items: Any) -> None:
        return None

    def latest_step(self) -> None:
        return None

    def list(self) -> list[Any]:
        return []

    def wait(self) -> None:
        return None

    def close(self) -> None:
        return None
