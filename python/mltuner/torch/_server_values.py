"""The servers' values in the model outside training: an evaluation forward
(under ``torch.no_grad()``), ``state_dict`` and ``unwrap()`` bind copies of
them to the parameters; after an evaluation, the light clock's parameters
go back to their held reads. Between clocks the original module, called
without gradients (a method of its own, as Hugging Face's ``generate()``),
and its own ``state_dict()`` (``save_pretrained()``) get them too."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

import numpy as np
import torch

from mltuner.exceptions import InvalidArgumentError, NotFoundError, OutOfOrderError
from mltuner.torch._driver_state import Phase
from mltuner.torch._layer_hooks import LayerHooks
from mltuner.torch._layers import Layer

__all__ = ["ServerValues"]

T = TypeVar("T")


class ServerValues(LayerHooks):
    """Binds the servers' values to a clock driver's parameters (module
    docstring)."""

    def _install_hooks(self) -> None:
        super()._install_hooks()
        for module in self.model.modules():  # model.module.encoder.state_dict() too
            self._hooks.append(module.register_state_dict_pre_hook(  # type: ignore[no-untyped-call]
                self._before_module_state_dict))

    def _before_layer(self, layer: Layer) -> None:
        if not torch.is_grad_enabled() and not self._eval_active and self._phase is not Phase.FORWARD:
            if self._phase is Phase.BACKWARD:  # a re-run of activation checkpointing has gradients
                raise OutOfOrderError(
                    f"layer {layer.name!r} ran without gradients between backward() and step(): the original "
                    "module runs on the servers' values between clocks only (call it after step())")
            self._bind_between_clocks()
            return
        super()._before_layer(layer)

    def _before_module_state_dict(self, module: Any, prefix: str, keep_vars: bool) -> None:
        # keep_vars asks for the parameters themselves (the adapter's own
        # look at the module's buffers does): no values to fetch for it.
        if self._phase is Phase.IDLE and not keep_vars and not self._own_state_dict:
            self._bind_between_clocks()

    def _bind_between_clocks(self) -> None:
        """The original module used between clocks: its parameters hold
        the servers' values of the default branch, unless they do already
        (an evaluation, ``state_dict()``)."""
        self.check_usable(recover=True)
        if self._eval_clock != (self.clock, self.worker.trained_branch):
            self.bind_server_values()

    def _evaluate(self, call: Callable[[], T]) -> T:
        if self._phase is Phase.FORWARD:
            raise OutOfOrderError("an evaluation forward inside a training forward pass")
        if self._phase is Phase.BACKWARD and self._updated and not self._at_step:
            # The servers may have applied some of this clock's updates already
            # (and, with several workers, some of the others'): no consistent
            # values to evaluate until the clock ends.
            raise OutOfOrderError(
                f"an evaluation forward between backward() and step() of clock {self.clock}, after some of the "
                "clock's updates left (the servers may hold some of them already): evaluate before the training "
                f"forward pass or after step(). Why they left: {self._why_shipped()}"
            )
        self.bind_server_values()
        self._eval_active = True
        try:
            return call()
        finally:
            self._eval_active = False
            self.rebind_held()

    def rebind_held(self) -> None:
        """Light clock, between the forward pass and a layer's update: points
        the layer's parameters back at its held read after an evaluation or
        ``state_dict`` bound them to the servers' values, because autograd
        saved some parameters themselves, not views (_clock.py's docstring)."""
        if not self._light or self._phase is not Phase.BACKWARD or not self._held_by_layer:
            return
        for number, indices in self._held_by_layer.items():
            layer = self.layers[number]
            layer.bind(layer.views(self._held[indices[0]]))
        self._eval_clock, self._eval_copies = None, []  # the parameters no longer hold the servers' values

    def bind_server_values(self, branch: int | None = None) -> None:
        """Points the parameters at copies of the servers' values after the
        clocks this worker finished (waiting for every worker's updates of
        those clocks first, so the result does not depend on timing), from
        ``branch`` (default: ``Worker.trained_branch`` where a tuning session
        set it, else the branch of the last finished clock)."""
        self._refuse_writes_between_clocks()
        if branch is None:
            branch = self.worker.trained_branch  # after a tuning session: its final branch
        if self._eval_clock == (self.clock, branch):
            return
        with self._mutating():
            self._flush_posts()  # the clock's posts so far, before waiting on the servers
        # Only reads from here: a refusal leaves the model as it was.
        try:
            self.worker.sync()
            values = [np.ascontiguousarray(self.worker.fetch(table, branch=branch), dtype=np.float32)
                      for table in self._tables]
        except (OutOfOrderError, InvalidArgumentError, NotFoundError) as error:
            raise type(error)(
                f"{error}. The servers' values of branch {self.worker.branch if branch is None else branch} "
                "cannot be read now: with a tuning session, every step (TESTING ones too) is one training "
                "clock, forward, backward and step(), and after the session the trained values are "
                "state_dict(branch=session.final_branch); a session whose driver freed every branch (an Optuna "
                "or fixed baseline without keep_branch=True: final_branch None) leaves no values on the servers"
            ) from None
        self._eval_copies = [torch.from_numpy(flat).to(self.device).view(-1) for flat in values]
        for layer, copy in zip(self.layers, self._eval_copies):
            layer.bind_flat(copy)
        self._eval_sums = torch.stack([copy.sum(dtype=torch.float64) for copy in self._eval_copies])
        self._eval_clock = (self.clock, branch)
        self.note_idle_versions()

    def close(self) -> None:
        """Leaves the parameters bound to the servers' values and removes the hooks."""
        self.check_between_clocks("unwrap()")
        self.bind_server_values()
        self.remove_hooks()
        for layer in self.layers:
            layer.forget_buffers()
        self._closed = True
