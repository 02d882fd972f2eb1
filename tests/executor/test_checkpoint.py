"""The executor against the uncheckpointed function: bitwise gradients, every calling convention, errors."""

from __future__ import annotations

import pytest
import torch

from torchckpt.executor import (
    Policy,
    RecomputationMismatchError,
    RematError,
    checkpoint,
    checkpoint_modules,
    checkpoint_sequential,
    recompute_checks,
    save_ops,
    tag,
)
from torchckpt.memory import MemoryMeter


def _block(width: int = 16, dropout: float = 0.25) -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(width, 2 * width), torch.nn.GELU(), torch.nn.Dropout(dropout),
                               torch.nn.Linear(2 * width, width))


def _grads(module: torch.nn.Module, *tensors: torch.Tensor) -> list[torch.Tensor]:
    grads = [p.grad.clone() for p in module.parameters()] + [t.grad.clone() for t in tensors if t.grad is not None]
    module.zero_grad(set_to_none=True)
    for t in tensors:
        t.grad = None
    return grads


def _assert_bitwise(a: list[torch.Tensor], b: list[torch.Tensor]) -> None:
    assert len(a) == len(b)
    for x, y in zip(a, b):
        assert torch.equal(x, y)


def test_dropout_gradients_bitwise_equal() -> None:
    block, x = _block(), torch.randn(8, 16, requires_grad=True)
    torch.manual_seed(1)
    block(x).square().sum().backward()
    expected = _grads(block, x)
    torch.manual_seed(1)
    checkpoint(block, x).square().sum().backward()
    _assert_bitwise(_grads(block, x), expected)


def test_kwargs_nested_structures_and_non_tensor_outputs() -> None:
    block = _block(dropout=0.0)

    def fn(inputs: dict, scale: float, *, shift: torch.Tensor) -> dict:
        a, (b,) = inputs["pair"]
        return {"out": block(a) * scale + b + shift, "note": "kept", "count": 3, "nothing": None}

    a, b, shift = (torch.randn(4, 16, requires_grad=True) for _ in range(3))
    plain = fn({"pair": (a, (b,))}, 0.5, shift=shift)
    plain["out"].sum().backward()
    expected = _grads(block, a, b, shift)
    result = checkpoint(fn, {"pair": (a, (b,))}, 0.5, shift=shift)
    assert (result["note"], result["count"], result["nothing"]) == ("kept", 3, None)
    result["out"].sum().backward()
    _assert_bitwise(_grads(block, a, b, shift), expected)


def test_frozen_inputs_still_give_parameter_gradients() -> None:
    """The LoRA / frozen-embedding case: no input requires grad, the parameters inside do."""
    embedding = torch.nn.Embedding(50, 16).requires_grad_(False)
    block = _block(dropout=0.0)
    tokens = torch.randint(0, 50, (4, 7))
    block(embedding(tokens)).sum().backward()
    expected = _grads(block)
    checkpoint(block, embedding(tokens)).sum().backward()
    _assert_bitwise(_grads(block), expected)


def test_nested_checkpoints_and_autograd_grad() -> None:
    inner, outer = _block(), _block()
    x = torch.randn(8, 16, requires_grad=True)

    def f(x: torch.Tensor) -> torch.Tensor:
        return outer(inner(x))

    def nested(x: torch.Tensor) -> torch.Tensor:
        return outer(checkpoint(inner, x, policy="dots_saveable"))

    torch.manual_seed(3)
    expected = torch.autograd.grad(f(x).sum(), [x, *inner.parameters(), *outer.parameters()])
    torch.manual_seed(3)
    result = torch.autograd.grad(checkpoint(nested, x).sum(), [x, *inner.parameters(), *outer.parameters()])
    _assert_bitwise(list(result), list(expected))


@pytest.mark.parametrize("inner_policy", ["plain", "nothing_saveable", "dots_saveable", "everything_saveable"])
def test_nested_region_holds_only_its_input(inner_policy: str) -> None:
    """checkpoint.py's [nested checkpoints keep nothing]: whatever the inner checkpoints keep, the enclosing region
    holds only its own input."""
    torch.manual_seed(0)
    blocks = [_block(width=64, dropout=0.1) for _ in range(3)]
    x = torch.randn(256, 64, requires_grad=True)

    def region(h: torch.Tensor) -> torch.Tensor:
        for block in blocks:
            h = block(h) if inner_policy == "plain" else checkpoint(block, h, policy=inner_policy)
        return h

    torch.manual_seed(1)
    region(x).sum().backward()
    expected = [g for b in blocks for g in _grads(b)] + [x.grad.clone()]
    x.grad = None
    torch.manual_seed(1)
    with MemoryMeter(include_existing=False) as meter:
        out = checkpoint(region, x)
        assert meter.current_bytes == out.untyped_storage().nbytes()  # nothing but the output is new
        out.sum().backward()
    _assert_bitwise([g for b in blocks for g in _grads(b)] + [x.grad.clone()], expected)


def test_checkpoint_holds_only_its_inputs_until_backward() -> None:
    block, x = _block(width=64), torch.randn(128, 64, requires_grad=True)
    with MemoryMeter(include_existing=False) as meter:
        out = checkpoint(block, x)
        assert meter.current_bytes == out.numel() * 4  # the output; no activation is kept
        out.sum().backward()


def test_kept_value_modified_in_place_is_recomputed() -> None:
    linear = torch.nn.Linear(8, 8)
    x = torch.randn(4, 8, requires_grad=True)

    def fn(x: torch.Tensor) -> torch.Tensor:
        h = linear(x)          # kept by dots_saveable ...
        h.mul_(2.0)            # ... then changed in place: the cache must not serve the old value
        return torch.tanh(h)

    fn(x).sum().backward()
    expected = _grads(linear, x)
    checkpoint(fn, x, policy="dots_saveable").sum().backward()
    _assert_bitwise(_grads(linear, x), expected)


def test_retain_graph_second_backward_recomputes_served_values() -> None:
    """checkpoint.py's [kept outputs are handed over once]: a second backward recomputes them, same gradients."""
    block, x = _block(dropout=0.3), torch.randn(8, 16, requires_grad=True)
    torch.manual_seed(2)
    out = checkpoint(block, x, policy="dots_saveable")
    out.sum().backward(retain_graph=True)
    first = _grads(block, x)
    out.sum().backward()
    _assert_bitwise(_grads(block, x), first)


@pytest.mark.parametrize("segments", [1, 2, 3, 6])
def test_checkpoint_sequential_matches_plain(segments: int) -> None:
    torch.manual_seed(0)
    chain = torch.nn.Sequential(*[torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Dropout(0.2), torch.nn.Tanh())
                                  for _ in range(6)])
    x = torch.randn(4, 8, requires_grad=True)
    torch.manual_seed(5)
    chain(x).sum().backward()
    expected = _grads(chain, x)
    torch.manual_seed(5)
    checkpoint_sequential(chain, segments, x, policy="dots_saveable").sum().backward()
    _assert_bitwise(_grads(chain, x), expected)


def test_checkpoint_modules_is_removable_and_keeps_state_dict() -> None:
    block = _block()
    keys, params = list(block.state_dict()), list(block.parameters())
    handle = checkpoint_modules(block, policy="nothing_saveable")
    assert list(block.state_dict()) == keys and all(a is b for a, b in zip(block.parameters(), params))
    with pytest.raises(ValueError, match="already has an instance-level forward"):
        checkpoint_modules([block[0]])
    handle.remove()
    handle.remove()  # idempotent
    assert all("forward" not in vars(m) for m in block.modules())


def test_no_grad_runs_plainly() -> None:
    block = _block()
    with torch.no_grad():
        assert not checkpoint(block, torch.randn(2, 16)).requires_grad


# ------------------------------------------------------------------------------------------ errors
def test_use_reentrant_is_refused_with_the_reason() -> None:
    with pytest.raises(ValueError, match=r"use_reentrant=True\) is not supported: the reentrant variant drops "
                                         r"parameter gradients when no input requires grad"):
        checkpoint(_block(), torch.randn(2, 16), use_reentrant=True)


def test_unknown_policy_name_lists_valid_names() -> None:
    with pytest.raises(ValueError, match=r"unknown policy 'dots_savable'; valid names: dots_saveable, "
                                         r"dots_with_no_batch_dims_saveable, everything_saveable, nothing_saveable"):
        checkpoint(_block(), torch.randn(2, 16), policy="dots_savable")


def test_recomputation_with_different_shape_names_op_tensor_and_cause() -> None:
    settings = {"repeat": 2}
    x = torch.randn(3, 4, requires_grad=True)
    out = checkpoint(lambda x: x.repeat(1, settings["repeat"]).sin(), x, debug=True)
    settings["repeat"] = 3
    with pytest.raises(RecomputationMismatchError,
                       match=r"output 0 of op #0 \(aten.repeat\) had shape \(3, 8\) dtype torch.float32 in the forward "
                             r"pass and shape \(3, 12\) dtype torch.float32 in recomputation. Likely cause: "
                             r"nondeterminism or global state"):
        out.sum().backward()


def test_recomputation_with_different_dtype_is_reported() -> None:
    settings = {"dtype": torch.float64}
    x = torch.randn(3, 4, requires_grad=True)
    with recompute_checks():  # the context does what debug=True does
        out = checkpoint(lambda x: x.to(settings["dtype"]).sin().float(), x)
    settings["dtype"] = torch.bfloat16
    with pytest.raises(RecomputationMismatchError, match=r"dtype torch.float64 in the forward pass and shape "
                                                         r"\(3, 4\) dtype torch.bfloat16 in recomputation"):
        out.sum().backward()


def test_recomputation_running_other_ops_is_reported() -> None:
    settings = {"branch": True}
    x = torch.randn(3, 4, requires_grad=True)
    out = checkpoint(lambda x: (x.sin() if settings["branch"] else x.cos()).exp(), x, debug=True)
    settings["branch"] = False
    with pytest.raises(RecomputationMismatchError, match=r"diverged from its forward pass at op #0: the forward pass "
                                                         r"ran aten.sin, recomputation ran aten.cos"):
        out.sum().backward()
    assert issubclass(RecomputationMismatchError, RematError)


def test_without_checks_a_region_that_keeps_nothing_runs_no_mode_of_ours_and_torch_still_checks() -> None:
    """checkpoint.py's [a region that keeps nothing runs on torch's checkpoint alone]: no op is recorded in the forward
    pass (a policy that is never asked), and a recomputation of a different shape is still refused, by
    torch's own determinism check."""
    asked: list[str] = []
    counting = Policy("counting", lambda op: asked.append(op.name) or False)
    x = torch.randn(3, 4, requires_grad=True)
    checkpoint(torch.sin, x, policy=counting).sum().backward()
    assert asked == ["aten.sin"]  # a policy that may keep something is asked: recorded path
    asked.clear()
    checkpoint(torch.sin, x, policy=save_ops([])).sum().backward()
    checkpoint(torch.sin, x).sum().backward()
    assert asked == [] and save_ops([]).keeps_nothing and not save_ops([0]).keeps_nothing
    settings = {"repeat": 2}
    out = checkpoint(lambda x: x.repeat(1, settings["repeat"]).sin(), x)
    settings["repeat"] = 3
    with pytest.raises(torch.utils.checkpoint.CheckpointError, match="metadata"):
        out.sum().backward()
    with pytest.raises(TypeError, match="debug"):
        checkpoint(torch.sin, x, debug="yes")  # type: ignore[arg-type]


def test_bad_arguments() -> None:
    with pytest.raises(TypeError, match="fn must be callable"):
        checkpoint(3, torch.ones(1))  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"segments must be an int from 1 to the number of functions \(2\); got 5"):
        checkpoint_sequential([torch.sin, torch.cos], 5, torch.ones(1))
    with pytest.raises(TypeError, match="policy must be a name"):
        checkpoint(torch.sin, torch.ones(1, requires_grad=True), policy=3)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="name must be a non-empty str"):
        tag(torch.ones(1), "")


def test_tag_is_identity_outside_a_region_and_a_view_inside() -> None:
    x = torch.randn(3, requires_grad=True)
    assert tag(x, "a") is x
    seen = []

    def fn(x: torch.Tensor) -> torch.Tensor:
        y = tag(x * 2, "double")
        seen.append(y._base is not None)
        return y.sin()

    checkpoint(fn, x).sum().backward()
    assert seen == [True, True]  # forward and recomputation both see a view, never a copy


def test_random_ops_are_never_kept_so_later_random_ops_match() -> None:
    """A policy asking to keep rand_like's output must not make recomputation skip the RNG draw."""
    x = torch.randn(4, 8, requires_grad=True)

    def fn(x: torch.Tensor) -> torch.Tensor:
        return (x * torch.rand_like(x) * torch.rand_like(x)).sin()

    torch.manual_seed(4)
    fn(x).sum().backward()
    expected = x.grad.clone()
    x.grad = None
    torch.manual_seed(4)
    checkpoint(fn, x, policy=lambda op: True).sum().backward()
    assert torch.equal(x.grad, expected)


def test_kept_output_modified_after_the_region_is_recomputed_not_served() -> None:
    x, weight = torch.randn(3, 4), torch.randn(4, 4, requires_grad=True)

    def fn(x: torch.Tensor, weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        z = x @ weight
        return z, z.sin()

    _, plain = fn(x, weight)
    plain.sum().backward()
    expected = weight.grad.clone()
    weight.grad = None
    z, out = checkpoint(fn, x, weight, policy="dots_saveable")
    with torch.no_grad():
        z.add_(1.0)  # the caller changes a value the policy kept
    out.sum().backward()
    assert torch.equal(weight.grad, expected)
