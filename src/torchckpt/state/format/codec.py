"""Pickle-free codecs: a state_dict becomes safetensors (tensors) plus JSON (everything else).

Rules kept here (named in ``docs/design.md``):

1. **[pickles are refused unread]** (Note: [no pickle]) Nothing here unpickles.
   Bytes are decoded only by ``json`` and by the safetensors header parser below,
   which checks every rule of the safetensors format as the reference library does
   (dtype names, shapes, offsets that tile the data exactly) before it makes a
   single view; a file that looks like a pickle or a ``torch.save`` zip is refused
   before any parser sees it. The tests check that the reference ``safetensors``
   reads what we write and refuses what we refuse.
2. **[round trips are exact]** Round trips are exact: tensors keep dtype, shape
   and bits; Python floats go through ``repr`` (exact); tuples, int dict keys,
   NumPy arrays and scalars are tagged so they come back with the same type.
   Anything else is an error that names its path, never a silent ``str()``.
3. **[tensor keys are tree paths]** Tensor keys are the path of the tensor in the
   tree joined by ``.``, so a model's flat state_dict is stored under its own keys
   (``torchckpt export`` relies on this).
4. **[zero copy both ways]** A safetensors file is written as chunks: its header,
   then each host tensor's own memory (format/tensor_chunks.py's ``safetensors_chunks``); only tensors under 64 KiB are
   joined (copied) into shared chunks, so many small tensors cost one write and one hash task per
   16 MiB, not one each. A restore reads each tensor into its own memory (read/tensor_file.py); decoding
   a buffer holding a whole file (other back ends, other readers) makes each tensor of 1 MiB or more a
   view of it; smaller tensors, and any whose offset does not suit its dtype's alignment (files written
   by other tools), are copied into their own memory.
"""

from __future__ import annotations

import base64
import json
import math
import sys
from collections import OrderedDict
from collections.abc import Mapping
from typing import Any

import numpy as np
import safetensors.torch
import torch

from torchckpt._host import local_part
from torchckpt.state.errors import CheckpointCorruptError, UnsafeFileError, UnsupportedStateError
from torchckpt.state.format.manifest import json_problem
from torchckpt.state.format.tensor_kinds import is_sparse, sparse_from_parts, sparse_parts, unstorable_problem

TREE_TAG = _TAG = "__torchckpt__"  # the key of a tagged entry in an encoded tree (format/storages.py adds some)
_SCALARS = (bool, int, float, str, type(None))
SAFETENSORS_MAX_HEADER_BYTES = 100 << 20
# Decoded tensors at least this large are views of the read buffer; smaller ones are copied. Copying
# them costs nothing, and some small uint8 tensors are structs in disguise (a torch.Generator's state)
# that native code reads with aligned loads: as views at an odd offset they crashed set_state (SIGSEGV).
_VIEW_MIN_BYTES = 1 << 20
_JSON_INT_LIMIT = 1 << 1000  # and beyond (302 digits): tagged hex; json refuses over 4300 digits (640 at the least)


def split_tensors(
    tree: Any, item: str, *, sharded: bool = False, keep_layout: bool = False
) -> tuple[Any, dict[str, torch.Tensor]]:
    """Separate tensors from a nested state into (JSON-able tree, flat tensor dict).

    Tensors are detached and made contiguous (with ``keep_layout``: left as the views they are, for
    format/storages.py to write each storage once) but stay on their device (views of CPU tensors; the
    snapshot moves them to host memory). Every key gets its own entry, tied ones too. A DTensor is refused
    unless ``sharded`` (sharded/save.py hands it to DCP as it is).

    Example:
        >>> tree, tensors = split_tensors({"w": torch.ones(2), "lr": 0.1, 3: (1, 2)}, "opt")
        >>> sorted(tensors), tree["__torchckpt__"]
        (['w'], 'dict')
    """
    tensors: dict[str, torch.Tensor] = {}
    encoded = _encode(tree, (), item, tensors, sharded, keep_layout)
    return encoded, tensors


def join_tensors(tree: Any, tensors: Mapping[str, torch.Tensor], source: str) -> Any:
    """Inverse of :func:`split_tensors`; ``source`` names the file for errors.

    Example:
        >>> tree, tensors = split_tensors({"w": torch.ones(2), "betas": (0.9, 0.99)}, "opt")
        >>> join_tensors(tree, tensors, "opt.json")["betas"]
        (0.9, 0.99)
    """
    try:
        return _decode(tree, tensors, source)
    except RecursionError:
        problem = "nested too deeply to decode (deeper than Python's recursion limit)"
        raise CheckpointCorruptError(f"{source}: {problem}", {source: problem}) from None


def _path_text(path: tuple[str, ...]) -> str:
    return ".".join(path) if path else "<root>"


def _encode(
    value: Any,
    path: tuple[str, ...],
    item: str,
    tensors: dict[str, torch.Tensor],
    sharded: bool = False,
    keep_layout: bool = False,
) -> Any:
    if type(value) in _SCALARS:
        if type(value) is int and not -_JSON_INT_LIMIT < value < _JSON_INT_LIMIT:
            return {_TAG: "int", "hex": hex(value)}  # json cannot write it (4300 digits); hex has no such limit
        return value
    if isinstance(value, torch.Tensor):
        return _encode_tensor(value, path, item, tensors, sharded, keep_layout)
    if type(value) in (dict, OrderedDict):  # state_dict() returns an OrderedDict
        return _encode_dict(value, path, item, tensors, sharded, keep_layout)
    if type(value) is list:
        return [_encode(v, path + (str(i),), item, tensors, sharded, keep_layout) for i, v in enumerate(value)]
    if type(value) in (tuple, torch.Size):
        kind = "tuple" if type(value) is tuple else "size"
        items = [_encode(v, path + (str(i),), item, tensors, sharded, keep_layout) for i, v in enumerate(value)]
        return {_TAG: kind, "items": items}
    if isinstance(value, (np.ndarray, np.generic)):
        return _encode_numpy(value, path, item)
    if isinstance(value, torch.dtype):
        return {_TAG: "dtype", "name": str(value).removeprefix("torch.")}
    raise UnsupportedStateError(
        f"item {item!r}: value at {_path_text(path)} has type {type(value).__qualname__}, which "
        "torchckpt cannot store without pickle. Supported: tensors, numbers, str, None, bool, "
        "lists, tuples, dicts, NumPy arrays/scalars, torch.dtype. Fix: convert it in the "
        "object's state_dict() (and back in load_state_dict())."
    )


def _encode_dict(value: dict, path: tuple[str, ...], item: str, tensors: dict[str, torch.Tensor],
                 sharded: bool, keep_layout: bool) -> Any:
    plain = all(type(k) is str for k in value) and _TAG not in value
    if plain:
        return {k: _encode(v, path + (k,), item, tensors, sharded, keep_layout) for k, v in value.items()}
    pairs = [
        [_encode(k, path, item, tensors, sharded, keep_layout),
         _encode(v, path + (_key_text(k),), item, tensors, sharded, keep_layout)]
        for k, v in value.items()
    ]
    return {_TAG: "dict", "items": pairs}


def _key_text(key: Any) -> str:  # str() of an int over 4300 digits raises
    return hex(key) if type(key) is int and not -_JSON_INT_LIMIT < key < _JSON_INT_LIMIT else str(key)


def _encode_tensor(
    value: torch.Tensor, path: tuple[str, ...], item: str, tensors: dict[str, torch.Tensor], sharded: bool,
    keep_layout: bool = False,
) -> dict[str, Any]:
    if type(value) is torch.Tensor and keep_layout and value.layout is torch.strided and not value.requires_grad:
        _check_storable(value, path, item)  # the common case, quickly (100k small tensors)
        key = _unique_key(_path_text(path), tensors)
        tensors[key] = value.detach().resolve_conj().resolve_neg()
        return {_TAG: "tensor", "key": key}
    local = local_part(value)
    if local is not value and not sharded:
        raise UnsupportedStateError(
            f"item {item!r}: tensor at {_path_text(path)} is a DTensor (sharded across processes, e.g. by FSDP2's "
            "fully_shard), and this Checkpointer writes whole tensors (sharded=False); saving this rank's shard "
            "as if it were the whole tensor would be wrong. Fix: build the Checkpointer after "
            "torch.distributed.init_process_group on every rank (it then writes sharded checkpoints), or leave "
            "sharded at its default."
        )
    if local is not value:  # a DTensor: DCP reads its local shard (checked below) and its placement
        _check_storable(local, path, item)
        key = _unique_key(_path_text(path), tensors)
        tensors[key] = value.detach()
        return {_TAG: "tensor", "key": key}
    if is_sparse(value) and not sharded:  # tensor_kinds.py's [sparse tensors are stored as their parts]
        fields, parts = sparse_parts(value)
        encoded = {name: _encode_tensor(part, path + (name,), item, tensors, sharded) for name, part in parts.items()}
        return {_TAG: "sparse", **fields, "parts": encoded}
    _check_storable(value, path, item)
    host = value.detach().resolve_conj().resolve_neg()
    host = host if keep_layout else host.contiguous()
    key = _unique_key(_path_text(path), tensors)
    tensors[key] = host
    tag: dict[str, Any] = {_TAG: "tensor", "key": key}
    if type(value) is torch.nn.Parameter:  # kept with its flag; readers before these fields give a plain tensor
        tag["parameter"] = True
    if value.requires_grad:
        tag["requires_grad"] = True
    return tag


def _check_storable(value: torch.Tensor, path: tuple[str, ...], item: str) -> None:
    problem = unstorable_problem(value)  # tensor_kinds.py's [an unstorable tensor names its fix]
    if problem is not None:
        raise UnsupportedStateError(f"item {item!r}: tensor at {_path_text(path)} {problem}.")
    if value.dtype not in SAFETENSORS_DTYPES:
        raise UnsupportedStateError(
            f"item {item!r}: tensor at {_path_text(path)} has dtype {value.dtype}, which safetensors "
            f"cannot store (supported: {sorted(str(d) for d in SAFETENSORS_DTYPES)}). Fix: convert it "
            "(complex: torch.view_as_real) in state_dict()."
        )


def _unique_key(base: str, taken: Mapping[str, Any]) -> str:
    if base not in taken:
        return base
    suffix = 1
    while f"{base}#{suffix}" in taken:
        suffix += 1
    return f"{base}#{suffix}"


def _encode_numpy(value: np.ndarray | np.generic, path: tuple[str, ...], item: str) -> dict[str, Any]:
    array = np.asarray(value)
    if array.dtype.hasobject:
        raise UnsupportedStateError(
            f"item {item!r}: NumPy value at {_path_text(path)} has dtype object; only numeric "
            "dtypes are stored without pickle. Fix: convert it to a list."
        )
    kind = "ndarray" if isinstance(value, np.ndarray) else "npscalar"
    data = base64.b64encode(np.ascontiguousarray(array).tobytes()).decode("ascii")
    return {_TAG: kind, "dtype": array.dtype.str, "shape": list(array.shape), "data": data}


def _decode(value: Any, tensors: Mapping[str, torch.Tensor], source: str) -> Any:
    if type(value) is list:
        return [_decode(v, tensors, source) for v in value]
    if type(value) is not dict:
        return value
    tag = value.get(_TAG)
    if tag is None:
        return {k: _decode(v, tensors, source) for k, v in value.items()}
    try:
        return _decode_tagged(tag, value, tensors, source)
    except (KeyError, TypeError, ValueError, OverflowError, RuntimeError) as error:  # RuntimeError: torch refused it
        raise CheckpointCorruptError(
            f"{source}: malformed {tag!r} entry ({error!r})", {source: f"malformed {tag!r} entry"}
        ) from None


def _decode_tagged(tag: str, value: dict, tensors: Mapping[str, torch.Tensor], source: str) -> Any:
    if tag == "tensor":
        if value["key"] not in tensors:
            problem = f"refers to tensor {value['key']!r}, which its .safetensors file lacks"
            raise CheckpointCorruptError(f"{source}: {problem}", {source: problem})
        return _with_flags(tensors[value["key"]], value)
    if tag == "view":
        return _with_flags(_decode_view(value, tensors, source), value)
    if tag == "int":
        return int(value["hex"], 16)
    if tag == "sparse":
        parts = {name: _decode(part, tensors, source) for name, part in value["parts"].items()}
        return sparse_from_parts(value, parts)
    if tag == "dict":
        return {_decode(k, tensors, source): _decode(v, tensors, source) for k, v in value["items"]}
    if tag == "tuple":
        return tuple(_decode(v, tensors, source) for v in value["items"])
    if tag == "size":
        return torch.Size(_decode(v, tensors, source) for v in value["items"])
    if tag in ("ndarray", "npscalar"):
        raw = base64.b64decode(value["data"], validate=True)
        array = np.frombuffer(raw, dtype=np.dtype(value["dtype"])).reshape(value["shape"]).copy()
        return array if tag == "ndarray" else array[()]
    if tag == "dtype":
        dtype = getattr(torch, value["name"])
        if not isinstance(dtype, torch.dtype):
            raise ValueError(f"{value['name']!r} is not a torch dtype")
        return dtype
    raise ValueError(f"unknown tag {tag!r}")


def _with_flags(tensor: torch.Tensor, tag: Mapping[str, Any]) -> torch.Tensor:
    requires_grad = tag.get("requires_grad") is True
    if tag.get("parameter") is True:
        return torch.nn.Parameter(tensor, requires_grad=requires_grad)
    return tensor.detach().requires_grad_() if requires_grad else tensor


def _decode_view(value: dict, tensors: Mapping[str, torch.Tensor], source: str) -> torch.Tensor:
    """A view entry (format/storages.py's ``view_node``) as a tensor sharing its base entry's storage; every
    number checked."""
    base = tensors.get(value["key"])
    if base is None:
        problem = f"refers to tensor {value['key']!r}, which its .safetensors file lacks"
        raise CheckpointCorruptError(f"{source}: {problem}", {source: problem})
    dtype = DTYPES_BY_NAME[value["dtype"]]
    offset, shape, stride = value["offset"], value["shape"], value["stride"]
    numbers = [offset, *shape, *stride]
    if not (type(shape) is list and type(stride) is list and len(shape) == len(stride)
            and all(type(n) is int and n >= 0 for n in numbers)):
        raise ValueError(f"offset {offset!r}, shape {shape!r}, stride {stride!r}: expected ints >= 0, one stride "
                         "per dimension")
    span = 0 if 0 in shape else (1 + sum((n - 1) * step for n, step in zip(shape, stride))) * dtype.itemsize
    base_bytes = base.numel() * base.element_size()
    if not base.is_contiguous() or offset + span > base_bytes:
        raise ValueError(f"a view of {span} bytes at byte {offset} does not fit in its base of {base_bytes} bytes")
    start = base.storage_offset() * base.element_size() + offset
    if start % dtype.itemsize:  # only bytes read into one shared buffer (another reader) can be misaligned
        raw = base.reshape(-1).view(torch.uint8)[offset : offset + span].clone()
        return raw.view(dtype).as_strided(shape, stride)
    return torch.empty(0, dtype=dtype).set_(base.untyped_storage(), start // dtype.itemsize, shape, stride)


def encode_json(tree: Any) -> bytes:
    """JSON bytes of an encoded tree (floats are written exactly via ``repr``).

    Example:
        >>> decode_json(encode_json({"lr": 0.1}), "x.json")
        {'lr': 0.1}
    """
    return json.dumps(tree, indent=None, separators=(",", ":")).encode("utf-8")


def decode_json(data: bytes | memoryview, path: str) -> Any:
    """Parse JSON bytes read from ``path``; refuses pickles ([pickles are refused unread]).

    Example:
        >>> decode_json(b"[1, 2]", "x.json")
        [1, 2]
    """
    refuse_executable_formats(data, path)
    try:
        return json.loads(bytes(data).decode("utf-8"))
    except ValueError as error:  # JSONDecodeError, UnicodeDecodeError, and Python's int-digit limit
        problem = json_problem(error)
        raise CheckpointCorruptError(f"{path}: {problem}", {path: problem}) from None
    except RecursionError:
        problem = "JSON nested too deeply to parse (deeper than Python's recursion limit)"
        raise CheckpointCorruptError(f"{path}: {problem}", {path: problem}) from None


# safetensors dtype names (https://github.com/huggingface/safetensors, format spec).
SAFETENSORS_DTYPES: dict[torch.dtype, str] = {
    torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
    torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8",
    torch.uint8: "U8", torch.bool: "BOOL", torch.uint16: "U16", torch.uint32: "U32", torch.uint64: "U64",
    torch.float8_e4m3fn: "F8_E4M3", torch.float8_e5m2: "F8_E5M2",
}
DTYPES_BY_NAME: dict[str, torch.dtype] = {name: dtype for dtype, name in SAFETENSORS_DTYPES.items()}



def decode_safetensors(data: bytes | memoryview | torch.Tensor, path: str) -> dict[str, torch.Tensor]:
    """Parse safetensors bytes read from ``path`` into tensors that view ``data``; refuses pickles
    ([pickles are refused unread]).

    ``data`` may be a writable buffer (what restore reads into: the tensors are views
    of it, [zero copy both ways]), a ``torch.uint8`` tensor, or ``bytes`` (copied once, then viewed).

    Example:
        >>> decode_safetensors(b"\\x80\\x04junk", "m.safetensors")  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        torchckpt.state.errors.UnsafeFileError: m.safetensors: ...
    """
    view = data.numpy().data if isinstance(data, torch.Tensor) else memoryview(data).cast("B")
    header_bytes = int.from_bytes(view[:8], "little") if len(view) >= 8 else -1
    if not (0 < header_bytes <= min(len(view) - 8, SAFETENSORS_MAX_HEADER_BYTES)) or view[8:9] != b"{":
        # Checked only here: a valid header length (e.g. 0x280) may start with pickle's magic.
        refuse_executable_formats(view, path)
        problem = f"not a safetensors file (header length field {header_bytes}, file {len(view)} bytes)"
        raise CheckpointCorruptError(f"{path}: {problem}", {path: problem})
    try:
        if sys.byteorder != "little":
            return safetensors.torch.load(bytes(view))
        entries = safetensors_entries(bytes(view[8 : 8 + header_bytes]), len(view) - 8 - header_bytes)
    except (ValueError, TypeError, safetensors.SafetensorError) as error:  # JSON and UTF-8 errors are ValueErrors
        problem = f"not a valid safetensors file ({error}); it was damaged or written by another tool"
        raise CheckpointCorruptError(f"{path}: {problem}", {path: problem}) from None
    buffer = _uint8_tensor(data, view)
    start = 8 + header_bytes
    return {key: _tensor_view(buffer, start + begin, start + end, dtype, shape)
            for key, dtype, shape, begin, end in entries}


def safetensors_entries(header: bytes, data_bytes: int) -> list[tuple[str, torch.dtype, list[int], int, int]]:
    """Entries (key, dtype, shape, begin, end) of a safetensors header (the JSON after the length field)
    followed by ``data_bytes`` bytes of data, in the order of their data; raises ``ValueError`` (or a
    ``TypeError``) unless every rule of the format holds, as the reference parser checks them.

    Example:
        >>> safetensors_entries(b'{"w":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}}', 8)
        [('w', torch.float32, [2], 0, 8)]
    """
    body = json.loads(header.decode("utf-8"))
    if type(body) is not dict:
        raise ValueError(f"header is a JSON {type(body).__name__}, expected an object")
    metadata = body.pop("__metadata__", None)
    if metadata is not None and not (
        type(metadata) is dict and all(type(v) is str for v in metadata.values())
    ):
        raise ValueError("__metadata__ must map strings to strings")
    entries = [_header_entry(key, info) for key, info in body.items()]
    entries.sort(key=lambda entry: (entry[3], entry[4]))
    expected_begin = 0
    for key, _, _, begin, end in entries:
        if begin != expected_begin:
            raise ValueError(f"tensor {key!r} starts at data byte {begin}, expected {expected_begin} (gap or overlap)")
        expected_begin = end
    if expected_begin != data_bytes:
        raise ValueError(f"tensors cover {expected_begin} data bytes but the file holds {data_bytes} (truncated?)")
    return entries


def _header_entry(key: str, info: Any) -> tuple[str, torch.dtype, list[int], int, int]:
    if type(info) is not dict:
        raise ValueError(f"entry {key!r} is not an object")
    dtype = DTYPES_BY_NAME.get(info.get("dtype"))  # type: ignore[arg-type]
    if dtype is None:
        raise ValueError(f"tensor {key!r} has dtype {info.get('dtype')!r}; supported: {sorted(DTYPES_BY_NAME)}")
    shape, offsets = info.get("shape"), info.get("data_offsets")
    if type(shape) is not list or not all(type(n) is int and n >= 0 for n in shape):
        raise ValueError(f"tensor {key!r} has shape {shape!r}; expected a list of non-negative ints")
    if type(offsets) is not list or len(offsets) != 2 or not all(type(n) is int and n >= 0 for n in offsets):
        raise ValueError(f"tensor {key!r} has data_offsets {offsets!r}; expected [begin, end]")
    begin, end = offsets
    nbytes = math.prod(shape) * dtype.itemsize
    if end - begin != nbytes:
        raise ValueError(f"tensor {key!r} spans {end - begin} bytes but dtype and shape {shape} need {nbytes}")
    return key, dtype, shape, begin, end


def _uint8_tensor(data: bytes | memoryview | torch.Tensor, view: memoryview) -> torch.Tensor:
    if isinstance(data, torch.Tensor):
        return data.reshape(-1)
    if view.readonly:  # bytes: torch.frombuffer would warn about writes; copy once
        return torch.frombuffer(bytearray(view), dtype=torch.uint8)
    return torch.frombuffer(view, dtype=torch.uint8)


def _tensor_view(buffer: torch.Tensor, begin: int, end: int, dtype: torch.dtype, shape: list[int]) -> torch.Tensor:
    raw = buffer[begin:end]
    if end - begin < _VIEW_MIN_BYTES or (buffer.storage_offset() + begin) % dtype.itemsize:
        raw = raw.clone()  # small or unaligned: its own (64-byte aligned) memory, as torch.load gives
    return raw.view(dtype).reshape(shape)


def refuse_executable_formats(data: bytes | memoryview, path: str) -> None:
    """Raise :class:`UnsafeFileError` if ``data`` looks like a pickle or ``torch.save`` zip.

    Example:
        >>> refuse_executable_formats(b'{"a": 1}', "x.json") is None
        True
    """
    is_pickle = len(data) >= 2 and data[0] == 0x80 and 2 <= data[1] <= 5
    is_zip = data[:4] == b"PK\x03\x04"
    if not (is_pickle or is_zip):
        return
    kind = "a Python pickle" if is_pickle else "a zip archive (torch.save format, holds a pickle)"
    problem = (
        f"expected a torchckpt file, found {kind}. It was refused unread: loading a "
        "pickle can run arbitrary code. Fix: if you trust its origin, convert it once with "
        "torchckpt.state.import_torch_save (weights_only=True) or `torchckpt import`."
    )
    raise UnsafeFileError(f"{path}: {problem}", {path: problem})
