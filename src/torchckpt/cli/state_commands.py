"""``torchckpt ls / verify / export / import``: inspect and convert training-state checkpoints.

Every command prints a one-line error (no traceback) and exits with 2 when the
input is unusable (a missing path among them); ``verify`` exits with 1 when a checkpoint is corrupt or
unverifiable (a hash algorithm this torchckpt does not know), or when there is none to verify.

Wherever a checkpoint directory is taken, a run directory of ``torchckpt train`` works too: ``runs/demo``
stands for ``runs/demo/checkpoints`` (:func:`checkpoint_dir`).

Text that comes from disk (metric names, paths, problems) is printed through :func:`shown`:
control characters (ESC, BEL, C1 codes, bidirectional overrides) appear as ``\\x1b``-style
escapes, so whoever wrote the files cannot send the terminal escape sequences.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import sys
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

from torchckpt.cli import COMMANDS
from torchckpt.state import (
    CheckpointError,
    CheckpointInfo,
    export_dcp,
    export_model_weights,
    import_dcp,
    import_torch_save,
    list_checkpoints,
    verify_checkpoint,
)
from torchckpt.state.format.layout import parse_step_dir_name

_DIRECTORY_HELP = "a run directory (runs/demo) or its checkpoints folder; a path or fsspec URL"


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add the four state subcommands to the ``torchckpt`` parser.

    Example:
        >>> parser = argparse.ArgumentParser(); register(parser.add_subparsers())
        >>> parser.parse_args(["verify", "runs/x", "--step", "3"]).step
        3
    """
    ls = subparsers.add_parser("ls", help=COMMANDS["ls"][1])
    ls.add_argument("directory", help=_DIRECTORY_HELP)
    ls.add_argument("--full", action="store_true", help="hash every file (default: sizes only)")
    ls.set_defaults(func=_guarded(_run_ls))

    verify = subparsers.add_parser("verify", help=COMMANDS["verify"][1])
    verify.add_argument("directory", help=_DIRECTORY_HELP)
    verify.add_argument("--step", type=int, default=None, help="verify only this step")
    verify.add_argument("--fast", action="store_true", help="check sizes only, not hashes")
    verify.set_defaults(func=_guarded(_run_verify))

    export = subparsers.add_parser("export", help=COMMANDS["export"][1])
    export.add_argument("directory", help=_DIRECTORY_HELP)
    export.add_argument("--step", type=int, default=None, help="default: newest valid step")
    export.add_argument("--out", required=True, help="output .safetensors path")
    export.add_argument("--item", default="model", help="item holding the weights (default: model)")
    export.add_argument("--dcp", action="store_true",
                        help="write a torch.distributed.checkpoint directory at --out instead (dcp.load, torchtitan)")
    export.set_defaults(func=_guarded(_run_export))

    imp = subparsers.add_parser("import", help=COMMANDS["import"][1])
    imp.add_argument("file", help="a .pt/.pth file written by torch.save, or a directory written by "
                                  "torch.distributed.checkpoint.save (DCP)")
    imp.add_argument("directory", help="the checkpoint directory to write (a run directory: its checkpoints folder)")
    imp.add_argument("--step", type=int, default=None, help="default: its 'step' key, else 0")
    imp.add_argument("--trust-dcp-metadata", action="store_true",
                     help="a DCP directory's .metadata is a pickle, read only by unpickling (which can run code): "
                          "allow it for this directory, if you trust where it came from")
    imp.set_defaults(func=_guarded(_run_import))


# the folder of a `torchckpt train` run directory that holds its checkpoints (train/run.py's Checkpointer)
RUN_CHECKPOINTS = "checkpoints"


def _has_steps(path: Path) -> bool:
    return any(parse_step_dir_name(child.name) is not None for child in path.iterdir())


def checkpoint_dir(directory: str, *, must_exist: bool = True) -> str:
    """The checkpoint directory ``directory`` names: itself, or ``directory/checkpoints`` for a run directory of
    ``torchckpt train`` (which holds no step itself); a local path that does not exist is a ``ValueError`` (the
    commands' exit code 2) unless ``must_exist`` is False. URLs (``s3://...``) are taken as given.

    Example:
        >>> import tempfile
        >>> run = Path(tempfile.mkdtemp()); (run / "checkpoints").mkdir()
        >>> checkpoint_dir(str(run)) == str(run / "checkpoints")
        True
        >>> checkpoint_dir(str(run / "nope"))
        Traceback (most recent call last):
        ValueError: .../nope: no such directory; give a run directory (e.g. runs/demo) or its checkpoints folder
    """
    if "://" in directory:
        return directory
    path = Path(directory)
    if not path.exists():
        if must_exist:
            raise ValueError(f"{directory}: no such directory; give a run directory (e.g. runs/demo) or its "
                             f"{RUN_CHECKPOINTS} folder")
        return directory
    if not path.is_dir():
        raise ValueError(f"{directory}: not a directory; give a run directory (e.g. runs/demo) or its "
                         f"{RUN_CHECKPOINTS} folder")
    inner = path / RUN_CHECKPOINTS
    if inner.is_dir() and not _has_steps(path):
        return str(inner)
    return directory


def _runs_below(directory: str) -> list[str]:
    """Run directories just below ``directory`` (a hint when it holds no checkpoint itself)."""
    path = Path(directory)
    if "://" in directory or not path.is_dir():
        return []
    return sorted(str(child) for child in path.iterdir() if (child / RUN_CHECKPOINTS).is_dir())


def _none_found(directory: str, what: str) -> str:
    runs = _runs_below(directory)
    hint = f"; run directories in it: {', '.join(runs[:5])}" if runs else ""
    return f"{shown(directory)}: {what}{shown(hint)}"


def _guarded(command: Callable[[argparse.Namespace], int]) -> Callable[[argparse.Namespace], int]:
    """``command`` with its refusals as one line (exit 2) and its long reads and writes shown on stderr."""
    def run(args: argparse.Namespace) -> int:
        from torchckpt._progress import reporting
        from torchckpt.train.status import Status

        try:
            with Status(f"torchckpt {command.__name__.removeprefix('_run_')}") as status, \
                    reporting(lambda report: status(replace(report, text=shown(report.text)))):
                return command(args)
        except (CheckpointError, ValueError, OSError) as error:
            print(f"torchckpt: error: {shown(str(error))}", file=sys.stderr)
            return 2

    return run


# C0 and C1 control characters, DEL, and the bidirectional embeddings, overrides and isolates (which
# reorder what the terminal shows)
_CONTROL_RE = re.compile(r"[\x00-\x1f\x7f-\x9f\u202a-\u202e\u2066-\u2069]")


def shown(text: str) -> str:
    r"""``text`` with every control character replaced by a visible escape, safe to print to a terminal.

    Example:
        >>> print(shown("\x1b[31mloss\ta\u202e"))
        \x1b[31mloss\x09a\u202e
    """
    return _CONTROL_RE.sub(lambda m: f"\\x{ord(m[0]):02x}" if ord(m[0]) < 0x100 else f"\\u{ord(m[0]):04x}", text)


def format_bytes(size_bytes: int | None) -> str:
    """Human-readable size with binary units.

    Example:
        >>> format_bytes(1536), format_bytes(None)
        ('1.5 KiB', '-')
    """
    if size_bytes is None:
        return "-"
    value = float(size_bytes)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if value < 1024 or unit == "GiB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    return f"{value:.1f} TiB"


def _format_time(unix_s: float | None) -> str:
    if unix_s is None:
        return "-"
    try:
        return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(unix_s))
    except (OverflowError, ValueError, OSError):  # a date this platform cannot show
        return "?"


def _valid_text(info: CheckpointInfo) -> str:
    if info.valid:
        return "yes"
    return f"{'UNVERIFIABLE' if info.unverifiable else 'NO'}: {info.problem}"


def _run_ls(args: argparse.Namespace) -> int:
    from rich.console import Console
    from rich.markup import escape
    from rich.table import Table

    directory = checkpoint_dir(args.directory)
    infos = list_checkpoints(directory, verify="full" if args.full else "fast")
    if not infos:
        print(_none_found(directory, "no checkpoints"))
        return 0
    # Every text from the directory is escaped: a metric name or path like "[/x]" or "[blink]" is shown as
    # written, never parsed as rich markup (a crash, or terminal styles injected by whoever wrote the files),
    # and its control characters are shown as escapes (shown), never sent to the terminal.
    table = Table(title=f"checkpoints in {escape(shown(directory))}")
    for column in ("step", "time", "size", "metrics", "valid"):
        table.add_column(column, overflow="fold")
    for info in infos:
        metrics = " ".join(f"{k}={v:.6g}" for k, v in info.metrics.items())
        table.add_row(str(info.step), _format_time(info.created_unix_s), format_bytes(info.size_bytes),
                      escape(shown(metrics)), escape(shown(_valid_text(info))))
    width = shutil.get_terminal_size(fallback=(160, 24)).columns
    Console(file=sys.stdout, width=max(width, 100)).print(table)
    return 0


def _run_verify(args: argparse.Namespace) -> int:
    directory = checkpoint_dir(args.directory)
    infos = verify_checkpoint(directory, step=args.step, verify="fast" if args.fast else "full")
    if not infos:
        print(_none_found(directory, "no checkpoints to verify"))
        return 1
    for info in infos:
        if info.valid:
            print(f"step {info.step}: OK ({format_bytes(info.size_bytes)})")
            continue
        print(f"step {info.step}: {'UNVERIFIABLE' if info.unverifiable else 'CORRUPT'}")
        for path, problem in (info.problems or {info.path: info.problem or "not valid"}).items():
            print(f"  {shown(path)}: {shown(problem)}")
    return 0 if all(info.valid for info in infos) else 1


def _run_export(args: argparse.Namespace) -> int:
    write = export_dcp if args.dcp else export_model_weights
    step = write(checkpoint_dir(args.directory), args.out, step=args.step, item=args.item)
    print(shown(f"exported step {step} ({args.item} weights) to {args.out}"))
    return 0


def _run_import(args: argparse.Namespace) -> int:
    directory = checkpoint_dir(args.directory, must_exist=False)
    if os.path.isdir(args.file) and os.path.isfile(os.path.join(args.file, ".metadata")):  # a DCP directory
        step, left_out = import_dcp(args.file, directory, step=args.step, trust_pickle=args.trust_dcp_metadata)
        print(shown(f"imported DCP directory {args.file} (its tensors, as the model) as step {step} into "
                    f"{directory}" + (f"; left out, not tensors: {', '.join(left_out)}" if left_out else "")))
        return 0
    step = import_torch_save(args.file, directory, step=args.step)
    print(shown(f"imported {args.file} as step {step} into {args.directory}"))
    return 0
