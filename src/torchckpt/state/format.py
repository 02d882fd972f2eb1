"""On-disk layout of a training-state checkpoint, its manifest, and file hashing.

Layout (``docs/design.md``, Note: [state layout])::

    runs/exp/
      step-000001200/
        model.safetensors        tensors of the item ``model``
        optimizer.safetensors    tensors of the item ``optimizer``
        optimizer.json           the rest of its state_dict (param_groups, ...)
        state.json               step, metrics, RNG streams, tensor-free items
        manifest.json            written last: every file with size and hash
      .tmp-step-000001300-<id>/  a save in flight (local back end); removed at start-up

Rules kept here (named in ``docs/design.md``; the design notes they keep in parentheses):

1. **[parse_manifest is the only way in]** (Note: [no manifest, no checkpoint]) A
   directory is a checkpoint only if ``manifest.json`` parses, its own
   ``manifest_hash`` matches, and it lists every file with size and hash.
   :func:`parse_manifest` is the only way a manifest is read.
2. **[the manifest hashes itself]** The manifest hashes its own canonical JSON, so
   a flipped byte in the manifest itself is detected, not just in the files it
   lists.
3. **[old hash names stay]** The manifest records the name of its file hash
   algorithm; every name that was ever a default stays in :data:`HASH_ALGORITHMS`,
   so a checkpoint written with an older default (``sha256``, before the zero-copy
   I/O work) still verifies.
4. **[hashes are incremental]** Hashes are incremental (``update`` per chunk): a
   file is hashed while it is written or read, chunk by chunk, never as one more
   pass over a joined copy.
5. **[manifest fields have exact types]** Every manifest field must have the type a
   save writes: sizes and the step are ints (never bools, floats or ``Infinity``),
   times are finite numbers, metrics are numbers other than NaN, names and hashes
   are strings. Anything else, and JSON that does not parse at all (a number too
   long for Python's int conversion included), is a :class:`CheckpointCorruptError`
   naming the field: the step is corrupt and every reader goes on with the others.
"""

from __future__ import annotations

import hashlib
import json
import math
import re
import sys
import zlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, NoReturn, Protocol

from torchckpt.state.errors import CheckpointCorruptError

FORMAT_NAME = "torchckpt.state"
FORMAT_VERSION = 1
SHARDED_FORMAT_VERSION = 2  # a sharded step (sharded.py): older readers refuse it by version, naming an upgrade
MANIFEST_NAME = "manifest.json"
STATE_NAME = "state.json"
LOCK_NAME = ".lock"
TMP_PREFIX = ".tmp-"
TRASH_PREFIX = ".trash-"
CORRUPT_PREFIX = ".corrupt-"
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


class Hasher(Protocol):
    """An incremental hash: ``update`` with consecutive chunks, then ``hexdigest`` of all of them."""

    def update(self, data: bytes | memoryview, /) -> None: ...
    def hexdigest(self) -> str: ...


class _Crc32:
    """zlib's CRC-32 with the hashlib interface (it releases the GIL on large buffers, like hashlib)."""

    def __init__(self) -> None:
        self._value = 0

    def update(self, data: bytes | memoryview) -> None:
        self._value = zlib.crc32(data, self._value)

    def hexdigest(self) -> str:
        return f"{self._value & 0xFFFFFFFF:08x}"


def _xxh3_128() -> Hasher:
    try:
        import xxhash  # a dependency (pyproject.toml); imported lazily so a broken install names the fix
    except ImportError:
        raise ValueError(
            "hash algorithm 'xxh3_128' needs the xxhash package, which is not installed. "
            "Fix: pip install xxhash (or pass hash_algorithm='sha256')"
        ) from None
    return xxhash.xxh3_128()


# Registry of incremental hashers by the name a manifest records (an explicit registry,
# Note: [no global state but registries]). Every name ever written stays here, so old checkpoints keep
# verifying ([old hash names stay]). xxh3_128 is the default since the zero-copy I/O work: ~15 GB/s here
# against ~1.5 GB/s for sha256 (which was the default before and made hashing as slow as the disk);
# measured in bench/state/bench_hash.py.
HASH_ALGORITHMS: Mapping[str, Callable[[], Hasher]] = {
    "xxh3_128": _xxh3_128,
    "sha256": hashlib.sha256,
    "blake2b": hashlib.blake2b,
    "crc32": _Crc32,
}
DEFAULT_HASH_ALGORITHM = "xxh3_128"


def new_hasher(algorithm: str) -> Hasher:
    """A fresh incremental hasher for a manifest hash algorithm.

    Example:
        >>> hasher = new_hasher("crc32"); hasher.update(b"a"); hasher.update(b"bc"); hasher.hexdigest()
        '352441c2'
    """
    try:
        factory = HASH_ALGORITHMS[algorithm]
    except KeyError:
        raise ValueError(
            f"hash algorithm {algorithm!r} is unknown; expected one of {sorted(HASH_ALGORITHMS)}. "
            "Fix: pick one of those (a manifest naming another was written by a newer torchckpt: upgrade)"
        ) from None
    return factory()


def hash_bytes(data: bytes | memoryview, algorithm: str) -> str:
    """Hex digest of ``data`` with a manifest hash algorithm.

    Example:
        >>> hash_bytes(b"abc", "crc32"), hash_bytes(b"abc", "xxh3_128")
        ('352441c2', '06b05ab6733a618578af5f94892f3950')
    """
    hasher = new_hasher(algorithm)
    hasher.update(data)
    return hasher.hexdigest()


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
        "format_version": FORMAT_VERSION if manifest.world_size is None else SHARDED_FORMAT_VERSION,
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
    version = body.get("format_version")
    if body.get("format") != FORMAT_NAME or not (_is_int(version) and version in (FORMAT_VERSION,
                                                                                  SHARDED_FORMAT_VERSION)):
        _corrupt(
            path,
            f"format {body.get('format')!r} version {body.get('format_version')!r}; "
            f"expected {FORMAT_NAME!r} version {FORMAT_VERSION} or {SHARDED_FORMAT_VERSION} (upgrade torchckpt?)",
        )
    if (version == SHARDED_FORMAT_VERSION) != ("world_size" in body):
        _corrupt(path, f"format version {version} {'needs' if version == 2 else 'has no'} field 'world_size'")
    return _manifest_from_body(body, path)


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


def _manifest_from_body(body: dict[str, Any], path: str) -> Manifest:
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
