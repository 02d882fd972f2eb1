"""Find a model's repeated blocks: the longest run of same-class modules in a ModuleList/Sequential.

HF ``model.layers``, GPT-2 ``transformer.h``, BERT ``encoder.layer``, the built-in models' ``blocks``.
Blocks of one class may differ in parameters (T5's first block also holds the relative position
bias). Encoder-decoder models have two such containers of equal length (T5 ``encoder.block`` and
``decoder.block``): every container whose run is as long as the longest is taken, in
``named_modules`` order, which is their forward order in these models.

A model whose blocks are not one such run (the U-Net's down, middle and up blocks have different
widths) names them itself: a method ``torchckpt_blocks()`` returning its blocks in forward order is
used instead of the search.
"""

from __future__ import annotations

from collections.abc import Sequence

from torch import nn

from torchckpt.executor.compiled import refuse_compiled

__all__ = ["block_paths", "find_blocks", "resolve_blocks", "structure_key"]


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
        if runs and type(runs[-1][0]) is type(child):
            runs[-1].append(child)
        else:
            runs.append([child])
    return runs


def find_blocks(model: nn.Module) -> tuple[str, list[nn.Module]]:
    """Return ``(container_name, blocks)``: the longest run of same-class modules in a container (or two).

    Raises ValueError naming ``blocks=`` when no container holds two or more modules of one class.

    Example:
        >>> from torchckpt.models import gpt
        >>> name, blocks = find_blocks(gpt("tiny"))
        >>> name, len(blocks)
        ('blocks', 2)
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"find_blocks: expected an nn.Module; got {type(model).__name__}")
    named = getattr(model, "torchckpt_blocks", None)
    if callable(named):
        blocks = list(named())
        if not blocks or not all(isinstance(block, nn.Module) for block in blocks):
            raise ValueError(f"{type(model).__name__}.torchckpt_blocks() must return a non-empty list of modules")
        return "torchckpt_blocks()", blocks
    found: list[tuple[str, list[nn.Module]]] = []  # the longest run of each container
    for name, module in model.named_modules():
        if isinstance(module, (nn.ModuleList, nn.Sequential)):
            runs = _runs(list(module.children()))
            if runs:
                found.append((name, max(runs, key=len)))
    longest = max((len(run) for _, run in found), default=0)
    chosen: list[tuple[str, list[nn.Module]]] = []
    for name, run in found:
        inside_chosen = any(name.startswith(f"{other}.") for other, _ in chosen)
        if len(run) == longest and not inside_chosen:
            chosen.append((name, run))
    best = ("+".join(name for name, _ in chosen), [block for _, run in chosen for block in run])
    if longest < 2:
        raise ValueError(
            f"{type(model).__name__} has no ModuleList or Sequential holding two or more modules of one class, so "
            "torchckpt cannot find its repeated blocks; pass them explicitly, e.g. "
            "torchckpt.plan(model, inputs, budget='6GiB', blocks=list(model.encoder.layers))")
    return best


def _refuse_wrapped(model: nn.Module) -> None:
    refuse_compiled([model], "torchckpt.plan/profile/verify")  # Note: [compiled models are refused]
    for name, module in model.named_modules():
        if "forward" in vars(module):
            raise ValueError(f"module {name or type(model).__name__!r} already runs under a torchckpt plan or "
                             "checkpoint_modules (it has an instance-level forward); call remove() on that handle "
                             "before profiling or planning the model again")


def resolve_blocks(model: nn.Module, blocks: str | Sequence[nn.Module]) -> list[nn.Module]:
    """The blocks to plan: ``find_blocks(model)`` for ``"auto"``, else the given submodules, checked.

    A model that already runs under a plan or ``checkpoint_modules`` is refused (measuring it would
    measure the old plan).

    Example:
        >>> from torchckpt.models import gpt
        >>> len(resolve_blocks(gpt("tiny"), "auto"))
        2
    """
    if isinstance(blocks, str):
        if blocks != "auto":
            raise ValueError(f"blocks={blocks!r}: use 'auto' or a list of modules, e.g. blocks=list(model.layers)")
        _refuse_wrapped(model)
        return find_blocks(model)[1]
    block_list = list(blocks)
    _refuse_wrapped(model)
    owned = {id(m) for m in model.modules()}
    for block in block_list:
        if not isinstance(block, nn.Module) or id(block) not in owned:
            raise ValueError(f"blocks=[...] must be submodules of the model; got {type(block).__name__}")
    if not block_list:
        raise ValueError("blocks=[] is empty; give the model's repeated layers, e.g. blocks=list(model.layers)")
    return block_list


def block_paths(model: nn.Module, blocks: Sequence[nn.Module]) -> list[str]:
    """The module path of each block (what a plan records to find them again).

    Example:
        >>> model = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2))
        >>> block_paths(model, list(model))
        ['0', '1']
    """
    names = {id(module): name for name, module in model.named_modules()}
    missing = [type(block).__name__ for block in blocks if id(block) not in names]
    if missing:
        raise ValueError(f"blocks must be submodules of the model; {missing[0]} is not")
    return [names[id(block)] for block in blocks]
