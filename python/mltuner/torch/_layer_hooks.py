"""The driver's hooks in the model: each layer's forward pre- and
post-hooks (and those of the modules that share its parameters), which
open, bind and post the layer's read, and each parameter's gradient hook,
which counts the layer's gradients down to its update. They run once per
layer or parameter a clock: keep them lean."""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from mltuner.exceptions import OutOfOrderError
from mltuner.torch._buffers import storage_ptr
from mltuner.torch._driver_state import Phase
from mltuner.torch._errors import UnsupportedModelError
from mltuner.torch._inputs import tensors_in
from mltuner.torch._layers import Layer
from mltuner.torch._loss_guard import LossGuard
from mltuner.torch._updates import GradientUpdates

__all__ = ["LayerHooks"]


class LayerHooks(GradientUpdates, LossGuard):
    """Installs a clock driver's hooks and runs them (module docstring)."""

    def _install_hooks(self) -> None:
        # The reads go first: a forward pre-hook registered before wrap()
        # (torch.nn.utils.prune, the old weight_norm and spectral_norm)
        # computes the weight from the parameters, which hold values only
        # once the layer is read.
        for layer in self.layers:
            self._hooks.append(layer.module.register_forward_pre_hook(self._pre_hook(layer), prepend=True))
            self._hooks.append(layer.module.register_forward_hook(self._post_hook(layer)))
            for _, caller in layer.callers:
                self._hooks.append(caller.register_forward_pre_hook(self._caller_pre_hook(layer), prepend=True))
                self._hooks.append(caller.register_forward_hook(self._caller_post_hook(layer)))
            for position, slot in enumerate(layer.params):
                hook = self._grad_hook(layer, position)
                handle = slot.param.register_post_accumulate_grad_hook(hook)  # type: ignore[no-untyped-call]
                self._grad_hooks.append(handle)

    def remove_hooks(self) -> None:
        self._end_loss_guard()
        self._load_guard.remove()
        for handle in self._hooks + self._grad_hooks:
            handle.remove()
        self._hooks.clear()
        self._layer_hooks.clear()
        self._grad_hooks.clear()

    def _pre_hook(self, layer: Layer) -> Callable[[nn.Module, Any], None]:
        def hook(module: nn.Module, args: Any) -> None:
            self._before_layer(layer)
        return hook

    def _post_hook(self, layer: Layer) -> Callable[[nn.Module, Any, Any], None]:
        def hook(module: nn.Module, args: Any, output: Any) -> None:
            self._after_layer(layer, output)
        return hook

    def _caller_pre_hook(self, layer: Layer) -> Callable[[nn.Module, Any], None]:
        """A module holding some of ``layer``'s parameters (tied weights,
        ``_layers.py``) reads the layer as its own call would, unless the
        layer is open already (the module runs inside the layer's forward)."""
        def hook(module: nn.Module, args: Any) -> None:
            if self._eval_active or layer.index in self._fwd_open:
                return
            self._before_layer(layer)
            self._opened_by_caller[layer.index] = module
        return hook

    def _caller_post_hook(self, layer: Layer) -> Callable[[nn.Module, Any, Any], None]:
        def hook(module: nn.Module, args: Any, output: Any) -> None:
            if self._opened_by_caller.get(layer.index) is module:
                del self._opened_by_caller[layer.index]
                self._after_layer(layer, output)
        return hook

    def _grad_hook(self, layer: Layer, position: int) -> Callable[[torch.Tensor], None]:
        """One parameter's gradient hook: marks the gradient as arrived and,
        for the layer's last one, ships the update (:meth:`_layer_done`).
        Anything unusual goes to :meth:`_refuse_gradient`, which raises.

        The hook holds the driver weakly and finds the layer through it:
        torch keeps a tensor's post-accumulate hooks in C++, where the
        garbage collector does not see them, so a strong reference would
        keep the driver, its worker and the engine's memory alive after the
        model is dropped."""
        index = layer.index
        marks = self._marks[index]
        pending = self._pending
        driver_ref = weakref.ref(self)

        def hook(param: torch.Tensor) -> None:
            driver = driver_ref()
            if driver is None:
                return  # the wrapped model is gone: its gradients go nowhere
            serial = driver._serial
            if not driver._pass_open and driver._phase is Phase.BACKWARD:
                driver._watch_pass_end()
            if driver._pass_deferred and driver._phase is Phase.BACKWARD and driver._broken is None:
                return  # no_sync(): the gradient stays in .grad for a later pass or step()
            if (driver._phase is not Phase.BACKWARD or marks[position] == serial or pending[index] <= 0
                    or driver._broken is not None):
                driver._refuse_gradient(driver.layers[index], position, param)
            marks[position] = serial
            pending[index] -= 1
            if pending[index] == 0:
                driver._layer_done(driver.layers[index])
        return hook

    # -- a layer's forward ------------------------------------------------------------------
    def _before_layer(self, layer: Layer) -> None:
        if self._eval_active:
            return
        if self._broken is not None or self._closed:
            self.check_usable()
        if self._phase is Phase.BACKWARD:
            self._rerun(layer)
            return
        if self._phase is not Phase.FORWARD:
            raise OutOfOrderError(
                f"layer {layer.name!r} ran outside a forward pass of the wrapped model: call the object "
                "wrap() returned, not the original module (which runs on the servers' values only without "
                "gradients, between clocks: under torch.no_grad(), as Hugging Face's generate() does)"
            )
        number = layer.index
        if number in self._fwd_open:
            raise UnsupportedModelError(f"layer {layer.name!r} was called from inside its own forward")
        try:
            held = None if self._recording else self._held_read(number)
            if held is not None:  # called again: the held read serves every call (_recording.for_holding)
                index, flat = held
                layer.bind(layer.views(flat))
            else:
                index = self._next("read", number)
                flat, views = self._open_read(index, layer)
                layer.bind(views)
            self._bound_versions.setdefault(number, layer.versions())
            address = storage_ptr(flat)
            assert address is not None
            self._fwd_open[number] = (index, address, flat)
            if not self._light:  # only the saved-tensor hooks look parameters up by address
                self._param_ptrs[address] = number
            reads = self._reads.get(number, 0)
            if reads == 0:  # the layer's gradients to wait for this clock
                self._pending[number] = len(layer.params)
            self._reads[number] = reads + 1
        except BaseException as error:
            self._fail(error)
            raise

    def _rerun(self, layer: Layer) -> None:
        """A layer run again in the backward pass (activation checkpointing,
        ``torch.utils.checkpoint``): its parameters point at the clock's held
        read again, which holding keeps until the layer's update; the
        recording pass notes the layer, so that the plan holds reads."""
        number = layer.index
        if self._recording:
            self._reruns.add(number)
            layer.bind(layer.views(self._init[number]))
            return
        held = self._held_read(number)
        if held is None:
            with self._mutating():
                raise UnsupportedModelError(
                    f"layer {layer.name!r} ran in the backward pass of clock {self.clock} "
                    f"{'after its update' if number in self._updated else 'without a held read'}: activation "
                    "checkpointing re-runs layers there, which needs their forward reads held until the update, "
                    "and the recording pass did not run it so"
                )
        if not self._light:
            layer.bind(layer.views(held[1]))

    def _after_layer(self, layer: Layer, output: Any) -> None:
        if self._eval_active or self._phase is not Phase.FORWARD:
            if self._phase is Phase.BACKWARD and not self._eval_active and not self._light:
                layer.unbind()  # the end of a re-run (_rerun)
            return
        number = layer.index
        try:
            index, address, flat = self._fwd_open.pop(number)
            if self._hold and not self._recording and index in self._held:  # a later call of a held layer
                if not self._light:
                    del self._param_ptrs[address]
                    layer.unbind()
                return
            self._next("post_read", number)
            for tensor in (output,) if isinstance(output, torch.Tensor) else tensors_in(output):
                if storage_ptr(tensor) == address:
                    raise UnsupportedModelError(
                        f"layer {layer.name!r} returns a view of its own parameters; the adapter hands the "
                        "parameters' memory back to the engine after the layer's forward, so return a copy"
                    )
            if self._light:  # the parameters keep their values until the update (_clock.py's docstring)
                self._held[index] = flat
                self._held_by_layer[number] = [index]
                return
            del self._param_ptrs[address]
            if self._hold:  # kept for the backward pass, posted with the update
                self._held[index] = flat
                self._held_by_layer.setdefault(number, []).append(index)
            else:
                self._close_read(index)
            layer.unbind()
        except BaseException as error:
            self._fail(error)
            raise
