"""What a checkpointed loop keeps about a carry: its layout (structure, paths, shapes), the stored copies
of it (``CarrySnapshot``) and the autocast settings its recomputation re-enters.

``torchckpt.loops.runner`` explains how these are used (module docstring, "How it works").
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator, Sequence
from typing import Any

import torch

from torchckpt._host import RngSnapshot

__all__ = ["AutocastState", "Carry", "CarryLayout", "CarrySnapshot"]

Carry = Any  # a tensor, or tuples / lists / dicts / namedtuples of tensors


def _flatten(tree: Carry, path: str, leaves: list[torch.Tensor], paths: list[str]) -> Any:
    """Append the tensors of ``tree`` to ``leaves``; return a hashable description of its structure."""
    if isinstance(tree, torch.Tensor):
        leaves.append(tree)
        paths.append(path)
        return None
    if isinstance(tree, tuple) and hasattr(tree, "_fields"):
        return (type(tree), tuple(_flatten(getattr(tree, f), f"{path}.{f}", leaves, paths) for f in tree._fields))
    if isinstance(tree, (tuple, list)):
        return (type(tree), tuple(_flatten(v, f"{path}[{i}]", leaves, paths) for i, v in enumerate(tree)))
    if isinstance(tree, dict):
        keys = tuple(tree)
        return (dict, keys, tuple(_flatten(tree[k], f"{path}[{k!r}]", leaves, paths) for k in keys))
    raise TypeError(
        f"{path} is a {type(tree).__name__}; a carry may hold only tensors, in tuples, lists, dicts and "
        f"namedtuples. Make it a tensor, or close over it in step_fn instead of carrying it."
    )


def _unflatten(spec: Any, leaves: Iterator[torch.Tensor]) -> Carry:
    if spec is None:
        return next(leaves)
    if spec[0] is dict:
        return {k: _unflatten(s, leaves) for k, s in zip(spec[1], spec[2])}
    kind, children = spec
    values = [_unflatten(s, leaves) for s in children]
    if hasattr(kind, "_fields"):
        return kind(*values)
    return kind(values)


@dataclasses.dataclass(frozen=True)
class CarryLayout:
    """Structure, paths and (shape, dtype, device) of every leaf: what every step must keep.

    Example:
        >>> layout, leaves = CarryLayout.of({"h": torch.zeros(2, 3), "c": (torch.ones(2),)})
        >>> layout.paths, layout.nbytes
        (("carry['h']", "carry['c'][0]"), 32)
        >>> layout.build(leaves)["c"][0].tolist()
        [1.0, 1.0]
    """

    spec: Any
    paths: tuple[str, ...]
    metas: tuple[tuple[tuple[int, ...], torch.dtype, torch.device], ...]

    @staticmethod
    def of(carry: Carry) -> tuple[CarryLayout, list[torch.Tensor]]:
        """The layout of ``carry`` and its tensors in layout order; raises if it holds no tensor."""
        leaves: list[torch.Tensor] = []
        paths: list[str] = []
        spec = _flatten(carry, "carry", leaves, paths)
        if not leaves:
            raise ValueError("the carry holds no tensors; a checkpointed loop needs at least one tensor.")
        metas = tuple((tuple(t.shape), t.dtype, t.device) for t in leaves)
        return CarryLayout(spec, tuple(paths), metas), leaves

    def leaves_of(self, carry: Carry, step: int) -> list[torch.Tensor]:
        """Flatten a carry returned by step ``step``, checking it matches the initial carry."""
        layout, leaves = CarryLayout.of(carry)
        if layout.spec != self.spec:
            raise ValueError(
                f"step_fn changed the carry's structure at step {step}: it received leaves "
                f"{list(self.paths)} and returned {list(layout.paths)}. step_fn must return the same "
                f"structure (same containers, keys and number of tensors) that it receives."
            )
        for path, old, new in zip(self.paths, self.metas, layout.metas):
            if old != new:
                raise ValueError(
                    f"step_fn changed {path} at step {step}: shape {old[0]}, dtype {old[1]}, device "
                    f"{old[2]} became shape {new[0]}, dtype {new[1]}, device {new[2]}. A checkpointed "
                    f"loop stores carries of one fixed size, so every step must keep shapes, dtypes and "
                    f"devices; pad or cast inside step_fn."
                )
        return leaves

    def build(self, leaves: Sequence[torch.Tensor]) -> Carry:
        """A carry of this structure holding ``leaves`` (in layout order)."""
        return _unflatten(self.spec, iter(leaves))

    @property
    def nbytes(self) -> int:
        """Bytes of one carry (all leaves)."""
        return sum(_numel(shape) * torch.empty((), dtype=dtype).element_size() for shape, dtype, _ in self.metas)


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for size in shape:
        n *= size
    return n


@dataclasses.dataclass(frozen=True)
class AutocastState:
    """Autocast settings of the forward pass, re-entered for every recomputation (loops/runner.py's
    [checkpoints hold carry and RNG]).

    Example:
        >>> with torch.autocast("cpu", dtype=torch.bfloat16):
        ...     state = AutocastState.capture()
        >>> state.enabled
        (('cpu', torch.bfloat16),)
    """

    enabled: tuple[tuple[str, torch.dtype], ...]  # (device type, dtype) of each enabled autocast

    @staticmethod
    def capture() -> AutocastState:
        """The autocast settings active now (CPU, and CUDA where available)."""
        device_types = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
        return AutocastState(
            tuple((d, torch.get_autocast_dtype(d)) for d in device_types if torch.is_autocast_enabled(d))
        )

    def enter(self, stack: contextlib.ExitStack) -> None:
        """Enter these autocast settings on ``stack``; they end when the stack closes."""
        for device_type, dtype in self.enabled:
            stack.enter_context(torch.autocast(device_type, dtype=dtype))


@dataclasses.dataclass(frozen=True)
class CarrySnapshot:
    """A stored carry x_i: detached aliases, their version counters, and the RNG state before step i+1.

    The version counters show whether a stored leaf was modified in place after it was stored.

    Example:
        >>> x = torch.ones(2)
        >>> snapshot = CarrySnapshot((x.detach(),), (x._version,), RngSnapshot.capture())
        >>> snapshot.versions
        (0,)
    """

    leaves: tuple[torch.Tensor, ...]
    versions: tuple[int, ...]
    rng: RngSnapshot | None
