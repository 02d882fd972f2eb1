"""The loss head as a plan option: find the LM head, measure it chunked (``executor/loss_head.py``).

**[the head is found, then proven]** The candidate is what ``model.get_output_embeddings()`` returns (Hugging
Face models) when it is an ``nn.Linear`` outside the blocks; else the last ``nn.Linear`` outside the blocks
(in ``named_modules`` order) that maps to more features than it reads. It is used only if one measured step
with it chunked proves it: the loop's loss was computed in chunks exactly once and nothing read the logits
whole (the loop's accuracy, a softcap, logging). Otherwise the costs say why (``loss_head["note"]``) and no
plan chunks it.

**[the chunked head is measured]** That step runs with every block checkpointed (keeping nothing; their pieces
nested too when the profile measures those, in the same step) and the head chunked, under the meter.
``loss_head["head_bytes"]`` is its peak between the last block's forward and the first block's backward above
``fixed`` and what the checkpointed blocks hold (costs.py's [forward-end peak]), or, if larger, the plain
``head_bytes`` less what chunking saved against the profile's own step with every block checkpointed.
``loss_head["extra_time_s"]`` is what the chunked head adds to a step: one more bare step, with the head in
chunks and no block checkpointed, less the profile's bare plain step; at least the head's logits and log-softmax
once more, timed bare on a tensor of the head input's shape (the least of three), the part timing noise cannot
hide. (The second figure alone predicted an HF Llama's 32k-vocabulary head at 0.92 s a step on this project's
CPU; it measured 1.74 s, as its chunks' smaller products and the weight gradient summed chunk by chunk cost
more than the plain head's, and plans chose it where checkpointing every block was faster.)
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator, Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from torchckpt.executor.loss_head import ChunkedHeadHandle, default_chunk_tokens
from torchckpt.planner.probe import Probe

__all__ = ["check_loss_head_arg", "chunked_for_profiling", "find_loss_head", "loss_head_entry"]


def check_loss_head_arg(model: nn.Module, loss_head: object) -> None:
    """Refuse a ``loss_head=`` argument that is not True, False or the path of an ``nn.Linear`` of ``model``.

    Example:
        >>> check_loss_head_arg(nn.Sequential(nn.Linear(2, 8)), "0")
        >>> try:
        ...     check_loss_head_arg(nn.Sequential(nn.Linear(2, 8)), "head")
        ... except ValueError as error:
        ...     print(str(error)[:55])
        loss_head='head': the model has no module at that path
    """
    if isinstance(loss_head, bool):
        return
    if not isinstance(loss_head, str):
        raise TypeError(f"loss_head must be True (find the LM head), False (leave it whole) or the module path of the "
                        f"LM head (an nn.Linear); got {loss_head!r}")
    try:
        found = model.get_submodule(loss_head)
    except AttributeError:
        raise ValueError(f"loss_head={loss_head!r}: the model has no module at that path (pass the LM head's path, "
                         f"as model.named_modules() lists it, or True to find it)") from None
    if not isinstance(found, nn.Linear):
        raise ValueError(f"loss_head={loss_head!r}: that module is a {type(found).__name__}, not an nn.Linear (the LM "
                         "head); pass the LM head's path, True to find it or False")


def find_loss_head(model: nn.Module, blocks: Sequence[nn.Module]) -> tuple[str | None, str]:
    """The path of the LM head candidate (module docstring's [the head is found, then proven]) and a note.

    Example:
        >>> from torchckpt.models import gpt
        >>> model = gpt("tiny")
        >>> find_loss_head(model, list(model.blocks))
        ('head', 'candidate: head (Linear 64 -> 256)')
    """
    inside = {id(module) for block in blocks for module in block.modules()}
    paths = {id(module): path for path, module in model.named_modules()}
    getter = getattr(model, "get_output_embeddings", None)
    chosen: nn.Module | None = None
    if callable(getter):
        try:
            found = getter()
        except Exception:  # noqa: BLE001 - a model's own getter may raise (not implemented); fall back
            found = None
        if isinstance(found, nn.Linear) and id(found) not in inside and id(found) in paths:
            chosen = found
    if chosen is None:
        linears = [m for m in model.modules() if isinstance(m, nn.Linear) and id(m) not in inside
                   and m.out_features > m.in_features]
        chosen = linears[-1] if linears else None
    if chosen is None:
        return None, "no: no nn.Linear outside the blocks maps to more features than it reads (no LM head found)"
    assert isinstance(chosen, nn.Linear)
    path = paths[id(chosen)]
    return path, f"candidate: {path} (Linear {chosen.in_features} -> {chosen.out_features})"


@contextlib.contextmanager
def chunked_for_profiling(head: nn.Module) -> Iterator[tuple[ChunkedHeadHandle, list[torch.Size]]]:
    """While the block runs, ``head`` (an ``nn.Linear`` without an instance-level forward) computes its loss in
    chunks; yields its handle and the shapes of the inputs it was called with.

    Example:
        >>> head = nn.Linear(4, 32)
        >>> with chunked_for_profiling(head) as (handle, shapes):
        ...     _ = F.cross_entropy(head(torch.randn(3, 4)), torch.tensor([1, 2, 3]))
        >>> handle.chunked_losses, shapes, "forward" in vars(head)
        (1, [torch.Size([3, 4])], False)
    """
    handle = ChunkedHeadHandle(head=head, chunk_tokens=None)
    shapes: list[torch.Size] = []
    forward = handle.forward

    def recording(hidden: torch.Tensor) -> torch.Tensor:
        if isinstance(hidden, torch.Tensor):
            shapes.append(hidden.shape)
        return forward(hidden)

    head.forward = recording
    try:
        yield handle, shapes
    finally:
        del head.forward


def loss_head_entry(path: str, head: nn.Linear, handle: ChunkedHeadHandle, shapes: list[torch.Size], probe: Probe, *,
                    held_checkpointed: int, plain_head: int, every_block: Probe) -> dict[str, Any]:
    """The ``CostModel.loss_head`` entry from a measured step with every block checkpointed and the head chunked
    (module docstring's [the chunked head is measured]), or ``{"note": why}`` when the step does not prove the
    head (its loss was not computed in chunks, or the logits were read).

    ``held_checkpointed`` is what the checkpointed blocks held in that step (cost model bytes); ``plain_head``
    the cost model's ``head_bytes``; ``every_block`` the profile's step with every block checkpointed.
    """
    if handle.materialized:
        readers = ", ".join(sorted(set(handle.materialized)))
        return {"note": f"no: the step read the logits of {path} whole ({readers}), "
                        "so they cannot be computed in chunks"}
    if handle.chunked_losses != 1 or len(shapes) != 1:
        return {"note": f"no: {path}'s output did not reach exactly one F.cross_entropy in the step "
                        f"({handle.chunked_losses} chunked losses, {len(shapes)} calls)"}
    chunked_fixed = probe.traces[0].before_forward - probe.traces[0].input_bytes
    measured = probe.head_peak - chunked_fixed - held_checkpointed
    saved = every_block.head_peak - (every_block.traces[0].before_forward - every_block.traces[0].input_bytes) \
        - (probe.head_peak - chunked_fixed)
    head_bytes = max(0, measured, plain_head - saved)
    tokens = int(torch.Size(shapes[0][:-1]).numel())
    chunk = default_chunk_tokens(tokens, head.in_features, head.out_features)
    return {"path": path, "chunk_tokens": chunk, "head_bytes": int(head_bytes),
            "extra_time_s": _recompute_time(head, tokens, chunk)}


def _recompute_time(head: nn.Linear, tokens: int, chunk: int) -> float:
    """Seconds the chunked backward pass spends computing the logits again (least of three, bare)."""
    weight = head.weight.detach()
    rows = torch.randn(min(tokens, chunk), head.in_features, dtype=weight.dtype, device=weight.device)
    bias = head.bias.detach() if head.bias is not None else None
    best = float("inf")
    with torch.no_grad():
        for _ in range(3):
            start = time.perf_counter()
            for begin in range(0, tokens, chunk):
                stop = min(tokens, begin + chunk)
                torch.log_softmax(F.linear(rows[: stop - begin], weight, bias).float(), 1)
            if weight.is_cuda:
                torch.cuda.synchronize(weight.device)
            best = min(best, time.perf_counter() - start)
    return best
