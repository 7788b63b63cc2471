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
first opens); :meth:`ClockDriver.plan` chooses held reads or not (asking
the engine for a dry run of the plan when there is a device budget) and
replays the log as the virtual iteration (``_recording.py``). Every later clock must produce the same events in the same order;
the driver checks each one against the log before touching the engine, so a
different clock raises :class:`IterationMismatchError` instead of confusing
the engine.
"""

from __future__ import annotations

import contextlib
import dataclasses
import enum
import threading
import warnings
import weakref
from collections.abc import Callable, Iterator, Sequence
from typing import Any, NamedTuple, NoReturn, TypeVar

import numpy as np
import torch
from torch import nn

from mltuner.client._worker import OP_KINDS, PlanPreview, Table, Worker
from mltuner.exceptions import ArgumentTypeError, InvalidArgumentError, OutOfOrderError, ResourceExhaustedError
from mltuner.torch._buffers import app_stream, as_tensor, autocast_state, buffer_key, placeholder, storage_ptr
from mltuner.torch._errors import IterationMismatchError, UnsupportedModelError
from mltuner.torch._layers import Layer
from mltuner.torch._pattern import reason, refusal
from mltuner.torch._recording import (Event, Slot, Tables, create_tables, describe, for_holding, replay, reuse_tables,
                                      store_groups)
from mltuner.torch._saved import BufferOwners, SavedActivations, empty_for, read_back, write_bytes
from mltuner.torch._trace import ParamRef

__all__ = ["ClockDriver", "input_layouts", "input_shapes", "tensors_in"]

T = TypeVar("T")

# The engine's op numbers for the light clock's batches (Worker._run_ops).
_READ, _POST_READ, _PRE_UPDATE, _UPDATE = (OP_KINDS[k] for k in ("read", "post_read", "pre_update", "update"))
_LOCAL, _POST_LOCAL, _CLOCK = (OP_KINDS[k] for k in ("local_access", "post_local_access", "clock"))
# An initial value worker 0 wrote to the servers and freed (commit_plan).
_WRITTEN = torch.empty(0)
_MAX_LOCAL_VIEWS = 4096  # cached torch views of local-table buffers (one per buffer address and shape)
_OPENS = frozenset((_READ, _PRE_UPDATE, _LOCAL))  # the ops whose engine call returns a buffer
_MAX_LOADS_AHEAD = 32  # stored activations read back ahead of their use, in one engine call with the first


class _ActRef(NamedTuple):
    """What autograd keeps of a saved activation: stored in the local table,
    or recomputed in the backward pass."""

    slot: int


class _Mutating:
    """The context manager of :meth:`ClockDriver._mutating`: a plain class,
    not ``contextlib.contextmanager``, because it wraps every hook call."""

    __slots__ = ("_driver",)

    def __init__(self, driver: ClockDriver) -> None:
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


def _weak_guard(driver: ClockDriver) -> torch.autograd.graph.saved_tensors_hooks:
    """The loss guard's hooks for ``driver``, which they do not keep alive:
    once the driver is gone, the guard takes itself off the stack at its
    next use (it is on top then) and passes the tensor."""
    alive = weakref.ref(driver)

    def pack(tensor: torch.Tensor) -> tuple[torch.Tensor, int]:
        owner = alive()
        if owner is None:
            guard.__exit__(None, None, None)
            return tensor, tensor._version
        return owner._guard_pack(tensor)

    guard = torch.autograd.graph.saved_tensors_hooks(pack, _guard_unpack)
    return guard


def _guard_unpack(packed: tuple[torch.Tensor, int]) -> torch.Tensor:
    """The loss guard's saved tensor back, with the check torch makes where
    no hooks are set (hooks turn its own off)."""
    tensor, version = packed
    if tensor._version != version:
        raise RuntimeError(
            "one of the variables needed for gradient computation has been modified by an inplace operation: "
            f"a tensor of shape {tuple(tensor.shape)} is at version {tensor._version}; expected version {version}"
        )
    return tensor


def input_shapes(args: tuple[Any, ...], kwargs: dict[str, Any]) -> list[tuple[int, ...]]:
    """The shapes of a forward call's tensors: the positional arguments',
    then the keyword arguments' by name."""
    return [tuple(t.shape) for t in tensors_in((args, [kwargs[name] for name in sorted(kwargs)]))]


def input_layouts(args: tuple[Any, ...], kwargs: dict[str, Any]) -> list[tuple[bool, tuple[int, ...]]]:
    """The memory layouts of a forward call's tensors (as input_shapes
    orders them): whether each covers its memory exactly once, and its
    dimensions of more than one element from the densest stride up
    (same_layouts compares them)."""
    layouts = []
    for tensor in tensors_in((args, [kwargs[name] for name in sorted(kwargs)])):
        slot = Slot(tuple(tensor.shape), tensor.dtype, tuple(tensor.stride()))
        order = tuple(sorted((d for d, size in enumerate(tensor.shape) if size != 1), key=lambda d: tensor.stride(d)))
        layouts.append((slot.exact_layout, order))
    return layouts


def same_layouts(now: list[tuple[bool, tuple[int, ...]]], recorded: list[tuple[bool, tuple[int, ...]]]) -> int:
    """The first input whose layout differs from the recorded one (-1: none
    does): the same coverage, and its dimensions in the recorded order (a
    dimension of one element, as a batch of 1, has no place in it)."""
    for number, ((exact, order), (then_exact, then_order)) in enumerate(zip(now, recorded)):
        if exact != then_exact or order != tuple(d for d in then_order if d in order):
            return number
    return -1


def tensors_in(value: Any) -> Iterator[torch.Tensor]:
    """The tensors in a (nested) tuple, list, dict or dataclass instance (a
    model's output type)."""
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, (list, tuple)):
        for item in value:
            yield from tensors_in(item)
    elif isinstance(value, dict):
        for item in value.values():
            yield from tensors_in(item)
    elif dataclasses.is_dataclass(value) and not isinstance(value, type):
        for field in dataclasses.fields(value):
            yield from tensors_in(getattr(value, field.name))


def _module_at(model: nn.Module, name: str) -> nn.Module | None:
    """The submodule of ``model`` at qualified ``name``, or None."""
    try:
        return model.get_submodule(name)
    except AttributeError:
        return None


def _parameter_at(model: nn.Module, name: str) -> nn.Parameter | None:
    """The parameter of ``model`` at qualified ``name``, or None."""
    try:
        return model.get_parameter(name)
    except AttributeError:
        return None


class ClockDriver:
    """Records one clock, plans the virtual iteration, then drives the
    engine from the model's hooks. One per wrapped model; used by one thread
    at a time (the training loop's; on CUDA, autograd runs the hooks on its
    device thread while the loop waits in ``backward``)."""

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
        self._grad_errors = False  # a gradient hook refused a gradient this clock
        self._updated: set[int] = set()
        # Saved activations seen this forward, by address, layout and version,
        # each with a weak reference to its storage: an entry counts only
        # while that memory is alive, so a tensor that reuses the address of
        # one freed earlier in the forward is not taken for it.
        self._saved: dict[tuple[Any, ...], tuple[weakref.ref[torch.UntypedStorage], _ActRef | None]] = {}
        self._local_ptrs: set[int] = set()
        self._stale_grads = True  # parameters may hold gradients that step() did not see handed over
        self._light = False  # the light clock (module docstring): no saved-tensor hooks after the recording
        self._at_step = False  # the light clock ships every update at step() (module docstring)
        self._filtered = 0  # the forward serial whose gradients filter_gradients() filtered
        self._outputs_seen: set[tuple[int, int]] = set()  # (forward, output) a backward passed (_watch_backward)
        self._forwards = 0  # training forward passes of this clock (several: gradient accumulation)
        self._synced_forwards = 0  # of them, those not under no_sync()
        self._defer = False  # inside no_sync(): this forward's gradients stay in .grad
        self._pass_deferred = False  # the running backward is of a forward under no_sync()

        self._eval_active = False
        self._eval_clock: tuple[int, int | None] | None = None  # (clock, branch) the parameters hold
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
        self._placeholder_ptr = storage_ptr(placeholder(self.device))
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
        # taken out for the clock's forward (module docstring).
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
        self._install_hooks()
        self._load_guard = model.register_load_state_dict_pre_hook(self._refuse_load)  # type: ignore[no-untyped-call]
        self._recording_hooks: list[Any] = []
        self.misgrouped: str | None = None  # a group whose member ran outside its forward (recording)
        # Called on each layer's gradients (in place) before they are copied
        # into its update; the mixed-precision scaler's unscaling (_amp.py).
        self.grad_filter: Callable[[list[torch.Tensor]], None] | None = None
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

    # -- hooks -----------------------------------------------------------------------
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
                self._grad_hooks.append(slot.param.register_post_accumulate_grad_hook(hook))  # type: ignore[no-untyped-call]

    def remove_hooks(self) -> None:
        self._end_loss_guard()
        self._load_guard.remove()
        for handle in self._hooks + self._grad_hooks:
            handle.remove()
        self._hooks.clear()
        self._layer_hooks.clear()
        self._grad_hooks.clear()

    def _refuse_load(self, module: nn.Module, state: dict[str, Any], prefix: str, *args: Any) -> None:
        """model.module.load_state_dict(): refused where it would write a
        trainable parameter (a buffers-only state may load)."""
        names = {prefix + slot.name for layer in self.layers for slot in layer.params}
        if not self._closed and names.intersection(state):
            raise OutOfOrderError(
                "load_state_dict on a wrapped model's module: the servers hold the parameters; load the state "
                "into the module before wrap() (worker 0's values become the servers' initial values), or "
                "resume from a checkpoint with wrap(..., resume_from=...)"
            )

    def note_idle_versions(self) -> None:
        """The adapter lets go of the parameters (module docstring of _idle_versions)."""
        self._idle_versions = [layer.versions() for layer in self.layers]

    def _check_autocast(self) -> None:
        """Refuses a training forward under another autocast than the
        recording's where layers are read in their own forward: autocast
        saves cast copies of the weights (and activations of its dtype)
        instead of what the recording saw, so the backward pass would leave
        the recorded order in the middle of the clock."""
        if self._light:
            return
        now = autocast_state(self.device)
        if now != self._recorded_autocast:
            def words(state: tuple[bool, torch.dtype | None]) -> str:
                return f"under {self.device.type} autocast to {state[1]}" if state[0] else "without autocast"

            raise IterationMismatchError(
                f"clock {self.clock} runs {words(now)}, but wrap() recorded the clock {words(self._recorded_autocast)}; "
                f"where layers are read in their own forward ({self.hold_choice}), call wrap() inside the same "
                "autocast (torch.autocast) as the training loop; nothing of this clock was done"
            )

    def _refuse_unfrozen(self) -> None:
        """Refuses a training forward after a parameter frozen at wrap() was
        made trainable (fine-tuning's "unfreeze the backbone"): the servers
        hold only the parameters wrap() found trainable, and autograd would
        pile its gradients up in .grad while the servers never update it."""
        unfrozen = [name for name, param in self._frozen if param.requires_grad]
        if unfrozen:
            raise UnsupportedModelError(
                f"parameter(s) {', '.join(repr(n) for n in unfrozen[:4])}{' ...' if len(unfrozen) > 4 else ''} "
                "were frozen when wrap() took the model and are trainable now (requires_grad_(True) after wrap()); "
                "the servers train only the parameters wrap() found trainable, so these would never change. To "
                "train them later, wrap them trainable in a param group of their own whose lr is 0 until then, or "
                "unwrap() and wrap the module on a new job's worker; nothing of this clock was done"
            )

    def _refuse_writes_between_clocks(self) -> None:
        """Raises OutOfOrderError where the loop changed a parameter in place
        since the adapter last let go of them: the write is lost (the
        servers hold the parameters), and one into the NaN placeholder that
        parameters point at between clocks would hide later misuse. The
        parameters are as before afterwards, so the loop can go on."""
        if self._idle_versions is None:
            return
        for layer, versions in zip(self.layers, self._idle_versions):
            name = layer.changed_since(versions)
            if name is None:
                continue
            with torch.no_grad():
                placeholder(self.device).fill_(float("nan"))
            self._eval_clock, self._eval_copies = None, []  # an evaluation's copies may hold the write
            self.note_idle_versions()
            raise OutOfOrderError(
                f"parameter {name!r} of the wrapped model was changed in place between clocks (model.module."
                "load_state_dict, an initialiser applied after wrap(), p.clamp_() as in WGAN's weight "
                "clipping, ...): the servers hold the parameters and change them only by the update rule, so "
                "the change was dropped. Initialise or load the module before wrap(), or resume with "
                "wrap(..., resume_from=...)"
            )

    def _refuse_writes_to_evaluation_copies(self) -> None:
        """At the clock after an evaluation: raises OutOfOrderError where the
        loop wrote the copies of the servers' values it bound (through
        ``p.data``, which no version counter sees; their sums differ); the
        write is lost either way. One host sync, only after an evaluation."""
        copies, sums = self._eval_copies, self._eval_sums
        self._eval_copies, self._eval_sums = [], None
        if not copies or sums is None:
            return
        now = torch.stack([flat.sum(dtype=torch.float64) for flat in copies])
        if torch.equal(now, sums):
            return
        changed = int(torch.nonzero(now != sums)[0, 0])
        raise OutOfOrderError(
            f"the parameters of layer {self.layers[changed].name!r} were changed after an evaluation (through "
            "p.data, say p.data.clamp_() as in WGAN's weight clipping): they held a copy of the servers' values, "
            "which change only by the update rule, so the change was dropped. Initialise or load the module "
            "before wrap(), or resume with wrap(..., resume_from=...)"
        )

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

    # -- state checks ----------------------------------------------------------------
    def check_usable(self) -> None:
        if self._closed:
            raise OutOfOrderError("the wrapped model was unwrapped; use the module unwrap() returned")
        if self._broken is not None:
            raise OutOfOrderError(
                f"an earlier error left clock {self.clock} incomplete ({type(self._broken).__name__}: "
                f"{self._broken}); the engine's recorded access order cannot be resumed, so this model "
                "cannot train further"
            ) from self._broken

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

    @property
    def hold_reads(self) -> bool:
        """Whether the plan holds forward reads through the backward pass."""
        return self._hold

    @property
    def overlap_updates(self) -> bool:
        """Whether updates ship from the backward pass (as given to the driver)."""
        return self._overlap

    @property
    def ships_at_step(self) -> bool:
        """Whether the gradients stay in ``.grad`` until step(), which ships
        them all (the light clock without overlap_updates)."""
        return self._at_step

    @property
    def accesses(self) -> list[str]:
        """The recorded clock's accesses, in order, described in words."""
        return [self._describe(event) for event in self._events]

    @property
    def saved_activations(self) -> list[str]:
        """Each saved activation of the recorded clock (with
        ``store_activations``) in words: stored, or how it is recomputed."""
        return self._acts.describe()

    @property
    def recompute_summary(self) -> str:
        """How many saved activations are stored and how many recomputed, in
        words (``PSModule.plan``); empty without stored activations."""
        if not self._store_activations:
            return self.keep_choice  # why wrap() stopped storing them, if it did
        # recompute="auto" that chose to store everything says so in place of the
        # summary's own reason for recomputing nothing.
        chose_none = self.auto_choice if not self._acts.recompute and not self._acts.fell_back else ""
        summary = self._acts.summary(why_none=chose_none)
        choices = "; ".join(why for why in (self.auto_choice, self.keep_choice) if why and why != chose_none)
        return f"{summary} ({choices})" if choices else summary

    @property
    def unreproducible(self) -> dict[int, str]:
        """Recording: the saved activations that could not be recomputed bit
        for bit, and why (``wrap()`` records again with them stored)."""
        return self._acts.unreproducible

    def _describe(self, event: Event) -> str:
        return describe(event, self.layers, self._acts.slots)

    def _next(self, kind: str, layer: int = -1, slot: int = -1) -> int:
        """Logs the event (recording) or checks that it is the next recorded
        one; returns its index. Takes the event's fields, not an
        :class:`Event`, which would be made only to be compared."""
        events = self._events
        if self._recording:
            events.append(Event(kind, layer, slot))  # type: ignore[arg-type]
            return len(events) - 1
        index = self._cursor
        if index < len(events):
            expected = events[index]
            if expected.kind == kind and expected.layer == layer and expected.slot == slot:
                self._cursor = index + 1
                return index
        self._refuse_replaced()
        event = Event(kind, layer, slot)  # type: ignore[arg-type]
        described = self._describe(events[index]) if index < len(events) else "the end of the clock"
        raise IterationMismatchError(
            f"clock {self.clock}: the model did a {self._describe(event)} where the recorded iteration has "
            f"a {described}; every clock must run the same layers in the same order as the recording "
            f"pass of wrap(){self._mismatch_cause(events[index] if index < len(events) else None)}"
        )

    def _refuse_replaced(self) -> None:
        """Where a clock left the recorded one: raises UnsupportedModelError,
        and the model can train no further, if a module or parameter of the
        layers is no longer where wrap() found it, the likely cause."""
        replaced = self._replaced()
        if replaced is None:
            return
        error = UnsupportedModelError(
            f"clock {self.clock}: {replaced} of the wrapped model was replaced or removed after wrap() (a new head "
            "assigned to model.module, say), which is not supported: the servers hold the parameters wrap() found "
            "and every clock must run the layers its recording pass saw, so a new module's parameters would never "
            "train. Make such changes before wrap(), or unwrap() and wrap the module on a new job's worker"
        )
        self._fail(error)
        raise error

    def _replaced(self) -> str | None:
        """The first module or parameter of the layers that is no longer
        where wrap() found it in the model, in words; None if every one is.
        A walk over the layers, made only once a clock has failed."""
        for layer in self.layers:
            for name, module in (*layer.members, *layer.callers):
                if _module_at(self.model, name) is not module:
                    return f"module {name!r}"
            for slot in layer.params:
                if _parameter_at(self.model, slot.name) is not slot.param:
                    return f"parameter {slot.name!r}"
        return None

    def _mismatch_cause(self, expected: Event | None) -> str:
        """The likely cause of a clock that left the recorded order, where
        it is one a loop can fix (for :meth:`_next`'s error)."""
        frozen = [slot.name for layer in self.layers for slot in layer.params if not slot.param.requires_grad]
        if frozen:
            return (f"; parameter(s) {', '.join(repr(n) for n in frozen[:4])} were frozen after wrap() "
                    "(requires_grad_(False)), which changes what autograd saves: the servers train every "
                    "parameter wrap() took, so freeze before wrapping (or unwrap() and wrap again)")
        if expected is not None and expected.kind == "update" and self._phase is Phase.BACKWARD:
            return (f"; the gradients of layer {self.layers[expected.layer].name!r} never reached .grad, from "
                    "which its update leaves (torch.autograd.grad, or backward(inputs=...), computes gradients without "
                    "accumulating them there): call loss.backward()")
        return ""

    # -- the data behind each event -------------------------------------------------------
    def _open(self, kind: int, handle: int) -> Any:
        """Opens a recorded access (an engine op number) and returns its
        buffer, in one engine call with the ops queued so far
        (:meth:`_post`, :meth:`_store`)."""
        ops = self._queued
        ops.append((kind, handle))
        self._check_queued_stores()
        try:
            buffer = self.worker._run_ops(ops, self._stream)[-1]
        finally:
            ops.clear()
            self._queued_stores.clear()
            self._queued_grads.clear()
        return buffer

    def _post(self, kind: int, handle: int) -> None:
        """Posts a recorded access with the next engine call (:meth:`_open`,
        :meth:`_flush_posts`). The engine sees the same ops in the same
        order as with a call per post, one call later: the training thread
        pays one engine call per opened buffer instead of two, and on CUDA
        the posts of one call share one ticket of the stream's work."""
        self._queued.append((kind, handle))

    def _flush_posts(self, *, clock: bool = False) -> list[Any]:
        """Hands the queued ops to the engine (and, with ``clock``, ends the
        clock in the same call); returns the buffers of the opens among them."""
        ops = self._queued
        if clock and not ops:
            self.worker.clock()
            return []
        if clock:
            ops.append((_CLOCK, -1))
        if not ops:
            return []
        self._check_queued_stores()
        try:
            return self.worker._run_ops(ops, self._stream)
        finally:
            ops.clear()
            self._queued_stores.clear()
            self._queued_grads.clear()

    def _check_queued_stores(self) -> None:
        """A queued store's bytes are copied when the queue goes to the
        engine: refuses an activation changed in place since autograd saved
        it (torch's own backward refuses that too, by the same version
        counter), rather than storing the changed bytes."""
        if self._filling:  # a group's post would leave without its later slots' pieces
            first = next(iter(self._filling))
            raise AssertionError(f"the stored activations {self._groups[first]} were posted to the engine "
                                 f"after {len(self._filling[first])} of their stores")
        for tensor, version, slot in self._queued_stores:
            if tensor._version != version:
                raise UnsupportedModelError(
                    f"saved activation #{slot} {tuple(tensor.shape)} was modified in place after autograd saved "
                    "it for the backward pass; torch refuses that in backward() too: make the in-place op "
                    "out of place"
                )

    def _local_bytes(self, buffer: Any) -> torch.Tensor:
        """A local-table buffer as a flat uint8 tensor, made once per buffer
        address and shape (:func:`mltuner.torch._buffers.buffer_key`)."""
        key = buffer_key(buffer)
        flat = self._local_views.get(key)
        if flat is None:
            if len(self._local_views) >= _MAX_LOCAL_VIEWS:
                del self._local_views[next(iter(self._local_views))]
            flat = self._local_views[key] = as_tensor(buffer, self.device).view(-1).view(torch.uint8)
        return flat

    def _open_read(self, index: int, layer: Layer) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """The read's flat buffer and the parameters' views into it."""
        if self._recording:
            flat = self._init[layer.index]
            return flat, layer.views(flat)
        if self._batched:
            if index == self._first_read:
                *reads, self._update_buffer = self.worker._run_ops(self._read_batch, self._stream)
                self._opened = dict(zip((i for i, e in enumerate(self._events) if e.kind == "read"), reads))
            return layer.buffer_views(self._opened.pop(index))
        return layer.buffer_views(self._open(_READ, self._handles[index]))

    def _close_read(self, index: int) -> None:
        if not self._recording:
            self._post(_POST_READ, self._handles[index])

    def _store(self, index: int, slot: int, tensor: torch.Tensor) -> None:
        """Copies a saved activation into its rows. Where the engine can copy
        the bytes itself (one span of memory, 4-byte aligned), the store is
        queued, open and post with the bytes to copy, for the next engine
        call: the forward then costs an engine call per layer, not two per
        saved tensor (the queue holds the tensor until then; after it the
        copy is on the stream, and torch may free and reuse its memory)."""
        if self._recording:
            return
        handle = self._handles[index]
        layout = self._layout(slot)
        if not (layout.exact_layout and layout.nbytes % 4 == 0):
            # Through a buffer of its own, now: an engine call, which also
            # posts whatever is queued (store_groups ends every group there).
            write_bytes(self._local_bytes(self._open(_LOCAL, handle)), tensor, layout)
            self._post(_POST_LOCAL, handle)
            return
        if tensor.data_ptr() % 4:  # a view at an odd offset: the engine copies whole words
            tensor = tensor.clone(memory_format=torch.preserve_format)
        address = tensor.data_ptr()
        self._queued_stores.append((tensor, tensor._version, slot))
        if slot not in self._groups:
            self._queued += [(_LOCAL, handle), (_POST_LOCAL, handle, [(address, 0, layout.nbytes // 4)])]
            return
        # One access for the group, opened at its first slot's store; its
        # post goes to the engine with the next call, after the last one.
        members = self._groups[slot]
        piece = (address, self._spans[slot][0], layout.nbytes // 4)
        if handle >= 0:
            pieces = self._filling[members[0]] = [piece]
            self._queued += [(_LOCAL, handle), (_POST_LOCAL, handle, pieces)]
        else:
            self._filling[members[0]].append(piece)
        if slot == members[-1]:
            del self._filling[members[0]]

    def _load(self, slot: int) -> torch.Tensor:
        """A stored activation, read back from the local table (its event
        logged or checked first). The loads recorded right after it (the
        rest of a layer's saved tensors, as a rule), and a backward read of
        parameters among them, go in the same engine call
        (:meth:`_queue_ahead`)."""
        index = self._next("load", slot=slot)
        if self._recording:
            return self._acts.original(slot)
        out = self._read_back.pop(slot, None)
        if out is not None:
            return out
        if self._handles[index] < 0:
            raise AssertionError(f"saved activation #{slot} was not read back with its group")
        if self._by_engine(slot):  # the engine copies the bytes out, in the same call that opens the rows
            self._queue_load(index)
            read, position = self._queue_ahead(index, read=True)
            opened = self._flush_posts()
            if read >= 0:
                self._read_ahead[read] = opened[position]
            return self._read_back.pop(slot)
        layout = self._layout(slot)
        out = read_back(self._local_bytes(self._open(_LOCAL, self._handles[index])), layout, self.device)
        self._post(_POST_LOCAL, self._handles[index])
        return out

    def _queue_ahead(self, index: int, *, read: bool) -> tuple[int, int]:
        """Queues, for the engine call about to go, the loads recorded right
        after event ``index`` that the engine copies out (the rest of a
        layer's saved tensors, as a rule: handed out when autograd asks)
        and, with ``read``, a backward read of parameters among them (the
        layer's backward op needs both; taken from ``_read_ahead``). Returns
        that read's event and its place among the call's opened buffers,
        or (-1, -1)."""
        events, handles = self._events, self._handles
        found = (-1, -1)
        ahead = index + 1
        while ahead < len(events) and ahead - index <= _MAX_LOADS_AHEAD:
            event = events[ahead]
            if event.kind == "read_grad" and read and found[0] < 0:
                found = (ahead, self._queue_read(handles[ahead]))
            elif event.kind != "load" or not self._by_engine(event.slot):
                break
            elif handles[ahead] >= 0:  # (else a slot of a group queued here already)
                self._queue_load(ahead)
            ahead += 1
        return found

    def _queue_read(self, handle: int) -> int:
        """Queues the open of a backward read for the next engine call;
        returns its place among the buffers that call opens."""
        position = sum(op[0] in _OPENS for op in self._queued)
        self._queued.append((_READ, handle))
        return position

    def _layout(self, slot: int) -> Slot:
        """A stored slot's layout this clock: the recorded one, or the smaller
        one its tensor had (:meth:`SavedActivations.check`)."""
        return self._shrunk.get(slot) or self._acts.slots[slot]

    def _by_engine(self, slot: int) -> bool:
        """Whether the engine copies a stored activation out itself (whole
        float32 words; a group's slots always)."""
        return slot in self._groups or self._acts.slots[slot].nbytes % 4 == 0

    def _queue_load(self, index: int) -> None:
        """Queues the open and the post of load event ``index``, the post
        copying the rows out into new tensors, one per slot of its group
        (or its slot alone), kept in ``_read_back`` until autograd asks."""
        handle, slot = self._handles[index], self._events[index].slot
        pieces = []
        for member in self._groups.get(slot, (slot,)):
            layout = self._layout(member)
            out = self._read_back[member] = empty_for(layout, self.device)
            pieces.append((out.data_ptr(), self._spans[member][0] if member in self._spans else 0,
                           layout.nbytes // 4))
        self._queued += [(_LOCAL, handle), (_POST_LOCAL, handle, (), pieces)]

    def _update(self, index: int, layer: Layer, grads: list[torch.Tensor]) -> None:
        if self._batched:
            self._batched_update(index, layer, grads)
            return
        if not self._recording:
            handle = self._handles[index]
            pieces = None if self.grad_filter is not None else self._pieces(layer, grads)
            if pieces is not None:  # the engine copies the gradients in: queued, like a store
                self._queued += [(_PRE_UPDATE, handle), (_UPDATE, handle, pieces)]
                self._queued_grads += grads  # alive until the queue goes to the engine
                return
            _, views = layer.buffer_views(self._open(_PRE_UPDATE, handle))
            with torch.no_grad():
                if self.grad_filter is not None:
                    self.grad_filter(grads)
                torch._foreach_copy_(views, grads)
            self._post(_UPDATE, handle)

    def _batched_update(self, index: int, layer: Layer, grads: list[torch.Tensor], *, filtered: bool = False) -> None:
        """The light clock's update: the buffer was opened by the last batch;
        one engine call copies the gradients in (one kernel for the layer),
        posts the update with the layer's read and opens the next update's
        buffer."""
        pieces = None if self.grad_filter is not None and not filtered else self._pieces(layer, grads)
        if pieces is None:  # a scaler to apply, or gradients the engine cannot take as they are
            _, views = layer.buffer_views(self._update_buffer)
            with torch.no_grad():
                if self.grad_filter is not None and not filtered:
                    self.grad_filter(grads)
                torch._foreach_copy_(views, grads)
            update: tuple[Any, ...] = (_UPDATE, self._handles[index])
        else:
            update = (_UPDATE, self._handles[index], pieces)
        self._update_buffer = None
        ops = [(_POST_READ, self._held_handle[layer.index]), update]
        following = self._next_pre_update[index]
        if following >= 0:
            ops.append((_PRE_UPDATE, following))
        opened = self.worker._run_ops(ops, self._stream)
        self._update_buffer = opened[0] if opened else None

    def _pieces(self, layer: Layer, grads: list[torch.Tensor]) -> list[tuple[int, int, int]] | None:
        """The gradients as pieces for the engine to copy (address, offset in
        the layer's rows, count); None when one needs torch to copy it
        (another dtype, device or layout)."""
        pieces = []
        for slot, grad in zip(layer.params, grads):
            if grad.dtype is not torch.float32 or grad.device != self.device or not grad.is_contiguous():
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

    def _open_forward_reads(self) -> None:
        """Shipping at step(): opens every forward read in one engine call and
        points each layer's parameters into its read, which stays held until
        step(); the forward then runs without the layer hooks."""
        with self._mutating():
            *reads, self._update_buffer = self.worker._run_ops(self._read_batch, self._stream)
        for (index, number), buffer in zip(self._forward_reads, reads):
            layer = self.layers[number]
            flat, views = layer.buffer_views(buffer)
            layer.bind(views)
            self._bound_versions[number] = layer.versions()
            self._held[index] = flat
            self._held_by_layer[number] = [index]
        self._cursor = self._forward_events

    # -- the forward pass --------------------------------------------------------------
    def forward(self, call: Callable[[], T], inputs: Any = None) -> T:
        """Runs the wrapped model's forward: a clock's training forward when
        gradients are enabled, an evaluation on the servers' current values
        otherwise. ``inputs``: the forward's arguments (for
        :meth:`_check_inputs`)."""
        self.check_usable()
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
            raise OutOfOrderError(
                f"a second training forward pass in clock {self.clock}: call loss.backward() and step() once "
                "per forward pass (run evaluation forwards under torch.no_grad()). Several forward and backward "
                "passes per step() (gradient accumulation) need held reads without stored activations (wrap()'s "
                "default without store_activations or a device_memory_budget) and, where updates ship from the "
                "backward pass, every pass but the last under model.no_sync(); "
                f"this model: {self.hold_choice}; {self.overlap_choice}"
            )
        self._end_loss_guard()
        if not again:
            if not self._recording:
                self._refuse_unfrozen()
                self._check_autocast()
                self._refuse_writes_between_clocks()  # nothing of the clock has reached the engine
                self._refuse_writes_to_evaluation_copies()
                self._check_inputs(inputs)
                self._acts.check_modes(self.model, self.clock)
                self._acts.read_buffers(self.clock)
            if self.clock_start is not None and not self._recording:
                self.clock_start()  # may raise: nothing of the clock has reached the engine
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
                    self._acts.end_forward()
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

    def _check_inputs(self, inputs: Any) -> None:
        """With stored activations, refuses inputs (``(args, kwargs)``) of shapes the slots cannot
        take (larger than example_input's; any other while recomputing,
        whose programs replay the recorded shapes) before the clock starts,
        so that it can go on with other inputs: found at a saved tensor, the
        clock's accesses would be half done."""
        if not self._store_activations or self.input_shapes is None or inputs is None:
            return
        shapes = input_shapes(*inputs)
        recorded = self.input_shapes
        number = -1 if self.input_layouts is None else same_layouts(input_layouts(*inputs), self.input_layouts)
        if number >= 0 and len(shapes) == len(recorded):
            tensor = list(tensors_in(inputs))[number]
            raise IterationMismatchError(
                f"clock {self.clock}: input tensor #{number} {tuple(tensor.shape)} has strides {tuple(tensor.stride())}, "
                "another memory layout than example_input's; with store_activations the activations are stored "
                "with the recorded layouts, so every clock's inputs must have example_input's (a slice such as "
                "x[:, :n] is a view with gaps: pass x[:, :n].contiguous()); nothing of this clock was done, so it "
                "can go on with other inputs"
            )
        if shapes == recorded:
            return
        if len(shapes) != len(recorded):
            raise IterationMismatchError(
                f"clock {self.clock}: the forward got {len(shapes)} tensors, example_input and example_kwargs "
                f"{len(recorded)}; with store_activations the recording pass must see the tensors every clock "
                "passes: give wrap() a call like the training batches' (example_kwargs= for keyword tensors); "
                "nothing of this clock was done, so it can go on with other inputs"
            )
        recomputing = self._acts.recomputing
        larger = any(len(now) != len(then) or any(a > b for a, b in zip(now, then))
                     for now, then in zip(shapes, recorded))
        if recomputing or larger:
            raise IterationMismatchError(
                f"clock {self.clock}: the inputs are {shapes}, example_input's {recorded}; with store_activations "
                "the recording pass sizes the stored activations, so "
                + ("with recomputed activations every clock must have the recorded shapes (the backward pass "
                   "replays the recorded ops): keep the batch size (DataLoader(..., drop_last=True)) or use "
                   "wrap(..., recompute='none'), with which smaller inputs work" if recomputing else
                   "no input may be larger than example_input: give wrap() the largest (an evaluation forward, "
                   "which may take any batch, runs under torch.no_grad())")
                + "; nothing of this clock was done, so it can go on with other inputs"
            )

    def _start_loss_guard(self, *, between_clocks: bool = False) -> None:
        """Where layers are read in their own forward: from the end of a
        forward pass to step(), and from step() to the next forward
        (``between_clocks``), a saved tensor whose storage is the NaN
        placeholder (a parameter used by the loss, as an L2 penalty over
        model.parameters() would) is refused instead of training on NaN.
        Saved-tensor hooks are a per-thread stack: pushed here, popped by
        this thread's next step() or forward. A pop takes the top, which may
        be another model's guard or a script's own hooks pushed since: each
        push still meets one pop, and every guard checks the same thing."""
        self._end_loss_guard()
        self._guard_between = between_clocks
        # Through a weak reference: a guard left on the stack when the loop
        # ends (between clocks) must not keep the model and its engine alive.
        self._loss_guard = _weak_guard(self)
        self._loss_guard.__enter__()
        self._loss_guard_thread = threading.get_ident()

    def _end_loss_guard(self) -> None:
        if self._loss_guard is not None and self._loss_guard_thread == threading.get_ident():
            guard, self._loss_guard = self._loss_guard, None
            guard.__exit__(None, None, None)

    def _guard_pack(self, tensor: torch.Tensor) -> tuple[torch.Tensor, int]:
        if storage_ptr(tensor) == self._placeholder_ptr:
            self._end_loss_guard()
            if self._guard_between:
                raise UnsupportedModelError(
                    "a parameter of the wrapped model is used between clocks (before the forward pass: a loss "
                    "term computed from model.parameters() before calling the model, say), where it holds a NaN "
                    "placeholder: this model reads each layer from the servers in the layer's own forward. Compute "
                    "such a term inside the model's forward, or use the optimizer's weight_decay"
                )
            raise UnsupportedModelError(
                "a parameter of the wrapped model is used outside its module's forward, after the forward pass "
                "(in the loss: an L2 penalty over model.parameters(), say); where layers are read in their own "
                "forward (stored activations, hold_reads=False) its value is gone by then. Compute such a term "
                "inside the model's forward, or use the optimizer's weight_decay"
            )
        return tensor, tensor._version

    def _check_parameter_writes(self) -> None:
        """Refuses a forward pass that wrote a parameter in place: the write
        lands in the engine's read buffer and would be lost at the next read,
        where torch would keep it (nn.Embedding(max_norm=...) renormalises
        the rows it looks up so)."""
        for number, versions in self._bound_versions.items():
            layer = self.layers[number]
            name = layer.changed_since(versions)
            if name is not None:
                with self._mutating():
                    raise UnsupportedModelError(
                        f"parameter {name!r} was written in place during the forward pass (nn.Embedding with "
                        "max_norm renormalises its rows so, as would a weight clamp in a forward pre-hook); the "
                        "servers hold the parameters and apply only the update of each clock, so the write would "
                        "be lost at the next read: remove the in-place write (for an Embedding, drop max_norm)"
                    )

    def _buffer_owners(self) -> BufferOwners:
        """Recording: the model's buffers and frozen parameters by storage
        address, with their module and name (SavedActivations.find_buffers)."""
        owners: BufferOwners = {}
        for prefix, module in self.model.named_modules():
            tensors = [*module._buffers.items(),
                       *((n, p) for n, p in module._parameters.items() if p is not None and not p.requires_grad)]
            for attribute, tensor in tensors:
                address = storage_ptr(tensor) if tensor is not None else None
                if address:
                    owners[address] = (module, attribute, tensor, f"{prefix}.{attribute}" if prefix else attribute)
        return owners

    def _local_storage(self) -> set[int]:
        """The storage addresses of tensors the model keeps anyway: buffers
        and frozen parameters. Saved, they pass through (no point storing a
        copy). Read per clock (a buffer may be replaced between clocks) from
        the modules that had some at wrap(), whose structure the clocks keep
        (parameters frozen later are refused: _mismatch_cause): a fraction of
        the time of walking ``model.buffers()``."""
        ptrs: set[int | None] = set()
        for module in self._modules:
            for tensor in module._buffers.values():
                if tensor is not None:
                    ptrs.add(storage_ptr(tensor))
            for param in module._parameters.values():
                if param is not None and not param.requires_grad:
                    ptrs.add(storage_ptr(param))
        ptrs.discard(None)
        ptrs.discard(0)  # empty storages
        return ptrs  # type: ignore[return-value]

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
                "wrap() returned, not the original module"
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

    def _held_read(self, number: int) -> tuple[int, torch.Tensor] | None:
        """Layer ``number``'s held forward read this clock, its event and flat
        buffer (holding, a layer has one: _recording.for_holding); None when
        not holding or not read yet."""
        indices = self._held_by_layer.get(number) if self._hold else None
        return (indices[0], self._held[indices[0]]) if indices else None

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
            if self._light:  # the parameters keep their values until the update (module docstring)
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

    def _placeholder_user(self, tensor: torch.Tensor) -> str:
        """For an error: which parameter a tensor pointing at the placeholder
        is, or may be (every unbound one of its size, a transposed view
        included; the placeholder is shared, so its address cannot tell)."""
        unbound = [(name, p) for name, p in self.model.named_parameters() if storage_ptr(p) == self._placeholder_ptr]
        names = [name for name, p in unbound if p is tensor] or [
            name for name, p in unbound if p.numel() == tensor.numel()]
        if not names:
            return f"of shape {tuple(tensor.shape)}"
        return " or ".join(repr(n) for n in names[:3]) + (" ..." if len(names) > 3 else "")

    def _pack(self, tensor: torch.Tensor) -> Any:
        if self._phase is not Phase.FORWARD:
            return tensor  # a backward of the loss outside our forward, etc.
        address = storage_ptr(tensor)
        if address is None or tensor.numel() == 0:
            return tensor
        layer = self._param_ptrs.get(address)
        if layer is not None:
            if tensor.dtype != torch.float32:
                raise UnsupportedModelError(
                    f"autograd saves a {tensor.dtype} reinterpretation of layer {self.layers[layer].name!r}'s "
                    "parameters; only float32 views are supported"
                )
            return ParamRef(layer, tuple(tensor.shape), tuple(tensor.stride()), int(tensor.storage_offset()))
        if address == self._placeholder_ptr:
            with self._mutating():
                raise UnsupportedModelError(
                    f"a parameter ({self._placeholder_user(tensor)}) is used outside the forward of the module "
                    "that owns it (it holds a NaN placeholder there: another module's weight, as in "
                    "F.linear(h, self.embedding.weight)); add the calling module's type to "
                    "wrap(..., whole_modules=...) so that it and the parameter are read as one layer"
                )
        if not self._store_activations or address in self._local_ptrs or tensor.device != self.device:
            return tensor
        key = (address, tensor.storage_offset(), tuple(tensor.shape), tuple(tensor.stride()), tensor.dtype,
               tensor._version)
        seen = self._saved.get(key)
        if seen is not None and seen[0]() is not None:
            # The same tensor saved again (e.g. by ReLU and by the next Linear).
            return tensor if seen[1] is None else seen[1]
        with self._mutating():
            slot = self._next_slot
            if self._recording:
                self._acts.add(tensor)
            try:
                layout = self._acts.slots[slot]
            except IndexError:
                self._refuse_more_saved()
            index = self._next("store", slot=slot) if layout.stored else -1
            try:
                this_clock = self._acts.check(slot, key[2], key[4], key[3], self.clock)
            except IterationMismatchError:
                self._refuse_replaced()
                raise
            if this_clock is not layout:  # smaller than recorded: its rows hold it
                self._shrunk[slot] = this_clock
            self._next_slot += 1
            if index >= 0:
                self._store(index, slot, tensor)
            ref = None if layout.kept else _ActRef(slot)  # None: autograd keeps the tensor itself
            if ref is None and not self._recording:
                self._acts.hold(slot, tensor)  # for the recomputations that read it
            self._saved[key] = (weakref.ref(tensor.untyped_storage()), ref)
            return tensor if ref is None else ref

    def _refuse_more_saved(self) -> NoReturn:
        """A forward pass that saves more tensors than the recording's."""
        self._refuse_replaced()
        raise IterationMismatchError(
            f"clock {self.clock}: the forward pass saved more tensors for the backward pass than the "
            f"{len(self._acts.slots)} of the recording pass of wrap(); with store_activations=True the local tables "
            "are sized by the recording pass, so every clock must save the recorded ones in the recorded order "
            "(a model whose saved tensors depend on the data: wrap() without store_activations)"
        )

    # -- the backward pass -------------------------------------------------------------
    def _unpack(self, packed: Any) -> torch.Tensor:
        if isinstance(packed, torch.Tensor):
            return packed
        self.check_usable()
        if self._phase is not Phase.BACKWARD:
            raise OutOfOrderError(
                f"autograd needs a saved tensor of the wrapped model outside clock {self.clock}'s backward "
                "pass: backward() can run once per forward pass, before step()"
            )
        if self._cursor == len(self._events) and not self._recording:  # every update has left: nothing to touch
            raise OutOfOrderError(
                f"a second backward pass through one forward pass in clock {self.clock}: backward() can run once "
                "per forward pass (was it called twice, with retain_graph=True?); call step() after each"
            )
        log = self._acts.store_all if self._recording else None
        if isinstance(packed, ParamRef):
            if log is not None:
                log.unpack_param(packed.layer)
            return self._grad_read(packed).as_strided(packed.size, packed.stride, packed.offset)
        assert isinstance(packed, _ActRef)
        if log is not None:
            log.unpack_slot(packed.slot)
        with self._mutating():
            return self._acts.resolve(packed.slot, recording=self._recording, load=self._load,
                                      param=self._program_param)

    def _program_param(self, ref: ParamRef) -> torch.Tensor:
        """The parameters a recomputation reads: from the layer's backward read."""
        if self._recording and ref.layer in self._updated:
            raise OutOfOrderError(f"needs layer {self.layers[ref.layer].name!r}'s parameters after its update")
        return self._grad_read(ref).as_strided(ref.size, ref.stride, ref.offset)


    def _trace_param(self, tensor: torch.Tensor) -> ParamRef | None:
        layer = self._param_ptrs.get(storage_ptr(tensor) or 0)
        if layer is None or tensor.dtype != torch.float32:
            return None
        return ParamRef(layer, tuple(tensor.shape), tuple(tensor.stride()), int(tensor.storage_offset()))

    def _grad_read(self, ref: ParamRef) -> torch.Tensor:
        """The flat buffer of ``ref``'s layer for its backward: the held
        forward read (holding, a layer has one: _recording.for_holding), or
        the layer's backward read (opened on first use)."""
        held = self._held_read(ref.layer)
        if held is not None:
            return held[1]
        opened = self._grad_open.get(ref.layer)
        if opened is not None:
            return opened[1]
        layer = self.layers[ref.layer]
        if ref.layer in self._updated or self._hold:
            raise OutOfOrderError(
                f"autograd needs layer {layer.name!r}'s parameters after their gradients were final (a second "
                "backward pass, or a saved detached view of the parameters); not supported"
            )
        with self._mutating():
            index = self._next("read_grad", ref.layer)
            ahead = self._read_ahead.pop(index, None)  # opened with the loads before it
            if self._recording:
                flat, _ = self._open_read(index, layer)
            elif ahead is not None:
                flat, _ = layer.buffer_views(ahead)
            else:
                # The loads recorded next (the layer's saved tensors, which
                # its backward needs with the parameters) go in the same call.
                position = self._queue_read(self._handles[index])
                self._queue_ahead(index, read=False)
                flat, _ = layer.buffer_views(self._flush_posts()[position])
            self._grad_open[ref.layer] = (index, flat)
            return flat

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
            layer.mark_shipped(self._shipped_why)  # until step(): a use of .grad must not find None (_shipped.py)
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
                raise UnsupportedModelError(f"{name!r} got a sparse or missing gradient: only dense gradients")
            self._refuse_replaced()
            raise UnsupportedModelError(
                f"{name!r} got a gradient, but module {layer.name!r} did not run in this forward pass: the "
                "parameter is used outside the forward of the module that owns it; add the calling "
                "module's type to wrap(..., whole_modules=...)"
            )

    # -- the end of a clock -----------------------------------------------------------------
    def step(self) -> None:
        """Ends the clock (``Worker.clock``)."""
        self._end_loss_guard()
        self.check_usable()
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
        self.clock += 1
        self._stale_grads = self._grad_errors  # unless a refused gradient left some behind: all handed over
        self._grad_errors = False
        self._reset_clock()
        if not self._light:
            self._start_loss_guard(between_clocks=True)

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
            if self._phase is not Phase.BACKWARD or self._serial != serial:
                raise OutOfOrderError(
                    f"a gradient arrived outside clock {self.clock}'s backward pass: backward() can run once per "
                    "forward pass, before step() (was it called twice, with retain_graph=True?)"
                )
            if output in self._outputs_seen:
                raise OutOfOrderError(
                    f"a second backward pass through one forward pass in clock {self.clock}: backward() can run "
                    "once per forward pass (several forward and backward passes before step() add up their "
                    "gradients)"
                )
            self._outputs_seen.add(output)
            self._pass_deferred = deferred
        return hook

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """The forward passes inside leave their gradients in ``.grad``
        (DDP's ``no_sync``): where updates ship from the backward pass, the
        next pass outside ships the sum, or step() does."""
        self.check_usable()
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

    def filter_gradients(self, grad_filter: Callable[[list[torch.Tensor]], None] | None = None) -> None:
        """Shipping at step(): applies ``grad_filter`` (by default
        :attr:`grad_filter`) once per clock to every layer's gradients
        together, so a scaler unscales them all and an overflow anywhere
        zeroes all of them, as torch's GradScaler does; step() calls it, and
        the scaler's side earlier after ``scaler.unscale_()``."""
        grad_filter = grad_filter or self.grad_filter
        if grad_filter is None or not self._at_step or self._phase is not Phase.BACKWARD:
            return
        if self._filtered == self._serial:
            return
        grads = [grad for layer in self.layers for grad in layer.grads() if grad is not None]
        with torch.no_grad():
            grad_filter(grads)
        self._filtered = self._serial

    def _ship_updates(self) -> bool:
        """The light clock's updates at step() (module docstring): every
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
                            f"recording pass of wrap(): module {layer.name!r} did not run in this forward pass, or "
                            "its output did not reach the loss; every clock must run the same layers"
                            + self._mismatch_cause(None)
                        )
                if grad.layout != torch.strided:
                    self._grad_errors = True
                    self._bad_gradient(layer, position, grad)
        updates = [(i, self._events[i].layer) for i in range(self._forward_events, len(self._events))]
        with self._mutating():
            self.filter_gradients()
            pieces = [self._pieces(self.layers[number], grads[number]) for _, number in updates]
            if all(p is not None for p in pieces):
                ops: list[tuple[Any, ...]] = []
                for (index, number), layer_pieces in zip(updates, pieces):
                    self._next("update", number)
                    ops += [(_POST_READ, self._held_handle[number]), (_UPDATE, self._handles[index], layer_pieces)]
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

    def _reset_clock(self) -> None:
        self._phase = Phase.IDLE
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

    # -- recording and planning ---------------------------------------------------------
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

    def prepare_plan(self, hold_reads: bool | None, tables: Tables | None = None, reserved: int = 0) -> None:
        """Creates the tables (or takes ``tables``, those of an earlier
        recording of the same model: :meth:`release_tables`) and replays the
        recording as the worker's virtual iteration, in the access pattern
        chosen; the engine's dry run keeps the plan that fits, for
        :meth:`commit_plan` or :meth:`release_tables` next. ``reserved``:
        the device memory saved activations autograd keeps take beside the
        engine (left out of its budget).

        ``hold_reads``: hold each layer's forward read until its update, or
        (False) post it after the layer's forward and read the rows again
        for the backward pass (GeePS). None chooses: held reads unless
        ``store_activations`` or the device-memory budget cannot hold the
        access-buffer pool they need, which the engine's plan says
        (:meth:`Worker.preview_plan`, a dry run) before anything is
        committed; where held reads fit but their plan swaps parameters over
        the host link, reading again is planned too and taken if it moves
        fewer bytes. The budget is ``Config.device_memory_budget`` or, with
        none set and a device too small for the plan, the engine's automatic
        one (the device's free memory less ``Config.device_memory_reserve``).

        Raises:
            mltuner.ResourceExhaustedError: the budget cannot hold the pool of
                the pattern given (or, choosing, of either); the message
                gives the bytes each needs.
        """
        worker = self.worker
        worker.reserve_device_memory(reserved)
        budget = worker.config.device_memory_budget  # until a preview says what the plan is made under
        if self.device.type == "cuda":
            # Memory torch cached and no longer uses (the model's parameters
            # before the recording moved them) back to the device, so that
            # the engine's automatic budget and the shard's placement see it.
            torch.cuda.empty_cache()
        tables = (create_tables(worker, self.layers, self._acts.slots, row_width=self._row_width) if tables is None
                  else reuse_tables(worker, tables, self.layers, self._acts.slots, row_width=self._row_width))
        self._all_tables = tables
        self._tables = tables.layers
        recorded = list(self._events)
        preferred = not self._store_activations if hold_reads is None else hold_reads
        candidates = [preferred, False] if hold_reads is None and preferred else [preferred]
        if self._reruns:  # activation checkpointing: the re-run layers need their reads held
            if not preferred:
                names = ", ".join(repr(self.layers[n].name) for n in sorted(self._reruns))
                raise UnsupportedModelError(
                    f"layer(s) {names} run again in the backward pass (activation checkpointing, "
                    "torch.utils.checkpoint), which needs each layer's forward read held until its update: not "
                    "with hold_reads=False or store_activations=True; drop the checkpointing to use those "
                    "(store_activations with recompute= frees activations under a device budget instead)"
                )
            candidates = [True]
        least: dict[bool, int] = {}  # the least pool (= budget) of each pattern tried
        chosen: bool | None = None
        for hold in candidates:
            self._replay(tables, recorded, hold)
            preview = worker.preview_plan()  # the engine keeps a plan that fits: finish uses it
            self._preview = preview
            if budget == 0 and not preview.automatic_budget:  # none set, and the device holds the plan
                chosen = hold
                break
            budget = preview.budget_bytes  # Config's, or the engine's automatic one
            least[hold] = preview.pool_min_bytes
            if preview.fits:
                chosen = hold
                break
            worker.reset_virtual_iteration()
            if self._acts.recomputing and self._recompute_fallback:
                # Recomputing reads some layers' parameters early in the
                # backward pass; storing everything may need a smaller pool.
                recorded, self._recorded_forward_events = self._acts.store_everything(
                    f"recompute='auto' stores them all: recomputing needs a device_memory_budget of at least "
                    f"{preview.pool_min_bytes} bytes, above the {budget} bytes given")
                tables = reuse_tables(worker, tables, self.layers, self._acts.slots, row_width=self._row_width)
                self._all_tables = tables
                self._replay(tables, recorded, hold)
                preview = worker.preview_plan()
                self._preview = preview
                # The least the refusal names: the smaller of the two plans, either of which "auto" takes.
                least[hold] = min(least[hold], preview.pool_min_bytes)
                if preview.fits:
                    chosen = hold
                    break
                worker.reset_virtual_iteration()
        swaps: tuple[int, int] | None = None  # held reads' and reading again's bytes over the link, when compared
        if chosen is True and hold_reads is None and budget > 0 and self.link_bytes > 0 and not self._reruns:
            # Held reads fit, but their pool takes budget the stores then
            # lack: parameters swap over the host link each clock. Reading
            # again needs a pool of about two layers, so the stores keep
            # more; it wins where it moves fewer bytes.
            held = self.link_bytes
            worker.reset_virtual_iteration()
            self._replay(tables, recorded, False)
            self._preview = worker.preview_plan()
            least[False] = self._preview.pool_min_bytes
            if self._preview.fits and self.link_bytes < held:
                chosen, swaps = False, (held, self.link_bytes)
            else:
                worker.reset_virtual_iteration()
                self._replay(tables, recorded, True)
                self._preview = worker.preview_plan()  # the engine keeps this plan for finish
        if chosen is None:
            if False not in least:  # for the message: what reading again would need
                self._replay(tables, recorded, False)
                least[False] = worker.preview_plan().pool_min_bytes
            note = ("; recomputing saved activations (recompute='cheap' or 'compute') reads some layers' "
                    "parameters earlier in the backward pass, which can raise the least budget: recompute='none' "
                    "may need less (and recompute='auto' falls back to it)" if self._acts.recomputing else "")
            if self._reruns:  # held reads were the only pattern tried
                names = ", ".join(repr(self.layers[n].name) for n in sorted(self._reruns))
                raise ResourceExhaustedError(
                    f"layer(s) {names} run again in the backward pass (activation checkpointing, "
                    "torch.utils.checkpoint), which needs each layer's forward read held until its update: a "
                    f"Config.device_memory_budget of at least {least[True]} bytes, above the {budget} bytes given; "
                    "drop the checkpointing to read each layer again for its backward pass, which needs "
                    f"{least[False]} bytes (store_activations with recompute= frees activations under a budget "
                    "instead)" + note)
            raise ResourceExhaustedError(refusal(hold_reads, least, budget, worker.config.prefetch_clocks) + note)
        self.hold_choice = reason(hold_reads, self._store_activations, chosen, least, budget, swaps)

    @property
    def link_bytes(self) -> int:
        """The bytes the prepared plan moves per clock over the busier
        direction of the host link (its swaps)."""
        assert self._preview is not None
        return max(self._preview.host_to_device_bytes, self._preview.device_to_host_bytes)

    @property
    def budget_bytes(self) -> int:
        """The device budget the prepared plan is made under (0: none)."""
        assert self._preview is not None
        return self._preview.budget_bytes

    @property
    def slot_bytes(self) -> list[int]:
        """The bytes of each saved activation the recording found."""
        return [slot.nbytes for slot in self._acts.slots]

    @property
    def recomputed_bytes(self) -> int:
        """The bytes of the saved activations the recording chose to
        recompute (stored instead, they would cross the host link at most
        once each way a clock)."""
        return sum(slot.nbytes for slot in self._acts.slots if slot.recomputed)

    def device_slots(self) -> tuple[frozenset[int], bool]:
        """The stored activations the prepared plan keeps on the device
        (never swapped), and whether that is all of them."""
        assert self._preview is not None
        on_device = self._preview.device_local_accesses
        slots: set[int] = set()
        stored: set[int] = set()
        for event, handle in zip(self._events, self._handles):
            if event.kind == "store":
                stored.add(event.slot)
                if handle >= 0 and handle in on_device:
                    slots.update(self._groups.get(event.slot, (event.slot,)))
        return frozenset(slots), slots == stored

    @property
    def forward_work(self) -> tuple[int, int]:
        """The recorded forward's flops (convolutions and matrix products)
        and aten ops; (0, 0) unless the recording traced it to recompute."""
        return self._acts.forward_work

    def release_tables(self) -> Tables:
        """Gives up the prepared plan (or a failed one) and the recording:
        the worker's virtual iteration is dropped and the model gets its
        initial values back. Returns the tables, for the next recording."""
        assert self._all_tables is not None
        self.worker.reset_virtual_iteration()
        self.abandon()
        return self._all_tables

    def commit_plan(self, restore: Callable[[], None] | None = None) -> None:
        """Commits the prepared plan, writes the initial values (worker 0),
        or calls ``restore`` on every worker instead (a checkpoint's values
        loaded into the shards), and starts the engine's iterations. A
        barrier over all workers."""
        worker = self.worker
        self._acts.end_planning()
        # The initial values in host memory are freed as they are written (a
        # shard whose state lives in host memory allocates each table's then):
        # the plan may count them as room for that state.
        worker.release_host_memory_during_init(
            sum(flat.numel() * flat.element_size() for flat in self._init if flat.device.type == "cpu"))
        worker.finish_virtual_iteration()
        if restore is not None:
            restore()
        elif worker.rank == 0:  # the initial values: worker 0's model, added to the servers' zeros
            # Each layer's copy freed once written, where it makes room for the
            # shard's state; else all at the end, so that a failed write can
            # still give the module its initial values back (abandon).
            free_as_written = bool(worker.stats["shard_in_host_memory"])
            updates = {e.layer: self._handles[i] for i, e in enumerate(self._events) if e.kind == "update"}
            for layer in self.layers:
                handle = updates[layer.index]
                # From host memory straight to the servers (record() keeps the
                # initial values there), with no device buffer in between.
                worker.write_initial(handle, self._init[layer.index].cpu().numpy())
                if free_as_written:
                    self._init[layer.index] = _WRITTEN
        self._init.clear()
        worker.start_iterations()
        self.note_idle_versions()
        self._shipped_why = self._why_shipped()
        if self._light:
            self._plan_batches()
        else:
            self._start_loss_guard(between_clocks=True)
        if self._at_step:  # gradients are picked up at step(): no Python call per parameter in backward
            for handle in self._grad_hooks:
                handle.remove()
            self._grad_hooks.clear()
            # The forward binds every layer up front: the layer hooks stay only
            # to refuse a layer called outside the wrapped model's forward.
            self._layer_hooks = [(hooks, handle.id, hooks[handle.id]) for handle in self._hooks
                                 if (hooks := handle.hooks_dict_ref()) is not None]

    def _replay(self, tables: Tables, recorded: list[Event], hold: bool) -> None:
        """Takes the recorded clock with held reads or without, and records
        it as the worker's virtual iteration."""
        self._hold = hold
        self._events = for_holding(recorded) if hold else list(recorded)
        forward = recorded[: self._recorded_forward_events]
        self._forward_events = len(for_holding(forward) if hold else forward)
        # The light clock needs every saved parameter view in a held read:
        # one read per layer, held until its update (module docstring).
        reads = [0] * len(self.layers)
        for event in self._events:
            if event.kind == "read":
                reads[event.layer] += 1
        self._light = hold and not self._store_activations and all(count == 1 for count in reads)
        self._at_step = self._light and not self._overlap
        if self._at_step:
            # Forward order: the next clock's first read waits for the first
            # layer's update, which the engine then handles first.
            first_read = {e.layer: i for i, e in enumerate(self._events[: self._forward_events]) if e.kind == "read"}
            self._events[self._forward_events:] = sorted(self._events[self._forward_events:],
                                                         key=lambda e: first_read[e.layer])
        self._groups = store_groups(self._events, self._acts.slots, tables,
                                    max(4 * layer.num_values for layer in self.layers))
        self._spans = {}
        for members in set(self._groups.values()):
            offset = 0
            for slot in members:
                self._spans[slot] = (offset, self._acts.slots[slot].nbytes // 4)
                offset += len(tables.slot_rows(slot)[1]) * self._row_width
        self._handles = replay(self.worker, tables, self._events, slack=self._slack, hold_reads=hold,
                               batched=self._light, groups=self._groups)

    def rule_has_state(self) -> bool:
        """Whether the servers keep optimizer state (momentum, Adam's
        moments) for some layer's table."""
        return any((rule := self.worker.update_rule_of(table)) is not None and rule.state_arrays
                   for table in self._tables)

    @property
    def tables(self) -> list[Table]:
        """The layers' tables, in layer order (empty before :meth:`prepare_plan`)."""
        return list(self._tables)

    # -- evaluation and export ------------------------------------------------------------
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
        saved some parameters themselves, not views (module docstring)."""
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
        except (OutOfOrderError, InvalidArgumentError) as error:
            raise type(error)(
                f"{error}. The servers' values of branch {self.worker.branch if branch is None else branch} "
                "cannot be read now: with a tuning session, every step (TESTING ones too) is one training "
                "clock, forward, backward and step(), and after the session the trained values are "
                "state_dict(branch=session.final_branch)") from None
        self._eval_copies = [torch.from_numpy(flat).to(self.device).view(-1) for flat in values]
        for layer, copy in zip(self.layers, self._eval_copies):
            layer.bind_flat(copy)
        self._eval_sums = torch.stack([copy.sum(dtype=torch.float64) for copy in self._eval_copies])
        self._eval_clock = (self.clock, branch)
        self.note_idle_versions()

    def abandon(self) -> None:
        """After a failed wrap(): gives the model its initial values back and
        removes the hooks, so the plain module is usable again."""
        self.remove_hooks()
        for layer, flat in zip(self.layers, self._init):
            if flat is not _WRITTEN:  # written to the servers and freed (commit_plan): its placeholder stays
                layer.bind_flat(flat.to(self.device))  # kept in host memory for the plan on CUDA (record)
        self._closed = True

    def check_between_clocks(self, what: str) -> None:
        self.check_usable()
        if self._phase is not Phase.IDLE:
            raise OutOfOrderError(f"{what} in the middle of a clock: call step() first")
        self._refuse_writes_between_clocks()

    def close(self) -> None:
        """Leaves the parameters bound to the servers' values and removes the hooks."""
        self.check_between_clocks("unwrap()")
        self.bind_server_values()
        self.remove_hooks()
        for layer in self.layers:
            layer.forget_buffers()
        self._closed = True
