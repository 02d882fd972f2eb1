"""Find a model's repeated blocks: the longest ModuleList/Sequential of structurally equal modules.

Structurally equal means the same module types, nested the same way, with parameters of the same
shapes and dtypes (HF ``model.layers``, GPT-2 ``transformer.h``, BERT ``encoder.layer``, the built-in
models' ``blocks``). Ties go to the container found first in ``named_modules`` order.
"""

from __future__ import annotations

from collections.abc import Sequence

from torch import nn

__all__ = ["find_blocks", "structure_key"]


def structure_key(module: nn.Module) -> tuple:
    """A hashable description of a module's structure (types, nesting, parameter shapes and dtypes).

    Example:
        >>> structure_key(nn.Linear(2, 3)) == structure_key(nn.Linear(2, 3))
        True
        >>> structure_key(nn.Linear(2, 3)) == structure_key(nn.Linear(3, 3))
        False
    """
    params = tuple((name, tuple(p.shape), str(p.dtype)) for name, p in module.named_parameters(recurse=False))
    children = tuple((name, structure_key(child)) for name, child in module.named_children())
    return (type(module).__qualname__, params, children)


def _runs(children: Sequence[nn.Module]) -> list[list[nn.Module]]:
    runs: list[list[nn.Module]] = []
    for child in children:
        if runs and structure_key(runs[-1][0]) == structure_key(child):
            runs[-1].append(child)
        else:
            runs.append([child])
    return runs


def find_blocks(model: nn.Module) -> tuple[str, list[nn.Module]]:
    """Return ``(container_name, blocks)``: the longest run of structurally equal modules in a container.

    Raises ValueError naming ``blocks=`` when the model has no container with two or more equal modules.

    Example:
        >>> from torchckpt.models import gpt
        >>> name, blocks = find_blocks(gpt("tiny"))
        >>> name, len(blocks)
        ('blocks', 2)
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"find_blocks: expected an nn.Module; got {type(model).__name__}")
    best: tuple[str, list[nn.Module]] = ("", [])
    for name, module in model.named_modules():
        if isinstance(module, (nn.ModuleList, nn.Sequential)):
            for run in _runs(list(module.children())):
                if len(run) > len(best[1]):
                    best = (name, run)
    if len(best[1]) < 2:
        raise ValueError(
            f"{type(model).__name__} has no ModuleList or Sequential of two or more structurally equal modules, so "
            "torchckpt cannot find its repeated blocks; pass them explicitly, e.g. "
            "torchckpt.plan(model, inputs, budget='6GiB', blocks=list(model.encoder.layers))")
    return best
