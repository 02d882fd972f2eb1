"""Shared storage written once: ties and views of one storage become one tensor entry plus references.

Rules kept here (named in ``docs/design.md``):

1. **[a storage is written once]** The tensors of one item that share a storage (tied weights: one
   tensor under two keys; views and slices of one buffer; a transposed or ``channels_last`` tensor) are
   written once. A tensor that is the same view as another (same dtype, offset, shape and strides) is a
   second tree entry naming the first one's key, and comes back as that same tensor (a format any
   torchckpt reads). Different views of one storage are written as the bytes they cover together, once,
   as one entry (the one tensor that covers them all exactly, when there is one), and every view is a
   ``view`` entry: that entry's key, byte offset, dtype, shape and strides; restore gives them one
   storage again. Views with gaps between them (they cover less than the span between their first and
   last byte, e.g. ``x[::100]``) are written as copies of their own bytes instead, so a step is never
   larger than the sum of its distinct tensors. So a step's tensor bytes are the unique bytes of the
   storages it holds: a tied GPT-2 small is 475 MiB, not 622 MiB.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from torchckpt.state.format.codec import SAFETENSORS_DTYPES, TREE_TAG

_Signature = tuple[torch.dtype, int, tuple[int, ...], tuple[int, ...]]


def write_once(tree: Any, tensors: Mapping[str, torch.Tensor]) -> tuple[Any, dict[str, torch.Tensor]]:
    """(tree, tensors to write) for an item whose tensors (from ``split_tensors(..., keep_layout=True)``) may
    share storages ([a storage is written once]); every tensor to write is contiguous, on its own device.

    Example:
        >>> from torchckpt.state.format.codec import join_tensors, split_tensors
        >>> weight = torch.ones(4, 2)
        >>> tree, tensors = split_tensors({"wte": weight, "lm_head": weight, "half": weight[2:]}, "model",
        ...                               keep_layout=True)
        >>> tree, written = write_once(tree, tensors)
        >>> sorted(written), written["wte"].shape
        (['wte'], torch.Size([4, 2]))
        >>> state = join_tensors(tree, written, "model.json")
        >>> state["lm_head"] is state["wte"], state["half"].untyped_storage().data_ptr() == weight.data_ptr()
        (True, True)
    """
    groups: dict[tuple[Any, int], list[str]] = {}
    alone: dict[str, torch.Tensor] = {}
    for key, tensor in tensors.items():
        if tensor.numel() == 0 or type(tensor) is not torch.Tensor:
            alone[key] = tensor.contiguous()  # nothing to share (or a subclass: written as it is)
        else:
            groups.setdefault((tensor.device, tensor.untyped_storage().data_ptr()), []).append(key)
    written: dict[str, torch.Tensor] = {}
    replacements: dict[str, dict[str, Any]] = {}
    for keys in groups.values():
        first = tensors[keys[0]]
        if len(keys) == 1 and first.is_contiguous():
            written[keys[0]] = first  # the common case: a tensor alone in its storage
        else:
            _write_group(keys, tensors, written, replacements)
    written.update(alone)
    return (replace_tensor_nodes(tree, replacements) if replacements else tree), written


def _write_group(keys: list[str], tensors: Mapping[str, torch.Tensor], written: dict[str, torch.Tensor],
                 replacements: dict[str, dict[str, Any]]) -> None:
    """Write the tensors of one storage once; ties and views become ``replacements`` of their tree entries."""
    distinct: dict[_Signature, str] = {}
    for key in keys:
        tensor = tensors[key]
        signature = (tensor.dtype, int(tensor.storage_offset()), tuple(tensor.shape), tuple(tensor.stride()))
        first = distinct.setdefault(signature, key)
        if first != key:
            replacements[key] = tensor_node(first)  # a tie: re-pointed below if its first becomes a view
    owners = list(distinct.values())
    spans = {key: _byte_span(tensors[key]) for key in owners}
    low = min(begin for begin, _ in spans.values())
    high = max(end for _, end in spans.values())
    dense = sum(_own_bytes(tensors[key]) for key in owners)
    if len(owners) == 1 and tensors[owners[0]].is_contiguous():
        written[owners[0]] = tensors[owners[0]]
        return
    if high - low > dense:  # gaps between the views: each its own copy (never more bytes than the tensors)
        for key in owners:
            written[key] = tensors[key].contiguous()
        return
    base = next((key for key in owners if tensors[key].is_contiguous() and spans[key] == (low, high)), None)
    if base is None:  # no tensor covers the span exactly: write its bytes as one uint8 entry
        base = _free_key(f"{owners[0]}@storage", tensors)
        storage = tensors[owners[0]].untyped_storage()
        written[base] = torch.empty(0, dtype=torch.uint8, device=tensors[owners[0]].device).set_(
            storage, low, (high - low,), (1,))
    else:
        written[base] = tensors[base]
    for key in owners:
        if key != base:
            replacements[key] = view_node(base, tensors[key], spans[key][0] - low)
    for key, node in list(replacements.items()):
        if key in tensors and node.get("key") in replacements and node.get("key") != base:
            replacements[key] = replacements[node["key"]]  # a tie of a view is that view


def _byte_span(tensor: torch.Tensor) -> tuple[int, int]:
    """(first byte, one past the last byte) of ``tensor`` in its storage."""
    itemsize = tensor.element_size()
    begin = int(tensor.storage_offset()) * itemsize
    last = sum((int(size) - 1) * stride for size, stride in zip(tensor.shape, tensor.stride()))
    return begin, begin + (last + 1) * itemsize


def _own_bytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


def _free_key(base: str, taken: Mapping[str, Any]) -> str:
    key, suffix = base, 0
    while key in taken:
        suffix += 1
        key = f"{base}#{suffix}"
    return key


def view_node(key: str, tensor: torch.Tensor, byte_offset: int) -> dict[str, Any]:
    """The tree entry of ``tensor`` stored as a view of entry ``key``'s bytes, from ``byte_offset`` on, with
    ``tensor``'s dtype, shape and strides (format/storages.py's [a storage is written once]).

    Example:
        >>> from torchckpt.state.format.codec import join_tensors
        >>> base = torch.arange(6.0)
        >>> node = view_node("base", base[2:].view(2, 2).t(), 8)
        >>> join_tensors(node, {"base": base}, "m.json")
        tensor([[2., 4.],
                [3., 5.]])
    """
    return {TREE_TAG: "view", "key": key, "dtype": SAFETENSORS_DTYPES[tensor.dtype], "offset": byte_offset,
            "shape": list(tensor.shape), "stride": list(tensor.stride())}


def tensor_node(key: str) -> dict[str, Any]:
    """The tree entry of a tensor stored whole under ``key`` (what :func:`split_tensors` writes; a tie is a
    second entry naming the same key).

    Example:
        >>> from torchckpt.state.format.codec import join_tensors
        >>> weight = torch.ones(2)
        >>> tied = join_tensors({"a": tensor_node("w"), "b": tensor_node("w")}, {"w": weight}, "m.json")
        >>> tied["a"] is tied["b"] is weight
        True
    """
    return {TREE_TAG: "tensor", "key": key}


_FLAGS = ("parameter", "requires_grad")


def replace_tensor_nodes(tree: Any, replacements: Mapping[str, dict[str, Any]]) -> Any:
    """``tree`` with each tensor entry whose key ``replacements`` names replaced by its new entry.

    Example:
        >>> replace_tensor_nodes([tensor_node("a"), tensor_node("b")], {"b": tensor_node("a")})
        [{'__torchckpt__': 'tensor', 'key': 'a'}, {'__torchckpt__': 'tensor', 'key': 'a'}]
    """
    if type(tree) is list:
        return [replace_tensor_nodes(value, replacements) for value in tree]
    if type(tree) is not dict:
        return tree
    if tree.get(TREE_TAG) == "tensor":  # a Parameter's flags (codec.py's tensor entry) stay with its new entry
        new = replacements.get(tree["key"])
        return tree if new is None else {**new, **{k: v for k, v in tree.items() if k in _FLAGS}}
    return {key: replace_tensor_nodes(value, replacements) for key, value in tree.items()}
