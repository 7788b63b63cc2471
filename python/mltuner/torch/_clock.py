"""The clock driver: turns a model's forward and backward pass into the
engine's access sequence, once recorded and then replayed every clock.

What happens in one clock, per layer (a table, see ``_layers.py``):

forward
    ``read`` before the layer's forward: its parameters point into the read
    buffer (no copy); at the end of the layer's forward they point at a NaN
    placeholder again. Autograd's saved tensors pass through
    ``saved_tensors_hooks``: a view of a parameter is saved as a reference
    to its rows, an activation (``store_activations``) is copied into a local
    table (``store``) or, if cheap ops make it from stored ones, not stored
    at all (``wrap(recompute=)``; ``_saved.py``, ``_recompute.py``), anything
    else is kept by torch as usual.
    With ``hold_reads`` the read stays open for the backward pass; otherwise
    (GeePS's pattern, for models larger than the memory budget) it is posted
    at the end of the layer's forward (``post_read``), so only the running
    layer's parameters occupy buffer memory.
backward
    A saved parameter reference resolves to the held forward read, or (not
    holding) the first one the layer's backward unpacks opens a second read
    of its rows (``read_grad``). Each parameter's gradient hook
    (``register_post_accumulate_grad_hook``) counts down its layer's
    pending gradients; when the last one is accumulated, the driver closes
    the layer's read, copies the gradients into an update buffer and hands
    it to the engine (``update``), which ships it at once while autograd
    goes on with the layers below: wait-free backpropagation. Stored
    activations come back from the local table on unpack (``load``, once per
    clock), recomputed ones are made again from them.
step
    ``Worker.clock`` (shipping at step(): the last op of the updates' call).

The light clock: holding reads without stored activations (the default),
with every layer read once per clock, the saved-tensor hooks have nothing
to do after the recording pass: every saved view of a parameter lies in a
held read, which stays open until the layer's update. So later clocks run
the forward without ``saved_tensors_hooks`` (two Python calls per saved
tensor fewer), and a layer's parameters keep pointing into the held read
until its update, when they get the NaN placeholder (autograd keeps a saved
parameter itself, not a view, so it must still hold the values in the
backward pass). What the hooks check (a parameter used outside the forward
of its module, a saved non-float32 reinterpretation or a detached view of
parameters needed after their update) is a property of the model's code,
checked by the recording pass, which always runs with the hooks.

The light clock also batches its engine calls (:meth:`Worker.run`): the
first layer's read opens every forward read and the first update's buffer
in one call, and each layer's update is posted together with its read and
the next update's open (``replay(batched=True)`` records the update's
pre_update before the read's post so that these ops are consecutive). On
CUDA that is one event record and one stream wait per layer instead of
three driver calls.

Unless the worker is on a GPU with a shard in another process
(``_shipping.py`` has the rule and why), the light clock ships the updates
at :meth:`ClockDriver.step` instead (``overlap_updates=False``): the
gradient hooks are removed after the recording, autograd accumulates into
``.grad`` as it does for a torch optimizer, and step() hands every layer's
gradients to the engine in one call, in forward order, so that the first
layer's update, which the next clock's first read waits for, is handled
first; the same call ends the clock. Shipping during backward overlaps an
update's transfer with the layers below, which pays off only when the
update crosses a socket while a GPU computes; its price is a Python call
per parameter and an engine call per layer on autograd's thread, about a
millisecond per clock of a ResNet-18. The forward opens every read in one call, points each
layer's parameters into its read and then runs with the driver's layer hooks
taken out of the modules (two Python calls per layer fewer; the user's own
hooks stay): a layer that did not run shows at step() as a missing gradient.
Between clocks the hooks are back, to refuse a layer called outside the
wrapped model.

A layer run again in the backward pass (activation checkpointing) finds
its parameters in its held read, which holding keeps until the layer's
update (:meth:`ClockDriver._rerun`); without held reads wrap() refuses it.

A light clock may also take several forward and backward passes before
step() (gradient accumulation): the reads stay bound, autograd adds the
gradients up in ``.grad``, and step() ships the sums; shipping from the
backward pass, the passes before the last run under :meth:`no_sync`
(DDP's API), whose gradient hooks leave the gradients alone.

Otherwise (stored activations, or reads posted after each layer) the
driver queues its posts, and the stores and updates it can leave to the
engine's own copy (``_store``, ``_update``), for the next engine call
(``_open``): the same ops in the same order, about one engine call per layer
in the forward and one per layer in the backward pass (its loads and its
backward read together, ``_queue_ahead``), instead of two per access.

The torch views of each engine buffer are made once per buffer address and
reused (``Layer.buffer_views``): the engine's pool gives every access the
same place clock after clock.

The recording pass runs these hooks on the model's own initial values and
logs the events, without held reads (each layer's backward read where it
first opens); :meth:`ClockDriver.prepare_plan` chooses held reads or not
(asking the engine for a dry run of the plan when there is a device budget)
and replays the log as the virtual iteration (``_recording.py``). Every
later clock must produce the same events in the same order; the driver
checks each one against the log before touching the engine, so a different
clock raises :class:`IterationMismatchError` instead of confusing the
engine.

The driver is one object, :class:`ClockDriver`; its parts are mixins, one
module a job, over the fields they share (``_driver_state.py``):

- ``_clock_checks.py``: refusals of what a loop may not do, the recorded
  order of events among them;
- ``_loss_guard.py``: a parameter's NaN placeholder refused in the loss;
- ``_engine_ops.py``: the engine calls, queued, and the forward reads;
- ``_stored.py``: stored activations to and from the local tables;
- ``_saved_hooks.py``: autograd's saved tensors (pack and unpack);
- ``_updates.py``: the gradients to the engine, from the backward pass or
  at step();
- ``_layer_hooks.py``: the layers' forward hooks and the gradient hooks;
- ``_plan.py``: the access pattern chosen, committed or given up;
- ``_server_values.py``: evaluation and the servers' values bound.

This module drives the clock itself: the recording pass, each clock's
forward pass and step().
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Callable
from typing import Any, NoReturn, TypeVar

import torch
from torch import nn

from mltuner.client._worker import Worker
from mltuner.exceptions import InvalidArgumentError, MltunerError, OutOfOrderError
from mltuner.torch._buffers import app_stream, autocast_state, storage_ptr
from mltuner.torch._driver_state import Phase, user_stacklevel
from mltuner.torch._errors import IterationMismatchError, UnsupportedModelError
from mltuner.torch._layers import Layer
from mltuner.torch._plan import Planning
from mltuner.torch._saved_hooks import SavedTensorHooks
from mltuner.torch._server_values import ServerValues

__all__ = ["ClockDriver"]

T = TypeVar("T")


class ClockDriver(Planning, ServerValues, SavedTensorHooks):
    """Records one clock, plans the virtual iteration, then drives the
    engine from the model's hooks. One per wrapped model; used by one thread
    at a time (the training loop's; on CUDA, autograd runs the hooks on its
    device thread while the loop waits in ``backward``)."""

    def __init__(self, model: nn.Module, layers: list[Layer], worker: Worker, *, slack: int,
                 store_activations: bool, row_width: int, overlap_updates: bool = True, recompute: str = "none",
                 recompute_fallback: bool = False, stored: dict[int, str] | None = None,
                 hold_reads: bool | None = None, keep: frozenset[int] = frozenset()) -> None:
        super().__init__(model, layers, worker, slack=slack, store_activations=store_activations,
                         row_width=row_width, overlap_updates=overlap_updates, recompute=recompute,
                         recompute_fallback=recompute_fallback, stored=stored, hold_reads=hold_reads, keep=keep)
        self._install_hooks()  # last: the hooks use the fields DriverState sets
        self._load_guard = model.register_load_state_dict_pre_hook(self._refuse_load)  # type: ignore[no-untyped-call]

    # -- the forward pass --------------------------------------------------------------
    def forward(self, call: Callable[[], T], inputs: Any = None) -> T:
        """Runs the wrapped model's forward: a clock's training forward when
        gradients are enabled, an evaluation on the servers' current values
        otherwise. ``inputs``: the forward's arguments (for
        :meth:`_check_inputs`)."""
        self.check_usable(recover=True)
        if not torch.is_grad_enabled():
            return self._evaluate(call)
        # Gradient accumulation: in a light clock (held reads, no stores) whose
        # updates have not left yet (they ship at step(), or the passes so far
        # ran under no_sync()), a clock may run several forward and backward
        # passes, whose gradients add up in .grad as with a torch optimizer;
        # the reads stay bound.
        again = (self._phase is Phase.BACKWARD and self._light and not self._updated
                 and (self._at_step or self._synced_forwards == 0))
        if self._phase is not Phase.IDLE and not again:
            shipped = ""
            if self._phase is Phase.BACKWARD and self._light and self._updated:
                shipped = (f" Here the last backward pass of clock {self.clock} already shipped its updates: a "
                           "backward pass through this model whose gradients the loop then drops (a GAN's "
                           "generator step through the discriminator, followed by the discriminator's zero_grad()) "
                           "still trains it where updates ship from the backward pass; wrap(..., "
                           "overlap_updates=False) ships them at step(), so zero_grad() drops them as torch's does.")
            raise OutOfOrderError(
                f"a second training forward pass in clock {self.clock}: call loss.backward() and step() once "
                "per forward pass (run evaluation forwards under torch.no_grad()). Several forward and backward "
                "passes per step() (gradient accumulation) need held reads without stored activations (wrap()'s "
                "default without store_activations or a device_memory_budget) and, where updates ship from the "
                "backward pass, every pass but the last under model.no_sync(); "
                f"this model: {self.hold_choice}; {self.overlap_choice}.{shipped}"
            )
        self._end_loss_guard()
        if again:
            self._check_parameter_writes(between_passes=True)
        if not again:
            if not self._recording:
                self._check_scheduled()
                self._refuse_swapped_for_the_call()
                self._refuse_unfrozen()
                self._check_autocast()
                self._refuse_writes_between_clocks()  # nothing of the clock has reached the engine
                self._refuse_writes_to_evaluation_copies()
                self._check_inputs(inputs)
                self._acts.check_modes(self.model, self.clock)
                self._acts.read_buffers(self.clock)
            if self.clock_start is not None and not self._recording:
                self.clock_start()  # may raise: nothing of the clock has reached the engine
            if self.grad_scale is not None and not self._recording:
                self.grad_scale.begin_clock()
            if self._stale_grads:  # stale gradients of an aborted backward must not accumulate
                for layer in self.layers:
                    layer.clear_grads()
            self._stale_grads = True  # until step() finds every gradient handed over
            self._serial += 1
            self._forwards = self._synced_forwards = 0
        self._forwards += 1
        self._synced_forwards += not self._defer
        self._phase = Phase.FORWARD
        self._eval_clock = None
        # The clock's stream, asked once (torch.cuda.current_stream costs tens
        # of microseconds and the clock's accesses need it dozens of times):
        # autograd runs each backward op on its forward op's stream.
        self._stream = app_stream(self.device)
        owners = self._buffer_owners() if self._recording and self._store_activations else None
        if self._store_activations:
            self._local_ptrs = self._local_storage()
        try:
            if self._at_step:
                if not again:
                    self._open_forward_reads()
                for hooks, key, _ in self._layer_hooks:
                    hooks.pop(key, None)
                try:
                    output = call()
                finally:
                    for hooks, key, hook in self._layer_hooks:
                        hooks[key] = hook
            elif self._light:
                output = call()
            else:
                mode = self._acts.dispatch_mode(self._recording, self._trace_param,
                                                lambda t: storage_ptr(t) in self._local_ptrs, self.clock)
                with torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack), \
                        mode if mode is not None else contextlib.nullcontext():
                    output = call()
                self._start_loss_guard()
            self._check_parameter_writes()
            if self._light:
                self._watch_backward(output)
            if self._recording:
                self._events = self._acts.choose(self._events, self.model.modules())
                if owners is not None:
                    self._acts.find_buffers(owners)
                self._forward_events = self._recorded_forward_events = len(self._events)
            elif self._cursor != self._forward_events:
                with self._mutating():
                    self._refuse_replaced()
                    event = self._events[self._cursor]
                    raise IterationMismatchError(
                        f"clock {self.clock}: the forward pass ended before the recorded {self._describe(event)}; "
                        "every clock must run the same layers as the recording pass of wrap()"
                    )
            else:
                with self._mutating():
                    self._acts.end_forward(self.clock)
                    if self._queued_stores:
                        self._flush_posts()
        except BaseException as error:
            if self._cursor == 0 and not self._recording and self._broken is None:
                self._phase = Phase.IDLE  # nothing reached the engine: the clock can start over
            elif self._broken is None:
                self._broken = error  # the clock's accesses are half done
            raise
        finally:
            self._saved.clear()
        self._phase = Phase.BACKWARD
        return output

    # -- the end of a clock -----------------------------------------------------------------
    def step(self) -> None:
        """Ends the clock (``Worker.clock``)."""
        self._end_loss_guard()
        if self.check_usable(recover=True):
            return  # the clock an exception left half done was ended (_recover_clock)
        if self._phase is Phase.IDLE:
            raise OutOfOrderError(f"step() in clock {self.clock} without a forward pass and loss.backward()")
        if self._phase is Phase.FORWARD:
            raise OutOfOrderError("step() inside the forward pass")
        if self._at_step or self._pass_deferred:  # the clock's updates leave now
            if self.clock_start is not None:
                self.clock_start()  # a rate set after backward() applies to them, as in torch
        elif self.rates_changed is not None and self.rates_changed():
            warnings.warn(
                f"a learning rate changed between backward() and step() of clock {self.clock}, whose updates had "
                f"already left; it applies from clock {self.clock + 1}: set it before the forward pass. Why they "
                f"left: {self._why_shipped()}", stacklevel=3)
        clocked = self._ship_updates() if self._at_step else False
        if self._pass_deferred and not self._at_step:  # the last pass ran under no_sync(): ship the sums now
            while self._cursor < len(self._events) and self._events[self._cursor].kind == "update":
                self._layer_done(self.layers[self._events[self._cursor].layer])
        if len(self._updated) < len(self.layers):
            self._refuse_replaced()
            missing = [layer.name for layer in self.layers if layer.index not in self._updated]
            if self._backward_done == self._serial:
                self._refuse_missing_gradients(missing)
            raise OutOfOrderError(
                f"step() before the backward pass of clock {self.clock} finished: no gradient yet for layer(s) "
                f"{', '.join(repr(m) for m in missing)}; call loss.backward() first"
            )
        with self._mutating():
            if self._cursor != len(self._events):
                self._refuse_replaced()
                raise IterationMismatchError(
                    f"clock {self.clock}: the backward pass ended before the recorded "
                    f"{self._describe(self._events[self._cursor])}"
                )
            if not clocked:
                self._flush_posts(clock=True)
        replaced = [name for layer in self.layers for name in layer.replaced_gradients()]
        self.clock += 1
        self._ended_a_clock = True
        self._stale_grads = self._grad_errors  # unless a refused gradient left some behind: all handed over
        self._grad_errors = False
        self._reset_clock()
        if not self._light:
            self._start_loss_guard(between_clocks=True)
        if replaced:  # after the clock ended: the model goes on
            raise OutOfOrderError(
                f"the .grad of {', '.join(repr(n) for n in replaced[:3])}{' ...' if len(replaced) > 3 else ''} was "
                f"replaced between backward() and step() of clock {self.clock - 1} (p.grad = ...; p.grad = None), "
                "but its update had already left for the parameter servers during backward(), so the change was "
                f"not applied: {self._why_shipped()}")

    def _refuse_missing_gradients(self, missing: list[str]) -> NoReturn:
        """step() after a backward pass of the clock finished without some
        layers' gradients."""
        names = ", ".join(repr(m) for m in missing)
        if self._at_step and not self._updated and all(
                grad is None for layer in self.layers for grad in layer.grads()):
            # The clock is intact: the loop may run a forward and backward pass again.
            raise OutOfOrderError(
                f"step() of clock {self.clock} found no gradients although its backward pass ran: zero_grad() "
                "between backward() and step() dropped them (torch's step() would then do nothing; the clock's "
                "update must still leave here): zero the gradients before the forward pass, or run a forward and "
                "a backward pass again before step()")
        if self._at_step:
            dropped = (" (here the gradients stay in .grad until step(): was .grad set to None after backward(), by "
                       "p.grad = None or a zero_grad of some parameters?)")
        elif any(grad is not None for layer in self.layers if layer.name in missing for grad in layer.grads()):
            dropped = (" (their .grad was assigned by hand, after torch.autograd.grad say, which reaches the servers "
                       f"only where updates ship at step(): {self._why_shipped()})")
        else:
            dropped = ""
        with self._mutating():
            raise IterationMismatchError(
                f"clock {self.clock}: the backward pass finished without a gradient for layer(s) {names}, which "
                "had one in the recording pass of wrap(): they did not run in this forward pass, or their output "
                f"did not reach the loss (detached, or computed under torch.no_grad()){dropped}; every clock must "
                "train the layers the recording trained" + self._mismatch_cause(None))

    def _recover_clock(self) -> bool:
        """After an exception of the loop's own left a clock half done (a
        Ctrl-C, a CUDA out-of-memory error, an error in the model's code; not
        the adapter's or the engine's, which say why the model cannot go on):
        ends it on the engine (``Worker.finish_clock``) and starts the next
        clock afresh. The clock's updates that had not left send zeros: for
        those layers a step of zero gradient, through which momentum and
        Adam's moments still move the parameters. A second Ctrl-C while it
        ends the clock propagates, and the next call tries again."""
        error = self._broken
        # An AssertionError is the adapter's own invariant failing.
        if error is None or self._recording or isinstance(error, (MltunerError, AssertionError)):
            return False
        left = self.clock
        try:
            if self._queued:
                self._flush_posts()  # the updates of the gradients that arrived go with them
            ran = self.worker.finish_clock(stream=app_stream(self.device))
        except MltunerError:
            return False  # the engine cannot (a lost peer, a failed engine): the model stays broken
        for layer in self.layers:
            layer.unbind()  # the clock's buffers are given back
        # The engine's clock: one past the half-done clock, or already past it
        # (the interruption came after step()'s last engine call), or at it
        # (nothing reached the engine: the clock starts over).
        self.clock = int(self.worker.stats["clock"])
        self._broken = None
        self._reset_clock()
        if not self._light:  # as step() leaves it (a light clock has no guard)
            self._start_loss_guard(between_clocks=True)
        if ran:
            warnings.warn(
                f"clock {left} of the wrapped model was left half done by {type(error).__name__}; it ended with "
                "the updates that had left, the other layers' as zeros (a step of zero gradient, through which "
                "momentum still moves them), and the model goes on from the next clock", stacklevel=4)
        return True

    def zero_grad(self, set_to_none: bool = True) -> None:
        """``model.optimizer.zero_grad()``: where updates ship at step() and
        none has left, the gradients of the passes since the last step() are
        dropped, as torch's zero_grad drops them (a pass whose backward raised
        adds nothing then); elsewhere gradients are cleared as they are
        handed over: a zero_grad() between backward() and step() cannot call
        back updates that left in the backward pass, and says so."""
        if self._phase is Phase.BACKWARD and self._at_step and not self._updated:
            dropped = self._backward_done == self._serial and any(
                grad is not None for layer in self.layers for grad in layer.grads())
            for layer in self.layers:
                layer.clear_grads(set_to_none)
            if dropped and not self._ended_a_clock:
                # Before any step(): a loop whose own update (p.data.add_)
                # the servers never see. Later, a dropped pass is a skipped
                # batch or a GAN's generator pass through this model, as in
                # torch.
                self._dropped_passes += 1
                why = (f"zero_grad() dropped the gradients of {self._dropped_passes} finished backward pass(es) "
                       "and no step() has ended a clock since wrap(): the servers never see them. A loop that "
                       "updates the parameters itself (p.data.add_(p.grad, alpha=-lr), as older scripts do) trains "
                       "nothing here: give wrap() a torch.optim.SGD and call its step() each iteration")
                if self._dropped_passes >= 3:
                    raise OutOfOrderError(why)
                if self._dropped_passes == 1:
                    warnings.warn(why, stacklevel=user_stacklevel())
        elif self._phase is Phase.BACKWARD and self._updated and not self._backward_failed():
            # (after a pass that raised, the next forward or step() ends the clock, saying so)
            warnings.warn(
                f"zero_grad() after the backward pass of clock {self.clock}: the updates of "
                f"{len(self._updated)} layer(s) had already left and apply (torch's zero_grad would drop them). "
                f"Why they left: {self._why_shipped()}", stacklevel=user_stacklevel())

    def _reset_clock(self) -> None:
        self._phase = Phase.IDLE
        self._pass_open = False
        if self._idle_versions is not None:
            self.note_idle_versions()
        self._cursor = 0
        self._next_slot = 0
        self._fwd_open.clear()
        self._opened_by_caller.clear()
        self._pass_deferred = False
        self._param_ptrs.clear()
        self._reads.clear()
        self._held.clear()
        self._held_by_layer.clear()
        self._bound_versions.clear()
        self._shrunk.clear()
        self._grad_open.clear()
        self._opened.clear()
        self._read_back.clear()
        self._read_ahead.clear()
        self._filling.clear()
        self._queued.clear()
        self._queued_stores.clear()
        self._queued_grads.clear()
        self._update_buffer = None
        self._pending[:] = [0] * len(self._pending)
        self._updated.clear()
        self._acts.reset_clock()
        for layer in self.layers:
            if layer.shipped:
                layer.clear_grads()

    # -- the recording pass -------------------------------------------------------------------
    def record(self, call: Callable[[], Any], loss_of: Callable[[Any], torch.Tensor]) -> None:
        """The recording pass: one forward and backward on the initial values,
        which logs the events; the model's buffers and the RNG are restored
        afterwards, so training starts as it would without it."""
        for layer in self.layers:
            flat = torch.zeros(layer.num_values, dtype=torch.float32, device=self.device)
            with torch.no_grad():
                for slot, view in zip(layer.params, layer.views(flat)):
                    view.copy_(slot.param.detach())
            self._init.append(flat)
            layer.unbind()  # from now on, parameters hold values only during their accesses
        saved_buffers = {name: buffer.detach().clone() for name, buffer in self.model.named_buffers()}
        devices = [self.device] if self.device.type == "cuda" else []
        self._install_member_checks()
        self._recorded_autocast = autocast_state(self.device)
        # wrap() may record several times inside one autocast, whose cache of
        # cast weights would hand a later recording the first one's copies
        # (then the backward pass reads parameters in another order).
        torch.clear_autocast_cache()
        try:
            with torch.random.fork_rng(devices=devices), torch.enable_grad():
                output = self.forward(call)
                loss = loss_of(output)
                if not isinstance(loss, torch.Tensor) or loss.numel() != 1 or not loss.requires_grad:
                    raise InvalidArgumentError(
                        "example_loss must return a scalar tensor that depends on the model's parameters"
                    )
                loss.backward()  # type: ignore[no-untyped-call]
        finally:
            self._end_loss_guard()
            for handle in self._recording_hooks:
                handle.remove()
            self._recording_hooks.clear()
            self._restore_buffers(saved_buffers)
            self._acts.end_recording()
        self._check_recording()
        self._recording = False
        self._reset_clock()
        if self.device.type == "cuda":
            # The initial values wait for the plan in host memory: on the
            # device they would hold a whole model's worth of memory that the
            # plan (the automatic budget, the shard's placement) then could
            # not use, and they are written once, layer by layer.
            self._init = [flat.cpu() for flat in self._init]

    def _install_member_checks(self) -> None:
        """For the recording pass: every module inside a grouped layer must
        run inside the forward of the group's root, which is when the
        group's parameters hold values. A model that calls a member from
        elsewhere sets :attr:`misgrouped` and fails the recording;
        ``wrap()`` then splits that group and records again."""
        for layer in self.layers:
            for name, member in layer.members:
                if member is not layer.module:
                    check = self._member_check(layer, name)
                    self._recording_hooks.append(member.register_forward_pre_hook(check))

    def _member_check(self, layer: Layer, name: str) -> Callable[[nn.Module, Any], None]:
        def hook(module: nn.Module, args: Any) -> None:
            if self._phase is Phase.FORWARD and layer.index not in self._fwd_open:
                self.misgrouped = layer.name
                raise UnsupportedModelError(
                    f"module {name!r} ran outside the forward of {layer.name!r}, whose parameters it shares a "
                    "table with; pass wrap(..., group_bytes=0) for one table per module"
                )
        return hook

    def _restore_buffers(self, saved: dict[str, torch.Tensor]) -> None:
        with torch.no_grad():
            for name, value in saved.items():
                owner_name, _, leaf = name.rpartition(".")
                owner = self.model.get_submodule(owner_name)
                current = getattr(owner, leaf)
                if isinstance(current, torch.Tensor) and current.shape == value.shape and current.dtype == value.dtype:
                    current.copy_(value)
                else:
                    setattr(owner, leaf, value)

    def _check_recording(self) -> None:
        for layer in self.layers:
            if self._reads.get(layer.index, 0) == 0:
                raise UnsupportedModelError(
                    f"module {layer.name!r} has trainable parameters but did not run in the recording forward "
                    "pass on example_input: remove it or freeze its parameters (requires_grad_(False))"
                )
            if layer.index not in self._updated:
                marks = self._marks[layer.index]
                names = [p.name for i, p in enumerate(layer.params) if marks[i] != self._serial]
                raise UnsupportedModelError(
                    f"parameter(s) {', '.join(repr(n) for n in names)} got no gradient in the recording pass "
                    "(unused, or used under torch.no_grad()): freeze them (requires_grad_(False)) or remove them"
                )
