"""The ops of the recording forward, for recomputing saved activations.

``wrap(recompute=...)`` re-runs cheap ops in the backward pass instead of
storing their outputs (``_recompute.py`` chooses which). To know how a saved
tensor was made, the recording pass of ``wrap()`` runs the forward under
:class:`ForwardTrace`, a ``TorchDispatchMode``: it sees every aten op below
autograd, after autocast and composite ops were decomposed, so exactly the
kernels that ran, and logs each as a :class:`Node`.

A *value* is a tensor's contents at one version: every tensor an op returns
is a new value, and an in-place op makes a new value of the same tensor
(its version counter, which autograd's saved tensors check too, goes up by
one). Values are numbered in the order they appear, so a value's producer
always comes before it. A tensor the trace did not see made (the model's
input, a tensor from outside the forward) is an *opaque* value: it can be
read from a saved activation, never recomputed.

A node's tensor arguments become templates, resolved when the op runs again:
:class:`ValueArg` (an earlier value), :class:`ParamRef` (a view of a layer's
parameters: in the backward pass they are read again from the engine),
:class:`BufferArg` (a buffer or frozen parameter: the module's own tensor)
and :class:`ScratchArg` (a fresh tensor of the same shape, where the op only
looks at the shape, as ``empty_like`` does, or only writes, as batch norm
does to its running statistics in training).

Random ops (tag ``nondeterministic_seeded``: dropout, ``bernoulli_``) are
numbered in forward order; the trace keeps the generator's state before
each, and in later clocks :class:`ClockOps` does the same, so that a
random op runs again with the random numbers of its forward.

Only the recording pass traces; later clocks that recompute run the lighter
:class:`ClockOps` (a Python call per aten op too): the recorded ops are run
again with each clock's own non-tensor arguments, and a clock whose forward
made a recomputed tensor by other ops is refused.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any, NamedTuple

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_map
from torch.utils.weak import WeakTensorKeyDictionary

from mltuner.torch._buffers import storage_ptr
from mltuner.torch._errors import IterationMismatchError

__all__ = ["BufferArg", "ClockOps", "ForwardTrace", "Made", "Node", "ParamRef", "ScratchArg", "ValueArg",
           "Input", "Seen", "TEMPLATES", "TENSOR", "generator_of",
           "scalars_of", "seen", "templates_of"]

_aten = torch.ops.aten

# Batch norm in training writes its running statistics in place (arguments
# 3 and 4) although the schemas of these overloads do not say so; the output
# does not depend on them. Run again, they get scratch tensors.
_BATCH_NORMS = {
    _aten.native_batch_norm.default: 5, _aten.cudnn_batch_norm.default: 5, _aten.miopen_batch_norm.default: 5,
    _aten._native_batch_norm_legit.default: 5, _aten._batch_norm_with_update.default: -1,
}
# Ops that read only the shape, dtype and layout of their tensor argument.
_SHAPE_ONLY = frozenset(p.default for p in (_aten.empty_like, _aten.zeros_like, _aten.ones_like, _aten.full_like,
                                              _aten.rand_like, _aten.randn_like)) | frozenset(
    (_aten.new_empty.default, _aten.new_zeros.default, _aten.new_ones.default, _aten.new_full.default,
     _aten.new_empty_strided.default))


@dataclasses.dataclass(frozen=True)
class ParamRef:
    """A view of a layer's parameters: its place in the layer's rows. (The
    templates are dataclasses, not named tuples, which pytree would flatten.)"""

    layer: int
    size: tuple[int, ...]
    stride: tuple[int, ...]
    offset: int

    @staticmethod
    def of(layer: int, tensor: torch.Tensor) -> ParamRef:
        """``tensor``, a view of layer ``layer``'s parameters."""
        return ParamRef(layer, tuple(tensor.shape), tuple(tensor.stride()), int(tensor.storage_offset()))


@dataclasses.dataclass(frozen=True)
class ValueArg:
    value: int


@dataclasses.dataclass(eq=False)
class BufferArg:
    # The recorded tensor, pointed at each clock's own by
    # SavedActivations.read_buffers where the model assigns a new one.
    tensor: torch.Tensor


@dataclasses.dataclass(frozen=True)
class ScratchArg:
    """A fresh tensor shaped like the original argument (uninitialised), or
    with ``zeros`` a tensor only written (batch norm's running statistics in
    training: the output never reads them), made once as zeros and reused by
    every later run: an allocation and a fill kernel fewer per batch norm run
    again, and its values stay finite."""

    shape: tuple[int, ...]
    stride: tuple[int, ...]
    dtype: torch.dtype
    device: torch.device
    zeros: bool
    _written: list[torch.Tensor] = dataclasses.field(default_factory=list, compare=False, repr=False)

    def make(self) -> torch.Tensor:
        if self._written:
            return self._written[0]
        tensor = torch.empty_strided(self.shape, self.stride, dtype=self.dtype, device=self.device)
        if self.zeros:
            self._written.append(tensor.zero_())
        return tensor


@dataclasses.dataclass
class Node:
    """One aten op of the recording forward."""

    func: torch._ops.OpOverload
    args: tuple[Any, ...]  # tensors replaced by templates (ValueArg, ParamRef, BufferArg, ScratchArg)
    kwargs: dict[str, Any]
    outputs: tuple[int, ...]  # per flattened output: its value, -1 for a non-tensor
    mutates: int = -1  # in-place ops: the value whose tensor they write
    seeded: int = -1  # random ops: their number in the forward's random ops
    replayable: bool = True  # False: writes a parameter, buffer or out= tensor, or two tensors; a random op
    # with a generator of its own; or an op that moves data between devices
    touched_bytes: int = 0  # bytes read and written (0 for views): the cost model's measure
    flops: int = 0  # convolutions and matrix products: their arithmetic (2 per multiply-add); else 0
    device: torch.device | None = None  # random ops: the device whose generator they draw from
    nested: bool = False  # a template sits in a list argument (cat's tensors), or in the keyword arguments
    # The flattened arguments split into templates and the rest, once (scalars_of, templates_of).
    _split: tuple[tuple[Any, ...], tuple[Any, ...]] | None = dataclasses.field(default=None, compare=False,
                                                                                repr=False)


def generator_of(device: torch.device) -> torch.Generator:
    """The default random generator of ``device``."""
    if device.type == "cuda":
        index = device.index if device.index is not None else torch.cuda.current_device()
        return torch.cuda.default_generators[index]
    return torch.default_generator


def _device_of(args: Any, kwargs: dict[str, Any]) -> torch.device:
    for item in tree_flatten((args, kwargs))[0]:
        if isinstance(item, torch.Tensor):
            return item.device
    device = kwargs.get("device")
    return torch.device(device) if device is not None else torch.device("cpu")


def _is_seeded(func: torch._ops.OpOverload) -> bool:
    return torch.Tag.nondeterministic_seeded in func.tags


_MATRIX_PRODUCTS = {_aten.mm.default: 0, _aten.bmm.default: 0, _aten.addmm.default: 1, _aten.baddbmm.default: 1}


def arithmetic(func: Any, args: Any, out: Any) -> int:
    """The flops of a convolution (not transposed) or a matrix product: 2 per
    multiply-add, from the tensors of the call; 0 for any other op."""
    if not isinstance(out, torch.Tensor):
        return 0
    if func is _aten.convolution.default and len(args) > 6 and not args[6]:  # args[6]: transposed
        weight = args[1]
        return int(2 * out.numel() * (weight.numel() // max(1, weight.shape[0])))  # C_in / groups x kernel per output
    position = _MATRIX_PRODUCTS.get(func)
    if position is not None:
        return 2 * out.numel() * int(args[position].shape[-1])
    return 0


@functools.cache
def _returns_alias(func: torch._ops.OpOverload) -> tuple[bool | None, ...]:
    """Per declared return: None (a new tensor), False (a view of an
    argument), True (an argument written in place)."""
    return tuple(None if r.alias_info is None else bool(r.alias_info.is_write) for r in func._schema.returns)


def _alias_of(aliases: tuple[bool | None, ...], position: int) -> bool | None:
    """Output ``position``'s alias (:func:`_returns_alias`); outputs past the
    declared ones (a list return) take the first's."""
    return aliases[position] if position < len(aliases) else (aliases[0] if aliases else None)


class ForwardTrace(TorchDispatchMode):  # type: ignore[no-untyped-call]
    """Logs the recording forward's aten ops (module docstring).

    ``param_ref`` maps a tensor to the :class:`ParamRef` of the parameters
    it views (None if it is none); ``is_local`` says whether a tensor is a
    buffer or frozen parameter of the model.
    """

    def __init__(self, param_ref: Callable[[torch.Tensor], ParamRef | None],
                 is_local: Callable[[torch.Tensor], bool]) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self._param_ref = param_ref
        self._is_local = is_local
        self.nodes: list[Node] = []
        self.producer: list[tuple[int, int] | None] = []  # per value: (node, output position); None: opaque
        self.base: list[int] = []  # per value: the value whose memory it lives in (itself unless a view)
        self.meta: list[ScratchArg] = []  # per value: its shape, stride, dtype and device
        self.mutated_buffers: set[int] = set()  # storage addresses of buffers an op wrote
        self.random_states: dict[int, torch.Tensor] = {}  # random op number -> generator state before it
        self.random_ops = 0  # how many the forward ran
        self._values: WeakTensorKeyDictionary = WeakTensorKeyDictionary()  # tensor -> (version, value)

    # -- values --------------------------------------------------------------------------
    def _new_value(self, tensor: torch.Tensor, producer: tuple[int, int] | None, base: int, version: int) -> int:
        value = len(self.producer)
        self.producer.append(producer)
        self.base.append(value if base < 0 else base)
        self.meta.append(ScratchArg(tuple(tensor.shape), tuple(tensor.stride()), tensor.dtype, tensor.device,
                                    zeros=False))
        self._values[tensor] = (version, value)
        return value

    def value_of(self, tensor: torch.Tensor) -> int:
        """The value ``tensor`` holds now (an opaque one if no traced op made it)."""
        known = self._values.get(tensor)  # type: ignore[no-untyped-call]
        if known is not None and known[0] == tensor._version:
            return int(known[1])
        return self._new_value(tensor, None, -1, tensor._version)

    # -- the mode ------------------------------------------------------------------------
    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        seeded = -1
        if _is_seeded(func):
            seeded = self.random_ops
            self.random_ops += 1
            if kwargs.get("generator") is None:
                self.random_states[seeded] = generator_of(_device_of(args, kwargs)).get_state()
        node = Node(func, (), {}, (), seeded=seeded)
        if seeded >= 0:
            node.device = _device_of(args, kwargs)
            node.replayable = kwargs.get("generator") is None
        node.args, node.kwargs = self._templates(func, node, args, kwargs)
        out = func(*args, **kwargs)
        node.flops = arithmetic(func, args, out)
        self._add(node, out)
        return out

    def _templates(self, func: Any, node: Node, args: Any, kwargs: dict[str, Any]) -> tuple[Any, Any]:
        written = {a.name for a in func._schema.arguments if a.alias_info is not None and a.alias_info.is_write}
        names = [a.name for a in func._schema.arguments]
        view = any(alias is False for alias in _returns_alias(func)) or func is _aten._unsafe_view.default
        touched = 0
        scratch: set[int] = set()
        if func in _BATCH_NORMS:
            training = _BATCH_NORMS[func]
            if training < 0 or (len(args) > training and args[training]):
                scratch |= {3, 4}
        elif func in _SHAPE_ONLY:
            scratch.add(0)

        def template(position: int | str, item: Any) -> Any:
            nonlocal touched
            if not isinstance(item, torch.Tensor):
                return item
            name = names[position] if isinstance(position, int) and position < len(names) else position
            if position in scratch:
                if isinstance(position, int) and position in (3, 4):  # running statistics, written
                    address = storage_ptr(item)
                    if address is not None:
                        self.mutated_buffers.add(address)
                return ScratchArg(tuple(item.shape), tuple(item.stride()), item.dtype, item.device,
                                  zeros=func in _BATCH_NORMS)
            if not view:
                touched += item.numel() * item.element_size()
            ref = self._param_ref(item)
            if ref is not None:
                if name in written:
                    node.replayable = False
                return ref
            if self._is_local(item):
                if name in written:
                    address = storage_ptr(item)
                    if address is not None:
                        self.mutated_buffers.add(address)
                    node.replayable = False
                return BufferArg(item)
            value = self.value_of(item)
            if name in written:
                if node.mutates >= 0:
                    node.replayable = False  # writes two tensors
                node.mutates = value
            return ValueArg(value)

        new_args = tuple(tree_map(lambda item, p=p: template(p, item), arg) for p, arg in enumerate(args))
        new_kwargs = {k: tree_map(lambda item, k=k: template(k, item), v) for k, v in kwargs.items()}
        node.nested = any(isinstance(item, torch.Tensor) for arg in args if isinstance(arg, (list, tuple))
                          for item in tree_flatten(arg)[0]) or any(
            isinstance(item, torch.Tensor) for item in tree_flatten(kwargs)[0])
        if any(k == "out" for k in kwargs):
            node.replayable = False
        node.touched_bytes = touched
        return new_args, new_kwargs

    def _add(self, node: Node, out: Any) -> None:
        number = len(self.nodes)
        aliases = _returns_alias(node.func)
        view = any(alias is False for alias in aliases) or node.func is _aten._unsafe_view.default
        first_input = next((a.value for a in tree_flatten(node.args)[0] if isinstance(a, ValueArg)), -1)
        flat = tree_flatten(out)[0]
        devices = {item.device for item in tree_flatten((node.args, node.kwargs))[0] if isinstance(item, ScratchArg)}
        devices |= {self.meta[a.value].device for a in tree_flatten((node.args, node.kwargs))[0]
                    if isinstance(a, ValueArg)}
        devices |= {item.device for item in flat if isinstance(item, torch.Tensor)}
        if len(devices) > 1:
            node.replayable = False  # a copy between devices is no cheap op to run again
        outputs = []
        for position, item in enumerate(flat):
            if not isinstance(item, torch.Tensor):
                outputs.append(-1)
                continue
            if _alias_of(aliases, position) is True:  # written in place: its version goes up when the op returns
                base = self.base[node.mutates] if node.mutates >= 0 else -1
                outputs.append(self._new_value(item, (number, position), base, item._version + 1))
            else:
                base = self.base[first_input] if view and first_input >= 0 else -1
                outputs.append(self._new_value(item, (number, position), base, item._version))
                if not view:
                    node.touched_bytes += item.numel() * item.element_size()
        if view:
            node.touched_bytes = 0
        node.outputs = tuple(outputs)
        self.nodes.append(node)


class Seen(NamedTuple):
    """Which tensor an op of a later clock read: its memory, layout and
    version (a parameter view is named by its :class:`ParamRef` instead)."""

    address: int | None
    offset: int
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    version: int


def seen(tensor: torch.Tensor) -> Seen:
    return Seen(storage_ptr(tensor), int(tensor.storage_offset()), tuple(tensor.shape), tuple(tensor.stride()),
                tensor._version)


@dataclasses.dataclass(eq=False, slots=True)
class Made:
    """How a later clock's forward made a tensor: the op, its arguments
    flattened (``spec``), with :data:`TENSOR` in place of each tensor, and
    for each tensor argument how it was made (None: by an op outside the
    programs, or outside the forward) and which tensor it was."""

    func: Any
    flat: tuple[Any, ...]
    spec: Any  # torch.utils._pytree.TreeSpec of (args, kwargs); None: ``flat`` is the positional arguments
    inputs: tuple[Input, ...]

    @property
    def scalars(self) -> tuple[Any, ...]:
        return tuple(item for item in self.flat if item is not TENSOR)


# An op's tensor argument in a later clock: how the programs' ops made it
# (None: by another op) and, a parameter view, its ParamRef, or a tensor no
# op of the programs made, which tensor it is (else None).
Input = tuple["tuple[Made, int] | None", "ParamRef | Seen | None"]

TENSOR = object()  # a tensor's place in Made.flat
_MADE = "_mltuner_made"  # a tensor's attribute: (the ClockOps that noted it, (Made, output position), version)


# What a recorded node holds in place of each tensor argument.
TEMPLATES = (ValueArg, ParamRef, BufferArg, ScratchArg)


def _split(node: Node) -> tuple[tuple[Any, ...], tuple[Any, ...]]:
    if node._split is None:
        flat = tree_flatten((node.args, node.kwargs))[0]
        node._split = (tuple(item for item in flat if isinstance(item, TEMPLATES)),
                       tuple(item for item in flat if not isinstance(item, TEMPLATES)))
    return node._split


def scalars_of(node: Node) -> tuple[Any, ...]:
    """A recorded node's arguments that are not tensors, in flattened order."""
    return _split(node)[1]


def templates_of(node: Node) -> tuple[Any, ...]:
    """A recorded node's templates of its tensor arguments, in flattened order."""
    return _split(node)[0]


class ClockOps(TorchDispatchMode):  # type: ignore[no-untyped-call]
    """Later clocks, where the backward pass recomputes saved activations:
    notes how the forward made each tensor an op of the programs (``funcs``)
    returned (:class:`Made`), so that a saved activation about to be
    recomputed can be checked against its recorded program and its ops run
    again with this clock's arguments (a softmax temperature that changes
    every clock, ``F.dropout(p=self.p)``); and keeps the generator state
    before each random op whose number is in ``wanted`` (the random ops of
    recomputed tensors, with the op the recording saw there). A clock whose
    random ops differ from the recording's raises
    :class:`IterationMismatchError` rather than replay another op's random
    numbers."""

    def __init__(self, wanted: dict[int, Any], total: int, clock: int, funcs: frozenset[Any],
                 param_ref: Callable[[torch.Tensor], ParamRef | None]) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self._param_ref = param_ref
        self.wanted = wanted
        self.total = total  # the recording's random ops
        self.clock = clock
        self.funcs = funcs
        self.states: dict[int, torch.Tensor] = {}
        self._count = 0

    def made(self, tensor: torch.Tensor) -> tuple[Made, int] | None:
        """How this clock's forward made ``tensor`` as it is now (None: not
        by an op of the programs, or written since by another op)."""
        found = tensor.__dict__.get(_MADE)
        return found[1] if found is not None and found[0] is self and found[2] == tensor._version else None

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if self.wanted and _is_seeded(func):
            self._note_random(func, args, kwargs or {})
        if func not in self.funcs:
            return func(*args, **(kwargs or {}))
        # How each tensor argument was made: noted on the tensor itself (a
        # dict lookup; a weak-keyed dictionary cost several times as much).
        if kwargs or any(type(item) in (list, tuple) for item in args):
            flat, spec = tree_flatten((args, kwargs or {}))
        else:
            flat, spec = args, None
        inputs: list[Input] = []
        kept = []
        for item in flat:
            if isinstance(item, torch.Tensor):
                source = self.made(item)
                inputs.append((source, self._param_ref(item) or (seen(item) if source is None else None)))
                kept.append(TENSOR)
            else:
                kept.append(item)
        made = Made(func, tuple(kept), spec, tuple(inputs))
        out = func(*args, **(kwargs or {}))
        # With the version each output has once the op returns (one more
        # where it writes an argument in place: autograd counts the write
        # above this mode): a later write by an op the programs do not run
        # (an in-place op of the model's own) makes the note stale, and the
        # tensor then counts as made by other ops.
        aliases = _returns_alias(func)
        for position, item in enumerate((out,) if isinstance(out, torch.Tensor) else tree_flatten(out)[0]):
            if isinstance(item, torch.Tensor):
                bump = _alias_of(aliases, position) is True
                item.__dict__[_MADE] = (self, (made, position), item._version + bump)
        return out

    def _note_random(self, func: Any, args: Any, kwargs: dict[str, Any]) -> None:
        expected = self.wanted.get(self._count)
        if expected is not None:
            if func is not expected:
                raise IterationMismatchError(
                    f"clock {self.clock}: random op #{self._count} of the forward is {func}, the recorded one "
                    f"{expected}; a recomputed activation replays its random numbers, so every clock must "
                    "run the same random ops as the recording pass of wrap()"
                )
            self.states[self._count] = generator_of(_device_of(args, kwargs)).get_state()
        self._count += 1

    def check_complete(self) -> None:
        """After the forward: it ran as many random ops as the recording
        (where some are replayed)."""
        if self.wanted and self._count != self.total:
            raise IterationMismatchError(
                f"clock {self.clock}: the forward ran {self._count} random ops, the recording pass of wrap() "
                f"{self.total}; a recomputed activation replays the random numbers of its op, so every clock must "
                "run the same random ops"
            )
