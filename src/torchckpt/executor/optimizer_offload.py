"""The optimizer's state in host memory between steps, brought to the device one parameter at a time.

An AdamW's state is twice its parameters, and it stays on the device for the whole step although only
``optimizer.step()`` reads it. ``OptimizerOffload(optimizer)`` keeps it in host memory instead (pinned on CUDA;
on the CPU the second pool of ``memory/host_pool.py``, which ``MemoryMeter`` does not count as device bytes), so
the device holds, beyond parameters and gradients, at most one parameter's state at a time. Rules:

1. **[the state lives on the host between steps]** Every state tensor with one or more dimensions and some
   elements (AdamW's ``exp_avg`` and ``exp_avg_sq``, SGD's ``momentum_buffer``) is moved into a host tensor when
   the offload is made and after each update that made it; ``optimizer.load_state_dict`` puts it straight into host
   tensors (taken out of the loaded dict before torch would copy it all next to the parameters, and cast as torch
   casts it), and what a restore by assignment put back is moved again before the next step. Scalars (AdamW's
   ``step``) and empty tensors stay where the optimizer keeps them. ``optimizer.state_dict()`` and checkpoints see
   host tensors; ``remove()`` moves the state back to its parameters' devices (``remove(to_device=False)`` leaves it,
   for a caller about to drop or replace it). The host bytes are counted apart from offloaded activations
   (``host_pool.host_state_bytes``), outside any activation host budget.
2. **[one parameter's state on the device at a time]** ``optimizer.step()`` runs, before the optimizer's own step,
   the optimizer's update one parameter at a time (executor/one_parameter.py): that parameter's state is copied
   to its device, updated there, copied back into the same host tensors, and the device copies go before the next
   parameter. Then the optimizer's own step runs with the gradients held aside (it finds none and changes nothing,
   while its hooks and an LR scheduler's bookkeeping run as always), and the gradients come back (also when an
   update raises). A step pre-hook registered after the offload would run after the update and find no gradients:
   the step refuses it. On CUDA the copies are asynchronous on the current stream (ordered with the update, the
   caching allocator safe), and the step ends by synchronising every device a parameter is on, so the host
   tensors are final when it returns. With the optimizer inside the backward pass
   (executor/optimizer_in_backward.py) each of its per-parameter updates does the same, synchronised when the
   backward pass ends.
3. **[the update stays the optimizer's own]** On the CPU, where optimizers take one tensor at a time by default, the
   parameters and state after the step are bitwise those of the plain ``optimizer.step()``
   (tests/executor/test_optimizer_offload.py). A closure (``step(closure)``), LBFGS, fused optimizers, sparse
   parameters and FSDP2's sharded (DTensor) parameters are refused with the reason.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Iterator
from typing import Any

import torch

from torchckpt.executor.one_parameter import hyperparameters, one_parameter_optimizer, refuse_unsplittable
from torchckpt.memory.host_pool import host_tensor, is_host_tensor, unmetered

__all__ = ["OptimizerOffload", "state_offload_of"]

# id(optimizer) -> its offload, weakly: the optimizer's hooks keep an offload alive, not this table
_ACTIVE: weakref.WeakValueDictionary[int, OptimizerOffload] = weakref.WeakValueDictionary()


def state_offload_of(optimizer: torch.optim.Optimizer) -> OptimizerOffload | None:
    """The ``OptimizerOffload`` keeping ``optimizer``'s state in host memory now, if any.

    Example:
        >>> state_offload_of(torch.optim.SGD([torch.nn.Parameter(torch.ones(1))], lr=0.1)) is None
        True
    """
    offload = _ACTIVE.get(id(optimizer))
    return offload if offload is not None and offload.optimizer is optimizer else None


class OptimizerOffload:
    """Keep ``optimizer``'s state in host memory between steps (module docstring's rules) until ``remove()``.

    ``pin`` (default: on CUDA) pins the host tensors. ``updates`` counts the per-parameter updates run.

    Example:
        >>> layer = torch.nn.Linear(256, 256)
        >>> optimizer = torch.optim.AdamW(layer.parameters())
        >>> offload = OptimizerOffload(optimizer)
        >>> layer(torch.ones(4, 256)).sum().backward()
        >>> optimizer.step()
        >>> offload.updates, all(is_host_tensor(state["exp_avg"]) for state in optimizer.state.values())
        (2, True)
        >>> offload.remove()
        >>> is_host_tensor(optimizer.state[layer.weight]["exp_avg"])
        False
    """

    def __init__(self, optimizer: torch.optim.Optimizer, *, pin: bool | None = None) -> None:
        refuse_unsplittable(optimizer, "OptimizerOffload")
        if pin is not None and not isinstance(pin, bool):
            raise TypeError(f"OptimizerOffload(pin=...): expected None, True or False; got {pin!r}")
        if state_offload_of(optimizer) is not None:
            raise ValueError("OptimizerOffload: this optimizer's state is already in host memory; remove() the "
                             "earlier offload first")
        if any(type(p).__name__ == "DTensor" for group in optimizer.param_groups for p in group["params"]):
            raise ValueError("OptimizerOffload: the parameters are DTensors (sharded by FSDP2), whose state it does "
                             "not move yet; use FSDP2's own offload, "
                             "fully_shard(..., offload_policy=CPUOffloadPolicy()), "
                             "which keeps parameters, gradients and optimizer state in host memory")
        self.optimizer = optimizer
        devices = {p.device.type for group in optimizer.param_groups for p in group["params"]}
        self.pin = ("cuda" in devices and torch.cuda.is_available()) if pin is None else pin
        self.updates = 0
        self._singles: dict[int, torch.optim.Optimizer] = {}
        self._held: list[tuple[torch.Tensor, torch.Tensor]] = []
        self._loading: list[tuple[torch.Tensor, str, torch.Tensor]] = []
        self._synced_task = -1
        self._hooks = [optimizer.register_step_pre_hook(self._before_step),
                       optimizer.register_step_post_hook(self._after_step),
                       optimizer.register_load_state_dict_pre_hook(self._before_load),
                       optimizer.register_load_state_dict_post_hook(self._after_load)]
        self._own_hook = self._hooks[0].id
        _ACTIVE[id(optimizer)] = self
        self._to_host()

    # ------------------------------------------------------------------------------------ where the state lives
    @staticmethod
    def _movable(value: object) -> bool:
        """A state tensor that goes to the host: one or more dimensions and some elements (an empty one holds no
        memory, and has no address to be known by)."""
        return isinstance(value, torch.Tensor) and value.dim() > 0 and value.numel() > 0

    def _to_host(self) -> None:
        """[the state lives on the host between steps]: also what something else put back on the device (a
        restore of the state by assignment) goes back."""
        for state in list(self.optimizer.state.values()):
            for key, value in list(state.items()):
                if self._movable(value) and not is_host_tensor(value):
                    host = host_tensor(value.shape, value.dtype, pin=self.pin)
                    with unmetered():
                        host.copy_(value)
                    state[key] = host
        self._synchronize()

    def _to_devices(self) -> None:
        for param, state in list(self.optimizer.state.items()):
            for key, value in list(state.items()):
                if isinstance(value, torch.Tensor) and is_host_tensor(value):
                    state[key] = value.to(param.device, copy=True)

    def _before_load(self, optimizer: torch.optim.Optimizer, state_dict: dict) -> dict:
        """The loaded state goes straight to host tensors: torch would first copy all of it next to the
        parameters (rule 1). Each tensor of a parameter's state is taken out here and put back by
        ``_after_load``, cast as torch casts it (floating-point state to its parameter's dtype)."""
        saved_ids = [i for group in state_dict.get("param_groups", []) for i in group.get("params", [])]
        params = [p for group in optimizer.param_groups for p in group["params"]]
        by_id = dict(zip(saved_ids, params))
        states = {}
        for saved_id, entry in state_dict.get("state", {}).items():
            param = by_id.get(saved_id)
            if param is None or not isinstance(entry, dict):
                states[saved_id] = entry
                continue
            kept = {}
            for key, value in entry.items():
                if self._movable(value) and key != "step":
                    self._loading.append((param, key, value))
                else:
                    kept[key] = value
            states[saved_id] = kept
        return {**state_dict, "state": states}

    def _after_load(self, optimizer: torch.optim.Optimizer) -> None:
        loading, self._loading = self._loading, []
        for param, key, value in loading:
            dtype = param.dtype if value.is_floating_point() and param.is_floating_point() else value.dtype
            host = host_tensor(value.shape, dtype, pin=self.pin)
            with unmetered():
                host.copy_(value)
            optimizer.state[param][key] = host
        self._singles.clear()  # load_state_dict made a new state dict; the one-parameter optimizers share it anew
        self._to_host()

    @contextlib.contextmanager
    def on_device(self, param: torch.Tensor) -> Iterator[None]:
        """[one parameter's state on the device at a time]: ``param``'s state on its device inside, back in the same
        host tensors after (state the update makes for the first time goes to new host tensors)."""
        state = self.optimizer.state.get(param, {})
        hosts = {key: value for key, value in state.items()
                 if isinstance(value, torch.Tensor) and is_host_tensor(value)}
        for key, host in hosts.items():
            device_copy = torch.empty_like(host, device=param.device)
            device_copy.copy_(host, non_blocking=self.pin)
            state[key] = device_copy
        try:
            yield
        finally:
            state = self.optimizer.state.get(param, {})
            for key, value in list(state.items()):
                if not self._movable(value) or is_host_tensor(value):
                    continue
                kept = hosts.get(key)
                target = kept if kept is not None and kept.shape == value.shape and kept.dtype == value.dtype else \
                    host_tensor(value.shape, value.dtype, pin=self.pin)
                with unmetered():
                    target.copy_(value, non_blocking=self.pin)
                state[key] = target
            self.updates += 1
            if self.pin and torch._C._current_graph_task_id() != -1:  # inside a backward pass (rule 2)
                self._synchronize_at_backward_end()

    def _synchronize_at_backward_end(self) -> None:
        """With the update inside the backward pass, its last copies are final when that pass ends."""
        task = torch._C._current_graph_task_id()
        if task != self._synced_task:
            self._synced_task = task
            torch.autograd.Variable._execution_engine.queue_callback(self._synchronize)

    # ------------------------------------------------------------------------------------ the step
    def _before_step(self, optimizer: torch.optim.Optimizer, args: tuple, kwargs: dict) -> None:
        closure = args[1] if len(args) > 1 else kwargs.get("closure")  # args[0] is the optimizer itself
        if closure is not None:
            raise ValueError("optimizer.step(closure) with the optimizer's state in host memory: the update runs one "
                             "parameter at a time and cannot re-evaluate the model; call loss.backward() yourself "
                             "and optimizer.step() without a closure, or plan without optimizer_offload")
        hooks = list(optimizer._optimizer_step_pre_hooks)
        if hooks.index(self._own_hook) != len(hooks) - 1:  # a later pre-hook would see no gradient
            raise ValueError("a step pre-hook was registered on this optimizer after its state went to host memory: "
                             "it would run after the update and find no gradients; register it before "
                             "OptimizerOffload (before torchckpt.apply), or clip or scale gradients in the loop "
                             "before optimizer.step()")
        self._to_host()  # what a restore by assignment put back on the device
        try:
            for group in optimizer.param_groups:
                for param in group["params"]:
                    if param.grad is None:
                        continue
                    single = self._singles.get(id(param))
                    if single is None or single.param_groups[0]["params"][0] is not param:
                        single = self._singles[id(param)] = one_parameter_optimizer(optimizer, group, param)
                    single.state = optimizer.state  # load_state_dict replaces the dict: share the current one
                    single.param_groups[0].update(hyperparameters(group))  # an LR schedule's changes included
                    with self.on_device(param):
                        single.step()
                    self._held.append((param, param.grad))
                    param.grad = None  # the optimizer's own step finds none (rule 2)
        except BaseException:
            self._after_step(optimizer, args, kwargs)  # the gradients back where the loop left them
            raise

    def _after_step(self, optimizer: torch.optim.Optimizer, args: tuple, kwargs: dict) -> None:
        for param, grad in self._held:
            param.grad = grad
        self._held = []
        self._synchronize()

    def _synchronize(self) -> None:
        """Every device a parameter is on, so that the host tensors are final."""
        if not (self.pin and torch.cuda.is_available()):
            return
        devices = {p.device for group in self.optimizer.param_groups for p in group["params"] if p.is_cuda}
        for device in devices:
            torch.cuda.synchronize(device)

    def remove(self, *, to_device: bool = True) -> None:
        """Take the hooks off and (``to_device``, the default) move the state back to its parameters' devices;
        ``to_device=False`` leaves it in host memory, for a caller about to drop or replace it (idempotent)."""
        if _ACTIVE.get(id(self.optimizer)) is not self:
            return
        for hook in self._hooks:
            hook.remove()
        self._hooks = []
        del _ACTIVE[id(self.optimizer)]
        if to_device:
            self._to_devices()

    def __enter__(self) -> OptimizerOffload:
        return self

    def __exit__(self, *exc_info: Any) -> None:
        self.remove()


# The Checkpointer checks a saved optimizer state against the optimizer before loading anything, unless a load
# hook may change its structure (state/live/capture.py); these hooks only move where its tensors live.
OptimizerOffload._before_load.keeps_state_structure = True  # type: ignore[attr-defined]
OptimizerOffload._after_load.keeps_state_structure = True  # type: ignore[attr-defined]
