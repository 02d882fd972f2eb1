"""TrainConfig: every option of ``torchckpt train``, defined once and checked when built.

Each field of :class:`TrainConfig` is declared with :func:`train_option`: its type (the annotation), its
default, its help text and what the command line needs beyond that (a count, choices, a flag name of its
own). Everything else is generated from these fields (:func:`train_options`): the argparse options of
``torchckpt train`` (``torchckpt.cli.train_commands``), the mapping from parsed options back to a config
(:meth:`TrainConfig.from_options`) and the argv that gives a process started by ``--nproc N`` the same
config (:meth:`TrainConfig.argv`). A field that is not an option says so (``cli=False``).

Options that define *what* is trained (model, batch shape, seed, learning rate) are the run's identity:
they are written to ``run.json`` in the run directory, and a later command on the same directory must
give the same ones (it resumes that run). ``steps``, ``save_every`` and ``budget`` may change between
commands: more steps continue the run, a new budget (or ``offload``, ``optimizer_offload``) makes a new plan (the
losses do not depend on the plan: gradients with any plan are bitwise those without checkpointing, and the update
with the state in host memory is bitwise the plain one).
"""

from __future__ import annotations

import types
import typing
from collections.abc import Mapping, Sequence
from dataclasses import Field, asdict, dataclass, field, fields
from functools import cache
from pathlib import Path
from typing import Any, Literal

from torchckpt._units import check_positive_int, parse_bytes, parse_percent
from torchckpt.models import GPT_SIZES

__all__ = ["DEFAULT_BUDGETS", "TrainConfig", "TrainOption", "check_budget", "train_option", "train_options"]

IDENTITY_FIELDS = ("model", "size", "batch_size", "seq_len", "seed", "lr", "dropout")

# Each built-in size's default --budget: above the floor of its step at the default batch (16 x 256, AdamW)
# (bench/train_defaults.py measures the floors: bench/results/train_defaults.json, which
# tests/train/test_default_budgets.py checks these against). mini's 28% is below what checkpointing every
# block needs (the demo's point); a user's --model gets mini's.
DEFAULT_BUDGETS: dict[str, str] = {"tiny": "50%", "mini": "28%", "small": "50%", "medium": "50%"}

OptionKind = Literal["count", "int", "float", "text", "switch"]


def check_budget(budget: str | int) -> str | int:
    """Check a budget's form (bytes, "300MiB" or "55%") before anything is measured; return it unchanged.

    Example:
        >>> check_budget("55%"), check_budget("300MiB")
        ('55%', '300MiB')
    """
    if parse_percent(budget, option="--budget") is None:
        parse_bytes(budget, option="--budget")
    return budget


def train_option(default: Any, help: str, *, count: bool = False, choices: Sequence[str] | None = None,
                 flag: str | None = None, cli: bool = True) -> Any:
    """A :class:`TrainConfig` field and its ``torchckpt train`` option, declared together.

    Args:
        default: the field's default, also the option's.
        help: what the option means (``torchckpt train --help``; plain text, no ``%`` escapes).
        count: the value is a whole number >= 1 (the command line's ``positive_int``).
        choices: the only values allowed.
        flag: the flag when not ``--`` + the name with dashes (a bool that is True by default gets
            ``--no-<name>``, one that is False ``--<name>``: both take no value).
        cli: False for a field that only the Python API sets (:meth:`TrainConfig.argv` refuses to
            forward a value other than its default).

    Example:
        >>> sorted(train_option(25, "checkpoint every N steps", count=True).metadata)
        ['choices', 'cli', 'count', 'flag', 'help']
    """
    if not help.strip():
        raise ValueError("train_option: every option needs a help text")
    metadata = {"help": help, "count": count, "choices": None if choices is None else tuple(choices),
                "flag": flag, "cli": cli}
    return field(default=default, metadata=metadata)


@dataclass(frozen=True)
class TrainOption:
    """One ``torchckpt train`` option, as generated from a :class:`TrainConfig` field.

    ``name`` is the field's name and argparse's ``dest``; ``kind`` says how a value is read: ``count``
    (a whole number >= 1), ``int``, ``float``, ``text`` or ``switch`` (a flag without a value that sets
    the field to ``not default``).
    """

    name: str
    flag: str
    kind: OptionKind
    default: Any
    help: str
    choices: tuple[str, ...] | None
    cli: bool

    def argv(self, value: Any) -> list[str]:
        """The arguments that set this option to ``value`` (none for a default switch or an unset None).

        Example:
            >>> steps = next(o for o in train_options() if o.name == "steps")
            >>> steps.argv(300)
            ['--steps=300']
        """
        if not self.cli:
            if value != self.default:
                raise ValueError(f"{self.name}={value!r} has no torchckpt train option, so processes started with "
                                 f"--nproc would train with {self.name}={self.default!r}; start them with torchrun "
                                 "and the Python API (torchckpt.train.train) instead")
            return []
        if self.kind == "switch":
            return [self.flag] if value != self.default else []
        if value is None:
            if self.default is not None:
                raise ValueError(f"{self.flag}: None cannot be given on the command line; pass a value")
            return []
        return [f"{self.flag}={value!r}" if self.kind == "float" else f"{self.flag}={value}"]


def _kind(name: str, hint: Any, count: bool) -> OptionKind:
    """The option kind of a field's annotation (``X | None`` as ``X``; ``str | int`` as text)."""
    members = set(typing.get_args(hint)) - {type(None)} if isinstance(hint, types.UnionType) else {hint}
    if members == {bool}:
        return "switch"
    if str in members:
        return "text"
    if members == {int}:
        return "count" if count else "int"
    if members == {float}:
        return "float"
    raise TypeError(f"TrainConfig.{name}: type {hint!r} has no command-line form; use int, float, str or bool")


def _option(item: Field, hint: Any) -> TrainOption:
    meta = item.metadata
    if "help" not in meta:
        raise TypeError(f"TrainConfig.{item.name}: declare it with train_option(default, help, ...)")
    kind = _kind(item.name, hint, meta["count"])
    dashed = item.name.replace("_", "-")
    flag = meta["flag"] or (f"--no-{dashed}" if kind == "switch" and item.default else f"--{dashed}")
    return TrainOption(name=item.name, flag=flag, kind=kind, default=item.default, help=meta["help"],
                       choices=meta["choices"], cli=meta["cli"])


@cache
def _all_options() -> tuple[TrainOption, ...]:
    hints = typing.get_type_hints(TrainConfig)
    return tuple(_option(item, hints[item.name]) for item in fields(TrainConfig))


def train_options(*, cli_only: bool = True) -> tuple[TrainOption, ...]:
    """The options of ``torchckpt train``, one per :class:`TrainConfig` field, in ``--help`` order;
    ``cli_only=False`` adds the fields only the Python API sets (``cli`` False).

    Example:
        >>> [o.flag for o in train_options()][:4]
        ['--budget', '--size', '--model', '--batch-size']
        >>> [o.flag for o in train_options() if o.kind == "switch"]
        ['--no-save', '--offload', '--optimizer-offload']
        >>> [o.name for o in train_options(cli_only=False) if not o.cli]
        ['dropout']
    """
    return tuple(o for o in _all_options() if o.cli or not cli_only)


@dataclass(frozen=True, kw_only=True)
class TrainConfig:
    """Options of a training run (see ``torchckpt train --help``); each field is one option.

    Example:
        >>> TrainConfig(size="tiny", steps=4, batch_size=2, seq_len=16).run_dir
        PosixPath('runs/demo')
    """

    budget: str | int = train_option(
        "auto", "peak memory of the whole step: bytes, '300MiB', or a percentage of the peak without "
              "checkpointing (default auto: the size's, " + ", ".join(f"{k} {v}" for k, v in DEFAULT_BUDGETS.items())
              + "; for the mini GPT that is below what checkpointing every block needs; with --model 28%)")
    size: str = train_option("mini", "built-in GPT size (default mini)", choices=tuple(GPT_SIZES))
    model: str | None = train_option(
        None, "path/to/file.py:factory: your model instead of the built-in GPT; model(ids, targets) must "
              "return the loss")
    batch_size: int = train_option(16, "sequences per step (default 16)", count=True)
    seq_len: int = train_option(256, "bytes per sequence (default 256)", count=True)
    steps: int = train_option(100, "train until this step (default 100)", count=True)
    save_every: int = train_option(25, "checkpoint every N steps (default 25)", count=True)
    seed: int = train_option(0, "seed of the weights, the data order and dropout (default 0)")
    lr: float = train_option(3e-3, "AdamW learning rate after a 20-step warm-up (default 3e-3)")
    dropout: float = train_option(0.1, "dropout of the built-in GPT (default 0.1); Python API only", cli=False)
    dir: str = train_option("runs/demo", "run directory (default runs/demo)")
    threads: int | None = train_option(
        None, "CPU threads (default: PyTorch's choice); resume with the same number for bitwise equal losses",
        count=True)
    rendezvous_timeout: int = train_option(
        300, "seconds every process waits for the others to join (WORLD_SIZE of them) before it stops, naming "
             "what is missing (default 300)", count=True)
    save: bool = train_option(True, "save no checkpoints: the plan and the loss log are still written to --dir, but "
                                    "the run cannot be resumed (the same command starts again at step 1)")
    offload: bool = train_option(
        False, "plan with offload as a third choice per block: its saved activations moved to host memory in the "
               "forward pass and brought back for the backward, where that is faster than recomputing (on CUDA; on "
               "the CPU the host is the same memory, counted apart); with --nproc beside FSDP2, each process its own")
    optimizer_offload: bool = train_option(
        False, "keep AdamW's state (twice the parameters) in host memory between steps, one parameter's on the "
               "device at a time for its update: the budget needs no room for it, and losses stay bitwise; one "
               "process only")

    def __post_init__(self) -> None:
        if self.budget == "auto":  # the size's default (frozen: set once, here)
            object.__setattr__(self, "budget", DEFAULT_BUDGETS["mini" if self.model else self.size]
                               if self.size in DEFAULT_BUDGETS else "28%")
        check_budget(self.budget)
        if self.size not in GPT_SIZES:
            raise ValueError(f"--size {self.size!r}: unknown; choose one of {', '.join(GPT_SIZES)}")
        for option in train_options():
            value = getattr(self, option.name)
            if option.kind == "count" and value is not None:
                check_positive_int(option.flag, value)
        if not self.lr > 0:
            raise ValueError(f"--lr must be positive; got {self.lr!r}")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"--dropout must be in [0, 1); got {self.dropout!r}")
        if self.model is None and self.seq_len > GPT_SIZES[self.size].max_seq_len:
            raise ValueError(f"--seq-len {self.seq_len} exceeds gpt({self.size!r})'s max_seq_len "
                             f"({GPT_SIZES[self.size].max_seq_len}); use a shorter --seq-len or a larger --size")

    @classmethod
    def from_options(cls, values: Mapping[str, Any]) -> TrainConfig:
        """The config that parsed ``torchckpt train`` options give (``vars(args)``; other keys are ignored,
        a missing option keeps its default).

        Example:
            >>> TrainConfig.from_options({"steps": 8, "save": False, "nproc": 2}).steps
            8
        """
        return cls(**{o.name: values[o.name] for o in train_options() if o.name in values})

    def argv(self) -> list[str]:
        """``torchckpt train`` arguments that give this config (what ``--nproc N`` passes to each process).

        Example:
            >>> TrainConfig(size="tiny", save=False).argv()[:3]
            ['--budget=50%', '--size=tiny', '--batch-size=16']
            >>> TrainConfig(size="tiny", save=False).argv()[-1]
            '--no-save'
        """
        return [arg for o in train_options(cli_only=False) for arg in o.argv(getattr(self, o.name))]

    def plan_options(self) -> dict[str, bool]:
        """The planning options besides ``budget`` (what ``torchckpt.plan`` takes them as).

        Example:
            >>> TrainConfig(optimizer_offload=True).plan_options()
            {'offload': False, 'optimizer_offload': True}
        """
        return {"offload": self.offload, "optimizer_offload": self.optimizer_offload}

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
