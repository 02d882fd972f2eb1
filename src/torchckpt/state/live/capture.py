"""Capture and restore live training state: named items (model, optimizer, ...) and RNG streams.

Rules kept here (named in ``docs/design.md``; the design notes they keep in parentheses):

1. **[every RNG stream is captured]** (Note: [restore is bit-exact]) Every RNG
   stream a training step may draw from is captured: Python ``random``, NumPy's
   global generator, torch CPU and, once CUDA is initialised, every CUDA device.
   Restoring them makes dropout, shuffling and augmentation continue exactly where
   the interrupted run was.
2. **[an item has state_dict or is a dict]** An item is either an object with
   ``state_dict()``/``load_state_dict()`` (module, optimizer, scheduler,
   StatefulDataLoader, sampler, GradScaler, ...) or a plain ``dict`` of user
   values, restored in place. Anything else is an error that says how to make it
   checkpointable, never a silent skip.
3. **[no half restore]** Restoring applies state only after every item decoded, so
   a corrupt file never leaves objects half restored, and only after every check that
   can be made without loading (:func:`check_item`, :func:`check_rng_devices`): the kind
   of each item; a module's keys and shapes (keys only when no submodule has its own
   loading code or hooks); an optimizer's parameter-group count and sizes; the CUDA
   device count of saved RNG streams. Items that only their own ``load_state_dict`` can
   check (user objects, schedulers, loaders, modules with their own loading code) are
   loaded first, in the order passed, then the checked ones: if such an item refuses
   its state, no checked item and no RNG stream has changed. Only when two of them are
   passed and the second refuses does the first stay loaded.
4. **[RNG streams are restored last]** (Note: [restore is bit-exact]) RNG streams
   are restored last, after every item. Every DataLoader iterator draws a base
   seed from torch's global RNG when it is created; the interrupted run drew it at
   the start of the epoch, before the save. So a restored torchdata
   ``StatefulDataLoader`` gets its resumed iterator created during restore, before
   the RNG streams are set (the loader hands that same iterator to the next
   ``for`` loop); otherwise the resumed run would draw once more and every later
   dropout mask would differ.
5. **[a loader's own generator is captured]** A torchdata ``StatefulDataLoader`` built with
   ``generator=g`` draws each epoch's shuffle and its iterator's seed from ``g``, whose state its own
   ``state_dict`` leaves out: without it a resumed run's next epoch differs. Its state is saved in
   the item (key ``torchckpt_loader_generator``) and set back after the resumed iterator is created.
6. **[restore in place when nobody can tell]** A module is restored without
   copying when nothing could tell the difference: each parameter and buffer takes
   the restored tensor (a view of the buffer the file was read into) as its data,
   in place, so the same Parameter objects stay in the optimizer. Only when every
   live tensor is a plain CPU tensor that owns its memory alone (no view, no other
   tensor or autograd graph sharing it), matches dtype, shape and strides, and no
   module customises loading (hooks, ``_load_from_state_dict``); otherwise
   ``load_state_dict`` copies, with its own checks and error messages.
"""

from __future__ import annotations

import base64
import random
import re
from collections.abc import Mapping
from typing import Any, Protocol, cast

import numpy as np
import torch

from torchckpt._host import RngSnapshot
from torchckpt.state.errors import CheckpointCorruptError, CheckpointMismatchError

RESERVED_ITEM_NAMES = frozenset({"state", "manifest", "metrics", "rng", "step"})
_ITEM_NAME_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]{0,99}$")


class _Stateful(Protocol):
    """An item of kind ``"state_dict"`` ([an item has state_dict or is a dict]; ``item_kind`` checks both
    methods are callable)."""

    def state_dict(self) -> Any: ...

    def load_state_dict(self, state: Any, /) -> Any: ...


def item_kind(name: str, obj: object) -> str:
    """``"state_dict"`` or ``"dict"``: how item ``name`` is captured ([an item has state_dict or is a dict]).

    Example:
        >>> item_kind("model", torch.nn.Linear(2, 2)), item_kind("extras", {"epoch": 1})
        ('state_dict', 'dict')
    """
    check_item_name(name)
    if callable(getattr(obj, "state_dict", None)) and callable(getattr(obj, "load_state_dict", None)):
        return "state_dict"
    if type(obj) is dict:
        return "dict"
    hint = (
        " For data position use torchdata.stateful_dataloader.StatefulDataLoader, a drop-in "
        "DataLoader with state_dict()."
        if type(obj).__name__ == "DataLoader"
        else ""
    )
    raise TypeError(
        f"item {name!r} is a {type(obj).__qualname__}, which has no state_dict()/load_state_dict(); "
        f"expected such an object or a plain dict.{hint}"
    )


def check_item_name(name: str) -> None:
    """Reject names that are not identifiers or collide with torchckpt's own files.

    Example:
        >>> check_item_name("state")  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        ValueError: item name 'state' is reserved (names torchckpt uses: manifest, metrics, rng, state, step); ...
    """
    if name in RESERVED_ITEM_NAMES:
        reserved = ", ".join(sorted(RESERVED_ITEM_NAMES))
        raise ValueError(f"item name {name!r} is reserved (names torchckpt uses: {reserved}); pick another name")
    if not _ITEM_NAME_RE.match(name):
        raise ValueError(f"item name {name!r} must be a Python identifier of at most 100 characters")


def capture_item(name: str, obj: object) -> tuple[str, Any]:
    """(kind, state) of one item, read from the live object.

    Example:
        >>> capture_item("extras", {"epoch": 2})
        ('dict', {'epoch': 2})
    """
    kind = item_kind(name, obj)
    state = cast(_Stateful, obj).state_dict() if kind == "state_dict" else dict(cast(dict, obj))
    generator = _loader_generator(obj)
    if generator is not None and isinstance(state, dict):  # [a loader's own generator is captured]
        state = {**state, LOADER_GENERATOR_KEY: generator.get_state()}
    return kind, state


LOADER_GENERATOR_KEY = "torchckpt_loader_generator"


def _loader_generator(obj: object) -> torch.Generator | None:
    """The ``generator=`` of a torchdata StatefulDataLoader, which its own state_dict leaves out."""
    if not type(obj).__module__.startswith("torchdata.stateful_dataloader"):
        return None
    generator = getattr(obj, "generator", None)
    return generator if isinstance(generator, torch.Generator) else None


_REBUILD_FIX = "Fix: build the object exactly as in the run that saved it (same model, same parameter groups)."


def _rejected(name: str, obj: object, source: str, reason: str) -> CheckpointMismatchError:
    return CheckpointMismatchError(
        f"{source}: item {name!r} ({type(obj).__qualname__}) rejected the saved state: {reason}. {_REBUILD_FIX}"
    )


def check_item(name: str, obj: object, kind: str, state: Any, source: str) -> bool:
    """Raise :class:`CheckpointMismatchError` if ``state`` cannot be loaded into ``obj``, as far as that can be
    told without loading it; changes nothing ([no half restore]). Returns True when loading cannot fail, False
    when only ``obj``'s own loading can tell.

    Example:
        >>> check_item("model", torch.nn.Linear(2, 2), "state_dict", torch.nn.Linear(2, 2).state_dict(), "s.json")
        True
        >>> check_item("model", torch.nn.Linear(2, 2), "state_dict", {"weight": torch.zeros(3, 2)},
        ...            "state.json")  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        torchckpt.state.errors.CheckpointMismatchError: state.json: item 'model' (Linear) rejected the saved ...
    """
    _check_kind(name, obj, kind, source)
    if kind == "dict":
        return True
    _refuse_meta(name, obj, source)
    if isinstance(obj, torch.nn.Module):
        return _check_module(name, obj, state, source)
    if isinstance(obj, torch.optim.Optimizer):
        return _check_optimizer(name, obj, state, source)
    return False


def _refuse_meta(name: str, obj: object, source: str) -> None:
    """A module or optimizer with tensors on the meta device: loading would copy into nothing and succeed."""
    if isinstance(obj, torch.nn.Module):
        tensors = [*obj.named_parameters(), *obj.named_buffers()]
    elif isinstance(obj, torch.optim.Optimizer):
        tensors = [(f"param_groups[{g}].params[{i}]", p) for g, group in enumerate(obj.param_groups)
                   for i, p in enumerate(group["params"])]
    else:
        return
    meta = [key for key, tensor in tensors if tensor.device.type == "meta"]
    if meta:
        raise CheckpointMismatchError(
            f"{source}: item {name!r} ({type(obj).__qualname__}) has tensors on the meta device ({meta[:5]}"
            f"{' ...' if len(meta) > 5 else ''}), which hold no memory: loading would change nothing. Nothing was "
            "restored. Fix: materialise the model first, model.to_empty(device='cpu') (or your device), then "
            "restore (every saved tensor is filled; buffers not in the state_dict stay uninitialised until you set "
            "them), and build the optimizer on the materialised parameters.")


def _check_kind(name: str, obj: object, kind: str, source: str) -> None:
    live_kind = item_kind(name, obj)
    if live_kind != kind:
        raise CheckpointMismatchError(
            f"{source}: item {name!r} was saved as a {kind} but restore got a {live_kind} "
            f"({type(obj).__qualname__}). Fix: pass the same kind of object that was saved."
        )


def _own_loading_code(module: torch.nn.Module, state: Mapping[str, Any]) -> str | None:
    """``"user"`` if loading runs code outside torch (an override, hooks), ``"torch"`` if torch's own overrides
    may change the keys (BatchNorm, InstanceNorm add or drop keys of states saved by an older version of
    them), else None."""
    if type(module).load_state_dict is not torch.nn.Module.load_state_dict:
        return "user"
    versions = getattr(state, "_metadata", None) or {}
    found = None
    for prefix, submodule in module.named_modules():
        if (submodule._load_state_dict_pre_hooks or submodule._load_state_dict_post_hooks
                or type(submodule).set_extra_state is not torch.nn.Module.set_extra_state):
            return "user"
        loader = type(submodule)._load_from_state_dict
        if loader is not torch.nn.Module._load_from_state_dict:
            if not loader.__module__.startswith("torch.nn.modules."):
                return "user"
            saved_version = versions.get(prefix, {}).get("version")
            if not (type(saved_version) is int and saved_version >= type(submodule)._version):
                found = "torch"  # their overrides only touch states of older versions
    return found


def _check_module(name: str, module: torch.nn.Module, state: Any, source: str) -> bool:
    own = _own_loading_code(module, state) if isinstance(state, Mapping) else "user"
    if own == "user":
        return False
    live = module.state_dict()
    problems = []
    if own is None:  # exactly the keys strict load_state_dict requires
        missing = [key for key in live if key not in state]
        unexpected = [key for key in state if key not in live]
        if missing:
            problems.append(f"missing key(s) {missing[:10]}{' ...' if len(missing) > 10 else ''}")
        if unexpected:
            problems.append(f"unexpected key(s) {unexpected[:10]}{' ...' if len(unexpected) > 10 else ''}")
    sizes = [
        f"size mismatch for {key}: saved {list(state[key].shape)}, live {list(tensor.shape)}"
        for key, tensor in live.items()
        if isinstance(tensor, torch.Tensor) and isinstance(state.get(key), torch.Tensor)
        and state[key].shape != tensor.shape
    ]
    problems.extend(sizes[:10])
    if problems:
        raise _rejected(name, module, source, "; ".join(problems))
    return own is None


def _check_optimizer(name: str, optimizer: torch.optim.Optimizer, state: Any, source: str) -> bool:
    hooks = [*getattr(optimizer, "_optimizer_load_state_dict_pre_hooks", {}).values(),
             *getattr(optimizer, "_optimizer_load_state_dict_post_hooks", {}).values()]
    if (type(optimizer).load_state_dict is not torch.optim.Optimizer.load_state_dict
            or not all(getattr(hook, "keeps_state_structure", False) for hook in hooks)):
        return False  # its own loading code may adapt the saved state (a hook that only moves it does not)
    saved = state.get("param_groups") if isinstance(state, Mapping) else None
    if not (isinstance(saved, list) and "state" in state
            and all(isinstance(group, Mapping) and isinstance(group.get("params"), list) for group in saved)):
        raise _rejected(name, optimizer, source, "it is not an optimizer state_dict (no 'state' and 'param_groups')")
    live = optimizer.param_groups
    if len(live) != len(saved):
        raise _rejected(name, optimizer, source, f"the optimizer has {len(live)} parameter group(s); the saved state "
                                                 f"has {len(saved)}")
    for index, (group, saved_group) in enumerate(zip(live, saved)):
        if len(group["params"]) != len(saved_group["params"]):
            raise _rejected(name, optimizer, source, f"parameter group {index} holds {len(group['params'])} "
                                                     f"parameter(s); the saved one holds {len(saved_group['params'])}")
    return True


def apply_item(name: str, obj: object, kind: str, state: Any, source: str) -> None:
    """Load ``state`` (decoded from ``source``) into the live object; restore calls :func:`check_item` on every
    item first ([no half restore]).

    Example:
        >>> extras = {"epoch": 0}
        >>> apply_item("extras", extras, "dict", {"epoch": 4}, "step-000000004/state.json")
        >>> extras
        {'epoch': 4}
    """
    _check_kind(name, obj, kind, source)
    if kind == "dict":
        live = cast(dict, obj)  # item_kind: type(obj) is dict
        live.clear()
        live.update(state)
        return
    # [restore in place when nobody can tell]
    if isinstance(obj, torch.nn.Module) and _load_module_without_copy(obj, state):
        return
    generator_state = None
    if isinstance(state, Mapping) and LOADER_GENERATOR_KEY in state:
        generator_state = state[LOADER_GENERATOR_KEY]
        state = {key: value for key, value in state.items() if key != LOADER_GENERATOR_KEY}
    try:
        cast(_Stateful, obj).load_state_dict(state)
    except (RuntimeError, ValueError, KeyError, TypeError) as error:
        raise _rejected(name, obj, source, str(error)) from error
    _prime_stateful_loader(obj)
    generator = _loader_generator(obj)
    if generator is not None and isinstance(generator_state, torch.Tensor):
        # after priming, which drew the resumed iterator's seed from it once more ([RNG streams are restored last])
        generator.set_state(generator_state.contiguous())


def _load_module_without_copy(module: torch.nn.Module, state: Mapping[str, Any]) -> bool:
    """Give ``module``'s tensors the restored ones as data, in place ([restore in place when nobody can tell]);
    False if it must copy.

    Example:
        >>> layer = torch.nn.Linear(2, 2)
        >>> restored = {k: torch.zeros_like(v) for k, v in layer.state_dict().items()}
        >>> weight = layer.weight
        >>> _load_module_without_copy(layer, restored), layer.weight is weight, layer.weight.sum().item()
        (True, True, 0.0)
    """
    if type(module).load_state_dict is not torch.nn.Module.load_state_dict:
        return False
    for submodule in module.modules():
        if (
            type(submodule)._load_from_state_dict is not torch.nn.Module._load_from_state_dict
            or submodule._load_state_dict_pre_hooks
            or submodule._load_state_dict_post_hooks
        ):
            return False
    live = module.state_dict(keep_vars=True)
    if live.keys() != state.keys():
        return False  # load_state_dict names the missing and unexpected keys
    swaps: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
    for key, tensor in live.items():
        restored = state[key]
        if not (_owns_its_memory(tensor) and _same_layout(tensor, restored)):
            return False
        swaps.setdefault(id(tensor), (tensor, restored))  # tied weights: one tensor under two keys
    with torch.no_grad():
        for tensor, restored in swaps.values():
            tensor.data = restored
    return True


def _owns_its_memory(tensor: object) -> bool:
    if type(tensor) not in (torch.Tensor, torch.nn.Parameter):
        return False  # subclasses (DTensor, quantized wrappers) load through load_state_dict
    assert isinstance(tensor, torch.Tensor)
    if tensor.device.type != "cpu" or tensor.layout != torch.strided or tensor._base is not None:
        return False
    use_count = getattr(torch._C, "_storage_Use_Count", None)
    # 2: the tensor's own reference and the temporary storage object made to ask; more means another
    # tensor, a view or a saved autograd graph shares the memory and would see a copy but not a swap
    return use_count is not None and use_count(tensor.untyped_storage()._cdata) == 2


def _same_layout(tensor: torch.Tensor, restored: object) -> bool:
    return (
        type(restored) is torch.Tensor
        and restored.device.type == "cpu"
        and restored.dtype == tensor.dtype
        and restored.shape == tensor.shape
        and restored.stride() == tensor.stride()
    )


def _prime_stateful_loader(obj: object) -> None:
    """Create a restored StatefulDataLoader's iterator now, before RNG streams are restored
    ([RNG streams are restored last])."""
    if type(obj).__module__.startswith("torchdata.stateful_dataloader"):
        cast(_Stateful, obj).state_dict()  # builds the iterator the next `for` reuses


def _text_of(state: np.ndarray) -> str:
    return base64.b64encode(state.tobytes()).decode("ascii")


def _array_of(text: str) -> np.ndarray:
    return np.frombuffer(base64.b64decode(text, validate=True), dtype=np.uint8).copy()


def capture_rng() -> dict[str, Any]:
    """Every RNG stream's state, as JSON-able values ([every RNG stream is captured]).

    Example:
        >>> sorted(capture_rng())
        ['cuda', 'numpy', 'python', 'torch_cpu']
    """
    torch_streams = RngSnapshot.capture()
    return {
        "python": random.getstate(),
        "numpy": np.random.get_state(),
        "torch_cpu": _text_of(torch_streams.cpu),
        "cuda": [_text_of(state) for state in torch_streams.cuda],
    }


def restore_rng(state: Mapping[str, Any], source: str) -> None:
    """Set every RNG stream from :func:`capture_rng`'s output ([every RNG stream is captured]).

    Example:
        >>> saved = capture_rng(); first = torch.rand(1)
        >>> restore_rng(saved, "state.json"); bool(torch.rand(1) == first)
        True
    """
    check_rng_devices(state, source)
    cuda_states = list(state["cuda"])
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    RngSnapshot(cpu=_array_of(state["torch_cpu"]), cuda=tuple(_array_of(text) for text in cuda_states)).restore()


def check_rng_devices(state: Mapping[str, Any], source: str) -> None:
    """Raise :class:`CheckpointMismatchError` unless this process has as many CUDA devices as ``state`` (from
    :func:`capture_rng`) has CUDA streams; changes nothing ([no half restore]).

    Example:
        >>> check_rng_devices({"cuda": []}, "state.json")  # no CUDA streams saved: any process fits
    """
    saved = len(state["cuda"])
    if saved:
        found = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if found != saved:
            raise CheckpointMismatchError(
                f"{source}: saved RNG streams of {saved} CUDA device(s), this process "
                f"has {found}; resume cannot be bit-exact. Fix: run on the same devices, or pass "
                "restore(..., rng=False) to keep this process's RNG state."
            )


def check_rng(rng: Mapping[str, Any], source: str) -> None:
    """Raise :class:`CheckpointCorruptError` unless ``rng`` (a decoded RNG entry) can be restored; changes no
    RNG stream: each state is tried on a fresh generator (read/load.py's [the whole step checks before anything
    changes]).

    Example:
        >>> check_rng({"python": (3, (1,), None)}, "step-000000001/state.json")  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        torchckpt.state.errors.CheckpointCorruptError: step-000000001/state.json: malformed RNG entry ...
    """
    try:
        random.Random().setstate(rng["python"])
        np.random.RandomState().set_state(rng["numpy"])
        torch.Generator().set_state(torch.from_numpy(_bytes_of(rng["torch_cpu"])))
        for text in rng["cuda"]:
            _bytes_of(text)
    except (KeyError, TypeError, ValueError, RuntimeError, IndexError, OverflowError) as error:
        problem = f"malformed RNG entry ({type(error).__name__}: {error}); nothing was restored from this step"
        raise CheckpointCorruptError(f"{source}: {problem}", {source: problem}) from None


def _bytes_of(text: str) -> np.ndarray:
    if not isinstance(text, str):
        raise TypeError(f"expected base64 text, found {type(text).__name__}")
    return np.frombuffer(base64.b64decode(text, validate=True), dtype=np.uint8).copy()
