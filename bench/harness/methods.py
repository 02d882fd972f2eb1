"""The methods compared, each applied in place to a freshly built model inside its own worker process.

Each peer is implemented with the peer's own mechanism, not torchckpt's, except where torchckpt *is*
the mechanism (JAX-style ``dots_saveable``):

1. ``none``: plain autograd.
2. ``every_block``: ``torch.utils.checkpoint.checkpoint(block, use_reentrant=False)`` around every block,
   which is what HF's ``gradient_checkpointing_enable()`` does.
3. ``sequential``: ``torch.utils.checkpoint.checkpoint_sequential`` with round(sqrt(L)) segments over the
   blocks; only for models whose blocks form a plain chain (one tensor in, one tensor out, each block
   fed the previous block's output); otherwise "n/a" with the reason found by :func:`chain_reason`.
4. ``selective_op``: torchtitan's "selective op" checkpointing: every block under
   ``torch.utils.checkpoint.checkpoint`` with ``create_selective_checkpoint_contexts``, matmul outputs
   (``aten.mm``, ``addmm``, ``bmm``, ``matmul``) ``MUST_SAVE``, everything else recomputed.
5. ``dots_saveable``: ``torchckpt.checkpoint_modules(blocks, policy="dots_saveable")`` (JAX's policy).
6. ``compile``: ``torch.compile`` with ``torch._functorch.config.activation_memory_budget`` set.
7. ``torchckpt``: a ``torchckpt.plan`` made in the planner process, loaded and applied.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, cast

import torch
from torch import nn

__all__ = ["MATMUL_OPS", "OFFLOAD_PEER_KINDS", "PEER_KINDS", "MethodSpec", "NotApplicableError", "apply_method",
           "chain_reason"]

PEER_KINDS: tuple[str, ...] = ("none", "every_block", "sequential", "selective_op", "dots_saveable")
OFFLOAD_PEER_KINDS: tuple[str, ...] = ("save_on_cpu", "sac_offload")  # offload's peers (bench/cuda_check.py)
_KINDS = (*PEER_KINDS, "compile", "torchckpt", *OFFLOAD_PEER_KINDS)

MATMUL_OPS = [torch.ops.aten.mm.default, torch.ops.aten.addmm.default, torch.ops.aten.bmm.default,
              torch.ops.aten.matmul.default]


@dataclass(frozen=True, kw_only=True)
class MethodSpec:
    """What a worker applies: a method kind and its parameters.

    ``compile_budget`` is ``activation_memory_budget`` for ``compile``; ``plan_path`` the plan JSON and
    ``budget_bytes`` its budget for ``torchckpt``.

    Example:
        >>> MethodSpec(kind="compile", label="compile 0.5", compile_budget=0.5).kind
        'compile'
    """

    kind: str
    label: str
    compile_budget: float | None = None
    plan_path: str | None = None
    budget_bytes: int | None = None

    def __post_init__(self) -> None:
        if self.kind not in _KINDS:
            raise ValueError(f"MethodSpec.kind={self.kind!r}: use one of {', '.join(_KINDS)}")
        if self.kind == "compile" and not (self.compile_budget is not None and 0 <= self.compile_budget <= 1):
            raise ValueError(f"MethodSpec(kind='compile').compile_budget must be in [0, 1]; "
                             f"got {self.compile_budget!r}")
        if self.kind == "torchckpt" and not self.plan_path:
            raise ValueError("MethodSpec(kind='torchckpt') needs plan_path, the plan's JSON file")


def chain_reason(model: nn.Module, blocks: list[nn.Module], inputs: tuple | dict) -> str | None:
    """None when the blocks run as a plain chain (``checkpoint_sequential`` applies), else why not.

    Runs one forward pass without gradients, watching how each block is called.

    Example:
        >>> from torchckpt.models import gpt, unet, block_modules
        >>> model = gpt("tiny"); print(chain_reason(model, list(model.blocks), model.example_batch(2, 8)))
        None
        >>> model = unet("tiny"); chain_reason(model, block_modules(model), model.example_batch(2, 8))[:24]
        "block 1's input is not b"
    """
    calls: list[tuple[int, list[str], Any, Any]] = []
    handles = []
    for block in blocks:
        def hook(module: nn.Module, args: tuple, kwargs: dict, output: Any) -> None:
            first = args[0] if args else None
            calls.append((len(args), sorted(kwargs), first, output))
        handles.append(block.register_forward_hook(hook, with_kwargs=True))
    try:
        with torch.no_grad():
            model(**inputs) if isinstance(inputs, dict) else model(*inputs)
    finally:
        for handle in handles:
            handle.remove()
    if len(calls) != len(blocks):
        return f"the blocks ran {len(calls)} times for {len(blocks)} blocks (not once each)"
    for i, (n_args, kwarg_names, first, output) in enumerate(calls):
        if kwarg_names:
            return f"block {i} takes keyword arguments besides the hidden state ({', '.join(kwarg_names)})"
        if n_args != 1:
            return f"block {i} takes {n_args} positional arguments, not one"
        if not isinstance(output, torch.Tensor):
            return f"block {i} returns {type(output).__name__}, not a tensor"
        if i and first is not calls[i - 1][3]:
            return f"block {i}'s input is not block {i - 1}'s output (code runs between blocks, e.g. skips or pooling)"
    return None


def _set_forward(module: nn.Module, forward: Callable[..., Any], undo: list[nn.Module]) -> None:
    module.forward = forward  # instance attribute; `del module.forward` restores the class's forward
    undo.append(module)


def _every_block(blocks: list[nn.Module], context_fn: Callable[[], Any] | None) -> list[nn.Module]:
    undo: list[nn.Module] = []
    extra: dict[str, Any] = {} if context_fn is None else {"context_fn": context_fn}
    for block in blocks:
        _set_forward(block, functools.partial(torch.utils.checkpoint.checkpoint, block.forward,
                                              use_reentrant=False, **extra), undo)
    return undo


def _offload_matmuls(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> Any:
    from torch.utils.checkpoint import CheckpointPolicy

    return CheckpointPolicy.MUST_CPU_OFFLOAD if op in MATMUL_OPS else CheckpointPolicy.PREFER_RECOMPUTE


def _saved_on_cpu(blocks: list[nn.Module]) -> list[nn.Module]:
    """Every block's saved tensors moved to (pinned) CPU memory by ``torch.autograd.graph.save_on_cpu``."""
    undo: list[nn.Module] = []
    for block in blocks:
        def forward(*args: Any, _forward: Callable[..., Any] = block.forward, **kwargs: Any) -> Any:
            pin = torch.cuda.is_available() and any(
                isinstance(a, torch.Tensor) and a.is_cuda for a in (*args, *kwargs.values()))
            with torch.autograd.graph.save_on_cpu(pin_memory=pin):
                return _forward(*args, **kwargs)
        _set_forward(block, forward, undo)
    return undo


def _sequential(blocks: list[nn.Module]) -> list[nn.Module]:
    """Block 0 runs all blocks through checkpoint_sequential; blocks 1.. pass their input through.

    Valid only after :func:`chain_reason` returned None: nothing runs between blocks."""
    undo: list[nn.Module] = []
    functions = [block.forward for block in blocks]
    segments = max(1, round(math.sqrt(len(blocks))))

    def run_all(x: torch.Tensor) -> torch.Tensor:
        return torch.utils.checkpoint.checkpoint_sequential(functions, segments, x, use_reentrant=False)

    _set_forward(blocks[0], run_all, undo)
    for block in blocks[1:]:
        _set_forward(block, lambda x: x, undo)
    return undo


def apply_method(spec: MethodSpec, model: nn.Module, blocks: list[nn.Module],
                 inputs: tuple | dict) -> tuple[nn.Module, Callable[[], None]]:
    """Apply ``spec`` to ``model`` in place; return ``(module to call, undo)``.

    Raises ``NotApplicableError`` (with the reason) when the method cannot run on this model.

    Example:
        >>> from torchckpt.models import gpt
        >>> model = gpt("tiny"); batch = model.example_batch(2, 8)
        >>> runnable, undo = apply_method(MethodSpec(kind="every_block", label="every block"), model,
        ...                               list(model.blocks), batch)
        >>> runnable(*batch).backward(); undo()
    """
    import torchckpt

    undo_modules: list[nn.Module] = []
    handle = None
    runnable: nn.Module = model
    if spec.kind == "every_block":
        undo_modules = _every_block(blocks, None)
    elif spec.kind == "selective_op":
        from torch.utils.checkpoint import create_selective_checkpoint_contexts

        undo_modules = _every_block(blocks, functools.partial(create_selective_checkpoint_contexts, MATMUL_OPS))
    elif spec.kind == "sequential":
        reason = chain_reason(model, blocks, inputs)
        if reason is not None:
            raise NotApplicableError(f"not a plain chain of blocks: {reason}")
        undo_modules = _sequential(blocks)
    elif spec.kind == "save_on_cpu":  # what HF's gradient_checkpointing_kwargs={"offload": True} runs
        undo_modules = _saved_on_cpu(blocks)
    elif spec.kind == "sac_offload":  # torch's own per-op offload policy: matmul outputs to the CPU, the rest
        # recomputed
        from torch.utils.checkpoint import create_selective_checkpoint_contexts

        undo_modules = _every_block(blocks, functools.partial(create_selective_checkpoint_contexts, _offload_matmuls))
    elif spec.kind == "dots_saveable":
        handle = torchckpt.checkpoint_modules(blocks, policy="dots_saveable")
    elif spec.kind == "torchckpt":
        assert spec.plan_path is not None  # MethodSpec.__post_init__ requires it for this kind
        plan = torchckpt.Plan.load(spec.plan_path, model, inputs)
        handle = torchckpt.apply(model, plan)
    elif spec.kind == "compile":
        import torch._functorch.config as functorch_config
        import torch._inductor.config as inductor_config

        assert spec.compile_budget is not None  # MethodSpec.__post_init__ requires it for this kind
        functorch_config.activation_memory_budget = spec.compile_budget
        inductor_config.fallback_random = True  # eager's RNG: the same dropout masks as every other method
        # torch.compile of a Module returns an OptimizedModule (a Module); its stub only says Callable.
        runnable = cast(nn.Module, torch.compile(model))

    def undo() -> None:
        for module in undo_modules:
            del module.forward
        if handle is not None:
            handle.remove()

    return runnable, undo


class NotApplicableError(Exception):
    """A method does not apply to a model (recorded as "n/a" with this message, not as a failure)."""
