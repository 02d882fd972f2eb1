"""Tensors that are not plain dense ones: sparse layouts stored as their parts, the others refused with a fix.

Rules kept here (named in ``docs/design.md``):

1. **[sparse tensors are stored as their parts]** A sparse tensor (COO, CSR, CSC, BSR, BSC) is stored
   as its index and value tensors plus its size and layout, exactly as they are held (a COO tensor
   is not coalesced on the way), and rebuilt bitwise. Such a step, and one holding a Python int too
   large for JSON, uses tags an older torchckpt does not know, so its manifest says format 3
   (:func:`needs_format_3`; manifest.py's ``TAGGED_FORMAT_VERSION``): an older torchckpt refuses it
   as newer instead of reading it wrong. A step without them keeps format 1 or 2.
2. **[an unstorable tensor names its fix]** A quantized, nested or meta tensor, or a dtype
   safetensors cannot hold, is an :class:`UnsupportedStateError` naming the item, the path inside
   it and a conversion that round-trips (tests/state/test_state_tensor_kinds.py applies each fix).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch

FORMAT_3_TAGS = ("int", "sparse")  # value tags an older torchckpt (formats 1 and 2) does not know
_MARKERS = tuple(f'"__torchckpt__":"{tag}"'.encode() for tag in FORMAT_3_TAGS)

_SPARSE_LAYOUTS: dict[torch.layout, str] = {
    torch.sparse_coo: "sparse_coo", torch.sparse_csr: "sparse_csr", torch.sparse_csc: "sparse_csc",
    torch.sparse_bsr: "sparse_bsr", torch.sparse_bsc: "sparse_bsc",
}
_LAYOUTS_BY_NAME = {name: layout for layout, name in _SPARSE_LAYOUTS.items()}
_ROW_MAJOR = (torch.sparse_csr, torch.sparse_bsr)


def needs_format_3(files: Mapping[str, Sequence[bytes | memoryview]]) -> bool:
    """Whether the JSON files of a step hold a tag of :data:`FORMAT_3_TAGS` ([sparse tensors are stored as their
    parts]). A tag is a JSON key ``"__torchckpt__"`` at the start of an object; a user string holding that text is
    escaped (``\\"``), and a user key of that name is stored as a pair list, so neither matches.

    Example:
        >>> needs_format_3({"state.json": [b'{"a":1}']}), needs_format_3({"x.json": [b'{"__torchckpt__":"int"}']})
        (False, True)
    """
    return any(marker in bytes(chunk) for name, chunks in files.items() if name.endswith(".json")
               for chunk in chunks for marker in _MARKERS)


def is_sparse(value: torch.Tensor) -> bool:
    """Whether ``value`` has a sparse layout stored as parts ([sparse tensors are stored as their parts]).

    Example:
        >>> is_sparse(torch.eye(2).to_sparse()), is_sparse(torch.eye(2))
        (True, False)
    """
    return value.layout in _SPARSE_LAYOUTS


def sparse_parts(value: torch.Tensor) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """(fields, parts) of a sparse tensor: its layout, size and flags, and its index and value tensors as it holds
    them.

    Example:
        >>> fields, parts = sparse_parts(torch.eye(2).to_sparse())
        >>> fields["layout"], fields["size"], sorted(parts)
        ('sparse_coo', [2, 2], ['indices', 'values'])
    """
    fields = {"layout": _SPARSE_LAYOUTS[value.layout], "size": list(value.shape), "requires_grad": value.requires_grad,
              "coalesced": value.layout == torch.sparse_coo and value.is_coalesced()}
    value = value.detach()
    if value.layout == torch.sparse_coo:
        return fields, {"indices": value._indices(), "values": value._values()}
    if value.layout in _ROW_MAJOR:
        compressed, plain = value.crow_indices(), value.col_indices()
    else:
        compressed, plain = value.ccol_indices(), value.row_indices()
    return fields, {"compressed": compressed, "plain": plain, "values": value.values()}


def sparse_from_parts(fields: Mapping[str, Any], parts: Mapping[str, torch.Tensor]) -> torch.Tensor:
    """The sparse tensor :func:`sparse_parts` took apart (raises ValueError/KeyError for a malformed entry).

    Example:
        >>> dense = torch.eye(2); fields, parts = sparse_parts(dense.to_sparse())
        >>> torch.equal(sparse_from_parts(fields, parts).to_dense(), dense)
        True
    """
    kind, size = _LAYOUTS_BY_NAME[fields["layout"]], fields["size"]
    try:  # the invariants are checked: a crafted file's out-of-range index is refused, never read out of bounds
        if kind == torch.sparse_coo:
            rebuilt = torch.sparse_coo_tensor(parts["indices"], parts["values"], size,
                                              is_coalesced=fields["coalesced"] is True, check_invariants=True)
        else:
            rebuilt = torch.sparse_compressed_tensor(parts["compressed"], parts["plain"], parts["values"], size,
                                                     layout=kind, check_invariants=True)
    except RuntimeError as error:
        raise ValueError(f"not a valid {fields['layout']} tensor ({error})") from None
    return rebuilt.requires_grad_() if fields.get("requires_grad") is True else rebuilt


def unstorable_problem(value: torch.Tensor) -> str | None:
    """What keeps a non-sparse ``value`` out of a safetensors file, with a fix that round-trips, or None
    ([an unstorable tensor names its fix]).

    Example:
        >>> unstorable_problem(torch.ones(1)) is None, unstorable_problem(torch.ones(1, device="meta"))[:21]
        (True, 'is on the meta device')
    """
    if value.is_quantized:
        return (f"is quantized ({value.qscheme()}), which safetensors cannot store. Fix: in state_dict() store "
                "tensor.int_repr() with q_scale() and q_zero_point() (per channel: q_per_channel_scales(), "
                "q_per_channel_zero_points(), q_per_channel_axis()), and in load_state_dict() rebuild it with "
                "torch._make_per_tensor_quantized_tensor (or _make_per_channel_quantized_tensor); "
                "or store tensor.dequantize() if the quantization may be redone")
    if value.is_nested:
        return ("is a nested tensor, which safetensors cannot store. Fix: in state_dict() store list(tensor.unbind()) "
                "and in load_state_dict() rebuild it with torch.nested.nested_tensor(parts, layout=tensor.layout)")
    if value.device.type == "meta":
        return ("is on the meta device: it holds no memory (a save has nothing to write, a restore into it would "
                "change nothing). Fix: materialise it first (module.to_empty(device='cpu'), then initialise it or "
                "restore into it), or leave it out of the state")
    if value.layout != torch.strided:
        return f"has layout {value.layout}, which torchckpt cannot store. Fix: store tensor.to_dense()"
    return None
