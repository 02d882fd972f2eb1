"""Sizes are parsed and printed in one place, and counts are checked in one place.

``parse_bytes`` accepts ints and strings with decimal (kB, MB, GB, TB) or binary (KiB, MiB, GiB, TiB)
units; percentages are left to callers that know what they are a percentage of. ``check_positive_int``
is the one check for options that must be a count >= 1.
"""

from __future__ import annotations

import re

_UNITS: dict[str, int] = {
    "": 1,
    "b": 1,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
}
_SIZE_RE = re.compile(r"^\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*$")


def check_positive_int(name: str, value: object) -> int:
    """Return ``value`` if it is an int >= 1; otherwise raise, naming the option, the value and the fix.

    Raises TypeError for anything but an int (bools included) and ValueError for ints below 1.

    Args:
        name: the option as the caller wrote it (``"steps"``, ``"GPTConfig.n_layer"``, ``"--threads"``).
        value: the value given.

    Example:
        >>> check_positive_int("steps", 3)
        3
        >>> check_positive_int("steps", 0)
        Traceback (most recent call last):
        ValueError: steps must be >= 1; got steps=0. Pass a positive count.
    """
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int >= 1; got {value!r} of type {type(value).__name__}. "
                        f"Pass a whole number such as {name}=1.")
    if value < 1:
        raise ValueError(f"{name} must be >= 1; got {name}={value}. Pass a positive count.")
    return value


def check_index(name: str, value: object) -> int:
    """Return ``value`` if it is an int >= 0 (a position); otherwise raise, naming the field and the value.

    Raises TypeError for anything but an int (bools included) and ValueError for negative ints.

    Example:
        >>> check_index("Single.block", 2)
        2
        >>> check_index("Single.block", -1)
        Traceback (most recent call last):
        ValueError: Single.block must be an int >= 0; got -1
    """
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int >= 0; got {value!r} of type {type(value).__name__}")
    if value < 0:
        raise ValueError(f"{name} must be an int >= 0; got {value!r}")
    return value


def parse_bytes(size: int | str, *, option: str = "size") -> int:
    """Parse a byte count such as ``6GiB``, ``800MB``, ``1.5 GB`` or ``1024``.

    Args:
        size: an int (bytes) or a string with an optional unit.
        option: the name of the option being parsed, used in error messages.

    Example:
        >>> parse_bytes("6GiB")
        6442450944
        >>> parse_bytes("800MB")
        800000000
    """
    if isinstance(size, bool) or not isinstance(size, (int, str)):
        raise TypeError(f"{option} must be an int number of bytes or a string like '6GiB'; got {size!r}")
    if isinstance(size, int):
        if size < 0:
            raise ValueError(f"{option} must be >= 0 bytes; got {size}")
        return size
    match = _SIZE_RE.match(size)
    unit = match.group(2).lower() if match else None
    if match is None or unit not in _UNITS:
        allowed = ", ".join(u for u in ("B", "kB", "MB", "GB", "TB", "KiB", "MiB", "GiB", "TiB"))
        raise ValueError(f"{option}={size!r} is not a size; write a number with one of the units {allowed} "
                         f"(for example '6GiB' or '800MB')")
    return int(float(match.group(1)) * _UNITS[unit])


def parse_percent(value: int | str, *, option: str = "budget") -> float | None:
    """The percentage in ``value`` ("60%" -> 60.0), or None when ``value`` is not a percentage.

    A percentage must be a number in (0, 1000] followed by ``%``; anything else ending in ``%`` raises
    ValueError naming ``option``.

    Example:
        >>> parse_percent("60%"), parse_percent("6GiB")
        (60.0, None)
    """
    if not (isinstance(value, str) and value.strip().endswith("%")):
        return None
    try:
        percent = float(value.strip()[:-1])
    except ValueError:
        raise ValueError(f"{option}={value!r}: a percentage must be a number followed by %, like '60%'") from None
    if not 0 < percent <= 1000:
        raise ValueError(f"{option}={value!r}: the percentage must be in (0, 1000]; it is a share of the peak "
                         "without checkpointing, e.g. '60%'")
    return percent


def format_bytes(num_bytes: float) -> str:
    """Format a byte count with a binary unit, three significant figures.

    Example:
        >>> format_bytes(6 * 2**30)
        '6.00 GiB'
        >>> format_bytes(512)
        '512 B'
    """
    value = float(num_bytes)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(value) < 1024 or unit == "GiB":
            break
        value /= 1024
    if unit == "B":
        return f"{int(value)} B"
    return f"{value:.0f} {unit}" if abs(value) >= 100 else f"{value:.2f} {unit}"


def counted(count: int, noun: str) -> str:
    """``count`` and ``noun``, plural unless the count is one (nouns whose plural adds an s).

    Example:
        >>> counted(1, "thread"), counted(2, "thread")
        ('1 thread', '2 threads')
    """
    return f"{count} {noun}" if count == 1 else f"{count} {noun}s"
