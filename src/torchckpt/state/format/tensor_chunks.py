"""A safetensors file as chunks to write: its header, then each tensor's own memory, small tensors joined.

Writing keeps format/codec.py's [zero copy both ways]: a tensor of 64 KiB or more is written from its own
memory; the bytes of smaller ones are joined (copied) into shared chunks of about 16 MiB, so many small
tensors cost one write and one hash task per chunk, not one each (100k tiny tensors: issue 29). Decoding
is codec.py's ``decode_safetensors``.
"""

from __future__ import annotations

import ctypes
import json
import sys
from collections.abc import Mapping
from typing import Any

import safetensors.torch
import torch

from torchckpt.state.format.codec import SAFETENSORS_DTYPES

# A save joins the bytes of tensors smaller than this into chunks of about _JOINED_CHUNK_BYTES (one write
# and one hash task each, not one per tensor); larger ones are written from their own memory.
_JOIN_BELOW_BYTES = 64 << 10
_JOINED_CHUNK_BYTES = 16 << 20


def safetensors_chunks(tensors: Mapping[str, torch.Tensor], *, join_small: bool = True) -> list[bytes | memoryview]:
    """A safetensors file of CPU contiguous tensors as chunks to write in order (codec.py's [zero copy both ways]).

    The first chunk is the 8-byte length plus the JSON header; every other chunk
    is a view of one tensor's memory, or (``join_small``) the bytes of many small
    tensors, copied now: the caller must not change the tensors until the chunks
    are written, and must pass ``join_small=False`` if their bytes are filled later.

    Example:
        >>> from torchckpt.state.format.codec import decode_safetensors
        >>> chunks = safetensors_chunks({"w": torch.ones(2)})
        >>> len(chunks), decode_safetensors(b"".join(chunks), "m.safetensors")["w"]
        (2, tensor([1., 1.]))
    """
    if sys.byteorder != "little":  # the format is little-endian; let the library swap bytes
        return [safetensors.torch.save({key: t.contiguous() for key, t in tensors.items()})]
    order = sorted(tensors, key=lambda key: (-tensors[key].element_size(), key))  # keeps data aligned
    header, _ = _safetensors_header(tensors, order)
    chunks: list[bytes | memoryview] = [len(header).to_bytes(8, "little") + header]
    small: list[bytes] = []  # small tensors' bytes, joined into one chunk: one write and one hash task for many
    small_bytes = 0
    for key in order:
        tensor = tensors[key]
        nbytes = tensor.numel() * tensor.element_size()
        if nbytes >= _JOIN_BELOW_BYTES or not join_small:
            if small:
                chunks.append(b"".join(small))
                small, small_bytes = [], 0
            chunks.append(_tensor_memory(key, tensor))
        elif nbytes:
            _check_host(key, tensor)
            small.append(ctypes.string_at(tensor.data_ptr(), nbytes))
            small_bytes += nbytes
            if small_bytes >= _JOINED_CHUNK_BYTES:
                chunks.append(b"".join(small))
                small, small_bytes = [], 0
    if small:
        chunks.append(b"".join(small))
    return chunks


def _check_host(key: str, tensor: torch.Tensor) -> None:
    if tensor.device.type != "cpu" or not tensor.is_contiguous():
        raise ValueError(
            f"tensor {key!r} is on {tensor.device}, contiguous={tensor.is_contiguous()}; expected a "
            "contiguous CPU tensor. Fix: pass tensor.cpu().contiguous() (snapshot.py does)."
        )


def _tensor_memory(key: str, tensor: torch.Tensor) -> memoryview:
    _check_host(key, tensor)
    return tensor.detach().reshape(-1).view(torch.uint8).numpy().data  # ndarray.data: a memoryview of its bytes


def encode_safetensors(tensors: Mapping[str, torch.Tensor]) -> bytes:
    """safetensors bytes of CPU contiguous tensors (the chunks of :func:`safetensors_chunks`, joined).

    For small files and tests; saves write the chunks without joining them.

    Example:
        >>> from torchckpt.state.format.codec import decode_safetensors
        >>> decode_safetensors(encode_safetensors({"w": torch.ones(2)}), "m.safetensors")["w"]
        tensor([1., 1.])
    """
    return b"".join(safetensors_chunks(tensors))


def _safetensors_header(tensors: Mapping[str, torch.Tensor], order: list[str]) -> tuple[bytes, int]:
    entries: dict[str, Any] = {}
    offset = 0
    for key in order:
        tensor = tensors[key]
        size = tensor.numel() * tensor.element_size()
        entries[key] = {"dtype": SAFETENSORS_DTYPES[tensor.dtype], "shape": list(tensor.shape),
                        "data_offsets": [offset, offset + size]}
        offset += size
    header = json.dumps(entries, separators=(",", ":")).encode("utf-8")
    return header + b" " * (-len(header) % 8), offset


