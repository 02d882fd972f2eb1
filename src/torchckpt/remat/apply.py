"""Wrap modules of an unmodified model in checkpoints, in place and removably.

Rules:

1. Wrapping sets an instance attribute ``forward`` on each module; nothing else changes, so
   ``state_dict`` keys, parameter identity and hooks are untouched (DESIGN invariant 5).
2. ``remove()`` deletes exactly the attributes it set and is idempotent; a module cannot be wrapped
   twice (the second wrap would checkpoint inside a checkpoint by accident).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable
from typing import Any

from torch import nn

from torchckpt.remat.checkpoint import checkpoint
from torchckpt.remat.plan import Plan
from torchckpt.remat.policies import PolicyLike, resolve_policy, save_ops

__all__ = ["CheckpointHandle", "checkpoint_modules", "apply_plan"]

_MARK = "_torchckpt_wrapped"


class CheckpointHandle:
    """Undo handle returned by :func:`checkpoint_modules`; ``remove()`` restores the original forwards."""

    def __init__(self, modules: list[nn.Module]) -> None:
        self._modules = modules

    @property
    def modules(self) -> list[nn.Module]:
        """The modules currently wrapped by this handle."""
        return list(self._modules)

    def remove(self) -> None:
        """Restore every wrapped module's own ``forward``.

        Example:
            >>> layer = nn.Linear(2, 2)
            >>> handle = checkpoint_modules([layer])
            >>> handle.remove()
            >>> "forward" in vars(layer)
            False
        """
        for module in self._modules:
            if getattr(module, _MARK, False):
                del module.forward
                delattr(module, _MARK)
        self._modules = []

    def __enter__(self) -> CheckpointHandle:
        return self

    def __exit__(self, *exc_info: Any) -> None:
        self.remove()


def _wrap(module: nn.Module, forward: Any, wrapped: list[nn.Module]) -> None:
    if not isinstance(module, nn.Module):
        CheckpointHandle(wrapped).remove()
        raise TypeError(f"expected nn.Module items; got {type(module).__name__}")
    if getattr(module, _MARK, False) or "forward" in vars(module):
        CheckpointHandle(wrapped).remove()
        raise ValueError(f"{type(module).__name__} already has an instance-level forward "
                         "(wrapped already?); call remove() on the earlier handle first")
    module.forward = forward
    setattr(module, _MARK, True)
    wrapped.append(module)


def checkpoint_modules(modules: Iterable[nn.Module], policy: PolicyLike = None,
                       preserve_rng_state: bool = True) -> CheckpointHandle:
    """Checkpoint every call of each module with ``policy``; returns a handle to undo it.

    Example:
        >>> from torchckpt.models import gpt
        >>> model = gpt("tiny")
        >>> with checkpoint_modules(model.blocks, policy="dots_saveable"):
        ...     loss = model(*model.example_batch(batch_size=2, seq_len=8))
        ...     loss.backward()
    """
    resolved = resolve_policy(policy)
    wrapped: list[nn.Module] = []
    for module in modules:
        if not isinstance(module, nn.Module):
            CheckpointHandle(wrapped).remove()
            raise TypeError(f"checkpoint_modules: expected nn.Module items; got {type(module).__name__}")
        _wrap(module, functools.partial(checkpoint, module.forward, policy=resolved,
                                        preserve_rng_state=preserve_rng_state), wrapped)
    return CheckpointHandle(wrapped)


# --------------------------------------------------------------------------------------------- plans
def apply_plan(model: nn.Module, plan: Plan) -> CheckpointHandle:
    """Realise ``plan`` on ``model`` in place (rules 1-2 above); returns the handle that undoes it.

    Single blocks are wrapped in a checkpoint that keeps the plan's ops (``save_ops``). A region of
    blocks ``a..b-1`` runs, from block ``a``'s forward, all of its blocks inside one checkpoint (the
    inner plan applied inside), and blocks ``a+1..b-1`` pass their input through. This needs the model
    to call its blocks as a chain (each block's first argument is the previous block's output, the
    other arguments are shared), which the profiler checks before a plan with regions is made.

    Example:
        >>> import torchckpt
        >>> from torchckpt.models import gpt
        >>> model = gpt("tiny", dropout=0.0)
        >>> batch = model.example_batch(batch_size=2, seq_len=16)
        >>> plan = torchckpt.plan(model, batch, budget="100%")
        >>> handle = apply_plan(model, plan)
        >>> handle.remove()
    """
    plan.check_fits(model)
    blocks = [model.get_submodule(path) for path in plan.block_paths]
    wrapped: list[nn.Module] = []
    for piece in plan.schedule:
        if "region" in piece:
            _wrap_region(piece, blocks, wrapped)
        elif not piece["plain"]:
            block = blocks[piece["block"]]
            policy = save_ops(piece.get("keep", ()), name=f"plan:{plan.block_paths[piece['block']]}")
            _wrap(block, functools.partial(checkpoint, block.forward, policy=policy), wrapped)
    return CheckpointHandle(wrapped)


def _hidden(output: Any) -> Any:
    """The hidden state a block passes on: the output itself, or its first item when it is a tuple."""
    return output[0] if isinstance(output, tuple) and output else output


def _run_pieces(pieces: list[dict], forwards: list[Callable], args: tuple, kwargs: dict) -> Any:
    """Run ``pieces`` as a chain from ``args``; nested pieces are checkpointed (rule 6 of the executor)."""
    output: Any = None
    for piece in pieces:
        if "region" in piece:
            output = checkpoint(_run_pieces, piece["inner"], forwards, args, kwargs)
        elif piece["plain"]:
            output = forwards[piece["block"]](*args, **kwargs)
        else:
            output = checkpoint(forwards[piece["block"]], *args, **kwargs)
        args = (_hidden(output), *args[1:])
    return output


def _wrap_region(piece: dict, blocks: list[nn.Module], wrapped: list[nn.Module]) -> None:
    start, stop = piece["region"]
    forwards = {index: blocks[index].forward for index in range(start, stop)}
    forwards_list: list[Callable] = [forwards.get(i) for i in range(len(blocks))]  # type: ignore[misc]
    # What pass-through blocks must return besides the hidden state: the region output's other tuple
    # items. Only those are kept (not the output itself, which would hold the region's graph), and the
    # last pass-through block drops them.
    shape_of_output: dict[str, Any] = {}

    def region_forward(*args: Any, **kwargs: Any) -> Any:
        if not args:
            raise TypeError(f"a checkpointed region starting at block {start} needs the hidden state as the first "
                            "positional argument; this model passes it by keyword, so plan without regions")
        output = checkpoint(_run_pieces, piece["inner"], forwards_list, args, kwargs)
        shape_of_output["rest"] = tuple(output[1:]) if isinstance(output, tuple) else None
        return output

    def pass_through(*args: Any, last: bool = False, **kwargs: Any) -> Any:
        rest = shape_of_output.pop("rest", None) if last else shape_of_output.get("rest")
        return args[0] if rest is None else (args[0], *rest)

    _wrap(blocks[start], region_forward, wrapped)
    for index in range(start + 1, stop):
        _wrap(blocks[index], functools.partial(pass_through, last=index == stop - 1), wrapped)
