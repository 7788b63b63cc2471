"""A clock's gradients to the engine: each layer's update, handed over when
its last gradient is accumulated (shipping from the backward pass) or all
of them at step() (the light clock without ``overlap_updates``), in as few
engine calls as the plan allows; the refusal of a gradient that is not the
clock's; gradient accumulation (``no_sync``); and the scaler's unscaling,
per layer or of every gradient at once.

With a scaler, an overflowing clock's updates are zeros: where the engine
copies the gradients in, its copy reads the scaler's overflow flag on the
stream and writes zeros when it is set (one kernel a layer, as without a
scaler); where torch copies them, they are zeroed first."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any, NoReturn

import torch

from mltuner.exceptions import OutOfOrderError
from mltuner.torch._clock_checks import ClockChecks
from mltuner.torch._driver_state import Phase
from mltuner.torch._engine_ops import _CLOCK, _POST_READ, _PRE_UPDATE, _READ, _UPDATE, EngineOps
from mltuner.torch._errors import IterationMismatchError, UnsupportedModelError
from mltuner.torch._inputs import tensors_in
from mltuner.torch._layers import Layer

__all__ = ["GradientUpdates"]


class GradientUpdates(EngineOps, ClockChecks):
    """Hands a clock driver's gradients to the engine (module docstring)."""

    # -- a layer's gradients --------------------------------------------------------------
    def _refuse_gradient(self, layer: Layer, position: int, param: torch.Tensor) -> NoReturn:
        """Raises the error for a gradient the hook's quick test refused; the
        gradient is dropped first, so it cannot add to a later clock's."""
        try:
            self._check_gradient(layer, position)
            raise AssertionError("a gradient hook refused a gradient it should have taken")
        except BaseException:
            self._grad_errors = True  # the next forward clears every gradient
            if self._phase is not Phase.BACKWARD:  # step() is past: tell the next forward directly
                self._stale_grads = True  # (other parameters' gradients of that backward may have landed)
            if self._phase is not Phase.BACKWARD or layer.index in self._updated:
                param.grad = None  # no update of this clock takes it (step() may come before a forward)
            raise

    def _check_gradient(self, layer: Layer, position: int) -> None:
        if self._closed or self._broken is not None:
            self.check_usable()
        if self._phase is not Phase.BACKWARD:
            raise OutOfOrderError(
                f"a gradient of {layer.params[position].name!r} arrived outside clock {self.clock}'s backward "
                "pass: backward() can run once per forward pass, before step() (was it called twice, with "
                "retain_graph=True?)"
            )
        if self._marks[layer.index][position] == self._serial or layer.index in self._updated:
            raise OutOfOrderError(
                f"{layer.params[position].name!r} received a second gradient in clock {self.clock}: backward() "
                "ran twice; call step() after each backward pass (the first one already shipped the update; "
                "gradients add up over several passes only where updates ship at step())"
            )
        if self._pending[layer.index] <= 0:  # not read in this forward pass
            self._bad_gradient(layer, position, layer.params[position].param.grad)

    def _layer_done(self, layer: Layer) -> None:
        """The last of ``layer``'s gradients arrived: closes its reads and
        hands the update to the engine."""
        number = layer.index
        grads = layer.grads()
        for position, grad in enumerate(grads):
            if grad is None or grad.layout != torch.strided:
                self._grad_errors = True
                self._bad_gradient(layer, position, grad)
        try:
            index = self._next("update", number)
            if self._recording and self._acts.store_all is not None:
                self._acts.store_all.update(number)
            for held in self._held_by_layer.pop(number, ()):
                self._held.pop(held, None)
                if not self._batched:  # else posted with the update
                    self._close_read(held)
            opened = self._grad_open.pop(number, None)
            if opened is not None:
                self._close_read(opened[0])
            self._update(index, layer, grads)
            # Until step(): a use of .grad must not find None, and a scaler's
            # inf check finds the clock's overflow there (_shipped.py).
            layer.mark_shipped(self._shipped_why, self.grad_scale.overflow if self.grad_scale is not None else None)
            if self._light:
                layer.unbind()
            self._updated.add(number)
        except BaseException as error:
            self._fail(error)
            raise

    def _why_shipped(self) -> str:
        """Why this plan's updates leave in the backward pass, and the way to
        keep the gradients in .grad until step() (for ShippedGradient)."""
        if self._light:
            return (f"this model ships each layer's update from the backward pass ({self.overlap_choice}); "
                    "wrap(..., overlap_updates=False) keeps the gradients in .grad until step(), as with a torch "
                    "optimizer")
        return (f"each layer's update leaves as soon as its gradients are final where reads are not held or "
                f"activations are stored ({self.hold_choice}); the gradients stay in .grad until step() only "
                "with held reads, no stored activations and overlap_updates=False")

    def _bad_gradient(self, layer: Layer, position: int, grad: torch.Tensor | None) -> None:
        name = layer.params[position].name
        with self._mutating():
            if grad is None or grad.layout != torch.strided:
                raise UnsupportedModelError(
                    f"{name!r} got a sparse or missing gradient: only dense gradients (an embedding looked up "
                    "with sparse=True, nn.Embedding or F.embedding: use sparse=False)")
            self._refuse_replaced()
            raise UnsupportedModelError(
                f"{name!r} got a gradient, but module {layer.name!r} did not run in this forward pass: the "
                "parameter is used outside the forward of the module that owns it; add the calling "
                "module's type to wrap(..., whole_modules=...)"
            )

    # -- its update -------------------------------------------------------------------------
    def _update(self, index: int, layer: Layer, grads: list[torch.Tensor]) -> None:
        if self._batched:
            self._batched_update(index, layer, grads)
            return
        if not self._recording:
            handle = self._handles[index]
            self._unscale(grads)
            pieces = self._pieces(layer, grads)
            if pieces is not None:  # the engine copies the gradients in: queued, like a store
                self._queued += [(_PRE_UPDATE, handle), self._update_op(handle, pieces)]
                self._queued_grads += grads  # alive until the queue goes to the engine
                return
            _, views = layer.buffer_views(self._open(_PRE_UPDATE, handle))
            self._copy_grads(views, grads)
            self._post(_UPDATE, handle)

    def _batched_update(self, index: int, layer: Layer, grads: list[torch.Tensor], *, filtered: bool = False) -> None:
        """The light clock's update: the buffer was opened by the last batch;
        one engine call copies the gradients in (one kernel for the layer),
        posts the update with the layer's read and opens the next update's
        buffer (``filtered``: step() unscaled every gradient already)."""
        if not filtered:
            self._unscale(grads)
        pieces = self._pieces(layer, grads)
        if pieces is None:  # gradients the engine cannot take as they are
            _, views = layer.buffer_views(self._update_buffer)
            self._copy_grads(views, grads)
            update: tuple[Any, ...] = (_UPDATE, self._handles[index])
        else:
            update = self._update_op(self._handles[index], pieces)
        self._update_buffer = None
        ops = [(_POST_READ, self._held_handle[layer.index]), update]
        following = self._next_pre_update[index]
        if following >= 0:
            ops.append((_PRE_UPDATE, following))
        opened = self.worker._run_ops(ops, self._stream)
        self._update_buffer = opened[0] if opened else None

    def _unscale(self, grads: list[torch.Tensor]) -> None:
        if self.grad_scale is not None:
            with torch.no_grad():
                self.grad_scale.unscale(grads)

    def _update_op(self, handle: int, pieces: list[tuple[int, int, int]]) -> tuple[Any, ...]:
        """The engine op that copies ``pieces`` into an update and posts it:
        with a scaler, zeros instead once the clock overflowed."""
        gate = self.grad_scale.gate() if self.grad_scale is not None else 0
        return (_UPDATE, handle, pieces, [], gate) if gate else (_UPDATE, handle, pieces)

    def _copy_grads(self, views: list[torch.Tensor], grads: list[torch.Tensor]) -> None:
        """Torch's copy of a layer's gradients into its update buffer's views
        (gradients the engine cannot take as they are), zeroed on an overflow."""
        with torch.no_grad():
            if self.grad_scale is not None:
                self.grad_scale.zero_on_overflow(grads)
            torch._foreach_copy_(views, grads)

    def _pieces(self, layer: Layer, grads: list[torch.Tensor]) -> list[tuple[int, int, int]] | None:
        """The gradients as pieces for the engine to copy (address, offset in
        the layer's rows, count); None when one needs torch to copy it
        (another dtype, device or layout)."""
        pieces = []
        for slot, grad in zip(layer.params, grads):
            if grad.dtype is not torch.float32 or grad.device != self.device or not slot.laid_out_as(grad):
                return None
            pieces.append((grad.data_ptr(), slot.offset, slot.numel))
        return pieces

    def _plan_batches(self) -> None:
        """The light clock's engine calls in batches: the recorded ops are the
        forward reads, then per update its pre_update, the layer's post_read
        and the update (``replay(batched=True)``), so consecutive ones can go
        in one call."""
        reads = [i for i, e in enumerate(self._events) if e.kind == "read"]
        updates = [i for i, e in enumerate(self._events) if e.kind == "update"]
        self._first_read = reads[0]
        self._read_batch = [(_READ, self._handles[i]) for i in reads] + [(_PRE_UPDATE, self._handles[updates[0]])]
        self._held_handle = {self._events[i].layer: self._handles[i] for i in reads}
        self._forward_reads = [(i, self._events[i].layer) for i in reads]
        self._next_pre_update = {u: (self._handles[n] if n >= 0 else -1) for u, n in zip(updates, updates[1:] + [-1])}
        self._batched = True

    # -- several passes a clock, and shipping at step() -------------------------------------
    def _watch_backward(self, output: Any) -> None:
        """Shipping at step(), no parameter hook sees the backward pass: a
        hook on each output that needs a gradient refuses a second backward
        through the clock's graph (retain_graph=True) or one after step(),
        before it adds anything to the gradients."""
        serial = self._serial
        if self._forwards == 1:
            self._outputs_seen.clear()
        for number, tensor in enumerate((output,) if isinstance(output, torch.Tensor) else tensors_in(output)):
            if tensor.requires_grad:
                hook = self._output_hook(serial, (self._forwards, number), self._defer)
                tensor.register_hook(hook)  # type: ignore[no-untyped-call]

    def _output_hook(self, serial: int, output: tuple[int, int], deferred: bool) -> Callable[[torch.Tensor], None]:
        """Runs first in a backward pass through ``output``: refuses a second
        one and tells the gradient hooks whether the pass's forward ran under
        no_sync()."""
        def hook(grad: torch.Tensor) -> None:
            self._refuse_create_graph()
            if self._phase is Phase.BACKWARD and self._serial > serial:
                raise self._earlier_graph()
            if self._phase is not Phase.BACKWARD or self._serial != serial:
                raise OutOfOrderError(
                    f"a gradient arrived outside clock {self.clock}'s backward pass: backward() can run once per "
                    "forward pass, before step() (was it called twice, with retain_graph=True?)"
                )
            if output in self._outputs_seen:
                raise OutOfOrderError(
                    f"a second backward pass through one forward pass in clock {self.clock}: backward() can run "
                    "once per forward pass (several forward and backward passes before step() add up their "
                    "gradients; for two losses of one forward, call torch.autograd.backward([loss1, loss2]) once)"
                )
            self._outputs_seen.add(output)
            self._pass_deferred = deferred
            if not self._pass_open:
                self._watch_pass_end()
        return hook

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """The forward passes inside leave their gradients in ``.grad``
        (DDP's ``no_sync``): where updates ship from the backward pass, the
        next pass outside ships the sum, or step() does."""
        self.check_usable(recover=True)
        if not self._light:
            raise OutOfOrderError(
                "no_sync() (gradient accumulation) needs held reads without stored activations (wrap()'s default "
                f"without store_activations or a device_memory_budget); this model: {self.hold_choice}"
            )
        before, self._defer = self._defer, True
        try:
            yield
        finally:
            self._defer = before

    def filter_gradients(self, grad_filter: Callable[[list[torch.Tensor]], None]) -> bool:
        """Shipping at step(): applies ``grad_filter`` once per clock to
        every layer's gradients together, before step() hands them over (the
        scaler's unscaling in ``scaler.step()``, whose overflow then skips
        the step). Returns whether it did: no update of the clock has left."""
        if not self._at_step or self._phase is not Phase.BACKWARD:
            return False
        if self._filtered == self._serial:
            return False
        grads = [grad for layer in self.layers for grad in layer.grads() if grad is not None]
        with torch.no_grad():
            grad_filter(grads)
        self._filtered = self._serial
        return True

    def _ship_updates(self) -> bool:
        """The light clock's updates at step() (_clock.py's docstring): every
        layer's gradients, final now, handed to the engine in forward order,
        in one engine call when the engine can copy them all itself; that
        call also ends the clock (every update is then the recorded clock's
        last event). Returns whether it did."""
        grads = [layer.grads() for layer in self.layers]
        if all(grad is None for layer_grads in grads for grad in layer_grads):
            return False  # no backward pass yet: step() says so, and the clock stays usable
        for layer, layer_grads in zip(self.layers, grads):
            for position, grad in enumerate(layer_grads):
                if grad is None:
                    self._grad_errors = True
                    with self._mutating():
                        self._refuse_replaced()
                        raise IterationMismatchError(
                            f"clock {self.clock}: {layer.params[position].name!r} got no gradient, but it did in the "
                            f"recording pass of wrap(): this forward did not use it (a branch that depends on the "
                            f"data), module {layer.name!r} did not run, its output did not reach the loss, or its "
                            ".grad was set to None after backward(); every clock must give every parameter wrap() "
                            "took a gradient"
                            + self._mismatch_cause(None)
                        )
                if grad.layout != torch.strided:
                    self._grad_errors = True
                    self._bad_gradient(layer, position, grad)
        updates = [(i, self._events[i].layer) for i in range(self._forward_events, len(self._events))]
        with self._mutating():
            found = [self._pieces(self.layers[number], grads[number]) for _, number in updates]
            pieces = [p for p in found if p is not None]
            if len(pieces) == len(found):
                ops: list[tuple[Any, ...]] = []
                for (index, number), layer_pieces in zip(updates, pieces):
                    self._next("update", number)
                    ops += [(_POST_READ, self._held_handle[number]),
                            self._update_op(self._handles[index], layer_pieces)]
                    following = self._next_pre_update[index]
                    if following >= 0:
                        ops.append((_PRE_UPDATE, following))
                ops.append((_CLOCK, -1))
                self._flush_posts()  # posts queued before (none in the light clock), in their order
                self.worker._run_ops(ops, self._stream)
                self._update_buffer = None
                clocked = True
            else:  # gradients torch must copy: layer by layer
                for index, number in updates:
                    self._next("update", number)
                    self._batched_update(index, self.layers[number], grads[number], filtered=True)
                clocked = False
            for layer in self.layers:
                layer.clear_grads()
                layer.unbind()
                self._updated.add(layer.index)
        return clocked
