"""TrainConfig: every option of ``torchckpt train``, checked when built.

Options that define *what* is trained (model, batch shape, seed, learning rate) are the run's identity:
they are written to ``run.json`` in the run directory, and a later command on the same directory must
give the same ones (it resumes that run). ``steps``, ``save_every`` and ``budget`` may change between
commands: more steps continue the run, a new budget makes a new plan (the losses do not depend on the
plan: gradients with any plan are bitwise those without checkpointing).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from torchckpt._units import check_positive_int, parse_bytes, parse_percent
from torchckpt.models import GPT_SIZES

__all__ = ["TrainConfig", "check_budget"]

IDENTITY_FIELDS = ("model", "size", "batch_size", "seq_len", "seed", "lr", "dropout")


def check_budget(budget: str | int) -> str | int:
    """Check a budget's form (bytes, "300MiB" or "55%") before anything is measured; return it unchanged.

    Example:
        >>> check_budget("55%"), check_budget("300MiB")
        ('55%', '300MiB')
    """
    if parse_percent(budget, option="--budget") is None:
        parse_bytes(budget, option="--budget")
    return budget


@dataclass(frozen=True, kw_only=True)
class TrainConfig:
    """Options of a training run (see ``torchckpt train --help``).

    Example:
        >>> TrainConfig(size="tiny", steps=4, batch_size=2, seq_len=16).run_dir
        PosixPath('runs/demo')
    """

    budget: str | int = "45%"
    size: str = "mini"
    model: str | None = None
    batch_size: int = 16
    seq_len: int = 256
    steps: int = 100
    save_every: int = 25
    seed: int = 0
    lr: float = 3e-3
    dropout: float = 0.1
    dir: str = "runs/demo"
    threads: int | None = None
    save: bool = True

    def __post_init__(self) -> None:
        check_budget(self.budget)
        if self.size not in GPT_SIZES:
            raise ValueError(f"--size {self.size!r}: unknown; choose one of {', '.join(GPT_SIZES)}")
        counts = ("batch_size", "seq_len", "steps", "save_every") + (() if self.threads is None else ("threads",))
        for option in counts:
            check_positive_int(f"--{option.replace('_', '-')}", getattr(self, option))
        if not self.lr > 0:
            raise ValueError(f"--lr must be positive; got {self.lr!r}")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"--dropout must be in [0, 1); got {self.dropout!r}")
        if self.model is None and self.seq_len > GPT_SIZES[self.size].max_seq_len:
            raise ValueError(f"--seq-len {self.seq_len} exceeds gpt({self.size!r})'s max_seq_len "
                             f"({GPT_SIZES[self.size].max_seq_len}); use a shorter --seq-len or a larger --size")

    @property
    def run_dir(self) -> Path:
        """The run directory (plan, run options, loss log, summary, ``checkpoints/``)."""
        return Path(self.dir)

    def identity(self) -> dict[str, Any]:
        """The options that define the run; a resumed run must have the same ones.

        Example:
            >>> sorted(TrainConfig().identity())[:3]
            ['batch_size', 'dropout', 'lr']
        """
        values = asdict(self)
        return {name: values[name] for name in IDENTITY_FIELDS}
