"""The activations a clock saves for its backward pass (``store_activations``):
which are stored in the engine's local table and which recomputed, how a
stored one is written and read back, and the per-clock bookkeeping.

Each tensor autograd saves (other than parameters and buffers) is a *slot*,
numbered in the order of the forward. A stored slot is copied into its rows
of the local table in the forward and read back in the backward pass; a
recomputed one (``_recompute.py``) has no rows, and the backward pass runs
its program again; a kept one stays with autograd, as it would without
``store_activations``: a tiny tensor (:func:`keep_small`, such as batch
norm's per-channel statistics), or one the plan would have kept on the
device anyway (``keep``: ``wrap()`` records again with those, and reserves
their bytes from the engine's device budget); a recomputation that reads a
kept slot gets the tensor autograd keeps. A stored or recomputed slot is made once per
clock, at its first use in the backward pass, and kept until its last use:
the recording pass counts the uses, so that, say, a ReLU output saved by the ReLU and by the
next convolution is loaded once, not twice.

A stored slot keeps the forward's strides when its tensor covers its memory
exactly once (any permutation of a contiguous layout): its bytes are kept in
memory order and come back with the same strides, so that the ops a
recomputation runs see exactly the forward's inputs.

One per :class:`~mltuner.torch._clock.ClockDriver`, used from its hooks
(the driver's threading rules apply); the driver keeps the engine calls.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_flatten

from mltuner.torch._buffers import storage_ptr
from mltuner.torch._errors import IterationMismatchError
from mltuner.torch._recompute import MAX_DEPTH, Program, check_clock, choose, compute_depth, run
from mltuner.torch._recompute import describe as describe_program
from mltuner.torch._recording import Event, Slot
from mltuner.torch._trace import BufferArg, ClockOps, ForwardTrace, Input, Made, ParamRef, seen

# Where a buffer or frozen parameter lives: (module, attribute, its tensor,
# the attribute's name in the model), by the tensor's storage address.
BufferOwners = dict[int, tuple[nn.Module, str, torch.Tensor, str]]

__all__ = ["KEEP_MAX_BYTES", "KEEP_SHARE", "SavedActivations", "StoreAllLog", "empty_for", "keep_small", "read_back",
           "write_bytes"]


KEEP_MAX_BYTES = 64 * 1024  # the largest saved tensor autograd may keep (keep_small)
KEEP_SHARE = 1 / 64  # ... and the most of a clock's saved bytes all kept ones may hold


def keep_small(slots: Sequence[Slot], excluded: Iterable[int] = ()) -> set[int]:
    """The slots autograd keeps instead of the local table: the smallest,
    each of at most :data:`KEEP_MAX_BYTES`, while together they hold at most
    :data:`KEEP_SHARE` of the clock's saved bytes; never one in ``excluded``
    (recomputed, or read by a recomputation).

    Why: storing a tensor costs the training thread a fixed amount per
    tensor (a pack and an unpack hook, two engine ops into the local table
    and two out, each a step of the access-buffer pool's chain under a
    budget), tens of microseconds whatever its size, while 64 KiB cross
    PCIe in under 3 us. Batch norm saves two per-channel vectors per layer:
    half of ResNet-18's saved tensors and a thousandth of their bytes. The
    share bounds the device memory kept outside the engine's budget."""
    excluded = set(excluded)
    allowed = KEEP_SHARE * sum(slot.nbytes for slot in slots)
    kept: set[int] = set()
    total = 0
    for number in sorted(range(len(slots)), key=lambda k: (slots[k].nbytes, k)):
        size = slots[number].nbytes
        if size > KEEP_MAX_BYTES or total + size > allowed:
            break
        if number not in excluded:
            kept.add(number)
            total += size
    return kept


def write_bytes(target: torch.Tensor, tensor: torch.Tensor, slot: Slot) -> None:
    """Copies a saved tensor into a local-table buffer (flat uint8): its
    memory span in memory order when the slot keeps the forward's layout,
    else its contiguous copy."""
    tensor = tensor.detach()
    if slot.exact_layout:
        source = tensor.as_strided((tensor.numel(),), (1,), tensor.storage_offset()).view(torch.uint8)
    else:
        source = tensor.contiguous().view(-1).view(torch.uint8)
    target[: source.numel()].copy_(source)


def empty_for(slot: Slot, device: torch.device) -> torch.Tensor:
    """An uninitialised tensor for a stored slot's contents, with the
    forward's strides where the slot keeps them (else contiguous); its
    ``slot.nbytes`` bytes start at its ``data_ptr()`` in either case."""
    if slot.exact_layout:
        return torch.empty_strided(slot.shape, slot.strides, dtype=slot.dtype, device=device)
    return torch.empty(slot.shape, dtype=slot.dtype, device=device)


def read_back(source: torch.Tensor, slot: Slot, device: torch.device) -> torch.Tensor:
    """A new tensor with a stored slot's contents (from a flat uint8 buffer),
    copied by torch. A copy: autograd gives no signal when it is done with
    the tensor, so the engine's buffer could not be handed back safely."""
    out = empty_for(slot, device)
    flat = out.as_strided((out.numel(),), (1,), 0) if slot.exact_layout else out.view(-1)
    flat.view(torch.uint8).copy_(source[: slot.nbytes])
    return out


def siblings(programs: dict[int, Program], trace: ForwardTrace,
             slot_values: Sequence[int]) -> dict[int, tuple[tuple[int, int], ...]]:
    """Per recomputed slot, the other recomputed slots (value, slot) that
    the last op of its program makes too: the other outputs of one op (a max
    pool's values and indices), run once for both. Only the last op's, so
    that no later op of the program can have written them in place."""
    out: dict[int, tuple[tuple[int, int], ...]] = {}
    for slot, program in programs.items():
        producer = trace.producer[program.output]
        if producer is None or not program.nodes or producer[0] != program.nodes[-1]:
            continue
        found = tuple((slot_values[other], other) for other in programs
                      if other != slot and slot_values[other] != program.output
                      and (trace.producer[slot_values[other]] or (-1,))[0] == producer[0])
        if found:
            out[slot] = found
    return out


def _layout(tensor: torch.Tensor) -> tuple[Any, ...]:
    return tuple(tensor.shape), tuple(tensor.stride()), tensor.storage_offset(), tensor.dtype, tensor.device


@dataclasses.dataclass(eq=False)
class _BufferUse:
    """A buffer or frozen parameter (or a view of one) that a recomputation
    reads, found again through its module each clock: a model may assign a
    new tensor to it between clocks (truncated backpropagation through time
    keeps its hidden state so), and the backward pass must read what this
    clock's forward read."""

    arg: BufferArg
    module: nn.Module
    attribute: str
    name: str  # in the model, for errors
    source: torch.Tensor  # the module's tensor the argument was last taken from
    layout: tuple[Any, ...]  # the recorded module tensor's (_layout)
    view: tuple[tuple[int, ...], tuple[int, ...], int] | None  # the argument's view of it; None: the tensor


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether two tensors are equal byte for byte, layout included."""
    layout = Slot(tuple(b.shape), b.dtype, tuple(b.stride()))
    if a.shape != b.shape or a.dtype != b.dtype or not layout.same_layout(tuple(a.stride())):
        return False
    return bool(torch.equal(a.detach().contiguous().view(-1).view(torch.uint8),
                            b.detach().contiguous().view(-1).view(torch.uint8)))


class StoreAllLog:
    """While the recording pass recomputes: the clock's events as they would
    be with every saved activation stored, for ``wrap(recompute="auto")`` to
    fall back to when the recomputing plan does not fit the budget (reading
    parameters for recomputations early in the backward pass can raise the
    least pool). The driver reports autograd's unpacks and the updates; the
    recomputations' own loads and reads are not in it."""

    def __init__(self, forward: list[Event], slots: int, kept: set[int]) -> None:
        self.events = list(forward)  # the forward's events with every store (of a slot not kept)
        self.forward_events = len(forward)
        self.uses = [0] * slots  # per slot: autograd's unpacks in the backward pass
        self._kept = kept
        self._loaded: set[int] = set()
        self._open: set[int] = set()  # layers whose backward read is open

    def unpack_slot(self, slot: int) -> None:
        if slot in self._kept:
            return
        if slot not in self._loaded:
            self._loaded.add(slot)
            self.events.append(Event("load", slot=slot))
        self.uses[slot] += 1

    def unpack_param(self, layer: int) -> None:
        if layer not in self._open:
            self._open.add(layer)
            self.events.append(Event("read_grad", layer))

    def update(self, layer: int) -> None:
        self._open.discard(layer)
        self.events.append(Event("update", layer))


class _NotReproducible(Exception):
    """The recording pass could not make a saved activation again bit for bit."""


class SavedActivations:
    """The slots of a wrapped model and their per-clock state (module docstring).

    ``recompute``: choose slots to recompute at the end of the recording
    forward; ``stored``: slots never to recompute, with the reason (an
    earlier recording could not reproduce them); ``parameters``: whether a
    recomputation may read parameters (not under SSP without held reads: a
    backward read may hold newer values than the forward used);
    ``compute_bound``: whether a recomputation may run convolutions and
    matrix products (``wrap(recompute="compute")``); ``keep``: slots autograd
    keeps on the device unless recomputed (those an earlier plan kept on the
    device).
    """

    def __init__(self, *, recompute: bool, stored: dict[int, str], parameters: bool = True,
                 compute_bound: bool = False, keep: frozenset[int] = frozenset()) -> None:
        self.recompute = recompute
        self.keep = keep
        self._parameters = parameters  # programs may read parameters (not under SSP without held reads)
        self._compute_bound = compute_bound
        self.stored = stored
        self.slots: list[Slot] = []
        self.unreproducible: dict[int, str] = {}  # recording: slot -> why it could not be recomputed
        self._originals: dict[int, torch.Tensor] = {}  # recording: the forward's tensors
        # Per slot: uses in a clock's backward pass (counted by the recording);
        # of a kept slot, the recomputations' reads of it only.
        self._uses: list[int] = []
        self._memo: dict[int, list[Any]] = {}  # slot -> [tensor, uses left this clock]
        self._made: set[int] = set()  # later clocks: the slots made this clock (memoised or used up)
        self._siblings: dict[int, tuple[tuple[int, int], ...]] = {}  # slot -> (value, slot) made by its last op
        self._trace: ForwardTrace | None = None
        self._values: list[int] = []  # per slot: its value in the trace
        self._programs: dict[int, Program] = {}
        self._random_wanted: dict[int, Any] = {}  # random ops (by number) the programs replay, with their op
        self._random: ClockOps | None = None  # later clocks that recompute
        self._funcs: frozenset[Any] = frozenset()  # the ops of the programs
        self._scalars: dict[int, dict[int, Made]] = {}  # slot -> this clock's ops whose arguments changed, by node
        # This clock's reads of saved activations by the programs' ops:
        # (recomputed slot, slot read, the tensor read), and which tensor each
        # slot saved, compared at the forward's end.
        self._leaf_reads: list[tuple[int, int, Input]] = []
        self._saved_as: dict[int, Input] = {}
        self._modes: list[bool] = []  # each module's training flag in the recording
        self._moded: list[nn.Module] = []  # ... and those modules, in the same order
        self.store_all: StoreAllLog | None = None  # recording, while recomputing
        self.fell_back = ""  # why wrap(recompute="auto") stores every activation after all
        self._buffer_uses: list[_BufferUse] = []  # the buffers the programs read (find_buffers)

    @property
    def forward_work(self) -> tuple[int, int]:
        """The recorded forward's work: the flops of its convolutions and
        matrix products, and its aten ops ((0, 0) when the recording kept no
        trace: nothing is recomputed)."""
        nodes = self._trace.nodes if self._trace is not None else []
        return sum(node.flops for node in nodes), len(nodes)

    @property
    def recomputing(self) -> bool:
        """Whether some slot is recomputed."""
        return bool(self._programs)

    # -- the forward ---------------------------------------------------------------------
    def dispatch_mode(self, recording: bool, param_ref: Callable[[torch.Tensor], ParamRef | None],
                      is_local: Callable[[torch.Tensor], bool], clock: int) -> Any:
        """The forward's TorchDispatchMode: the op trace in the recording pass
        (when recomputing), how the programs' ops ran and the random states
        of recomputed random ops in later clocks that recompute, else None."""
        if recording and self.recompute:
            self._trace = ForwardTrace(param_ref, is_local)
            return self._trace
        if self._programs and not recording:
            assert self._trace is not None
            self._random = ClockOps(self._random_wanted, self._trace.random_ops, clock, self._funcs, param_ref)
            return self._random
        return None

    def add(self, tensor: torch.Tensor) -> None:
        """Recording: a new slot for ``tensor``."""
        self._originals[len(self.slots)] = tensor
        self.slots.append(Slot(tuple(tensor.shape), tensor.dtype, tuple(tensor.stride())))
        self._uses.append(0)
        if self._trace is not None:
            self._values.append(self._trace.value_of(tensor))

    def check(self, slot: int, shape: tuple[int, ...], dtype: torch.dtype, stride: tuple[int, ...],
              clock: int) -> Slot:
        """The layout of this clock's tensor in ``slot``: the recorded one, or
        one of a smaller shape that its rows hold (a partial last batch, a
        shorter sequence: :meth:`_smaller`). Raises IterationMismatchError
        for any other shape, dtype or strides."""
        expected = self.slots[slot]
        if stride == expected.stride and shape == expected.shape and dtype == expected.dtype:
            return expected  # the common case: exactly the recorded tensor's layout
        if shape != expected.shape and dtype == expected.dtype:
            smaller = self._smaller(expected, shape, stride)
            if smaller is not None:
                return smaller
        if (shape, dtype) != (expected.shape, expected.dtype):
            larger = len(shape) == len(expected.shape) and any(a > b for a, b in zip(shape, expected.shape))
            if shape == expected.shape:
                why = "every clock must save the recorded dtypes"
            elif dtype != expected.dtype or len(shape) != len(expected.shape):
                why = ("this clock's forward saved other tensors than the recording pass did (the number or order "
                       "of saved tensors depends on the data, as with packed sequences of varying lengths or top-k "
                       "routing); with stored activations every clock must save the recorded ones in the recorded "
                       "order: wrap() without store_activations for such a model")
            elif self._programs and not larger:
                why = ("every clock must save the recorded shapes, since the recomputations replay the recorded ops "
                       "(recompute='none' lets them shrink)")
            elif larger:
                why = ("a clock may save smaller tensors of the same dtype and memory layout (a smaller batch, a "
                       "shorter sequence), not larger ones: give wrap() the largest example_input; if it is the "
                       "largest batch already, the size of this saved tensor depends on the data (top-k routing, "
                       "packed sequences of varying lengths): wrap() without store_activations for such a model")
            else:
                why = ("a smaller tensor must keep the recorded memory layout, and this one does not (or the forward "
                       "saved other tensors than the recording pass did, in a data-dependent order: then wrap() "
                       "without store_activations)")
            raise IterationMismatchError(
                f"clock {clock}: saved activation #{slot} is {shape} {dtype}, the "
                f"recorded one {expected.shape} {expected.dtype}; with store_activations=True the local "
                f"tables are sized by the recording pass, so {why}"
                + (" (another dtype only: under torch.autocast, call wrap() inside the same autocast)"
                   if shape == expected.shape else "")
            )
        if not expected.same_layout(stride):
            raise IterationMismatchError(
                f"clock {clock}: saved activation #{slot} {expected.shape} has strides {stride}, "
                f"the recorded one {expected.strides}; with store_activations=True a stored activation comes "
                "back with the recorded layout, so every clock must save the same layouts (the same memory "
                "format of the inputs)"
            )
        return expected  # strides that differ only where a dimension has size 1

    def _smaller(self, expected: Slot, shape: tuple[int, ...], stride: tuple[int, ...]) -> Slot | None:
        """``expected`` for a tensor of a smaller ``shape`` (no dimension
        larger) whose bytes go the same way as the recorded tensor's (both
        in memory order or both contiguous copies, both whole float32 words
        or neither), so that its rows hold it; None if not, or while
        recomputing (the programs replay the recorded shapes)."""
        if self._programs or len(shape) != len(expected.shape):
            return None
        if any(size > recorded for size, recorded in zip(shape, expected.shape)):
            return None
        smaller = dataclasses.replace(expected, shape=shape, stride=stride)
        if smaller.exact_layout != expected.exact_layout or (smaller.nbytes % 4 == 0) != (expected.nbytes % 4 == 0):
            return None
        return smaller

    def choose(self, events: list[Event], modules: Iterable[nn.Module]) -> list[Event]:
        """End of the recording forward: chooses the slots to recompute
        (``_recompute.choose``) and those autograd keeps (:func:`keep_small`),
        and returns ``events`` without their stores."""
        programs: dict[int, Program] = {}
        if self.slots:  # a module switched to the other mode would save other tensors (check_modes)
            self._moded = list(modules)
            self._modes = [module.training for module in self._moded]
        if self._trace is not None:
            try:
                depth = (compute_depth(len(self.slots) - len(keep_small(self.slots))) if self._compute_bound
                         else MAX_DEPTH)
                programs = choose(self._trace, self._values, self.slots, frozenset(self.stored),
                                  parameters=self._parameters, compute_bound=self._compute_bound, max_depth=depth)
            except Exception as error:  # noqa: BLE001 - a model the planner does not understand: store everything
                self.recompute = False
                self.fell_back = f"choosing what to recompute failed: {type(error).__name__}: {error}"
        kept = (keep_small(self.slots, {slot for p in programs.values() for _, slot in p.leaves} | programs.keys())
                | (self.keep - programs.keys()))
        if not programs and not kept:
            return events
        left = [e for e in events if not (e.kind == "store" and (e.slot in programs or e.slot in kept))]
        self.slots = [dataclasses.replace(s, recomputed=k in programs, kept=k in kept)
                      for k, s in enumerate(self.slots)]
        if not programs:
            return left
        assert self._trace is not None
        self.store_all = StoreAllLog([e for e in events if not (e.kind == "store" and e.slot in kept)],
                                     len(self.slots), kept)
        self._programs = programs
        self._siblings = siblings(programs, self._trace, self._values)
        nodes = self._trace.nodes
        self._random_wanted = {nodes[n].seeded: nodes[n].func for p in programs.values() for n in p.nodes
                               if nodes[n].seeded >= 0}
        self._funcs = frozenset(nodes[n].func for p in programs.values() for n in p.nodes)
        return left

    def find_buffers(self, owners: BufferOwners) -> None:
        """Recording, after :meth:`choose`: where each buffer the programs
        read lives in the model (``owners``: the model's buffers and frozen
        parameters at the forward's start), for :meth:`read_buffers`."""
        self._buffer_uses = []
        if not self._programs:
            return
        assert self._trace is not None
        seen: set[int] = set()
        for number in sorted({n for program in self._programs.values() for n in program.nodes}):
            node = self._trace.nodes[number]
            for item in tree_flatten((node.args, node.kwargs))[0]:
                if not isinstance(item, BufferArg) or id(item) in seen:
                    continue
                seen.add(id(item))
                owner = owners.get(storage_ptr(item.tensor) or 0)
                if owner is None:
                    continue
                module, attribute, source, name = owner
                tensor = item.tensor
                view = None if tensor is source else (tuple(tensor.shape), tuple(tensor.stride()),
                                                      int(tensor.storage_offset()))
                self._buffer_uses.append(_BufferUse(item, module, attribute, name, source, _layout(source), view))

    def read_buffers(self, clock: int) -> None:
        """Before a clock: points the programs' buffer arguments at the
        tensors the model holds now (a new one where it assigned one since).
        A buffer now of another shape, dtype or layout is refused: the
        recorded ops could not run on it as they did."""
        for use in self._buffer_uses:
            module = use.module
            current = (module._buffers.get(use.attribute) if use.attribute in module._buffers
                       else module._parameters.get(use.attribute))
            if current is use.source:
                continue
            if not isinstance(current, torch.Tensor) or _layout(current) != use.layout:
                raise IterationMismatchError(
                    f"clock {clock}: {use.name!r} is now "
                    f"{'None' if current is None else f'{tuple(current.shape)} {current.dtype}'}, where wrap() "
                    f"recorded {tuple(use.source.shape)} {use.source.dtype} (or another memory layout); recomputed "
                    "activations read it in the backward pass, so it must keep its shape and layout "
                    "(or use wrap(..., recompute='none'))"
                )
            use.source = current
            use.arg.tensor = current if use.view is None else current.as_strided(*use.view)

    def store_everything(self, why: str) -> tuple[list[Event], int]:
        """Gives up recomputing (``why``, for :meth:`summary`): every slot is
        stored. Returns the clock's events with every activation stored and
        the number of forward events (:class:`StoreAllLog`)."""
        assert self.store_all is not None
        log = self.store_all
        self.slots = [dataclasses.replace(s, recomputed=False) for s in self.slots]
        self._uses = list(log.uses)
        self._programs = {}
        self._random_wanted = {}
        self._funcs = frozenset()
        self._buffer_uses = []
        self.recompute = False
        self.fell_back = why
        self.store_all = None
        return log.events, log.forward_events

    def end_forward(self, clock: int) -> None:
        """After a later clock's forward: raises IterationMismatchError if a
        random op to replay did not run, or a recomputed activation's ops
        read another tensor than the saved activation the program reads back
        (two inputs swapped by the data)."""
        if self._random is None:
            return
        self._random.check_complete()
        for slot, leaf, (made, tensor) in self._leaf_reads:
            saved = self._saved_as.get(leaf)
            same = saved is not None and (
                tensor == saved[1] if made is None else
                saved[0] is not None and saved[0][0] is made[0] and saved[0][1] == made[1])
            if not same:
                raise IterationMismatchError(
                    f"clock {clock}: saved activation #{slot} is recomputed from saved activation #{leaf}, but this "
                    "clock's forward made it from another tensor (a choice of input that depends on the data); it is "
                    "recomputed in the backward pass from the recorded inputs: use wrap(..., recompute='none'), "
                    "which stores it")

    def check_modes(self, model: nn.Module, clock: int) -> None:
        """A module switched between train and eval mode since the recording
        (batch norm, dropout) saves other tensors than the recorded ones:
        refused before the clock starts."""
        if not self._moded or [module.training for module in self._moded] == self._modes:
            return  # the common case, checked without named_modules()' walk (a per-clock cost)
        for (name, module), training in zip(model.named_modules(), self._modes):
            if module.training != training:
                raise IterationMismatchError(
                    f"clock {clock}: module {name or type(module).__name__!r} is in "
                    f"{'train' if module.training else 'eval'} mode, but it was in "
                    f"{'train' if training else 'eval'} mode when wrap() recorded the clock; with stored "
                    "activations a training clock must save the tensors the recording saved, so the modes must "
                    "stay as they were (evaluate under torch.no_grad(), in any mode)"
                )

    # -- the backward pass ---------------------------------------------------------------
    def resolve(self, slot: int, *, recording: bool, load: Callable[[int], torch.Tensor],
                param: Callable[[ParamRef], torch.Tensor]) -> torch.Tensor:
        """A slot's tensor for the backward pass: ``load(slot)`` (a stored
        slot, read back; in the recording, :meth:`original`) or its program run again, at its first use in the
        clock; the same tensor for its later uses (module docstring).
        ``param(ref)`` gives a program the parameters it reads."""
        entry = self._memo.get(slot)
        if entry is not None:
            if recording:
                self._uses[slot] += 1
            else:
                entry[1] -= 1
                if entry[1] <= 0:
                    del self._memo[slot]
            return entry[0]  # type: ignore[no-any-return]
        if self.slots[slot].kept:  # the recording only: later clocks hand autograd the tensor itself
            assert recording
            return self._originals[slot]
        if self.slots[slot].recomputed:
            tensor = self._recomputed(slot, recording, load, param)
        else:
            tensor = load(slot)
        if recording:
            self._uses[slot] = 1
            self._memo[slot] = [tensor, 0]
            return tensor
        self._made.add(slot)
        if self._uses[slot] > 1:
            self._memo[slot] = [tensor, self._uses[slot] - 1]
        return tensor

    def _recomputed(self, slot: int, recording: bool, load: Callable[[int], torch.Tensor],
                    param: Callable[[ParamRef], torch.Tensor]) -> torch.Tensor:
        """Runs a recomputed slot's program. The recording pass checks the
        result against the forward's tensor, byte for byte; one that differs
        (or cannot run) is noted in :attr:`unreproducible`, and the forward's
        tensor serves (``wrap()`` then records again with the slot stored)."""
        assert self._trace is not None
        program = self._programs[slot]

        def leaf(other: int) -> torch.Tensor:
            if recording and self.slots[other].kept:
                self._uses[other] += 1  # later clocks hold the tensor for this read (hold)
            return self.resolve(other, recording=recording, load=load, param=param)

        if not recording:
            env = run(program, self._trace, leaf=leaf, param=param, random_state=self._random_state,
                      scalars=self._scalars.get(slot, {}))
            for value, other in self._siblings.get(slot, ()):
                # Made by the same op (a max pool's indices beside its values):
                # kept for its first use rather than run again then.
                if other not in self._made and self._uses[other] > 0:
                    self._made.add(other)
                    self._memo[other] = [env[value], self._uses[other]]
            return env[program.output]
        original = self._originals[slot]
        try:
            tensor = run(program, self._trace, leaf=leaf, param=param, random_state=self._random_state)[program.output]
            if not _same_bits(tensor, original):
                raise _NotReproducible("the ops run again made other bytes than the forward")
        except Exception as error:  # noqa: BLE001 - any failure means: store it instead
            self.unreproducible[slot] = f"{type(error).__name__}: {error}"
        return original

    def check_recomputed(self, slot: int, tensor: torch.Tensor, clock: int) -> None:
        """A later clock's forward saved ``tensor`` in recomputed ``slot``: its
        ops are checked against the slot's program (IterationMismatchError
        where they differ), and their non-tensor arguments kept for running
        it again where they changed since the recording."""
        assert self._random is not None and self._trace is not None
        changed, read = check_clock(self._programs[slot], self._trace, self._random.made(tensor), clock)
        if changed:
            self._scalars[slot] = changed
        self._leaf_reads.extend((slot, leaf, tensor) for leaf, tensor in read)

    def note_saved(self, slot: int, tensor: torch.Tensor) -> None:
        """A later clock that recomputes saved ``tensor`` in ``slot``: which
        tensor it is, for the programs that read it (:meth:`end_forward`)."""
        if self._random is not None:
            self._saved_as[slot] = (self._random.made(tensor), seen(tensor))

    def hold(self, slot: int, tensor: torch.Tensor) -> None:
        """A later clock's forward saved kept ``slot``: held for the
        recomputations that read it, until their last read."""
        if self._uses[slot]:
            self._memo[slot] = [tensor, self._uses[slot]]

    @property
    def kept_bytes(self) -> int:
        """The bytes of the slots kept because of ``keep`` (device memory
        outside the engine's tables for the whole forward)."""
        return sum(s.nbytes for k, s in enumerate(self.slots) if s.kept and k in self.keep)

    def original(self, slot: int) -> torch.Tensor:
        """Recording: the forward's tensor of ``slot``."""
        return self._originals[slot]

    def _random_state(self, number: int) -> torch.Tensor:
        if self._random is None:  # the recording
            assert self._trace is not None
            return self._trace.random_states[number]
        return self._random.states[number]

    def end_recording(self) -> None:
        """The recording pass is over: its tensors can go."""
        self._originals.clear()
        self.reset_clock()

    def end_planning(self) -> None:
        """The plan is made: the fallback log can go."""
        self.store_all = None

    def reset_clock(self) -> None:
        self._memo.clear()
        self._made.clear()
        self._scalars.clear()
        self._leaf_reads.clear()
        self._saved_as.clear()
        self._random = None

    # -- in words ------------------------------------------------------------------------
    def describe(self) -> list[str]:
        """Each slot in words: stored, or how it is recomputed."""
        lines = []
        for number, slot in enumerate(self.slots):
            head = f"#{number} {slot.shape} {slot.dtype}"
            program = self._programs.get(number)
            if program is not None and self._trace is not None:
                lines.append(f"{head}: {describe_program(program, self._trace)}")
            elif slot.kept:
                lines.append(f"{head}: kept by autograd ({'on the device' if number in self.keep else 'small'})")
            else:
                lines.append(f"{head}: stored")
        return lines

    def summary(self, why_none: str = "") -> str:
        """How many slots are stored, recomputed and kept, with their bytes;
        ``why_none``: why nothing is recomputed, when the caller knows."""
        kept = [s for k, s in enumerate(self.slots) if s.kept and k not in self.keep]
        slots = [s for k, s in enumerate(self.slots) if not s.kept or k in self.keep]
        total = sum(s.nbytes for s in slots)
        recomputed = [s for s in slots if s.recomputed]
        gone = sum(s.nbytes for s in recomputed)
        notes = (f"; {len(kept)} small ones kept by autograd ({sum(s.nbytes for s in kept)} B)" if kept else "")
        on_device = sum(s.kept for k, s in enumerate(self.slots) if k in self.keep)
        if on_device:
            notes += (f"; {on_device} of the stored ones kept by autograd on the device ({self.kept_bytes} B, reserved "
                      "from the device budget)")
        if self.fell_back:
            return (f"saved activations: {len(slots)} stored ({total} B per clock), none recomputed "
                    f"({self.fell_back}){notes}")
        if not self.recompute:
            why = why_none or "recompute='none', or 'auto' without a device_memory_budget"
            return f"saved activations: {len(slots)} stored ({total} B per clock), none recomputed ({why}){notes}"
        first = min(self.stored, default=0)
        spoiled = (f", {len(self.stored)} stored because running their ops again failed or gave other bytes "
                   f"(#{first}: {self.stored[first]})" if self.stored else "")
        return (f"saved activations: {len(slots) - len(recomputed)} stored ({total - gone} B per clock), "
                f"{len(recomputed)} recomputed in the backward pass from stored ones ({gone} B not stored{spoiled})"
                f"{notes}")
