"""Process resident set size from ``/proc/self/status`` (Linux); zeros elsewhere."""

from __future__ import annotations

from pathlib import Path

_STATUS = Path("/proc/self/status")
_CLEAR_REFS = Path("/proc/self/clear_refs")


def read_rss_bytes() -> tuple[int, int]:
    """Return ``(current_rss_bytes, peak_rss_bytes)`` of this process (``VmRSS``, ``VmHWM``).

    Example:
        >>> rss, peak = read_rss_bytes()
        >>> peak >= rss >= 0
        True
    """
    try:
        text = _STATUS.read_text()
    except OSError:
        return 0, 0
    fields = {}
    for line in text.splitlines():
        key, _, value = line.partition(":")
        if key in ("VmRSS", "VmHWM"):
            fields[key] = int(value.split()[0]) * 1024  # reported in kB
    return fields.get("VmRSS", 0), fields.get("VmHWM", 0)


def reset_peak_rss() -> bool:
    """Reset the kernel's RSS high-water mark to the current RSS; False where not supported.

    Example:
        >>> isinstance(reset_peak_rss(), bool)
        True
    """
    try:
        _CLEAR_REFS.write_text("5")
    except OSError:
        return False
    return True
