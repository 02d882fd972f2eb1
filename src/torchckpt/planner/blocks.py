"""Find a model's repeated blocks (``blocks="auto"``), and name them in messages.

The rule, in order (``find_blocks``):

1. A model that names its blocks itself, with a method ``torchckpt_blocks()`` returning them in
   forward order, gets those (the built-in U-Net).
2. A U-Net laid out as diffusers lays them out (a module with ``down_blocks`` and ``up_blocks``
   ModuleLists and a ``mid_block``: ``UNet2DModel``, ``UNet2DConditionModel``) gets its down blocks, its
   mid block and its up blocks, in that order, which is the order its forward runs them. Their classes
   differ from block to block, so the search below cannot find them.
3. Otherwise the blocks are the instances of one class taken across every ``ModuleList`` and
   ``Sequential`` of the model:

   - a *candidate* class is one that some container holds two or more of in a row; its instances are
     all the children of containers of that class (in every container, so a ConvNeXt or ResNet's
     blocks are gathered from all of its stages), less those holding another of its instances (a
     ``Sequential`` stage of ``Sequential`` blocks gives the blocks);
   - a candidate whose instances each hold fewer than two weight layers (modules with a parameter of
     two or more dimensions: convolutions, linear layers) and lie, some of them, inside instances of
     another candidate is a layer of those blocks, not a block (HF ResNet's ``ResNetConvLayer`` inside
     each ``ResNetBasicLayer``);
   - the candidate with the most instances wins (a stage holds several blocks, so blocks outnumber
     stages: ConvNeXt's ``ConvNextLayer``s, not its ``ConvNextStage``s); classes tied with it are taken
     too when their instances are disjoint from its (encoder and decoder layers of two classes), and of
     two tied classes one inside the other the outer one is kept.

   Blocks come in ``named_modules`` order, which is their forward order in every model above (HF
   ``model.layers``, GPT-2 ``transformer.h``, BERT ``encoder.layer``, T5 ``encoder.block`` then
   ``decoder.block``, ConvNeXt/ResNet ``encoder.stages.i.layers``, torchvision ``layer1..layer4``). A
   model that runs them in another order (diffusers' AutoencoderKL registers its decoder's up blocks
   before the mid block it runs first) is profiled again with the blocks in the order they ran, which
   the first step measured (``profile``); blocks given by hand in another order are refused, named
   in the order they ran. Blocks of one
   class may differ in parameters (T5's first block also holds the relative position bias).

A model the rule gets wrong (e.g. a mixture of experts, whose experts outnumber its layers) is planned
with ``blocks=[...]`` given by hand. ``describe_paths`` is how messages name a list of blocks.
"""

from __future__ import annotations

import inspect
from collections.abc import Sequence
from typing import Any

from torch import nn

from torchckpt.executor.compiled import is_compiled_module, uncompiled

__all__ = ["block_paths", "block_pieces", "describe_paths", "find_blocks", "other_groupings", "positional_form",
           "own_type", "resolve_blocks", "structure_key"]

_FIRST_PARAMETER: dict[type, str | None] = {}  # a block class -> its forward's first parameter, if by-keyword-able


def structure_key(module: nn.Module) -> tuple:
    """A hashable description of a module's structure (types, nesting, parameter shapes and dtypes).

    Example:
        >>> structure_key(nn.Linear(2, 3)) == structure_key(nn.Linear(2, 3))
        True
        >>> structure_key(nn.Linear(2, 3)) == structure_key(nn.Linear(3, 3))
        False
    """
    module = uncompiled(module)  # torch.compile(block) has the block's structure
    params = tuple((name, tuple(p.shape), str(p.dtype)) for name, p in module.named_parameters(recurse=False))
    children = tuple((name, structure_key(child)) for name, child in module.named_children())
    return (own_type(module).__qualname__, params, children)


def own_type(module: nn.Module) -> type:
    """The module's class as written: FSDP2's ``fully_shard`` swaps it for a subclass ``FSDP<name>``, which a plan
    made before sharding (torchtitan's order) must not take for another model. Its parameters' shapes are the
    unsharded ones (``DTensor.shape``), so the structure is the same too.

    Example:
        >>> own_type(nn.Linear(2, 3)).__name__
        'Linear'
    """
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:
        return type(module)
    if isinstance(module, FSDPModule):
        return next((base for base in type(module).__bases__ if not issubclass(base, FSDPModule)), type(module))
    return type(module)


def block_pieces(block: nn.Module) -> list[nn.Module]:
    """The pieces a block may checkpoint inside itself (costs.py's [pieces nested inside a block]): its direct
    children that hold parameters (attention, MLP, norms; convolutions), in registration order; none when fewer
    than two (nothing to split), and none for a block that holds buffers: a BatchNorm's running statistics were
    updated twice with a ResNet block's convolutions nested (tests/planner/test_blocks_staged.py), where the
    block's own recomputation leaves them alone (executor/checkpoint.py's [recomputation leaves buffers alone]).

    Example:
        >>> block = nn.Sequential(nn.Linear(4, 8), nn.GELU(), nn.Linear(8, 4))
        >>> [type(piece).__name__ for piece in block_pieces(block)]
        ['Linear', 'Linear']
        >>> block_pieces(nn.Linear(4, 4))
        []
    """
    if any(True for _ in block.buffers()):
        return []
    pieces = [child for child in block.children() if any(True for _ in child.parameters())]
    return pieces if len(pieces) >= 2 else []


def describe_paths(paths: Sequence[str]) -> str:
    """Block paths as messages name them: all of them when few, else the first and last and the count.

    Example:
        >>> describe_paths(["model.layers.0", "model.layers.1"])
        'model.layers.0, model.layers.1 (2 blocks)'
        >>> describe_paths([f"encoder.stages.{s}.layers.{i}" for s in range(4) for i in range(3)])
        'encoder.stages.0.layers.0 … encoder.stages.3.layers.2 (12 blocks)'
    """
    paths = [path or "(the model itself)" for path in paths]
    if not paths:
        return "no blocks"
    count = f"({len(paths)} block{'s' if len(paths) != 1 else ''})"
    if len(paths) <= 3:
        return f"{', '.join(paths)} {count}"
    return f"{paths[0]} … {paths[-1]} {count}"


def _first_parameter(cls: type[nn.Module]) -> str | None:
    if cls not in _FIRST_PARAMETER:
        name = None
        try:
            parameters = list(inspect.signature(cls.forward).parameters.values())[1:]  # after self
        except (TypeError, ValueError):  # no readable signature: calls are taken as they come
            parameters = []
        if parameters and parameters[0].kind is inspect.Parameter.POSITIONAL_OR_KEYWORD:
            name = parameters[0].name
        _FIRST_PARAMETER[cls] = name
    return _FIRST_PARAMETER[cls]


def positional_form(module: nn.Module, args: tuple, kwargs: dict[str, Any]) -> tuple[tuple, dict[str, Any]]:
    """A block call with its first parameter passed by position: ``block(hidden_states=h, temb=e)`` reads
    as ``block(h, temb=e)`` (the same call: the values bind to the same parameters of the class's
    ``forward``). The profiler and regions take a block's first positional argument as its input (the
    hidden state), so every call is read through this; calls with positional arguments are unchanged.

    Example:
        >>> class Block(nn.Module):
        ...     def forward(self, hidden_states, temb=None):
        ...         return hidden_states
        >>> positional_form(Block(), (), {"temb": 2, "hidden_states": 1})
        ((1,), {'temb': 2})
        >>> positional_form(Block(), (1,), {"temb": 2})
        ((1,), {'temb': 2})
    """
    if args or not kwargs:
        return args, kwargs
    first = _first_parameter(type(module))
    if first is None or first not in kwargs:
        return args, kwargs
    rest = dict(kwargs)
    return (rest.pop(first),), rest


def _runs(children: Sequence[nn.Module]) -> list[list[nn.Module]]:
    runs: list[list[nn.Module]] = []
    for child in children:
        if runs and type(runs[-1][0]) is type(child):
            runs[-1].append(child)
        else:
            runs.append([child])
    return runs


def _inside(path: str, outer: str) -> bool:
    return outer == "" or path.startswith(f"{outer}.")


def _weight_layers(module: nn.Module) -> int:
    return sum(1 for sub in module.modules() if any(p.dim() >= 2 for p in sub.parameters(recurse=False)))


def _unet_blocks(model: nn.Module) -> tuple[str, list[nn.Module]] | None:
    """Rule 2: the first module laid out as a diffusers U-Net: down blocks, mid block, up blocks."""
    for name, module in model.named_modules():
        down, up = getattr(module, "down_blocks", None), getattr(module, "up_blocks", None)
        if isinstance(down, nn.ModuleList) and isinstance(up, nn.ModuleList) and hasattr(module, "mid_block"):
            mid = module.mid_block
            blocks = [*down, *([mid] if isinstance(mid, nn.Module) else []), *up]
            if len(blocks) >= 2:
                prefix = f"{name}." if name else ""
                parts = ["down_blocks", *(["mid_block"] if isinstance(mid, nn.Module) else []), "up_blocks"]
                return "+".join(prefix + part for part in parts), blocks
    return None


def _search(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """Rule 3: (path, block) in named_modules order; empty when no container holds two of one class in a row."""
    order, kept = _candidates(model)
    most = max((len(found_) for found_ in kept.values()), default=0)
    tied = [cls for cls, found_ in kept.items() if len(found_) == most]
    chosen = [cls for cls in tied if not any(o is not cls and _within(kept, cls, o) for o in tied)]
    blocks = [entry for cls in chosen for entry in kept[cls]]
    return sorted(blocks, key=lambda entry: order[id(entry[1])][0])


def _within(candidates: dict[type, list[tuple[str, nn.Module]]], inner: type, outer: type, every: bool = True) -> bool:
    """Whether instances of ``inner`` lie inside ``outer``'s (every one of them, or any)."""
    test = all if every else any
    return test(any(_inside(path, other) for other, _ in candidates[outer]) for path, _ in candidates[inner])


def other_groupings(model: nn.Module, chosen: Sequence[str]) -> list[tuple[str, list[str]]]:
    """Other ways to cut ``model`` into blocks than the paths ``chosen``: the instances of each other candidate
    class of rule 3, and the children of each container of two or more children of mixed classes that each hold
    two or more weight layers (a model's stages). ``(description, paths)`` pairs, paths in forward order.

    Example:
        >>> def block() -> nn.Module:
        ...     return nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 4))
        >>> class Stage(nn.Sequential):
        ...     pass
        >>> staged = nn.Sequential(Stage(block(), block()), nn.Sequential(nn.Conv1d(4, 4, 1), block(), block()))
        >>> other_groupings(staged, ["0.0", "0.1", "1.1", "1.2"])
        [('stages 0, 1 (Sequential)', ['0', '1'])]
    """
    order, kept = _candidates(model)
    found = []
    for cls, entries in kept.items():
        paths = [path for path, _ in entries]
        if len(paths) >= 2 and set(paths) != set(chosen):
            found.append((f"{cls.__name__} ({len(paths)} blocks)", paths))
    for name, container in model.named_modules():
        children = list(container.named_children())
        if (not isinstance(container, (nn.ModuleList, nn.Sequential)) or len(children) < 2
                or len({type(child) for _, child in children}) < 2
                or any(_weight_layers(child) < 2 for _, child in children)):
            continue
        paths = [f"{name}.{child}" if name else child for child, _ in children]
        if set(paths) != set(chosen):
            shown = ", ".join(child for child, _ in children)
            found.append((f"stages {shown} ({name or type(container).__name__})", paths))
    return found


def _candidates(model: nn.Module) -> tuple[dict[int, tuple[int, str]], dict[type, list[tuple[str, nn.Module]]]]:
    """Rule 3's candidate classes, less those that are layers of another: (named_modules order by id, class ->
    its (path, instance) pairs in order)."""
    order = {id(module): (i, name) for i, (name, module) in enumerate(model.named_modules())}
    repeated: set[type] = set()
    found: dict[type, dict[int, nn.Module]] = {}
    for _, container in model.named_modules():
        if not isinstance(container, (nn.ModuleList, nn.Sequential)):
            continue
        children = list(container.children())
        repeated.update(type(run[0]) for run in _runs(children) if len(run) >= 2)
        for child in children:
            if not isinstance(child, nn.ModuleList):
                found.setdefault(type(child), {})[id(child)] = child
    candidates: dict[type, list[tuple[str, nn.Module]]] = {}
    for cls in repeated - {nn.ModuleList}:
        ranked = sorted((order[id(m)] for m in found[cls].values()), key=lambda entry: entry[0])
        paths = [path for _, path in ranked]
        candidates[cls] = [(path, model.get_submodule(path)) for path in paths
                           if not any(_inside(other, path) for other in paths if other != path)]

    layers = {cls for cls, found_ in candidates.items() if all(_weight_layers(m) < 2 for _, m in found_)
              and any(_within(candidates, cls, other, every=False) for other in candidates if other is not cls)}
    return order, {cls: found_ for cls, found_ in candidates.items() if cls not in layers}


def _containers(paths: Sequence[str]) -> str:
    parents = list(dict.fromkeys(path.rpartition(".")[0] for path in paths))
    if len(parents) <= 2:
        return "+".join(parents)
    return f"{parents[0]} … {parents[-1]} ({len(parents)} containers)"


def find_blocks(model: nn.Module) -> tuple[str, list[nn.Module]]:
    """Return ``(where, blocks)``: the model's repeated blocks in forward order (the rule: module docstring)
    and where they live (their containers, ``"+"``-joined, or ``"torchckpt_blocks()"``).

    Raises ValueError naming ``blocks=`` when the model has no repeated blocks by that rule.

    Example:
        >>> from torchckpt.models import gpt
        >>> name, blocks = find_blocks(gpt("tiny"))
        >>> name, len(blocks)
        ('blocks', 2)
        >>> def block() -> nn.Module:
        ...     return nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 4))
        >>> staged = nn.Sequential(nn.Linear(4, 4), nn.Sequential(block(), block()), nn.Sequential(block(), block()))
        >>> name, blocks = find_blocks(staged)
        >>> name, len(blocks)
        ('1+2', 4)
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"find_blocks: expected an nn.Module; got {type(model).__name__}")
    named = getattr(model, "torchckpt_blocks", None)
    if callable(named):
        blocks = list(named())
        if not blocks or not all(isinstance(block, nn.Module) for block in blocks):
            raise ValueError(f"{type(model).__name__}.torchckpt_blocks() must return a non-empty list of modules")
        return "torchckpt_blocks()", blocks
    unet = _unet_blocks(model)
    if unet is not None:
        return unet
    found = _search(model)
    if not found:
        raise ValueError(
            f"{type(model).__name__} has no ModuleList or Sequential holding two or more modules of one class, so "
            "torchckpt cannot find its repeated blocks; pass them explicitly, in the order they run: "
            "torchckpt.plan(model, inputs, budget='6GiB', blocks=[...]) (often a ModuleList's contents, "
            "e.g. list(model.layers); print(model) shows the model's modules)")
    return _containers([path for path, _ in found]), [block for _, block in found]


def _refuse_wrapped(model: nn.Module) -> None:
    own = [name or type(model).__name__ for name, module in model.named_modules()
           if getattr(module, "gradient_checkpointing", False) is True]
    if own:  # HF's (and diffusers') own checkpointing sets this flag on the modules it wraps
        raise ValueError(f"{type(model).__name__} has its library's own gradient checkpointing on ({own[0]!r}"
                         f"{f' and {len(own) - 1} more' if len(own) > 1 else ''}), so its plain step is already "
                         "checkpointed and a plan would be measured on top of it. Fix: call "
                         "model.gradient_checkpointing_disable() (HF; diffusers: disable_gradient_checkpointing()) "
                         "and do not pass gradient_checkpointing=True to TrainingArguments; the plan replaces it")
    for name, module in model.named_modules():
        if "forward" in vars(module) and not is_compiled_module(module):  # torch.compile sets one too
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
        return [uncompiled(block) for block in find_blocks(model)[1]]
    block_list = list(blocks)
    _refuse_wrapped(model)
    owned = {id(m) for m in model.modules()}
    for block in block_list:
        if not isinstance(block, nn.Module) or id(block) not in owned:
            raise ValueError(f"blocks=[...] must be submodules of the model; got {type(block).__name__}")
    if not block_list:
        raise ValueError("blocks=[] is empty; give the model's repeated layers, e.g. blocks=list(model.layers)")
    return [uncompiled(block) for block in block_list]  # Note: [a compiled model is planned through its original]


def block_paths(model: nn.Module, blocks: Sequence[nn.Module]) -> list[str]:
    """The module path of each block (what a plan records to find them again).

    Example:
        >>> model = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2))
        >>> block_paths(model, list(model))
        ['0', '1']
    """
    # a block compiled on its own is found by the path of its compiled wrapper, whether or not it is compiled
    # when the plan is applied (Note: [a compiled model is planned through its original])
    names = {id(module): ".".join(part for part in name.split(".") if part != "_orig_mod")
             for name, module in model.named_modules()}
    missing = [type(block).__name__ for block in blocks if id(block) not in names]
    if missing:
        raise ValueError(f"blocks must be submodules of the model; {missing[0]} is not")
    return [names[id(block)] for block in blocks]
