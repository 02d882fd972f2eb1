"""The loss head in chunks of tokens: the LM head's logits never exist whole (forward or backward).

A language model's last linear layer (the LM head) maps ``N`` tokens to ``N x V`` logits, and the
cross-entropy over them keeps their log-softmax for the backward pass, which then makes two more ``N x V``
tensors. With a real vocabulary (32k-150k) those dominate the step's peak once the blocks are
checkpointed. ``chunk_loss_head(head)`` makes the head return *deferred logits* (``DeferredLogits``: a
tensor with the logits' shape and dtype and no storage) that remember the head's input; when the loop
computes ``F.cross_entropy`` on them (after any of ``.float()``, ``.view``, ``.reshape``, ``.flatten``,
``.contiguous`` or slicing of the token dimensions, as Hugging Face's ``ForCausalLMLoss`` and nanoGPT-style
losses do), the loss is computed by :class:`ChunkedCrossEntropy` chunk by chunk of tokens, and so is its
backward pass. Any other use of the logits (``argmax``, a softcap, logging them) makes them real: the
values are right, the memory is the plain head's, and the head records what read them
(``ChunkedHeadHandle.materialized``), which is how the planner refuses the chunked head for such loops.
The idea follows fused linear cross-entropy kernels (Liger-Kernel; Wijmans et al. 2024, "Cut Your
Losses in Large-Vocabulary Language Models"); this is a plain PyTorch version of it.

**[the chunked loss is exact]** The forward pass computes each chunk's logits with the head's own
``F.linear`` and ``log_softmax``, gathers each token's log-probability of its target, and reduces those
``N`` numbers with the same ``nll_loss`` kernel and reduction the plain loss uses, so the loss is bitwise
the plain one (when the matrix product of a chunk gives each row what the whole product gives it, which
tests/executor/test_loss_head.py checks on this machine). The backward pass recomputes each chunk's
logits (one more head matrix product per step: the price of the memory) and applies ATen's own
``nll_loss_backward`` and ``_log_softmax_backward_data`` with the plain loss's total weight and the
incoming gradient, so the gradient of the logits is bitwise the plain one, row by row, and so is the
gradient of the head's input (each row is its own product). The head's weight (and bias) gradient is
a sum over tokens, taken chunk by chunk here and in one matrix product in the plain step: it matches to
rounding, not bitwise (relative error ~1e-6 in float32, tested), and so does whatever the weight is tied to
(GPT-2's token embedding).

**[what the chunked head holds]** After the forward pass: the head's input (which the plain head saves
too) and one float per token; while a chunk is computed, about four ``chunk x V`` tensors. The chunk is
``chunk_tokens`` tokens (default: the tokens whose logits take the bytes of the head's input, as
Liger-Kernel sizes its chunks, but at most ``CHUNKS_AT_MOST`` chunks and at least ``MIN_CHUNK_TOKENS`` tokens
each: on this project's CPU BLAS a product of 192 rows or more gives each row what the whole product gives it,
and of 128 or fewer not always, for heads 256 and 768 wide: tests/executor/test_loss_head.py); the tokens are
split into chunks of equal size but for one token.

Supported: ``F.cross_entropy`` with class-index targets, ``reduction`` ``"mean"`` or ``"sum"``,
``ignore_index``, no class weights, no label smoothing; anything else makes the logits real (recorded).
Under ``torch.compile`` the head returns real logits, recorded as ``"torch.compile"`` but without a warning (a
warning would break the graph): Dynamo does not trace deferred logits, so make plans for compiled training with
``loss_head=False`` (docs/planner.md says so).
"""

from __future__ import annotations

import contextlib
import logging
import math
import warnings
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["ChunkedCrossEntropy", "ChunkedHeadHandle", "DeferredLogits", "chunk_loss_head", "default_chunk_tokens"]

_log = logging.getLogger("torchckpt")
_REDUCTIONS = {"mean": 1, "sum": 2}  # ATen's Reduction enum
_SHAPE_OPS = {torch.Tensor.view, torch.Tensor.reshape, torch.Tensor.flatten, torch.Tensor.contiguous,
              torch.Tensor.__getitem__, torch.flatten, torch.reshape}
_DTYPE_OPS = {torch.Tensor.float, torch.Tensor.to, torch.Tensor.type_as, torch.Tensor.bfloat16, torch.Tensor.half,
              torch.Tensor.double}
_PROPERTIES = ("shape", "dtype", "device", "ndim", "requires_grad", "is_cuda", "layout", "grad_fn", "is_sparse")
_METADATA: set[Any] = {torch.Tensor.size, torch.Tensor.dim, torch.Tensor.numel, torch.Tensor.__len__,
                       torch.Tensor.is_floating_point, torch.Tensor.__hash__,
                       *(vars(torch._C.TensorBase)[name].__get__ for name in _PROPERTIES)}


CHUNKS_AT_MOST = 16
MIN_CHUNK_TOKENS = 256


def default_chunk_tokens(tokens: int, width: int, vocab: int) -> int:
    """Tokens per chunk: a chunk's logits take about the bytes of the head's input (``tokens x width``), and
    there are at most ``CHUNKS_AT_MOST`` chunks (smaller chunks save little more and, many, cost time on CPU).

    Example:
        >>> default_chunk_tokens(4096, 768, 50257)
        256
        >>> default_chunk_tokens(8, 64, 256)
        8
        >>> default_chunk_tokens(65536, 4096, 32000)
        8388
    """
    for name, value in (("tokens", tokens), ("width", width), ("vocab", vocab)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"default_chunk_tokens: {name} must be an int >= 1; got {value!r}")
    return min(tokens, max((tokens * width) // vocab, -(-tokens // CHUNKS_AT_MOST), MIN_CHUNK_TOKENS))


class ChunkedCrossEntropy(torch.autograd.Function):
    """``F.cross_entropy(F.linear(hidden, weight, bias).to(dtype), target)`` chunk by chunk of rows
    (module docstring's [the chunked loss is exact]).

    Example:
        >>> hidden = torch.randn(64, 16, requires_grad=True); head = nn.Linear(16, 100)
        >>> target = torch.randint(0, 100, (64,)); target[::5] = -100
        >>> loss = ChunkedCrossEntropy.apply(hidden, head.weight, head.bias, target, None, -100, "mean", 16)
        >>> bool(loss == F.cross_entropy(head(hidden), target))
        True
    """

    @staticmethod
    def forward(ctx: Any, hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                target: torch.Tensor, dtype: torch.dtype | None, ignore_index: int, reduction: str,
                chunk_tokens: int) -> torch.Tensor:
        rows = hidden.shape[0]
        gathered = torch.empty(rows, 1, dtype=dtype or torch.result_type(hidden, weight), device=hidden.device)
        log_probs_of_target = gathered.view(-1)
        safe_target = target.masked_fill(target == ignore_index, 0)
        for start, stop in _chunks(rows, chunk_tokens):
            log_probs = _log_probs(hidden[start:stop], weight, bias, dtype)
            log_probs_of_target[start:stop] = log_probs.gather(1, safe_target[start:stop, None]).view(-1)
            del log_probs
        # The plain loss's own reduction over the same per-token numbers: one column, class 0 for every token,
        # the plain loss's ignored tokens ignored, so the sum runs in the same order.
        column_target = torch.where(target == ignore_index, target, torch.zeros_like(target))
        loss, total_weight = torch.ops.aten.nll_loss_forward(gathered, column_target, None, _REDUCTIONS[reduction],
                                                             ignore_index)
        ctx.save_for_backward(hidden, weight, bias, target, total_weight)
        ctx.options = (dtype, ignore_index, reduction, chunk_tokens)
        return loss

    @staticmethod
    def backward(ctx: Any, grad_loss: torch.Tensor) -> tuple[Any, ...]:
        hidden, weight, bias, target, total_weight = ctx.saved_tensors
        dtype, ignore_index, reduction, chunk_tokens = ctx.options
        need_hidden, need_weight, need_bias = ctx.needs_input_grad[:3]
        grad_hidden = torch.empty_like(hidden) if need_hidden else None
        grad_weight = torch.zeros_like(weight) if need_weight else None
        grad_bias = torch.zeros_like(bias) if need_bias and bias is not None else None
        for start, stop in _chunks(hidden.shape[0], chunk_tokens):
            rows = hidden[start:stop]
            log_probs = _log_probs(rows, weight, bias, dtype)
            grad = torch.ops.aten.nll_loss_backward(grad_loss, log_probs, target[start:stop], None,
                                                    _REDUCTIONS[reduction], ignore_index, total_weight)
            grad = torch.ops.aten._log_softmax_backward_data(grad, log_probs, 1, log_probs.dtype)
            del log_probs
            grad = grad.to(weight.dtype)  # the backward of the plain loss's upcast
            if grad_hidden is not None:
                grad_hidden[start:stop] = grad @ weight
            if grad_weight is not None:
                grad_weight.addmm_(grad.t(), rows)
            if grad_bias is not None:
                grad_bias.add_(grad.sum(0))
            del grad
        return grad_hidden, grad_weight, grad_bias, None, None, None, None, None


def _chunks(rows: int, chunk_tokens: int) -> list[tuple[int, int]]:
    """``rows`` split into ``ceil(rows / chunk_tokens)`` chunks of sizes differing by at most one: no last chunk of
    a row or two, whose matrix product a BLAS may compute another way (a matrix-vector kernel for one row)."""
    count = -(-rows // chunk_tokens)
    size, larger = divmod(rows, count)
    bounds, start = [], 0
    for index in range(count):
        stop = start + size + (1 if index < larger else 0)
        bounds.append((start, stop))
        start = stop
    return bounds


def _log_probs(rows: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
               dtype: torch.dtype | None) -> torch.Tensor:
    logits = F.linear(rows, weight, bias)
    if dtype is not None and dtype != logits.dtype:
        logits = logits.to(dtype)
    return torch.log_softmax(logits, 1)


@dataclass
class ChunkedHeadHandle:
    """What ``chunk_loss_head`` returns: ``remove()`` puts the head's forward back; ``materialized`` lists
    what made deferred logits real (an op name, or ``"torch.compile"``); ``chunked_losses`` counts the
    losses computed in chunks.

    Example:
        >>> handle = chunk_loss_head(nn.Linear(4, 10))
        >>> handle.remove(); handle.materialized
        []
    """

    head: nn.Module
    chunk_tokens: int | None
    warn: bool = False
    materialized: list[str] = field(default_factory=list)
    chunked_losses: int = 0

    def _made_real(self, reason: str) -> None:
        self.materialized.append(reason)
        if self.warn and len(self.materialized) == 1 and not torch.compiler.is_compiling():
            _warn_made_real(reason)

    def remove(self) -> None:
        """Give the head its own forward back (idempotent)."""
        if vars(self.head).get("forward") is not None and getattr(self.head.forward, "_torchckpt_head", None) is self:
            del self.head.forward

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        """The head's forward while chunked: deferred logits, or real ones where they cannot be deferred."""
        tokens = isinstance(hidden, torch.Tensor) and hidden.dim() >= 2
        reason = ("torch.compile" if torch.compiler.is_compiling()
                  else "an input that is not a tensor of tokens" if not tokens
                  else "autocast" if torch.is_autocast_enabled(hidden.device.type) else None)
        if reason is not None:
            self._made_real(reason)
            return type(self.head).forward(self.head, hidden)
        return DeferredLogits.of(self, hidden)


def _warn_made_real(reason: str) -> None:
    message = (f"torchckpt: the plan computes the loss head's logits in chunks, but this step made them whole "
               f"({reason}), so it peaks above the plan's prediction; make the plan with your loop "
               "(torchckpt.plan(..., step_fn=...)) so the profiler sees it and leaves the head whole")
    warnings.warn(message, RuntimeWarning, stacklevel=4)
    _log.warning(message)



def chunk_loss_head(head: nn.Module, chunk_tokens: int | None = None) -> ChunkedHeadHandle:
    """Make ``head`` (an ``nn.Linear``: the LM head) return deferred logits whose cross-entropy is computed in
    chunks of ``chunk_tokens`` tokens (default: ``default_chunk_tokens``); ``handle.remove()`` undoes it.

    Example:
        >>> head = nn.Linear(8, 100, bias=False)
        >>> handle = chunk_loss_head(head, chunk_tokens=16)
        >>> hidden, target = torch.randn(2, 20, 8), torch.randint(0, 100, (2, 20))
        >>> logits = head(hidden)
        >>> loss = F.cross_entropy(logits.view(-1, logits.size(-1)), target.view(-1))
        >>> handle.remove()
        >>> plain = F.cross_entropy(head(hidden).view(-1, 100), target.view(-1))
        >>> bool(loss == plain), handle.chunked_losses
        (True, 1)
    """
    if not isinstance(head, nn.Linear):
        raise TypeError(f"chunk_loss_head: the head must be an nn.Linear (the LM head); got {type(head).__name__}")
    if chunk_tokens is not None and (isinstance(chunk_tokens, bool) or not isinstance(chunk_tokens, int)
                                     or chunk_tokens < 1):
        raise ValueError(f"chunk_loss_head: chunk_tokens must be an int >= 1 or None; got {chunk_tokens!r}")
    if "forward" in vars(head):
        raise ValueError("chunk_loss_head: the head already has an instance-level forward (chunked or wrapped "
                         "already?); remove the earlier handle first")
    handle = ChunkedHeadHandle(head=head, chunk_tokens=chunk_tokens)

    def forward(hidden: torch.Tensor) -> torch.Tensor:
        return handle.forward(hidden)

    forward._torchckpt_head = handle  # type: ignore[attr-defined]
    head.forward = forward  # type: ignore[method-assign, assignment]
    return handle



@contextlib.contextmanager
def _plain_torch_function() -> Iterator[None]:
    with torch._C.DisableTorchFunctionSubclass():
        yield


class DeferredLogits(torch.Tensor):
    """Logits not computed yet: the head's input, its (possibly sliced) view and the dtype asked for.

    Shape, dtype and device are the logits'; it holds no storage. ``F.cross_entropy`` on it is computed in
    chunks; shape and dtype changes stay deferred; any other op makes the logits real (recorded on the
    handle) and runs on them.
    """

    _handle: ChunkedHeadHandle
    _hidden: torch.Tensor  # the head's input, reshaped/sliced as the logits were (last dim: width)
    _dtype: torch.dtype | None

    @staticmethod
    def __new__(cls, handle: ChunkedHeadHandle, hidden: torch.Tensor, dtype: torch.dtype | None) -> DeferredLogits:
        head: nn.Linear = handle.head  # type: ignore[assignment]
        shape = (*hidden.shape[:-1], head.out_features)
        out_dtype = dtype or torch.result_type(hidden, head.weight)
        self = torch.Tensor._make_wrapper_subclass(cls, shape, dtype=out_dtype, device=hidden.device)
        self._handle, self._hidden, self._dtype = handle, hidden, dtype
        return self

    @classmethod
    def of(cls, handle: ChunkedHeadHandle, hidden: torch.Tensor) -> DeferredLogits:
        return cls(handle, hidden, None)

    def __repr__(self) -> str:  # type: ignore[override]
        return f"DeferredLogits(shape={tuple(self.shape)}, dtype={self.dtype}; computed in chunks by torchckpt)"

    def whole(self) -> torch.Tensor:
        """The logits, computed whole (what the plain head returns, cast as asked)."""
        head = self._handle.head
        with _plain_torch_function():
            logits = type(head).forward(head, self._hidden)
            return logits.to(self._dtype) if self._dtype is not None else logits

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if func in _METADATA:
            with _plain_torch_function():
                return func(*args, **kwargs)
        this = args[0] if args and isinstance(args[0], DeferredLogits) else None
        if func is F.cross_entropy and this is not None:
            loss = this._chunked_cross_entropy(*args[1:], **kwargs)
            if loss is not None:
                return loss
        elif this is not None and func in _DTYPE_OPS:
            dtype = _dtype_asked(func, args, kwargs, this)
            if dtype is not None:
                return DeferredLogits(this._handle, this._hidden, dtype)
        elif this is not None and func in _SHAPE_OPS:
            hidden = this._reshaped_hidden(func, args[1:], kwargs)
            if hidden is not None:
                return DeferredLogits(this._handle, hidden, this._dtype)
        name = getattr(func, "__name__", str(func))
        owners = {id(a._handle): a._handle for a in (*args, *kwargs.values()) if isinstance(a, DeferredLogits)}
        for handle in owners.values():
            handle._made_real(name)
        real_args = tuple(a.whole() if isinstance(a, DeferredLogits) else a for a in args)
        real_kwargs = {k: v.whole() if isinstance(v, DeferredLogits) else v for k, v in kwargs.items()}
        with _plain_torch_function():
            return func(*real_args, **real_kwargs)

    @classmethod
    def __torch_dispatch__(cls, func: Any, types: Any, args: tuple = (),  # type: ignore[override]
                           kwargs: dict | None = None) -> Any:
        # Every Python-level use goes through __torch_function__ first, which makes the logits real.
        raise RuntimeError(f"torchckpt: deferred logits reached {func} below autograd; please report this "
                           "(chunked loss head)")

    def _chunked_cross_entropy(self, target: torch.Tensor, weight: Any = None, size_average: Any = None,
                               ignore_index: int = -100, reduce: Any = None, reduction: str = "mean",
                               label_smoothing: float = 0.0) -> torch.Tensor | None:
        if (self.dim() != 2 or weight is not None or size_average is not None or reduce is not None
                or label_smoothing != 0.0 or reduction not in _REDUCTIONS or not isinstance(target, torch.Tensor)
                or target.dim() != 1 or target.dtype not in (torch.int64, torch.int32)
                or target.shape[0] != self.shape[0]):
            return None
        head: nn.Linear = self._handle.head  # type: ignore[assignment]
        chunk = self._handle.chunk_tokens or default_chunk_tokens(self.shape[0], head.in_features, head.out_features)
        with _plain_torch_function():
            loss = ChunkedCrossEntropy.apply(self._hidden, head.weight, head.bias, target.long(), self._dtype,
                                             ignore_index, reduction, chunk)
        self._handle.chunked_losses += 1
        return loss

    def _reshaped_hidden(self, func: Any, args: tuple, kwargs: dict) -> torch.Tensor | None:
        """The head's input shaped as ``func`` shapes the logits, or None when that touches the vocabulary."""
        vocab, width = self.shape[-1], self._hidden.shape[-1]
        with _plain_torch_function():
            if func in (torch.Tensor.contiguous,):
                return self._hidden.contiguous() if not args and not kwargs else None
            if func is torch.Tensor.__getitem__:
                index = args[0] if args else None
                index = index if isinstance(index, tuple) else (index,)
                if (Ellipsis in index or len(index) == self.dim()) and isinstance(index[-1], slice) \
                        and index[-1] == slice(None) and all(isinstance(i, (slice, type(Ellipsis))) for i in index):
                    return self._hidden[index]
                return None
            if func in (torch.Tensor.flatten, torch.flatten):
                start = kwargs.get("start_dim", args[0] if args else 0)
                end = kwargs.get("end_dim", args[1] if len(args) > 1 else -1)
                last = self.dim() - 1
                if (end % self.dim()) == last:
                    return None
                return self._hidden.flatten(start, end)
            shape = args[0] if len(args) == 1 and isinstance(args[0], (tuple, list, torch.Size)) else args
            if kwargs or not shape or not all(isinstance(s, int) for s in shape):
                return None
            shape = tuple(shape)
            if shape[-1] not in (vocab, -1):
                return None
            lead = math.prod(self.shape[:-1])
            known = math.prod(s for s in shape[:-1] if s != -1)
            if shape[-1] == -1 and (-1 in shape[:-1] or known * vocab != math.prod(self.shape)):
                return None
            if -1 not in shape[:-1] and known != lead:
                return None
            return self._hidden.reshape(*shape[:-1], width)


def _dtype_asked(func: Any, args: tuple, kwargs: dict, this: DeferredLogits) -> torch.dtype | None:
    """The dtype a cast asks for, or None when it asks more (another device, a copy, memory format)."""
    named = {torch.Tensor.float: torch.float32, torch.Tensor.bfloat16: torch.bfloat16, torch.Tensor.half: torch.float16,
             torch.Tensor.double: torch.float64}
    if func in named:
        return named[func] if not args[1:] and not kwargs else None
    if func is torch.Tensor.type_as:
        other = args[1] if len(args) > 1 else None
        return other.dtype if isinstance(other, torch.Tensor) and other.device == this.device else None
    rest, kwargs = list(args[1:]), dict(kwargs)
    dtype = kwargs.pop("dtype", None)
    device = kwargs.pop("device", None)
    if kwargs:
        return None
    for item in rest:
        if isinstance(item, torch.dtype) and dtype is None:
            dtype = item
        elif isinstance(item, (torch.device, str)) and device is None:
            device = item
        else:
            return None
    if device is not None and torch.device(device) != this.device:
        return None
    return dtype or this.dtype
