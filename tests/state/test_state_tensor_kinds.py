"""Values that are not plain dense tensors or JSON numbers (issue 29, items 3, 4, 7): sparse tensors round-trip
bitwise, quantized / nested / meta tensors are refused naming their path and a fix that this file applies,
Parameters and requires_grad come back as saved, Python ints of any size round-trip exactly."""

from __future__ import annotations

import glob
import json
import os

import pytest
import torch

from torchckpt.state import CheckpointCorruptError, Checkpointer, UnsupportedStateError
from torchckpt.state.format.codec import join_tensors, split_tensors
from torchckpt.state.format.layout import MANIFEST_NAME, step_dir_name
from torchckpt.state.format.tensor_kinds import sparse_parts


def _round_trip(run_dir: str, extras: dict) -> dict:
    with Checkpointer(run_dir) as ckpt:
        ckpt.save(1, extras=extras)
    restored: dict = {}
    with Checkpointer(run_dir) as ckpt:
        assert ckpt.restore(extras=restored) == 1
    return restored


def _format_version(run_dir: str, step: int = 1) -> int:
    with open(os.path.join(run_dir, step_dir_name(step), MANIFEST_NAME), "rb") as handle:
        return json.load(handle)["format_version"]


def _same_sparse(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Same layout, size and parts, bit for bit (a COO tensor's coalesced flag too)."""
    (fields_a, parts_a), (fields_b, parts_b) = sparse_parts(a), sparse_parts(b)
    return (fields_a == fields_b and parts_a.keys() == parts_b.keys()
            and all(parts_a[k].dtype == parts_b[k].dtype and torch.equal(parts_a[k].view(torch.uint8),
                                                                        parts_b[k].view(torch.uint8)) for k in parts_a)
            and (a.layout != torch.sparse_coo or a.is_coalesced() == b.is_coalesced()))


def test_sparse_tensors_of_every_layout_round_trip_bitwise(run_dir):
    torch.manual_seed(0)
    dense = torch.randn(4, 6) * (torch.rand(4, 6) > 0.6)
    uncoalesced = torch.sparse_coo_tensor(torch.tensor([[0, 0, 2], [1, 1, 3]]), torch.tensor([1.5, -2.0, 3.0]),
                                          (3, 4))  # a duplicate index, kept as held (not summed)
    extras = {"coo": dense.to_sparse().requires_grad_(), "raw": uncoalesced, "half": dense.half().to_sparse(),
              "nested": [{"csr": dense.to_sparse_csr()}, (dense.to_sparse_csc(),)],
              "bsr": dense.to_sparse_bsr((2, 2)), "bsc": dense.to_sparse_bsc((2, 3))}
    restored = _round_trip(run_dir, extras)
    pairs = [(restored["coo"], extras["coo"]), (restored["raw"], uncoalesced), (restored["half"], extras["half"]),
             (restored["nested"][0]["csr"], extras["nested"][0]["csr"]),
             (restored["nested"][1][0], extras["nested"][1][0]), (restored["bsr"], extras["bsr"]),
             (restored["bsc"], extras["bsc"])]
    for got, saved in pairs:
        assert _same_sparse(got, saved), (got, saved)
    assert not restored["raw"].is_coalesced() and restored["raw"]._values().tolist() == [1.5, -2.0, 3.0]
    assert restored["coo"].requires_grad and not restored["half"].requires_grad
    assert _format_version(run_dir) == 3  # tags an older torchckpt does not know: it refuses the step as newer


def test_a_sparse_buffer_of_a_module_restores_bitwise(run_dir):
    model = torch.nn.Linear(3, 3)
    model.register_buffer("mask", torch.eye(3).to_sparse())
    with Checkpointer(run_dir) as ckpt:
        ckpt.save(1, model=model)
    fresh = torch.nn.Linear(3, 3)
    fresh.register_buffer("mask", torch.zeros(3, 3).to_sparse())
    with Checkpointer(run_dir) as ckpt:
        ckpt.restore(model=fresh)
    assert torch.equal(fresh.weight, model.weight) and torch.equal(fresh.mask.to_dense(), torch.eye(3))


def test_a_crafted_sparse_index_out_of_range_is_corrupt_not_read():
    tree, tensors = split_tensors({"s": torch.eye(3).to_sparse()}, "extras")
    key = next(k for k in tensors if k.endswith("indices"))
    tensors[key] = torch.full_like(tensors[key], 99)  # beyond the size (3, 3)
    with pytest.raises(CheckpointCorruptError, match="malformed 'sparse' entry"):
        join_tensors(tree, tensors, "extras.json")


def _quantized_holder_state(q: torch.Tensor) -> dict:
    return {"int_repr": q.int_repr(), "scale": q.q_scale(), "zero_point": q.q_zero_point(), "dtype": q.dtype}


@pytest.mark.parametrize("kind", ["quantized", "nested", "meta", "complex"])
def test_unstorable_tensors_name_their_path_and_the_suggested_fix_works(run_dir, kind):
    base = torch.randn(5)
    values = {
        "quantized": torch.quantize_per_tensor(base, 0.1, 3, torch.qint8),
        "nested": torch.nested.nested_tensor([torch.randn(2), torch.randn(3)]),
        "meta": torch.empty(5, device="meta"),
        "complex": torch.randn(3, dtype=torch.complex64),
    }
    value = values[kind]
    with Checkpointer(run_dir) as ckpt, pytest.raises(UnsupportedStateError) as caught:
        ckpt.save(1, extras={"x": [0, 1, 2, value]})
    message = str(caught.value)
    assert "item 'extras': tensor at x.3" in message and "Fix:" in message
    assert not [n for n in os.listdir(run_dir) if n.startswith(("step-", ".tmp-"))]
    # the fix the message names, applied: the value comes back exactly
    if kind == "quantized":
        assert "int_repr()" in message and "_make_per_tensor_quantized_tensor" in message
        saved = _quantized_holder_state(value)
        back = _round_trip(run_dir, saved)
        rebuilt = torch._make_per_tensor_quantized_tensor(back["int_repr"], back["scale"], back["zero_point"])
        assert rebuilt.dtype == value.dtype and torch.equal(rebuilt.int_repr(), value.int_repr())
        assert rebuilt.q_scale() == value.q_scale() and rebuilt.q_zero_point() == value.q_zero_point()
    elif kind == "nested":
        assert "unbind()" in message
        back = _round_trip(run_dir, {"parts": list(value.unbind())})
        rebuilt = torch.nested.nested_tensor(back["parts"], layout=value.layout)
        assert all(torch.equal(a, b) for a, b in zip(rebuilt.unbind(), value.unbind()))
    elif kind == "meta":
        assert "to_empty(device='cpu')" in message
        model = torch.nn.Linear(2, 2, device="meta").to_empty(device="cpu")
        torch.nn.init.ones_(model.weight), torch.nn.init.zeros_(model.bias)
        back = _round_trip(run_dir, {"w": model.weight.detach()})
        assert torch.equal(back["w"], torch.ones(2, 2))
    else:
        assert "view_as_real" in message
        back = _round_trip(run_dir, {"c": torch.view_as_real(value)})
        assert torch.equal(torch.view_as_complex(back["c"]), value)


def test_parameters_and_requires_grad_keep_their_type_and_flag(run_dir):
    weight = torch.nn.Parameter(torch.randn(3))
    frozen = torch.nn.Parameter(torch.randn(2), requires_grad=False)
    leaf = torch.randn(4, dtype=torch.float64).requires_grad_()
    plain = torch.randn(2)
    extras = {"w": weight, "frozen": frozen, "nested": {"leaf": leaf, "list": [plain, weight * 1.0]}}
    restored = _round_trip(run_dir, extras)
    assert type(restored["w"]) is torch.nn.Parameter and restored["w"].requires_grad
    assert type(restored["frozen"]) is torch.nn.Parameter and not restored["frozen"].requires_grad
    got_leaf = restored["nested"]["leaf"]
    assert type(got_leaf) is torch.Tensor and got_leaf.requires_grad and got_leaf.is_leaf
    assert type(restored["nested"]["list"][0]) is torch.Tensor and not restored["nested"]["list"][0].requires_grad
    assert restored["nested"]["list"][1].requires_grad and restored["nested"]["list"][1].is_leaf  # saved detached
    for got, saved in [(restored["w"], weight), (got_leaf, leaf), (restored["frozen"], frozen)]:
        assert torch.equal(got.detach(), saved.detach()) and got.dtype == saved.dtype
    (restored["w"].sum() * 2 + got_leaf.sum()).backward()  # usable as leaves of a new graph
    assert torch.equal(restored["w"].grad, torch.full((3,), 2.0)) and torch.equal(got_leaf.grad, torch.ones(4,
                                                                                                dtype=torch.float64))
    assert _format_version(run_dir) == 3  # every unsharded step (format/storages.py); the flags add no version


def test_a_flat_dict_of_parameters_keeps_them(run_dir):
    params = {"a": torch.nn.Parameter(torch.ones(2)), "b": torch.nn.Parameter(torch.zeros(1))}
    restored = _round_trip(run_dir, params)
    assert all(type(restored[k]) is torch.nn.Parameter and torch.equal(restored[k], params[k]) for k in params)


def test_huge_python_ints_round_trip_exactly(run_dir):
    huge = 7 ** 20_000  # 16,902 digits: json refuses it
    with pytest.raises(ValueError, match="integer string conversion"):
        json.dumps(huge)
    extras = {"huge": huge, "negative": -huge - 1, "edge": 1 << 1000, "below": (1 << 1000) - 1, "small": 12,
              "nested": [(huge, {5: -(1 << 1000)})], "keys": {huge: torch.ones(1), -huge: "x"}}
    restored = _round_trip(run_dir, extras)
    assert restored.keys() == extras.keys() and type(restored["nested"][0]) is tuple
    assert torch.equal(restored["keys"][huge], torch.ones(1)) and restored["keys"][-huge] == "x"
    assert {k: v for k, v in restored.items() if k != "keys"} == {k: v for k, v in extras.items() if k != "keys"}
    assert _format_version(run_dir) == 3


def test_ints_json_holds_stay_json_numbers(run_dir):
    restored = _round_trip(run_dir, {"n": (1 << 1000) - 1, "m": -(1 << 999)})
    assert restored == {"n": (1 << 1000) - 1, "m": -(1 << 999)}
    written = [open(path).read() for path in glob.glob(os.path.join(run_dir, step_dir_name(1), "*.json"))]
    assert written and str((1 << 1000) - 1) in "".join(written) and '"int"' not in "".join(written)


def test_a_crafted_requires_grad_flag_on_an_integer_tensor_is_corrupt():
    tree = {"__torchckpt__": "tensor", "key": "a", "parameter": True, "requires_grad": True}
    with pytest.raises(CheckpointCorruptError, match="malformed 'tensor' entry.*can require gradients"):
        join_tensors(tree, {"a": torch.ones(2, dtype=torch.int64)}, "extras.json")


def test_a_tied_or_viewed_parameter_keeps_its_type_and_flag(run_dir):
    """Ties and views become references to one written storage (format/storages.py); the flags go with them."""
    weight = torch.nn.Parameter(torch.arange(8.0))
    restored = _round_trip(run_dir, {"a": weight, "tied": weight, "half": torch.nn.Parameter(weight.data[4:])})
    assert all(type(restored[k]) is torch.nn.Parameter and restored[k].requires_grad for k in ("a", "tied", "half"))
    assert torch.equal(restored["half"].detach(), torch.arange(4.0, 8.0))
    assert restored["a"].untyped_storage().data_ptr() == restored["tied"].untyped_storage().data_ptr()
