"""torch.compile and torchckpt: the one place that recognises a compiled model and refuses it clearly.

Plans and ``checkpoint_modules`` do not run under ``torch.compile`` yet (Note: [compiled models are
refused]). Three cases reach torchckpt, and each gets an error that names ``torch.compile`` and the fix:

- ``plan`` / ``profile`` / ``verify`` / ``apply`` / ``checkpoint_modules`` given a module built by
  ``torch.compile(model)`` (an ``OptimizedModule`` whose ``_orig_mod`` is the user's model), or a model
  holding one: ``refuse_compiled``. Without this check such a module's instance-level ``forward`` (set
  by ``torch.compile``) was mistaken for a torchckpt wrap.
- A model compiled *after* a plan was applied: Dynamo traces into torchckpt's checkpoint, graph-breaks
  on every block and recompiles until its limit, and the plan has no memory effect. The checkpoint calls
  ``refuse_while_compiling`` first; it raises through a ``torch.compiler.disable``'d function, so the
  error reaches the caller instead of being swallowed by a graph break.
- ``MemoryMeter`` on CPU: Dynamo skips every frame while a Python dispatch mode is active ("non-infra
  torch dispatch mode present, this is not supported today in torch.compile", PyTorch's
  ``convert_frame.py``), so a compiled model measured there runs, and is measured, eagerly. The meter's
  docstring says so; planning refuses the compiled module before anything is measured.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

__all__ = ["is_compiled_module", "refuse_compiled", "refuse_while_compiling"]

_FIX = ("plans and checkpoint_modules do not run under torch.compile yet: plan, apply and train the uncompiled "
        "model (for compiled = torch.compile(model), use model, i.e. compiled._orig_mod) and run it without "
        "torch.compile")


def is_compiled_module(module: object) -> bool:
    """Whether ``module`` is what ``torch.compile(an nn.Module)`` returns (it holds the original as ``_orig_mod``).

    Example:
        >>> is_compiled_module(nn.Linear(2, 2))
        False
    """
    return isinstance(module, nn.Module) and type(module).__name__ == "OptimizedModule" and \
        isinstance(getattr(module, "_orig_mod", None), nn.Module)


def refuse_compiled(modules: Iterable[nn.Module], action: str) -> None:
    """Raise TypeError naming ``torch.compile`` and the fix if any of ``modules``, or a submodule, is compiled.

    ``action`` names what was attempted (``"torchckpt.plan"``, ``"checkpoint_modules"``).

    Example:
        >>> refuse_compiled([nn.Linear(2, 2)], "torchckpt.plan")  # not compiled: nothing happens
    """
    for module in modules:
        if not isinstance(module, nn.Module):
            continue  # the caller reports non-modules with its own message
        for name, sub in module.named_modules():
            if is_compiled_module(sub):
                where = f"submodule {name!r} is" if name else "the model is"
                raise TypeError(f"{action}: {where} a torch.compile'd module (OptimizedModule; the original is "
                                f"its ._orig_mod); {_FIX}")


@torch.compiler.disable
def _raise_while_compiling() -> None:
    raise RuntimeError(f"torchckpt: torch.compile is tracing a model that runs under a torchckpt plan or "
                       f"checkpoint_modules; {_FIX} (call remove() on the handle before compiling)")


def refuse_while_compiling() -> None:
    """Raise RuntimeError when called while ``torch.compile`` traces (a plan applied, then compiled).

    Example:
        >>> refuse_while_compiling()  # eager: nothing happens
    """
    if torch.compiler.is_compiling():
        _raise_while_compiling()
