"""What the parts of a clock driver share: the fields one wrapped model's
driver keeps (the recording, the plan made from it, the clock under way),
and whether the driver can go on after an error.

The driver (``_clock.py``) is one object made of mixins, one module a job;
each reads and writes the fields set up here. Their comments say what each
is for and, where it is not plain, which part keeps it."""

from __future__ import annotations

import enum
import os
import sys
import weakref
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple, NoReturn, Protocol

import torch
from torch import nn

from mltuner.client._worker import PlanPreview, Table, Worker
from mltuner.exceptions import ArgumentTypeError, OutOfOrderError
from mltuner.torch._buffers import app_stream
from mltuner.torch._layers import Layer
from mltuner.torch._recording import Event, Slot, Tables
from mltuner.torch._saved import SavedActivations
from mltuner.torch._trace import ParamRef

__all__ = ["DriverState", "GradScale", "Phase", "refuse_copy", "user_stacklevel"]

_PACKAGE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # mltuner/


def user_stacklevel() -> int:
    """The ``stacklevel`` for ``warnings.warn`` that names the first caller
    outside the mltuner package (the loop's own line, however many of the
    adapter's frames lie between: a taken-over optimizer's zero_grad)."""
    frame = sys._getframe(1)  # the function that warns
    level = 1
    while frame is not None and frame.f_code.co_filename.startswith(_PACKAGE):
        frame = frame.f_back  # type: ignore[assignment]
        level += 1
    return level


class GradScale(Protocol):
    """A mixed-precision scaler's part in the updates (``_amp.py``)."""

    # One float32 on the driver's device, nonzero once the clock overflowed.
    overflow: torch.Tensor

    def unscale(self, grads: list[torch.Tensor]) -> None:
        """Takes the scale off gradients in place and notes an overflow."""

    def zero_on_overflow(self, grads: list[torch.Tensor]) -> None:
        """Zeroes gradients in place if the clock overflowed (for those
        torch copies; the engine's copy reads :meth:`gate`)."""

    def gate(self) -> int:
        """The address of :attr:`overflow` for the engine's copy of the
        clock's updates, or 0 where it is not this clock's."""

    def begin_clock(self) -> None:
        """Before a training clock touches the engine: the scaler takes the
        state of the clock's branch."""


class _ActRef(NamedTuple):
    """What autograd keeps of a saved activation: stored in the local table,
    or recomputed in the backward pass (``serial``: the forward's)."""

    slot: int
    serial: int


class _ParamUse(NamedTuple):
    """What autograd keeps of a view of a layer's parameters: read again in
    the backward pass (``serial``: the forward's)."""

    ref: ParamRef
    serial: int


class _Mutating:
    """The context manager of :meth:`DriverState._mutating`: a plain class,
    not ``contextlib.contextmanager``, because it wraps every hook call."""

    __slots__ = ("_driver",)

    def __init__(self, driver: DriverState) -> None:
        self._driver = driver

    def __enter__(self) -> None:
        return None

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None, trace: Any) -> None:
        if error is not None:
            self._driver._fail(error)


def refuse_copy(how: str) -> NoReturn:
    """copy.deepcopy or pickle of a wrapped model, or of its module (whose
    hooks hold the adapter): refused with what to do instead."""
    if how == "deepcopy":
        raise ArgumentTypeError(
            "copy.deepcopy of a wrapped model or its module: its parameters live on the servers and the "
            "adapter's hooks drive the engine's clock. For a copy of the trained values (an EMA, the best "
            "model so far), deepcopy the module before wrap() and load model.state_dict() into the copy"
        )
    raise ArgumentTypeError(
        "pickling a wrapped model or its module (torch.save(model)): save model.state_dict(), which loads into "
        "the plain module, or model.save_checkpoint(root) to resume training from it"
    )


class Phase(enum.Enum):
    IDLE = "idle"  # between clocks
    FORWARD = "forward"  # inside the training forward pass
    BACKWARD = "backward"  # forward done; gradients pending or done, step() not yet called


class DriverState:
    """The fields of one wrapped model's clock driver, set up before the
    driver's hooks go into the model (``ClockDriver.__init__``)."""

    def __init__(self, model: nn.Module, layers: list[Layer], worker: Worker, *, slack: int,
                 store_activations: bool, row_width: int, overlap_updates: bool = True, recompute: str = "none",
                 recompute_fallback: bool = False, stored: dict[int, str] | None = None,
                 hold_reads: bool | None = None, keep: frozenset[int] = frozenset()) -> None:
        self.model = model
        # The modules with buffers or frozen parameters, walked per clock (_local_storage).
        self._modules = [m for m in model.modules()
                         if m._buffers or any(p is not None and not p.requires_grad for p in m._parameters.values())]
        # The parameters frozen at wrap(): they stay local, so one made trainable later would never train.
        self._frozen = [(name, p) for name, p in model.named_parameters() if not p.requires_grad]
        self.layers = layers
        self.worker = worker
        self._branches = worker.config.branches  # clocks must be scheduled on one (_check_scheduled)
        self.device = layers[0].device
        self._slack = slack
        self._store_activations = store_activations
        self._row_width = row_width
        # Held reads or the GeePS pattern: chosen by prepare_plan(). The recording
        # pass logs the clock without held reads (_recording.for_holding).
        self._hold = False
        self.hold_choice = ""  # which pattern prepare_plan() chose, and why (PSModule.plan)
        self._overlap = overlap_updates
        self.overlap_choice = ""  # when updates ship, and why (PSModule.plan)
        self._shipped_why = "the recording pass of wrap()"  # for ShippedGradient's errors (_why_shipped)

        # The recording, then the plan made from it.
        self._recording = True
        self._events: list[Event] = []
        self._forward_events = 0  # of self._events
        self._recorded_forward_events = 0  # of the recording's (without held reads)
        self._init: list[torch.Tensor] = []  # per layer: its initial values, flat
        # The saved activations: stored or recomputed (_saved.py).
        # recompute: "cheap", "compute" or "none" (wrap()'s choice, "auto" resolved).
        self._acts = SavedActivations(recompute=recompute != "none" and store_activations, stored=stored or {},
                                      parameters=slack == 0 or hold_reads is True,  # hold_reads: as given to wrap()
                                      compute_bound=recompute == "compute", keep=keep)
        self._recompute_fallback = recompute_fallback  # store everything if the recomputing plan does not fit
        self.auto_choice = ""  # what wrap(recompute="auto") chose after its first plan, and why (wrap sets it)
        self.keep_choice = ""  # what wrap() kept with autograd on the device, and why (wrap sets it)
        self._handles: list[int] = []
        self._tables: list[Table] = []
        self._all_tables: Tables | None = None  # the layers' tables and the local ones (prepare_plan)
        self._preview: PlanPreview | None = None  # of the plan prepare_plan chose

        # Per clock.
        self.clock = 0  # clocks finished
        self._phase = Phase.IDLE
        self._cursor = 0  # next event
        self._next_slot = 0
        self._fwd_open: dict[int, tuple[int, int, torch.Tensor]] = {}  # layer -> (event, address, flat buffer)
        self._opened_by_caller: dict[int, nn.Module] = {}  # layer -> the tied module whose call opened it
        self._param_ptrs: dict[int, int] = {}  # address of an open forward read -> its layer
        self._reads: dict[int, int] = {}  # layer -> forward reads this clock
        self._reruns: set[int] = set()  # layers the recording pass ran again in the backward (checkpointing)
        self._held: dict[int, torch.Tensor] = {}  # event of a held forward read -> its flat buffer
        self._held_by_layer: dict[int, list[int]] = {}  # layer -> events of its held forward reads
        self._bound_versions: dict[int, list[int]] = {}  # layer -> its parameters' versions when bound this clock
        self._shrunk: dict[int, Slot] = {}  # slot -> this clock's layout where smaller than recorded
        # Between a forward pass whose layers were read in their own forward
        # and step(): saved-tensor hooks that refuse a parameter the loss uses
        # (it holds the NaN placeholder there), and the thread that set them.
        self._loss_guard: Any = None
        self._loss_guard_thread = 0
        self._guard_between = False  # the guard was set between clocks (its message)
        self._recorded_autocast: tuple[bool, torch.dtype | None] = (False, None)  # autocast_state at recording
        self._grad_open: dict[int, tuple[int, torch.Tensor]] = {}  # layer -> (event, flat buffer)
        # Gradients: per layer, the forward serial in which each parameter's
        # gradient last arrived, and how many of the layer's gradients are
        # still to come this clock (0: not read yet, or updated).
        self._serial = 0  # training forward passes started
        self._stream = app_stream(self.device)  # the current clock's CUDA stream (0 on the CPU)
        self._marks: list[list[int]] = [[0] * len(layer.params) for layer in layers]
        self._pending: list[int] = [0] * len(layers)
        # A backward pass that delivered a gradient and has not finished
        # (autograd runs the callback queued at its first gradient only once
        # the whole pass is done), and the serial of the last finished one.
        self._pass_open = False
        self._backward_done = -1
        self._grad_errors = False  # a gradient hook refused a gradient this clock
        self._updated: set[int] = set()
        # Saved activations seen this forward, by address, layout and version,
        # each with a weak reference to its storage: an entry counts only
        # while that memory is alive, so a tensor that reuses the address of
        # one freed earlier in the forward is not taken for it.
        self._saved: dict[tuple[Any, ...], tuple[weakref.ref[torch.UntypedStorage], _ActRef | None]] = {}
        self._local_ptrs: set[int] = set()
        self._stale_grads = True  # parameters may hold gradients that step() did not see handed over
        self._light = False  # the light clock (_clock.py's docstring): no saved-tensor hooks after the recording
        self._at_step = False  # the light clock ships every update at step() (_clock.py's docstring)
        self._filtered = 0  # the forward serial whose gradients filter_gradients() filtered
        self._outputs_seen: set[tuple[int, int]] = set()  # (forward, output) a backward passed (_watch_backward)
        self._forwards = 0  # training forward passes of this clock (several: gradient accumulation)
        self._synced_forwards = 0  # of them, those not under no_sync()
        self._defer = False  # inside no_sync(): this forward's gradients stay in .grad
        self._pass_deferred = False  # the running backward is of a forward under no_sync()

        self._eval_active = False
        self._eval_clock: tuple[int, int | None] | None = None  # (clock, branch) the parameters hold
        self._dropped_passes = 0  # finished passes whose gradients zero_grad() dropped before any step()
        self._ended_a_clock = False  # a step() ended a clock since wrap()
        # Per parameter of the layers: (its module's _parameters, its key, the
        # parameter, its name), made at the first clock (_refuse_swapped_for_the_call).
        self._param_places: list[tuple[dict[str, Any], str, nn.Parameter, str]] | None = None
        self._own_state_dict = False  # PSModule.state_dict() runs: it bound the branch it was asked for
        # The copies an evaluation bound, with their sums then: a write
        # through p.data (which no version counter sees) shows in them.
        self._eval_copies: list[torch.Tensor] = []
        self._eval_sums: torch.Tensor | None = None
        # The parameters' version counters when the adapter last let go of
        # them (after wrap(), a clock, an evaluation): a write in between is
        # the loop's, and lost (_refuse_writes_between_clocks). None until wrap() ends.
        self._idle_versions: list[list[int]] | None = None
        self._broken: BaseException | None = None
        self._mutating_block = _Mutating(self)
        self._closed = False
        self._hooks: list[Any] = []
        self._grad_hooks: list[Any] = []  # removed when updates ship at step()
        # The light clock's batched engine calls (_plan_batches): the reads
        # opened at the first layer's read with the first update buffer, and
        # each update posted with its reads and the next update buffer opened.
        self._batched = False
        self._read_batch: list[tuple[int, int]] = []
        self._first_read = -1  # event index of the clock's first read
        self._next_pre_update: dict[int, int] = {}  # update event -> the next update's handle (-1: none)
        self._held_handle: dict[int, int] = {}  # layer -> handle of its forward read
        self._forward_reads: list[tuple[int, int]] = []  # (read event, layer) in forward order
        # Shipping at step(): this driver's forward hooks, (hook dict, key, hook),
        # taken out for the clock's forward (_clock.py's docstring).
        self._layer_hooks: list[tuple[dict[int, Any], int, Any]] = []
        self._opened: dict[int, Any] = {}  # read event -> its buffer, opened by the batch
        self._read_back: dict[int, torch.Tensor] = {}  # slot -> its tensor, read back ahead of its use (_load)
        self._read_ahead: dict[int, Any] = {}  # read_grad event -> its buffer, opened with loads (_queue_ahead)
        # Stored activations sharing one local access (_recording.store_groups):
        # slot -> its group's slots, and slot -> (offset, floats) in the access.
        self._groups: dict[int, tuple[int, ...]] = {}
        self._spans: dict[int, tuple[int, int]] = {}
        self._filling: dict[int, list[tuple[int, int, int]]] = {}  # group (first slot) -> pieces to store
        self._queued: list[tuple[Any, ...]] = []  # ops for the next engine call (_post, _store)
        self._queued_stores: list[tuple[torch.Tensor, int, int]] = []  # queued stores: (tensor, _version, slot)
        self._queued_grads: list[torch.Tensor] = []  # gradients the queued updates copy from
        self._local_views: dict[Any, torch.Tensor] = {}  # local-table buffer key -> flat uint8 view
        self._update_buffer: Any = None  # the next update's buffer, opened by the last batch
        # Refuses load_state_dict on the module where it would write a trainable
        # parameter (ClockChecks._refuse_load; registered by ClockDriver.__init__).
        self._load_guard: Any = None
        self._recording_hooks: list[Any] = []
        self.misgrouped: str | None = None  # a group whose member ran outside its forward (recording)
        # The mixed-precision scaler (_amp.py): unscales each layer's gradients
        # before they are copied into its update, which is zeros on an overflow.
        self.grad_scale: GradScale | None = None
        # Called before each training clock touches the engine; sends the
        # optimizer's changed learning rates (_optim.py).
        self.clock_start: Callable[[], None] | None = None
        # Whether a rate changed since the last clock_start (a warning at step()
        # where the clock's updates have left already).
        self.rates_changed: Callable[[], bool] | None = None
        # Refuses param-group settings to be loaded that the rules cannot take (LearningRates.check_loaded).
        self.check_loaded_groups: Callable[[Sequence[dict[str, Any]]], None] | None = None
        # The shapes of example_input's tensors (set by wrap()), for _check_inputs.
        self.input_shapes: list[tuple[int, ...]] | None = None
        self.input_layouts: list[tuple[bool, tuple[int, ...]]] | None = None  # example_input's (input_layouts)

    def __deepcopy__(self, memo: dict[int, Any]) -> NoReturn:
        refuse_copy("deepcopy")  # reached through the module's hooks

    def __reduce_ex__(self, protocol: Any) -> NoReturn:
        refuse_copy("pickle")

    # -- whether the driver can go on ----------------------------------------------------
    @property
    def stream(self) -> int:
        """The current clock's CUDA stream handle (0 on the CPU)."""
        return self._stream

    def check_usable(self, *, recover: bool = False) -> bool:
        """Raises where the model cannot be used. ``recover``: a call of the
        loop's between hooks (a forward, step(), state_dict(), a save) first
        ends a clock the loop's own exception left half done (_recover_clock);
        True when it did."""
        if self._closed:
            raise OutOfOrderError("the wrapped model was unwrapped; use the module unwrap() returned")
        if recover and self._broken is None and self._backward_failed():
            self._broken = RuntimeError(f"the backward pass of clock {self.clock} ended before every layer's "
                                        "gradient arrived (an exception in it)")
        if self._broken is None:
            return False
        if not (recover and self._recover_clock()):
            raise OutOfOrderError(
                f"an earlier error left clock {self.clock} incomplete ({type(self._broken).__name__}: "
                f"{self._broken}); the engine's recorded access order cannot be resumed, so this model "
                "cannot train further"
            ) from self._broken
        return True

    def _backward_failed(self) -> bool:
        """Whether a backward pass of this clock began and did not finish:
        back in the loop, that means it raised (``loss.backward()`` returns
        only once it is done). One that finished with layers still waiting
        for gradients did not fail: step() says which got none."""
        if not self._pass_open or self._phase is not Phase.BACKWARD or not any(c > 0 for c in self._pending):
            return False
        return bool(self._updated) or any(mark == self._serial for marks in self._marks for mark in marks)

    def _watch_pass_end(self) -> None:
        """At a backward pass's first gradient: autograd calls back when the
        whole pass is done (not when it raises), which tells a pass that
        raised from one after which a layer still had no gradient."""
        self._pass_open = True
        driver_ref, serial = weakref.ref(self), self._serial

        def done() -> None:
            driver = driver_ref()
            if driver is not None and driver._serial == serial:
                driver._pass_open = False
                driver._backward_done = serial
        torch.autograd.Variable._execution_engine.queue_callback(done)

    def _recover_clock(self) -> bool:
        """Ends the clock an error left half done, where it can (ClockDriver's);
        True when the model may go on."""
        return False

    def _mutating(self) -> _Mutating:
        """Marks the driver broken if the block fails: the clock's accesses
        are then half done and cannot be completed in the recorded order."""
        return self._mutating_block

    def _fail(self, error: BaseException) -> None:
        """Marks the driver broken by ``error`` (the first one counts): the
        clock's accesses are half done. :meth:`_mutating` calls it on the way
        out of a block; the per-layer paths call it from their own ``except``
        (a ``try`` costs nothing until it raises)."""
        if self._broken is None:
            self._broken = error
