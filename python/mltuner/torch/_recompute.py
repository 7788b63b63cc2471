"""Recompute or store: which saved activations the backward pass makes again.

With ``store_activations`` every tensor autograd saves for the backward pass
is copied into the engine's local table, and under a device-memory budget
the engine swaps what does not fit to host memory and back. ``wrap(recompute=
"auto")`` stores less: a saved tensor made by a few cheap ops from tensors
that are stored anyway (or from parameters, buffers and random state) is not
stored; the backward pass runs those ops again from the stored inputs, as
selective activation checkpointing does (Korthikanti et al. 2022; torch's
``create_selective_checkpoint_contexts``).

Cost model. Storing a tensor of ``b`` bytes costs two copies of ``b`` on the
device per clock (into the local table in the forward, out in the backward)
and, when the plan puts it in host memory, ``2 b`` over the host link: at the
~25 GB/s of pinned PCIe copies on an H100 host, 80 ps per byte stored.
Running a memory-bound op again (elementwise, batch and layer norm, softmax,
pooling, dropout, casts, concatenation) costs the bytes it reads and writes
at device-memory bandwidth (~3 TB/s on an H100: 0.3 ps per byte touched); a
view costs nothing. So a chain of such ops that touches at most
:data:`MAX_TOUCHED_PER_BYTE` (16) bytes per byte it saves costs at most about
a fifteenth of the swap it avoids, and at most about four times the
device-memory traffic of storing it (two copies, each reading and writing
its bytes). Compute-bound ops (matmul, convolution, attention) do
``2 K`` flops per output element, K the reduction size (hundreds to
thousands): running them again repeats the forward's arithmetic (full
activation checkpointing, about a third of a step more). ``"cheap"``
always stores their outputs. ``"compute"`` also runs convolutions and
matrix products again when the chain's work is at most
:data:`MAX_FLOPS_PER_BYTE` (2,048) per byte it saves, counting a byte
touched as :data:`FLOPS_PER_TOUCHED_BYTE` (16) flops (a float32 H100 does
~50 TFLOP/s against ~3 TB/s): at 20 fs a flop that is at most 40 ps a byte,
half the swap it avoids, and far less on tensor cores. It pays where
the host link bounds the clock (large activations swapped to host memory:
ImageNet-sized images), not where the device's arithmetic does. Attention
and other compute-bound ops stay stored, as do tensors made from unstored
inputs.

``"auto"`` (under a device-memory budget) plans with ``"cheap"`` first and
asks the plan for the bytes its swaps move per clock. When a step's work
(three times the forward's convolutions and matrix products) is under
:data:`LINK_BOUND_FLOPS_PER_BYTE` (1,280 on a GPU) flops per byte over the
busier direction of the host link, the link bounds the clock, so ``wrap()``
records the clock again with ``"compute"`` and keeps that plan if it moves
fewer bytes (:func:`link_bound`). Why 1,280: a float32 training step on an
H100 sustains 33-50 TFLOP/s (matrix products in float32, convolutions in
TF32: measured without a budget), and pinned copies ~25 GB/s, so the link
and the arithmetic balance at 1,300-2,000 flops per byte; below the lower
end the link surely bounds the step, while ``"compute"`` surely costs its
recomputations, so doubt keeps ``"cheap"``. A small step is bound by the
host instead, whatever its flops: each op of the forward costs a step tens
of microseconds of the host's time (its kernels forward and backward, the
adapter's hooks), and ``"compute"`` adds more (each op it runs again is
dispatched from Python), so the link must also move more than
:data:`LINK_BOUND_BYTES_PER_OP` (2 MiB) per op of the forward. Where that
line lies was measured at a quarter of the need on ResNet-18 with 32x32
images, bound by the host: batch 128 (0.52 MiB per op) ran at 0.40-0.48 of
no budget with ``"cheap"`` and 0.39 with ``"compute"`` (an H100 host),
batch 512 (0.80 MiB per op) at 0.47 with ``"cheap"`` and 0.42 with
``"compute"``, whose chains now run up to :func:`compute_depth` deep and
so dispatch more ops again (an H200 host, two rounds each, the same run:
stop 35 in docs/results.md). Both stay on ``"cheap"``; ResNet-18 on
224x224 images (about 1,070 flops per byte, 6 MiB per op at batch 128,
23 at 512) ran at 0.39-0.40 with ``"cheap"`` and 0.55-0.61 with
``"compute"`` at depth 2 (0.78-0.79 at :func:`compute_depth`); the 12-layer
transformer (about 1,630 flops per byte, 1.5 MiB per op) at 0.73-0.75 and
0.72. Under autocast the arithmetic runs several times faster, so the rule
keeps ``"cheap"`` for some steps the link bounds.

The rule, per saved tensor, in the order the forward made them:

1. it is made by ops that are all memory-bound (:func:`memory_bound`) or,
   with ``"compute"``, convolutions and matrix products, each replayable
   (no write to a parameter or buffer, no ``out=``, no copy between
   devices, random ops only with the default generator), from
   stored or recomputed saved tensors, parameters (not under SSP without
   held reads, where a backward read may hold newer values than the
   forward's), buffers no op of the forward writes, and random state;
2. its ops touch at most ``MAX_TOUCHED_PER_BYTE`` bytes per byte saved
   (a chain with convolutions or matrix products: its work, as above, is at
   most ``MAX_FLOPS_PER_BYTE`` per byte saved);
3. its depth is at most :data:`MAX_DEPTH` (2) with ``"cheap"``: a
   recomputed tensor read by another recomputed tensor's ops must itself
   read only stored ones. The backward pass keeps a recomputed tensor until
   its last use, so the depth bounds how many are alive at once, and how
   many layers' parameters are read early (a residual network's block
   outputs, each made from the previous one, are then stored at every third
   block). With ``"compute"`` the bound is :func:`compute_depth`, the square
   root of the number of tensors worth storing: a chain of ``n`` equal
   activations stored every ``d``-th one holds ``n / d`` stored and up to
   ``d`` recomputed at once, least at ``d = sqrt(n)`` (Chen et al. 2016,
   "Training deep nets with sublinear memory cost"). Where the link bounds
   the clock this is what removes the swaps: ResNet-18 on 224x224 images at
   a quarter of its need stores 18 of its 41 large saved tensors at depth 2
   (886 MB swapped each way a clock), 12 at depth 6 (none swapped), and runs
   at 0.53 of no budget at depth 2, 0.74 at 3 and 4, 0.77 at 6, 0.76 at 8,
   0.75 at 12 (one H100 host; 41 tensors: depth 6);
4. an in-place op writes only memory its own chain made (never a stored
   input, which the backward pass shares), and uninitialised memory
   (``empty_like``) is read only by ops that overwrite it (``bernoulli_``).

Why not ``torch.utils.checkpoint``: its non-reentrant mode keeps what it
saves (a region's inputs, and with a selective policy the outputs it must
save) in its own Python objects, behind its own ``saved_tensors_hooks``,
which take precedence over the adapter's: those tensors would stay on the
device, outside the engine's budget and its swaps. Deciding per saved
tensor in the adapter's own hook keeps every stored byte in the engine.

Bit-identical results: the ops run again are the same aten ops on the same
inputs (stored inputs come back with their strides, see ``_saved.read_back``),
random ops with the generator state they had in the forward; batch norm's
running statistics are not updated twice (scratch tensors take the write).
The recording pass of ``wrap()`` checks every recomputed tensor against the
one the forward made, byte for byte, and records again with those that
differ stored.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Mapping, Sequence
from types import MappingProxyType
from typing import Any, Literal, NoReturn

import torch
from torch.utils._pytree import tree_flatten, tree_map, tree_unflatten

from mltuner.torch._buffers import storage_ptr
from mltuner.torch._recording import Slot
from mltuner.torch._errors import IterationMismatchError
from mltuner.torch._trace import (TENSOR, BufferArg, ForwardTrace, Input, Made, Node, ParamRef, ScratchArg, Seen,
                                  ValueArg, generator_of, scalars_of, seen, templates_of)

__all__ = ["FLOPS_PER_TOUCHED_BYTE", "LINK_BOUND_BYTES_PER_OP", "LINK_BOUND_FLOPS_PER_BYTE", "MAX_DEPTH",
           "MAX_FLOPS_PER_BYTE", "MAX_TOUCHED_PER_BYTE", "Program", "RECOMPUTE_CHOICES", "Recompute",
           "check_clock", "choose", "compute_depth", "describe", "link_bound", "memory_bound", "run"]

Recompute = Literal["auto", "cheap", "compute", "none"]
RECOMPUTE_CHOICES: tuple[Recompute, ...] = ("auto", "cheap", "compute", "none")

MAX_DEPTH = 2
MAX_TOUCHED_PER_BYTE = 16
MAX_FLOPS_PER_BYTE = 2048  # "compute": a chain's work per byte saved, in flops
FLOPS_PER_TOUCHED_BYTE = 16  # a byte read or written, in flops of work (device bandwidth against arithmetic)
MAX_NODES = 64  # ops in one tensor's chain: a bound on the planning work, not a cost limit
# "auto": below this much work of a step per byte over the host link, the
# link bounds the clock, by device type. None on the CPU, where a swap is a
# copy within one memory and recomputing a convolution costs far more.
LINK_BOUND_FLOPS_PER_BYTE = {"cuda": 1280}
# ... and above this many bytes per op of the forward: below, the host's time
# per op (its launches, the adapter's hooks) bounds the clock, not the link.
LINK_BOUND_BYTES_PER_OP = 2 << 20

_aten = torch.ops.aten
_MEMORY_BOUND = frozenset(p.__name__ for p in (
    _aten.native_batch_norm, _aten.cudnn_batch_norm, _aten.miopen_batch_norm, _aten._native_batch_norm_legit,
    _aten._batch_norm_with_update, _aten._batch_norm_no_update, _aten.native_layer_norm, _aten.native_group_norm,
    _aten._softmax,
    _aten._log_softmax, _aten._safe_softmax, _aten.max_pool2d_with_indices, _aten.max_pool3d_with_indices,
    _aten.avg_pool2d, _aten.avg_pool3d, _aten._adaptive_avg_pool2d, _aten._adaptive_avg_pool3d, _aten.mean,
    _aten.sum, _aten.amax, _aten.amin, _aten.native_dropout, _aten.bernoulli, _aten.bernoulli_, _aten.uniform_,
    _aten.normal_, _aten.fill_, _aten.zero_, _aten.copy_, _aten.cat, _aten.stack, _aten._to_copy, _aten.clone,
    _aten.embedding, _aten.index_select, _aten.gather, _aten.constant_pad_nd, _aten.where, _aten.masked_fill,
    _aten.repeat, _aten._unsafe_view, _aten.empty, _aten.empty_like, _aten.empty_strided, _aten.new_empty,
    _aten.new_empty_strided, _aten.zeros_like, _aten.ones_like, _aten.full_like, _aten.new_zeros, _aten.new_ones,
    _aten.new_full, _aten.zeros, _aten.ones, _aten.full, _aten.arange, _aten.scalar_tensor))
# Ops that make uninitialised memory, and in-place ops that overwrite all of
# their tensor without reading it (only these may take such memory).
_UNINITIALISED = frozenset(p.__name__ for p in (_aten.empty, _aten.empty_like, _aten.empty_strided,
                                                _aten.new_empty, _aten.new_empty_strided))
_OVERWRITES = frozenset(p.__name__ for p in (_aten.bernoulli_, _aten.uniform_, _aten.normal_, _aten.fill_,
                                             _aten.zero_, _aten.copy_))
_DROPOUT = _aten.native_dropout.default
_NONE: Mapping[int, Made] = MappingProxyType({})


def link_bound(device: torch.device, forward_work: tuple[int, int], link_bytes: int) -> bool:
    """Whether a plan on ``device`` that moves ``link_bytes`` per clock over
    the busier direction of the host link is bound by it, for a forward of
    ``forward_work`` (flops, aten ops; a step: three times as much; module
    docstring)."""
    flops, ops = forward_work
    return (3 * flops < LINK_BOUND_FLOPS_PER_BYTE.get(device.type, 0) * link_bytes
            and link_bytes > LINK_BOUND_BYTES_PER_OP * ops)


def compute_depth(large_slots: int) -> int:
    """``"compute"``'s bound on a chain's depth for a clock that saves
    ``large_slots`` tensors worth storing (rule 3 of the module docstring)."""
    return max(MAX_DEPTH, round(math.sqrt(large_slots)))


def _name(func: torch._ops.OpOverload) -> str:
    return str(func.overloadpacket.__name__)


def memory_bound(func: torch._ops.OpOverload) -> bool:
    """Whether an aten op does O(1) arithmetic per byte it touches, so that
    running it again costs about its bytes at device-memory bandwidth:
    elementwise ops (tag ``pointwise``), views, and a list of normalisation,
    pooling, softmax, reduction, dropout, cast, copy and factory ops."""
    if torch.Tag.pointwise in func.tags or _name(func) in _MEMORY_BOUND:
        return True
    return any(r.alias_info is not None and not r.alias_info.is_write for r in func._schema.returns)


@dataclasses.dataclass(frozen=True)
class Program:
    """How the backward pass makes a saved activation again: the traced ops
    to run, in forward order, and the saved activations they read."""

    slot: int
    output: int  # the value the saved activation holds
    nodes: tuple[int, ...]  # trace nodes, in forward order
    leaves: tuple[tuple[int, int], ...]  # (value, slot) of the saved activations it reads
    mask_only: tuple[tuple[int, ScratchArg], ...]  # dropouts run for their mask alone, on a stand-in input
    depth: int  # 1 + the largest depth of the recomputed activations it reads (stored: 0)
    touched_bytes: int
    flops: int  # of its convolutions and matrix products


def choose(trace: ForwardTrace, slot_values: Sequence[int], slots: Sequence[Slot],
           stored: frozenset[int] = frozenset(), *, parameters: bool = True,
           compute_bound: bool = False, max_depth: int = MAX_DEPTH) -> dict[int, Program]:
    """The saved activations to recompute (by slot) and their programs,
    under the rule of the module docstring. ``slot_values[k]`` is the value
    saved activation ``k`` holds; ``stored`` are slots never to recompute;
    ``parameters=False`` recomputes only tensors made without parameters
    (under SSP a backward read may hold newer values than the forward's);
    ``compute_bound=True`` lets chains run convolutions and matrix products
    (``recompute="compute"``); ``max_depth`` bounds rule 3."""
    slot_of_value: dict[int, int] = {}
    for slot, value in enumerate(slot_values):
        slot_of_value.setdefault(value, slot)
    depth: dict[int, int] = {}  # slot -> depth (0: stored)
    programs: dict[int, Program] = {}
    for slot in sorted(range(len(slot_values)), key=lambda k: slot_values[k]):  # producers first
        program = None if slot in stored else _program(slot, trace, slot_values, slot_of_value, slots, depth,
                                                       parameters, compute_bound)
        if program is None or program.depth > max_depth or _too_costly(program, slots[slot].nbytes):
            depth[slot] = 0
        else:
            depth[slot] = program.depth
            programs[slot] = program
    return programs


def _too_costly(program: Program, nbytes: int) -> bool:
    """Rule 2: the chain's cost against the bytes it saves."""
    if program.flops == 0:
        return program.touched_bytes > MAX_TOUCHED_PER_BYTE * nbytes
    return program.flops + FLOPS_PER_TOUCHED_BYTE * program.touched_bytes > MAX_FLOPS_PER_BYTE * nbytes


def _program(slot: int, trace: ForwardTrace, slot_values: Sequence[int], slot_of_value: dict[int, int],
             slots: Sequence[Slot], depth: dict[int, int], parameters: bool,
             compute_bound: bool) -> Program | None:
    """The chain of ops that makes ``slot``'s value from other saved
    activations, parameters, buffers and random state; None if there is
    none under the rule's conditions 1 and 4."""
    target = slot_values[slot]
    wanted: dict[int, set[int]] = {}  # node -> its outputs the chain uses
    leaves: dict[int, int] = {}
    written: list[int] = []  # values that in-place ops of the chain write
    stack = [(target, True, False)]  # (value, is the target, reached as the tensor an overwriting op writes)
    while stack:
        value, top, overwritten = stack.pop()
        other = slot_of_value.get(value)
        if not top and other is not None:
            if other not in depth or (depth[other] == 0 and not slots[other].exact_layout):
                return None  # read back with another layout than the forward's
            leaves[value] = other
            continue
        producer = trace.producer[value]
        if producer is None:
            return None  # opaque: the model's input, or made outside the trace
        number, position = producer
        node = trace.nodes[number]
        if not node.replayable or not (memory_bound(node.func) or (compute_bound and node.flops > 0)):
            return None
        if _name(node.func) in _UNINITIALISED and not overwritten:
            return None
        outputs = wanted.setdefault(number, set())
        if position in outputs:
            continue
        first = not outputs
        outputs.add(position)
        if len(wanted) > MAX_NODES:
            return None
        if node.func is _DROPOUT:  # its mask depends on the random state alone, its output on the input too
            source = node.args[0] if node.args else None
            if not isinstance(source, ValueArg):
                return None  # dropout of a parameter: not worth the trouble
            if position == 0:
                stack.append((source.value, False, False))
            continue
        if not first:
            continue
        for arg in tree_flatten((node.args, node.kwargs))[0]:
            if isinstance(arg, ValueArg):
                stack.append((arg.value, False, arg.value == node.mutates and _name(node.func) in _OVERWRITES))
            elif isinstance(arg, BufferArg) and storage_ptr(arg.tensor) in trace.mutated_buffers:
                return None  # its value in the backward pass may not be the forward's
            elif isinstance(arg, ParamRef) and not parameters:
                return None
        if node.mutates >= 0:
            written.append(node.mutates)
    made = {value for number in wanted for value in trace.nodes[number].outputs if value >= 0}
    for value in written:  # an in-place op writes only memory its own chain made
        base = trace.base[value]
        if base in leaves or base not in made or value in leaves:
            return None
    nodes = tuple(sorted(wanted))
    mask_only = tuple((n, trace.meta[trace.nodes[n].args[0].value]) for n in nodes
                      if trace.nodes[n].func is _DROPOUT and 0 not in wanted[n])
    return Program(slot, target, nodes, tuple(sorted(leaves.items())), mask_only,
                   1 + max((depth[s] for s in leaves.values()), default=0),
                   sum(trace.nodes[n].touched_bytes for n in nodes), sum(trace.nodes[n].flops for n in nodes))


def check_clock(program: Program, trace: ForwardTrace, made: tuple[Made, int] | None,
                  clock: int) -> tuple[dict[int, Made], list[tuple[int, Input]]]:
    """Checks how a later clock's forward made ``program``'s saved activation
    (``made``: :meth:`ClockOps.made` of the tensor autograd saves) against
    the program: the same ops, one after the other, reading the same
    parameters and buffers. Returns the non-tensor arguments of the clock's
    ops where they differ from the recorded ones, by node (for :func:`run`),
    and which tensor it read for each saved activation the program reads
    (slot, tensor: checked once the forward saved them all); raises
    IterationMismatchError where the ops or their parameters or buffers
    differ (a choice that depends on the data: an op, a task's row of a
    parameter)."""
    nodes = frozenset(program.nodes)
    leaves = dict(program.leaves)
    changed: dict[int, Made] = {}
    read: list[tuple[int, Input]] = []
    visited: set[int] = set()
    stack: list[tuple[int, tuple[Made, int] | None]] = [(program.output, made)]

    def refuse(what: str) -> NoReturn:
        raise IterationMismatchError(
            f"clock {clock}: saved activation #{program.slot} was made {what}; it is recomputed in the backward "
            "pass by the recorded ops from the recorded inputs, so every clock must make it so (here a choice that "
            "depends on the data: an op, or which tensor or row of a parameter it takes): use wrap(..., "
            "recompute='none'), which stores it")

    while stack:
        value, this = stack.pop()
        producer = trace.producer[value]
        if value in leaves or producer is None or producer[0] not in nodes:
            continue  # read back, or a dropout's input run for its mask alone
        number, position = producer
        node = trace.nodes[number]
        if this is None or this[0].func is not node.func or this[1] != position:
            refuse(f"by other ops than the recording pass of wrap() ran, not by {_name(node.func)}"
                   + ("" if this is None else f" ({_name(this[0].func)})"))
        if number in visited:
            continue
        visited.add(number)
        templates = templates_of(node)
        if len(templates) != len(this[0].inputs):
            refuse(f"by {_name(node.func)} of {len(this[0].inputs)} tensors where the recording pass of wrap() gave "
                   f"it {len(templates)}")
        if not _same_scalars(this[0].scalars, scalars_of(node)):
            changed[number] = this[0]
        for template, (source, tensor) in zip(templates, this[0].inputs):
            if isinstance(template, ValueArg):
                if template.value in leaves:
                    read.append((leaves[template.value], (source, tensor)))
                else:
                    stack.append((template.value, source))
            elif isinstance(template, ParamRef) and tensor != template:
                refuse(f"by {_name(node.func)} from other parameters than the recording pass of wrap() read")
            elif isinstance(template, BufferArg) and (not isinstance(tensor, Seen)
                                                      or tensor[:4] != seen(template.tensor)[:4]):
                refuse(f"by {_name(node.func)} from another buffer than the recording pass of wrap() read")
    return changed, read


def _same_scalars(now: tuple[Any, ...], then: tuple[Any, ...]) -> bool:
    """Equal non-tensor arguments, strictly: the same type each and, for
    floats, the same sign of zero (Python's ``==`` takes ``-0.0`` for
    ``0.0``, ``True`` for ``1`` and ``1.0`` for ``1``, which can make other
    bits)."""
    if len(now) != len(then):
        return False
    for a, b in zip(now, then):
        if type(a) is not type(b):
            return False
        if isinstance(a, float):
            if not (a == b and math.copysign(1.0, a) == math.copysign(1.0, b)) and not (a != a and b != b):
                return False
        elif a != b:
            return False
    return True


def run(program: Program, trace: ForwardTrace, *, leaf: Callable[[int], torch.Tensor],
        param: Callable[[ParamRef], torch.Tensor], random_state: Callable[[int], torch.Tensor],
        scalars: Mapping[int, Made] = _NONE) -> dict[int, torch.Tensor]:
    """Runs ``program``'s ops again and returns the values they made, by
    value number: the saved activation is ``[program.output]``.
    ``leaf(slot)`` gives a saved activation it reads, ``param(ref)`` a view
    of a layer's parameters, ``random_state(n)`` the generator state before
    the forward's random op ``n``; ``scalars``: a clock's own non-tensor
    arguments of some nodes (:func:`check_clock`)."""
    env = {value: leaf(slot) for value, slot in program.leaves}
    stand_ins = dict(program.mask_only)

    def fill(item: object) -> object:
        if isinstance(item, ValueArg):
            return env[item.value]
        if isinstance(item, ParamRef):
            return param(item)
        if isinstance(item, BufferArg):
            return item.tensor
        if isinstance(item, ScratchArg):
            return item.make()
        return item

    with torch.no_grad():
        for number in program.nodes:
            node = trace.nodes[number]
            if number in scalars:
                node = _with_scalars(node, scalars[number])
            if number in stand_ins:  # a dropout for its mask: its input is not made
                args, kwargs = (stand_ins[number].make(), *node.args[1:]), node.kwargs
            elif node.nested:  # a list of tensors (cat): the general, slower walk
                args, kwargs = tree_map(fill, node.args), tree_map(fill, node.kwargs)
            else:  # flat arguments, no tensor among the keywords: the common case, a Python call per argument
                args, kwargs = tuple(fill(item) for item in node.args), node.kwargs
            if node.seeded >= 0:
                assert node.device is not None
                generator = generator_of(node.device)
                saved = generator.get_state()
                generator.set_state(random_state(node.seeded))
                try:
                    out = node.func(*args, **kwargs)
                finally:
                    generator.set_state(saved)
            else:
                out = node.func(*args, **kwargs)
            for value, item in zip(node.outputs, tree_flatten(out)[0]):
                if value >= 0:
                    env[value] = item
    return env


def _with_scalars(node: Node, made: Made) -> Node:
    """``node`` with the arguments of a clock's op (``made``): its non-tensor
    ones, and the node's templates for its tensors, in order."""
    templates = iter(templates_of(node))
    flat = [next(templates) if item is TENSOR else item for item in made.flat]
    if made.spec is None:  # positional arguments only, none a list
        return dataclasses.replace(node, args=tuple(flat), kwargs={}, _split=None)
    args, kwargs = tree_unflatten(flat, made.spec)
    return dataclasses.replace(node, args=args, kwargs=kwargs, nested=True, _split=None)


def describe(program: Program, trace: ForwardTrace) -> str:
    """A program in words: ``recomputed from #2 by native_batch_norm, relu_``."""
    ops = [_name(trace.nodes[n].func) for n in program.nodes if trace.nodes[n].touched_bytes > 0]
    sources = ", ".join(f"#{slot}" for _, slot in program.leaves)
    source = f" from {sources}" if sources else ""
    params = any(isinstance(a, ParamRef) for n in program.nodes
                 for a in tree_flatten((trace.nodes[n].args, trace.nodes[n].kwargs))[0])
    if params:
        source += (" and parameters" if sources else " from parameters")
    return f"recomputed{source} by {', '.join(ops) if ops else 'a view'}"
