"""Save policies: which op outputs inside a checkpointed region are kept instead of recomputed.

The names and meanings follow ``jax.checkpoint_policies``. A policy is a callable that receives one
:class:`OpInfo` (an op that just ran in the forward pass of a checkpointed region) and returns ``True``
to keep its outputs for the backward pass, ``False`` to recompute them.

Rules the executor applies around any policy (checkpoint.py's [the executor overrides the policy]):

1. **[no view, in-place or random op is kept]** View, in-place and random ops are never kept (a view is
   free to recompute; keeping an in-place result would skip the mutation; a random op must draw again
   so later random ops get the same numbers). ``tag`` is the one view that is asked about.
2. **[a value written in place is recomputed]** A kept output that is later modified in place (inside
   the region or after it) is recomputed instead of served, so recomputation always sees the values the
   forward pass saw.
3. **[the policy is asked once]** The policy is asked in the forward pass only; recomputation replays
   the same decisions by position.

Example:
    >>> from torchckpt.executor.policies import resolve_policy
    >>> resolve_policy("dots_saveable").name
    'dots_saveable'
"""

from __future__ import annotations

import itertools
import threading
import weakref
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import torch

__all__ = [
    "OpInfo",
    "can_keep",
    "Policy",
    "nothing_saveable",
    "everything_saveable",
    "dots_saveable",
    "dots_with_no_batch_dims_saveable",
    "save_only_these_names",
    "save_anything_except_these_names",
    "save_from_both_policies",
    "save_ops",
    "parse_occurrence",
    "policy_by_key",
    "tag",
    "resolve_policy",
    "POLICIES",
    "PolicyLike",
    "TAG_STATE",
    "op_name",
]


@dataclass(frozen=True)
class OpInfo:
    """One op that ran inside a checkpointed region, as a policy sees it.

    Attributes:
        func: the ATen overload (e.g. ``torch.ops.aten.mm.default``).
        args, kwargs: the op's arguments (tensors are the real inputs; do not modify them).
        index: position of the op in the region's forward pass, counting from 0.
        tag_name: the name given with :func:`tag` when this op is a tag, else None.
    """

    func: Any
    args: tuple
    kwargs: dict
    index: int
    tag_name: str | None = None

    @property
    def name(self) -> str:
        """The op's name without overload, e.g. ``"aten.mm"``."""
        return op_name(self.func)


def op_name(func: Any) -> str:
    """An ATen op's name without overload, as policies and reports show it.

    Example:
        >>> op_name(torch.ops.aten.mm.default)
        'aten.mm'
    """
    packet = getattr(func, "overloadpacket", func)
    return str(packet).replace("torch.ops.", "")


_REGISTRY: weakref.WeakValueDictionary[str, Policy] = weakref.WeakValueDictionary()
_KEYS = itertools.count()


def _register(policy: Policy) -> str:
    # a str: Dynamo specialises on strings (an int that changes between compiles would become symbolic)
    key = f"policy-{next(_KEYS)}"
    _REGISTRY[key] = policy
    return key


def policy_by_key(key: str) -> Policy:
    """The live :class:`Policy` with this ``key`` (how compiled code finds its policy again).

    Example:
        >>> policy_by_key(nothing_saveable.key) is nothing_saveable
        True
    """
    try:
        return _REGISTRY[key]
    except KeyError:
        raise LookupError(f"no live torchckpt policy has key {key}; the policy object was garbage-collected "
                          "while compiled code still refers to it (keep the handle that applied it)") from None


class Policy:
    """A named save policy: ``policy(op: OpInfo) -> bool`` (True keeps the op's outputs).

    Example:
        >>> keep_mm = Policy("keep_mm", lambda op: op.name == "aten.mm")
        >>> keep_mm
        Policy('keep_mm')
    """

    def __init__(self, name: str, decide: Callable[[OpInfo], bool], *, keeps_nothing: bool = False,
                 by_position: bool = False,
                 occurrences: Iterable[tuple[str, int, int | None] | None] | None = None) -> None:
        if not callable(decide):
            raise TypeError(f"Policy {name!r}: decide must be callable; got {type(decide).__name__}")
        self.name = name
        self._decide = decide
        # True when the policy is known to keep no op: the executor then records nothing in the forward
        # pass (checkpoint.py's [a region that keeps nothing runs on torch's checkpoint alone]).
        self.keeps_nothing = keeps_nothing
        # A policy that decides by ``OpInfo.index`` (``save_ops``) cannot be asked under torch.compile, whose
        # traced graph numbers ops differently; ``occurrences`` says the same choice as (op name, how many ops
        # of that name ran before it in the region) -> the output's bytes, which survives tracing; None entries
        # are ops that cannot be named in a traced graph (Note: [compiled plans keep ops by name and
        # occurrence], ``executor/compiled.py``).
        self.by_position = by_position
        self.occurrences: dict[tuple[str, int], int | None] | None = None
        self.unnamed_under_compile = 0
        if occurrences is not None:
            entries = list(occurrences)
            self.occurrences = {(e[0], e[1]): e[2] for e in entries if e is not None}
            self.unnamed_under_compile = sum(1 for e in entries if e is None)
        # Under torch.compile, a key Dynamo guards on, so each policy gets its own graph
        # (Note: [under torch.compile a region is torch's checkpoint]).
        self.key = _register(self)

    def __call__(self, op: OpInfo) -> bool:
        return bool(self._decide(op))

    def __repr__(self) -> str:
        return f"Policy({self.name!r})"


# Matmul-family ops as they reach the dispatcher (aten.linear and aten.matmul decompose into these).
_DOT_OPS = frozenset({"aten.mm", "aten.addmm", "aten.bmm", "aten.baddbmm", "aten.convolution",
                      "aten._scaled_dot_product_flash_attention_for_cpu",
                      "aten._scaled_dot_product_flash_attention",
                      "aten._scaled_dot_product_efficient_attention",
                      "aten._scaled_dot_product_cudnn_attention",
                      "aten._efficient_attention_forward", "aten._flash_attention_forward"})
# JAX's dot_general without batch dimensions: 2-D matrix products only.
_NO_BATCH_DOT_OPS = frozenset({"aten.mm", "aten.addmm"})

nothing_saveable = Policy("nothing_saveable", lambda op: False, keeps_nothing=True)
"""Keep nothing: recompute the whole region (classic activation checkpointing)."""

everything_saveable = Policy("everything_saveable", lambda op: True)
"""Keep everything: no recomputation. ``checkpoint`` then runs the function plainly."""

dots_saveable = Policy("dots_saveable", lambda op: op.name in _DOT_OPS)
"""Keep outputs of matmul-family ops (mm, addmm, bmm, baddbmm: every ``nn.Linear`` and ``matmul``; convolution).

Never a fused scaled dot-product attention's output: PyTorch tags those ops random (they take a dropout
argument), and random ops are never kept. Where attention runs as bmm, softmax, bmm (CPU with dropout), the two
bmm outputs are kept."""

dots_with_no_batch_dims_saveable = Policy("dots_with_no_batch_dims_saveable",
                                          lambda op: op.name in _NO_BATCH_DOT_OPS)
"""Keep outputs of matrix products without batch dimensions (mm, addmm: every ``nn.Linear``)."""


def _check_names(function: str, names: tuple[str, ...]) -> frozenset[str]:
    for name in names:
        if not isinstance(name, str):
            raise TypeError(f"{function}(*names): every name must be a str; got {name!r}")
    return frozenset(names)


def save_only_these_names(*names: str) -> Policy:
    """Keep only values marked with :func:`tag` under one of ``names``.

    Example:
        >>> save_only_these_names("attn_out", "mlp_in")
        Policy("save_only_these_names('attn_out', 'mlp_in')")
    """
    wanted = _check_names("save_only_these_names", names)
    label = ", ".join(repr(n) for n in names)
    return Policy(f"save_only_these_names({label})", lambda op: op.tag_name in wanted)


def save_anything_except_these_names(*names: str) -> Policy:
    """Keep every op output except values tagged with one of ``names``.

    Example:
        >>> save_anything_except_these_names("scores")
        Policy("save_anything_except_these_names('scores')")
    """
    unwanted = _check_names("save_anything_except_these_names", names)
    label = ", ".join(repr(n) for n in names)
    return Policy(f"save_anything_except_these_names({label})", lambda op: op.tag_name not in unwanted)


def save_from_both_policies(first: PolicyLike, second: PolicyLike) -> Policy:
    """Keep what either policy keeps.

    Example:
        >>> save_from_both_policies("dots_saveable", save_only_these_names("x")).name
        "save_from_both_policies(dots_saveable, save_only_these_names('x'))"
    """
    a, b = resolve_policy(first), resolve_policy(second)
    # a position-based side cannot be combined under torch.compile: the combination is refused there
    return Policy(f"save_from_both_policies({a.name}, {b.name})", lambda op: a(op) or b(op),
                  keeps_nothing=a.keeps_nothing and b.keeps_nothing, by_position=a.by_position or b.by_position)


def save_ops(indices: Iterable[int], name: str = "save_ops", ops: Iterable[str] | None = None) -> Policy:
    """Keep the outputs of the ops at these positions of the region's forward pass.

    This is how a plan expresses a selective-checkpoint choice measured by the profiler. ``ops`` names
    the same ops as ``"aten.mm#2:4096"`` (the op, how many ops of that name ran before it in the region,
    and optionally its output's bytes), one per index, ``"-"`` for one that cannot be named in a traced
    graph: the form a region traced by ``torch.compile`` is lowered with (Note: [compiled plans keep ops
    by name and occurrence]). Without it the policy works eagerly only.

    Example:
        >>> save_ops([0, 3]).name
        'save_ops'
        >>> save_ops([3], ops=["aten.mm#1:4096"]).occurrences
        {('aten.mm', 1): 4096}
    """
    wanted = frozenset(int(i) for i in indices)
    occurrences = None if ops is None else [parse_occurrence(op) for op in ops]
    named = [entry for entry in occurrences or () if entry is not None]
    if occurrences is not None and (len(occurrences) != len(wanted) or len({e[:2] for e in named}) != len(named)):
        raise ValueError(f"save_ops: ops lists {len(occurrences)} entries for {len(wanted)} distinct indices; "
                         "give one distinct 'name#occurrence' (or '-') per index, or leave ops out")
    return Policy(name, lambda op: op.index in wanted, keeps_nothing=not wanted, by_position=bool(wanted),
                  occurrences=occurrences)


def parse_occurrence(text: str) -> tuple[str, int, int | None] | None:
    """``"aten.mm#2:4096"`` as ``("aten.mm", 2, 4096)``: an op name, how many ops of that name ran before it,
    and its output's bytes (optional); ``"-"`` (an op that cannot be named in a traced graph) as None.

    Example:
        >>> parse_occurrence("aten.addmm#0:4096"), parse_occurrence("aten.mm#3"), parse_occurrence("-")
        (('aten.addmm', 0, 4096), ('aten.mm', 3, None), None)
    """
    if text == "-":
        return None
    head, _, size = text.partition(":") if isinstance(text, str) else ("", "", "")
    name, sep, count = head.rpartition("#")
    if not sep or not name or not count.isdigit() or (size and not size.isdigit()):
        raise ValueError(f"an op occurrence is written 'name#k' or 'name#k:bytes' (e.g. 'aten.mm#2:4096': the third "
                         f"aten.mm of the region, 4096 bytes), or '-'; got {text!r}")
    return name, int(count), int(size) if size else None


PolicyLike = Policy | str | Callable[[OpInfo], bool] | None


POLICIES: dict[str, Policy] = {
    p.name: p for p in (nothing_saveable, everything_saveable, dots_saveable, dots_with_no_batch_dims_saveable)
}
"""Named policies usable as strings: ``checkpoint(fn, x, policy="dots_saveable")``."""


def resolve_policy(policy: PolicyLike) -> Policy:
    """Turn a policy name, callable or None (= ``nothing_saveable``) into a :class:`Policy`.

    Example:
        >>> resolve_policy(None).name
        'nothing_saveable'
        >>> resolve_policy(lambda op: op.name == "aten.mm").name
        '<lambda>'
    """
    if policy is None:
        return nothing_saveable
    if isinstance(policy, Policy):
        return policy
    if isinstance(policy, str):
        if policy not in POLICIES:
            valid = ", ".join(sorted(POLICIES))
            hint = ("; name-based policies are built with save_only_these_names(...) or "
                    "save_anything_except_these_names(...)")
            raise ValueError(f"unknown policy {policy!r}; valid names: {valid}{hint}")
        return POLICIES[policy]
    if callable(policy):
        return Policy(getattr(policy, "__name__", type(policy).__name__), policy)
    raise TypeError(f"policy must be a name ({', '.join(sorted(POLICIES))}), a Policy, a callable "
                    f"taking an OpInfo, or None; got {type(policy).__name__}")


# ----------------------------------------------------------------------------------------------- tag
class _TagState(threading.local):
    pending_name: str | None = None
    active_regions: int = 0
    checks: int = 0  # > 0 inside ``recompute_checks()``: every region records and checks its recomputation


TAG_STATE = _TagState()
"""Per-thread: the name of a tag being applied, and how many checkpointed regions are active."""


def tag(tensor: torch.Tensor, name: str) -> torch.Tensor:
    """Mark ``tensor`` with ``name`` for the name-based policies (like ``jax.ad_checkpoint.checkpoint_name``).

    Returns a view of ``tensor`` (no copy) inside a checkpointed region, and ``tensor`` itself outside
    one. Use the returned value afterwards.

    Example:
        >>> x = torch.ones(3)
        >>> tag(x, "hidden") is x          # outside a checkpointed region: identity
        True
    """
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"tag(tensor, name): tensor must be a torch.Tensor; got {type(tensor).__name__}")
    if not isinstance(name, str) or not name:
        raise TypeError(f"tag(tensor, name): name must be a non-empty str; got {name!r}")
    if TAG_STATE.active_regions == 0:
        return tensor
    TAG_STATE.pending_name = name
    try:
        return torch.ops.aten.alias.default(tensor)
    finally:
        TAG_STATE.pending_name = None


def _is_keepable(func: Any, tag_name: str | None) -> bool:
    schema = func._schema
    if schema.is_mutable or torch.Tag.nondeterministic_seeded in func.tags:
        # Random ops must draw again in recomputation, or every later random op shifts. ATen tags every
        # op that may draw so, including the attention kernels that take ``dropout_p`` (SDPA).
        return False
    if tag_name is not None:
        return True
    return not any(ret.alias_info is not None for ret in schema.returns)


def can_keep(func: Any, flat: list[Any], tag_name: str | None) -> bool:
    """Whether a policy is asked about this op at all: every output is a tensor and the op is not a view,
    in-place or random op ([no view, in-place or random op is kept]). The profiler offers the planner only
    ops that pass.

    Example:
        >>> x = torch.ones(2, 2)
        >>> can_keep(torch.ops.aten.mm.default, [x], None), can_keep(torch.ops.aten.view.default, [x], None)
        (True, False)
    """
    return bool(flat) and all(isinstance(v, torch.Tensor) for v in flat) and _is_keepable(func, tag_name)
