"""``torchckpt train``'s options are TrainConfig's fields: the argparse options, the parsed-options -> config
mapping and the argv forwarded to ``--nproc`` processes are generated from them. These tests hold the
generated parts to the fields: a non-default config survives argv -> parse -> config with every field
covered, every field has help text, and docs/train.md's options table names the same options."""

from __future__ import annotations

import argparse
import re
from dataclasses import fields
from pathlib import Path

import pytest

from torchckpt.cli.train_commands import register
from torchckpt.train import TrainConfig
from torchckpt.train.config import train_option, train_options

DOCS = Path(__file__).resolve().parents[2] / "docs" / "train.md"

# Not the defaults in any field (checked below): a field added to TrainConfig must be added here.
NON_DEFAULT = TrainConfig(budget="300MiB", size="tiny", model="my models/m.py:build", batch_size=3, seq_len=32,
                          steps=7, save_every=2, seed=-5, lr=1 / 3, dir="-odd dir", threads=2, save=False,
                          rendezvous_timeout=9, offload=True, optimizer_offload=True)
PYTHON_ONLY = {"dropout"}  # fields without a command-line option (TrainConfig(dropout=...) only)


def _parse(argv: list[str]) -> argparse.Namespace:
    root = argparse.ArgumentParser(prog="torchckpt")
    register(root.add_subparsers())
    return root.parse_args(["train", *argv])


def _train_parser() -> argparse.ArgumentParser:
    root = argparse.ArgumentParser(prog="torchckpt")
    subparsers = root.add_subparsers()
    register(subparsers)
    return subparsers.choices["train"]


def test_every_field_is_an_option_or_python_only() -> None:
    options = train_options(cli_only=False)
    assert [o.name for o in options] == [f.name for f in fields(TrainConfig)]
    assert {o.name for o in options if not o.cli} == PYTHON_ONLY


def test_a_non_default_config_round_trips_through_the_forwarded_argv() -> None:
    for option in train_options():
        assert getattr(NON_DEFAULT, option.name) != option.default, f"NON_DEFAULT leaves {option.flag} at its default"
    argv = NON_DEFAULT.argv()
    assert TrainConfig.from_options(vars(_parse(argv))) == NON_DEFAULT
    assert "--no-save" in argv and "--lr=0.3333333333333333" in argv and "--dir=-odd dir" in argv


def test_defaults_round_trip_and_parse_to_the_dataclass_defaults() -> None:
    assert TrainConfig.from_options(vars(_parse([]))) == TrainConfig()
    assert TrainConfig.from_options(vars(_parse(TrainConfig().argv()))) == TrainConfig()
    assert "--no-save" not in TrainConfig().argv() and not any(a.startswith("--model") for a in TrainConfig().argv())


def test_space_separated_values_parse_as_before() -> None:
    args = _parse(["--budget", "90%", "--size", "tiny", "--batch-size", "4", "--lr", "0.001", "--threads", "1",
                   "--no-save", "--nproc", "2"])
    config = TrainConfig.from_options(vars(args))
    assert (config.budget, config.size, config.batch_size, config.lr, config.threads, config.save) == \
        ("90%", "tiny", 4, 0.001, 1, False)
    assert args.nproc == 2


def test_a_python_only_field_off_its_default_is_not_forwarded_silently() -> None:
    with pytest.raises(ValueError, match=r"dropout=0\.0 has no torchckpt train option"):
        TrainConfig(dropout=0.0).argv()


def test_bad_values_keep_their_errors(capsys: pytest.CaptureFixture[str]) -> None:
    for argv, message in ((["--steps", "0"], "argument --steps: must be a positive integer; got 0."),
                          (["--size", "huge"], "argument --size: invalid choice: 'huge'"),
                          (["--lr", "fast"], "argument --lr: invalid float value: 'fast'")):
        with pytest.raises(SystemExit):
            _parse(argv)
        assert message in capsys.readouterr().err
    with pytest.raises(ValueError, match="--save-every must be >= 1"):
        TrainConfig(save_every=0)
    with pytest.raises(ValueError, match="--budget"):
        TrainConfig.from_options(vars(_parse(["--budget", "lots"])))


def test_every_option_has_help_text_shown_by_help() -> None:
    text = " ".join(_train_parser().format_help().split())
    for option in train_options(cli_only=False):
        assert len(option.help.split()) >= 3, f"{option.name}: help text too short: {option.help!r}"
        if option.cli:
            assert option.flag in text and " ".join(option.help.split()) in text


def test_a_field_without_help_is_refused() -> None:
    with pytest.raises(ValueError, match="needs a help text"):
        train_option(1, " ")


def _options_table() -> list[tuple[list[str], list[str]]]:
    """(flags, defaults) per row of docs/train.md's table of options."""
    section = DOCS.read_text().split("| option | default | meaning |", 1)[1].split("\n\n", 1)[0]
    rows = []
    for line in section.strip().splitlines()[1:]:  # after the |---| line
        flag_cell, default_cell = line.split("|")[1:3]
        defaults = [d.strip().strip("`") for d in default_cell.split(",")] if default_cell.strip() else []
        rows.append((re.findall(r"--[a-z][a-z-]*", flag_cell), defaults))
    return rows


def test_docs_table_lists_the_options_with_their_defaults() -> None:
    rows = _options_table()
    by_flag = {o.flag: o for o in train_options()}
    assert sorted(flag for flags, _ in rows for flag in flags) == sorted([*by_flag, "--nproc"])
    readers = {"count": int, "int": int, "float": float, "text": str}
    for flags, defaults in rows:
        for index, flag in enumerate(flags):
            option = by_flag.get(flag)
            if option is None or option.default is None:  # --nproc; "PyTorch's" or none shown
                continue
            if option.kind == "switch":
                assert defaults == ["off"], flag
            else:
                assert readers[option.kind](defaults[index]) == option.default, flag


def test_docs_name_the_python_only_fields() -> None:
    after_table = DOCS.read_text().split("| option | default | meaning |", 1)[1].split("\n\n", 2)[1]
    for name in PYTHON_ONLY:
        assert f"`{name}`" in after_table
