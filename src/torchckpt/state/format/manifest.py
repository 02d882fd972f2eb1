"""The manifest of a step: every file with its size and hash, written last, self-checked when read.

Rules kept here (named in ``docs/design.md``; the design notes they keep in parentheses):

1. **[parse_manifest is the only way in]** (Note: [no manifest, no checkpoint]) A
   directory is a checkpoint only if ``manifest.json`` parses, its own
   ``manifest_hash`` matches, and it lists every file with size and hash.
   :func:`parse_manifest` is the only way a manifest is read.
2. **[the manifest hashes itself]** The manifest hashes its own canonical JSON, so
   a flipped byte in the manifest itself is detected, not just in the files it
   lists.
3. **[manifest fields have exact types]** Every manifest field must have the type a
   save writes: sizes and the step are ints (never bools, floats or ``Infinity``),
   times are finite numbers, metrics are numbers other than NaN, names and hashes
   are strings. Anything else, and JSON that does not parse at all (a number too
   long for Python's int conversion included), is a :class:`CheckpointCorruptError`
   naming the field: the step is corrupt and every reader goes on with the others.

The file names of a step are in layout.py; the hash algorithms a manifest names in hashing.py.
"""

from __future__ import annotations

import json
import math
import sys
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, NoReturn

from torchckpt.state.errors import CheckpointCorruptError, CheckpointNewerFormatError
from torchckpt.state.format.hashing import hash_bytes

FORMAT_NAME = "torchckpt.state"
FORMAT_VERSION = 3  # an unsharded step: 3, a storage written once, views as entries (format/storages.py); 1 is read
SHARDED_FORMAT_VERSION = 2  # a sharded step (sharded/save.py): older readers refuse it by version, naming an upgrade
# A sharded step whose JSON holds a value tag added in format 3 (codec.py's FORMAT_3_TAGS: a huge int, a sparse
# tensor) is format 3 too; a sharded step without one keeps version 2, so that an older torchckpt still reads it.
TAGGED_FORMAT_VERSION = 3
NEWEST_FORMAT_VERSION = TAGGED_FORMAT_VERSION  # a step of a greater version is refused, never taken for corrupt


def canonical_json(value: Any) -> bytes:
    """JSON bytes with sorted keys and no spaces: the form that gets hashed.

    Example:
        >>> canonical_json({"b": 1, "a": [1.5, None]})
        b'{"a":[1.5,null],"b":1}'
    """
    return json.dumps(value, sort_keys=True, separators=(",", ":")).encode("utf-8")


@dataclass(frozen=True, kw_only=True)
class FileEntry:
    """One file listed in a manifest.

    Example:
        >>> FileEntry(size_bytes=3, hash="352441c2").size_bytes
        3
    """

    size_bytes: int
    hash: str


@dataclass(frozen=True, kw_only=True)
class Manifest:
    """The parsed ``manifest.json`` of one checkpoint.

    Example:
        >>> m = Manifest(step=1, created_unix_s=0.0, hash_algorithm="crc32", files={})
        >>> parse_manifest(encode_manifest(m), "m.json").step
        1
    """

    step: int
    created_unix_s: float
    hash_algorithm: str
    files: Mapping[str, FileEntry]
    metrics: Mapping[str, float] = field(default_factory=dict)
    world_size: int | None = None  # set for a sharded step: the number of ranks that wrote it
    format_version: int | None = None  # None: the lowest that holds it (1 unsharded, 2 sharded)

    @property
    def size_bytes(self) -> int:
        """Total bytes of the listed files (the manifest itself excluded)."""
        return sum(entry.size_bytes for entry in self.files.values())


def encode_manifest(manifest: Manifest) -> bytes:
    """Serialise a manifest, adding ``manifest_hash`` over the rest of it ([the manifest hashes itself]).

    Example:
        >>> m = Manifest(step=3, created_unix_s=1.0, hash_algorithm="sha256", files={})
        >>> b'"step": 3' in encode_manifest(m)
        True
    """
    body = _manifest_body(manifest)
    body["manifest_hash"] = hash_bytes(canonical_json(body), "sha256")
    return json.dumps(body, indent=1, sort_keys=True).encode("utf-8")


def _manifest_body(manifest: Manifest) -> dict[str, Any]:
    body: dict[str, Any] = {
        "format": FORMAT_NAME,
        "format_version": max(manifest.format_version or 0,
                              FORMAT_VERSION if manifest.world_size is None else SHARDED_FORMAT_VERSION),
        "step": manifest.step,
        "created_unix_s": manifest.created_unix_s,
        "hash_algorithm": manifest.hash_algorithm,
        "files": {
            name: {"size_bytes": entry.size_bytes, "hash": entry.hash}
            for name, entry in sorted(manifest.files.items())
        },
        "metrics": dict(manifest.metrics),
    }
    if manifest.world_size is not None:
        body["world_size"] = manifest.world_size
    return body


def parse_manifest(data: bytes, path: str) -> Manifest:
    """Parse and self-check manifest bytes read from ``path`` ([parse_manifest is the only way in]).

    Raises :class:`CheckpointCorruptError` naming ``path`` and the problem.

    Example:
        >>> parse_manifest(b"{", "runs/x/step-000000001/manifest.json")  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        torchckpt.state.errors.CheckpointCorruptError: runs/x/step-000000001/manifest.json: ...
    """
    body = _load_manifest_json(data, path)
    claimed = body.pop("manifest_hash", None)
    try:
        actual = hash_bytes(canonical_json(body), "sha256")
    except RecursionError:  # json.dumps may give up a level or two before json.loads does
        _corrupt(path, "JSON nested too deeply to hash: corrupt (a manifest is nested 3 levels deep)")
    if claimed != actual:
        _corrupt(path, f"manifest_hash is {claimed!r} but its content hashes to {actual!r}")
    version: Any = body.get("format_version")
    if body.get("format") == FORMAT_NAME and _is_int(version) and version > NEWEST_FORMAT_VERSION:
        problem = (f"written by a newer torchckpt (format {version}); this torchckpt reads formats 1 to "
                   f"{NEWEST_FORMAT_VERSION}. Nothing was changed. Fix: upgrade torchckpt (pip install -U torchckpt)")
        raise CheckpointNewerFormatError(f"{path}: {problem}", {path: problem})
    if body.get("format") != FORMAT_NAME or not (_is_int(version) and 1 <= version <= NEWEST_FORMAT_VERSION):
        _corrupt(
            path,
            f"format {body.get('format')!r} version {body.get('format_version')!r}; "
            f"expected {FORMAT_NAME!r} version 1 to {NEWEST_FORMAT_VERSION}",
        )
    if version != TAGGED_FORMAT_VERSION and (version == SHARDED_FORMAT_VERSION) != ("world_size" in body):
        _corrupt(path, f"format version {version} {'needs' if version == 2 else 'has no'} field 'world_size'")
    return _manifest_from_body(body, path, version)


def json_problem(error: ValueError) -> str:
    """What a ``ValueError`` of ``json.loads`` says about the bytes (``JSONDecodeError``, a UTF-8 error, or a
    number too long for Python's int conversion, which no save writes).

    Example:
        >>> try:
        ...     json.loads("1" * 5000)
        ... except ValueError as error:
        ...     json_problem(error)
        'a number with more than 4300 digits (no save writes one)'
    """
    if isinstance(error, (json.JSONDecodeError, UnicodeDecodeError)):
        return f"not valid JSON ({error})"
    digits = sys.get_int_max_str_digits() if hasattr(sys, "get_int_max_str_digits") else 4300
    return f"a number with more than {digits} digits (no save writes one)"


def _load_manifest_json(data: bytes, path: str) -> dict[str, Any]:
    try:
        body = json.loads(data.decode("utf-8"))
    except ValueError as error:  # JSONDecodeError, UnicodeDecodeError, and Python's int-digit limit
        # A save writes the manifest whole and fsyncs it before the step is renamed into place, so a
        # committed manifest that does not parse was damaged afterwards: corruption, not an unfinished save.
        _corrupt(path, f"{json_problem(error)}: corrupt (damaged after it was written)")
    except RecursionError:
        _corrupt(path, "JSON nested too deeply to parse: corrupt (a manifest is nested 3 levels deep)")
    if not isinstance(body, dict):
        _corrupt(path, f"expected a JSON object, found {type(body).__name__}")
    return body


_MAX_SIZE_BYTES = 1 << 63  # no file is larger; a size beyond it would overflow float() in `torchckpt ls`


def _manifest_from_body(body: dict[str, Any], path: str, version: int) -> Manifest:
    """Every field checked for the exact type a save writes ([manifest fields have exact types])."""
    for key in ("step", "created_unix_s", "hash_algorithm", "files"):
        if key not in body:
            _corrupt(path, f"missing field {key!r}")
    files = _field(path, "files", body["files"], dict, "an object")
    metrics = _field(path, "metrics", body.get("metrics", {}), dict, "an object")
    entries = {}
    for name, entry in files.items():
        where = f"files[{name!r}]"
        if not name or name in (".", "..") or any(c in name for c in "/\\\0"):
            _malformed(path, "files", name, "plain file names inside the step (no '/', '..')")
        entry = _field(path, where, entry, dict, "an object")
        size = entry.get("size_bytes")
        if not (_is_int(size) and 0 <= size < _MAX_SIZE_BYTES):
            _malformed(path, f"{where}.size_bytes", size, "a non-negative int")
        entries[name] = FileEntry(size_bytes=size, hash=_field(path, f"{where}.hash", entry.get("hash"), str, "a str"))
    step = body["step"]
    if not (_is_int(step) and step >= 0):
        _malformed(path, "step", step, "a non-negative int")
    created = body["created_unix_s"]
    seconds = _as_float(created)
    if seconds is None or not abs(seconds) < 1e11:  # finite (not NaN), and a date time.localtime can show
        _malformed(path, "created_unix_s", created, "a finite number of seconds since 1970")
    checked_metrics = {}
    for name, value in metrics.items():
        number = _as_float(value)
        if number is None or math.isnan(number):  # saves refuse NaN (keep_best cannot rank it); +-inf is kept
            _malformed(path, f"metrics[{name!r}]", value, "a number (not NaN)")
        checked_metrics[name] = number
    world_size = body.get("world_size")
    if world_size is not None and not (_is_int(world_size) and 1 <= world_size < 1 << 24):
        _malformed(path, "world_size", world_size, "a positive int")
    return Manifest(
        step=step,
        world_size=world_size,
        format_version=version,
        created_unix_s=seconds,
        hash_algorithm=_field(path, "hash_algorithm", body["hash_algorithm"], str, "a str"),
        files=entries,
        metrics=checked_metrics,
    )


def _is_int(value: object) -> bool:
    return type(value) is int  # bool is a subclass of int: excluded


def _as_float(value: object) -> float | None:
    """``value`` as a float if it is an int or a float (never a bool), else None."""
    if type(value) is float:
        return value
    if type(value) is int and abs(value) < 1 << 1000:  # float() of a larger int overflows
        return float(value)
    return None


def _field(path: str, where: str, value: Any, kind: type, expected: str) -> Any:
    if type(value) is not kind:
        _malformed(path, where, value, expected)
    return value


def _malformed(path: str, where: str, value: object, expected: str) -> NoReturn:
    shown = repr(value)
    shown = shown if len(shown) <= 40 else f"{shown[:40]}..."
    _corrupt(path, f"malformed field {where}: {shown} ({type(value).__name__}); expected {expected}")


def _corrupt(path: str, problem: str) -> NoReturn:
    raise CheckpointCorruptError(f"{path}: {problem}", {path: problem})


def metric_value(name: str, value: object) -> float:
    """Convert one metric to a float (a number or a one-element tensor).

    Example:
        >>> metric_value("loss", 2)
        2.0
    """
    item = getattr(value, "item", None)
    if callable(item) and getattr(value, "numel", lambda: 1)() == 1:
        value = item()
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(
            f"metrics[{name!r}] is {type(value).__name__}; expected a number or a one-element "
            f"tensor. Fix: pass float(value)."
        )
    result = float(value)
    if math.isnan(result):
        raise ValueError(f"metrics[{name!r}] is NaN; keep_best cannot rank it. Fix: skip the metric.")
    return result
