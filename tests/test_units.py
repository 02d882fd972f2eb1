"""Sizes are parsed in one place; every bad input names the option and the fix."""

from __future__ import annotations

import pytest

from torchckpt._units import format_bytes, parse_bytes


@pytest.mark.parametrize("text,expected", [("6GiB", 6 * 2**30), ("800MB", 800 * 10**6), ("1.5 GB", 1_500_000_000),
                                           ("1024", 1024), ("64kib", 65536), (4096, 4096), ("0", 0)])
def test_parse_bytes(text: str | int, expected: int) -> None:
    assert parse_bytes(text) == expected


@pytest.mark.parametrize("bad,error,message", [("6 parsecs", ValueError, "budget='6 parsecs' is not a size"),
                                               ("GiB", ValueError, "is not a size"),
                                               (-1, ValueError, "must be >= 0"),
                                               (1.5, TypeError, "must be an int number of bytes"),
                                               (True, TypeError, "must be an int number of bytes")])
def test_parse_bytes_errors(bad: object, error: type, message: str) -> None:
    with pytest.raises(error, match=message):
        parse_bytes(bad, option="budget")  # type: ignore[arg-type]


def test_format_bytes() -> None:
    assert [format_bytes(n) for n in (0, 1023, 1024, 1536 * 2**20, 300 * 2**20, 1020 * 2**20)] == \
        ["0 B", "1023 B", "1.00 KiB", "1.50 GiB", "300 MiB", "1020 MiB"]
