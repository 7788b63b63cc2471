"""The recorded clock: its accesses (events), the saved activations' slots,
and the replay of both as the engine's virtual iteration.

The clock driver (``_clock.py``) logs the events during the recording pass
and checks every later clock against them; :func:`replay` turns them into
the ``virtual_*`` calls, one handle per event that opens a buffer. The
recording pass logs the clock without held reads (each layer's backward
read where it first opens); :func:`for_holding` gives the same clock with
held reads, so that one recording serves both patterns and the driver can
choose between them by what the engine's plan needs.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import zlib
from collections.abc import Sequence
from typing import Any, Literal, NamedTuple

import torch

from mltuner.client._layout import TensorLayout
from mltuner.client._worker import Table, Worker
from mltuner.exceptions import InternalError
from mltuner.torch._layers import Layer, contiguous_strides, covers_once, memory_order

__all__ = ["GROUP_MAX_BYTES", "Event", "EventKind", "Slot", "Tables", "add_activations", "create_tables", "describe",
           "for_holding", "replay", "reuse_tables", "store_groups", "table_name"]

GROUP_MAX_BYTES = 4 << 20  # the most bytes of saved activations one local access moves together (store_groups)

EventKind = Literal["read", "post_read", "store", "load", "read_grad", "update"]


@dataclasses.dataclass(frozen=True)
class Event:
    """One access of the recorded clock.

    ``read`` / ``post_read``: a layer's forward read and the end of the
    layer's forward, where the read is posted (or, holding reads, kept open
    until the layer's ``update``). ``store`` / ``load``: a saved activation
    written in the forward and read back in the backward. ``read_grad``: a
    layer's backward read (not holding reads), open until its ``update``,
    which hands the layer's gradients over.
    """

    kind: EventKind
    layer: int = -1  # for read, post_read, read_grad, update
    slot: int = -1  # for store, load


@dataclasses.dataclass(frozen=True)
class Slot:
    """A saved activation of the recorded clock: its rows in the local table
    hold its bytes, or it has no rows: (``recomputed``) the backward pass
    makes it again (``_recompute.py``), or (``kept``) autograd keeps the
    tensor itself, as without ``store_activations`` (``_saved.keep_small``)."""

    shape: tuple[int, ...]
    dtype: torch.dtype
    stride: tuple[int, ...] = ()  # the forward's strides ((): contiguous)
    recomputed: bool = False
    kept: bool = False

    @property
    def stored(self) -> bool:
        """Whether the slot has rows in the local table."""
        return not (self.recomputed or self.kept)

    def same_layout(self, stride: tuple[int, ...]) -> bool:
        """Whether ``stride`` lays a tensor of this shape out as the slot's
        strides do (a dimension of size 1 may have any stride)."""
        return all(a == b for a, b, size in zip(stride, self.strides, self.shape) if size != 1)

    # The derived properties are cached: the adapter asks for them per saved
    # tensor per clock, and a slot never changes (replace() makes a new one).
    @functools.cached_property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize

    @functools.cached_property
    def strides(self) -> tuple[int, ...]:
        """The forward's strides (contiguous ones when ``stride`` is empty)."""
        return self.stride or contiguous_strides(self.shape)

    @functools.cached_property
    def exact_layout(self) -> bool:
        """Whether a stored copy comes back with the forward's strides: the
        tensor covers its memory span exactly once (contiguous in some order
        of its dimensions), so its bytes are kept in memory order. Others
        (expanded, or with gaps) come back contiguous."""
        return covers_once(self.shape, self.strides)


def describe(event: Event, layers: Sequence[Layer], slots: Sequence[Slot]) -> str:
    """An event in words, for error messages and ``PSModule.accesses``."""
    if event.kind in ("store", "load"):
        slot = slots[event.slot] if 0 <= event.slot < len(slots) else None
        what = f"saved activation #{event.slot}" + (f" {tuple(slot.shape)} {slot.dtype}" if slot else "")
        return f"{event.kind} of {what}"
    name = layers[event.layer].name
    return {
        "read": f"forward read of layer {name!r}",
        "post_read": f"end of the forward of layer {name!r}",
        "read_grad": f"backward read of layer {name!r}",
        "update": f"update of layer {name!r}",
    }[event.kind]


def for_holding(events: Sequence[Event]) -> list[Event]:
    """The events of the recorded clock when reads are held: the recording
    pass logs where each layer's backward read would open (``read_grad``,
    the first use of its parameters in the backward pass); holding, the
    backward uses the held forward read instead. A layer called again in
    the forward (a module called twice, the other module of a tied weight)
    uses that read too: its later reads and their posts drop out, so every
    layer is read once and the clock can be light (``_clock.py``)."""
    out: list[Event] = []
    read: set[int] = set()
    again: set[int] = set()  # layers inside a later call: its post drops out too
    for event in events:
        if event.kind == "read_grad":
            continue
        if event.kind == "read":
            if event.layer in read:
                again.add(event.layer)
                continue
            read.add(event.layer)
        elif event.kind == "post_read" and event.layer in again:
            again.discard(event.layer)
            continue
        out.append(event)
    return out


class Tables(NamedTuple):
    """The tables of a wrapped model: one per layer, and the local table of
    the stored activations with its layout (none without any)."""

    layers: list[Table]
    activations: list[tuple[Table, TensorLayout]]

    def slot_rows(self, *slots: int) -> tuple[Table, Any]:
        """The local table and rows of stored activations (of one table), in
        the order given."""
        number = self.table_of(slots[0])
        if number < 0:
            raise KeyError(f"saved activation #{slots[0]} has no rows")
        table, layout = self.activations[number]
        return table, layout.rows(*(f"a{slot}" for slot in slots))

    def table_of(self, slot: int) -> int:
        """Which local table holds a stored activation's rows (-1: none)."""
        return next((n for n, (_, layout) in enumerate(self.activations) if f"a{slot}" in layout), -1)


def table_name(layer: Layer) -> str:
    """The name of the engine table of a layer's parameters. Where some
    are held in an order of their own (their memory format's), a digest of
    those orders follows: the shards refuse a worker whose tables differ,
    so workers whose models differ in layout cannot mix their rows."""
    orders = [(slot.name, memory_order(slot.shape, slot.stride)) for slot in layer.params if slot.reordered]
    suffix = f" [memory format {zlib.crc32(repr(orders).encode()):08x}]" if orders else ""
    return f"torch:{layer.name}{suffix}"


def create_tables(worker: Worker, layers: Sequence[Layer], slots: Sequence[Slot], *, row_width: int) -> Tables:
    """Creates one table per layer and, for the stored activations, a local
    table (recomputed and kept ones have no rows)."""
    tables = [worker.create_tensor_table(table_name(layer), layer.layout, update_rule=layer.update_rule)
              for layer in layers]
    return add_activations(worker, Tables(tables, []), slots, row_width=row_width)


def reuse_tables(worker: Worker, tables: Tables, layers: Sequence[Layer], slots: Sequence[Slot], *,
                 row_width: int) -> Tables:
    """The tables of an earlier recording of the same model (``wrap()``
    records again after a plan, ``recompute="auto"``). The rows of slots no
    longer stored stay, untouched: the engine places them nowhere. A
    recording that stores slots without rows gets its activations laid out
    anew in one local table: a run of stores shares one engine access only
    within a table (ResNet-18 at batch 128 took 22 store accesses a clock
    in two tables, 16 in one). Local tables are this worker's alone, so no
    other worker need drop them."""
    names = [table.name for table in tables.layers]
    if names != [table_name(layer) for layer in layers]:
        raise InternalError(f"recording again found other layers ({len(layers)}) than the tables ({len(names)})")
    for k, slot in enumerate(slots):
        number = tables.table_of(k)
        if number >= 0 and tables.activations[number][1].slot(f"a{k}").shape != (_words(slot),):
            raise InternalError(f"recording again saved activation #{k} with another size ({slot.nbytes} B)")
    if tables.activations and any(s.stored and tables.table_of(k) < 0 for k, s in enumerate(slots)):
        worker.drop_tables(tables.activations[0][0])
        tables = Tables(tables.layers, [])
    return add_activations(worker, tables, slots, row_width=row_width)


def _words(slot: Slot) -> int:
    """The float32 words of a stored slot's rows: its bytes, rounded up."""
    return max(1, -(-slot.nbytes // 4))


def add_activations(worker: Worker, tables: Tables, slots: Sequence[Slot], *, row_width: int) -> Tables:
    """``tables`` with a local table holding the stored ``slots`` that have
    no rows in ``tables`` yet; ``tables`` itself if there are none."""
    new = {k: s for k, s in enumerate(slots) if s.stored and tables.table_of(k) < 0}
    if not new:
        return tables
    layout = TensorLayout(row_width)
    for k, slot in new.items():
        layout.add(f"a{k}", (_words(slot),))
    name = "torch:activations" if not tables.activations else f"torch:activations.{len(tables.activations)}"
    table = worker.create_tensor_table(name, layout, local=True)
    return Tables(tables.layers, [*tables.activations, (table, layout)])


def store_groups(events: Sequence[Event], slots: Sequence[Slot], tables: Tables,
                 largest: int) -> dict[int, tuple[int, ...]]:
    """The stored activations that share one local access: within each run
    of consecutive store events (a layer's saved tensors, as a rule) and
    not split by a slot the engine cannot copy itself, those of one table
    whose slots it copies itself (one span of memory, whole float32 words),
    in forward order, up to :data:`GROUP_MAX_BYTES`
    and to the ``largest`` access without groups (a layer's parameters, or
    a stored activation) a group, so that no access buffer outgrows the
    largest one. Maps each slot of a group of two or more to the group's
    slots.

    Why: each local access costs the training thread and the engine's
    pipeline a fixed amount (an open and a post, each a step of the
    access-buffer pool's chain under a budget), whatever its size; a
    group's slots are stored with one access in the forward and read back
    with one at the first use of any of them in the backward pass."""
    limit = min(GROUP_MAX_BYTES, max([largest, *(slot.nbytes for slot in slots if slot.stored)]))
    groups: dict[int, tuple[int, ...]] = {}
    filling: dict[int, tuple[list[int], int]] = {}  # table -> (its open group's slots, their bytes)

    def close(table: int) -> None:
        members, _ = filling.pop(table)
        if len(members) > 1:
            groups.update((number, tuple(members)) for number in members)

    for event in events:
        slot = slots[event.slot] if event.kind == "store" else None
        if slot is not None and not slot.stored:
            continue
        if slot is None or not (slot.exact_layout and slot.nbytes % 4 == 0):
            # The run of stores ends, or a slot the engine cannot copy itself
            # is stored through an engine call of its own, which posts what
            # is queued: a group still open would leave without its later slots.
            for table in list(filling):
                close(table)
            continue
        table = tables.table_of(event.slot)
        if table in filling and filling[table][1] + slot.nbytes > limit:
            close(table)
        members, size = filling.get(table, ([], 0))
        filling[table] = ([*members, event.slot], size + slot.nbytes)
    for table in list(filling):
        close(table)
    return groups


def replay(worker: Worker, tables: Tables, events: Sequence[Event], *, slack: int, hold_reads: bool,
           batched: bool = False, groups: dict[int, tuple[int, ...]] | None = None) -> list[int]:
    """Records ``events`` as the worker's virtual iteration, ending with
    ``virtual_clock``. With ``hold_reads`` a layer's forward reads stay open
    until its update. ``batched`` (the light clock) opens each update's
    buffer before the layer's reads are posted, so that the posts and the
    next update's open are consecutive ops, one engine call. ``groups``
    (:func:`store_groups`): stored activations that share one access, at
    the store of the group's first slot and at the first load of any of
    them. Returns, per event, the handle of the access it opens (-1 for
    events that open none, such as the stores and later loads of a group's
    other slots)."""
    layer_tables = tables.layers
    groups = groups or {}
    handles = [-1] * len(events)
    open_forward: dict[int, int] = {}
    held: dict[int, list[int]] = {}  # layer -> its held forward reads
    open_backward: dict[int, int] = {}
    loaded: set[int] = set()  # groups (by first slot) whose load is recorded
    for index, event in enumerate(events):
        if event.kind == "read":
            handles[index] = open_forward[event.layer] = worker.virtual_read(layer_tables[event.layer], slack=slack)
        elif event.kind == "post_read":
            if hold_reads:
                held.setdefault(event.layer, []).append(open_forward.pop(event.layer))
            else:
                worker.virtual_post_read(open_forward.pop(event.layer))
        elif event.kind in ("store", "load"):
            fetch = event.kind == "load"
            members = groups.get(event.slot, (event.slot,))
            if members[0] in loaded if fetch else event.slot != members[0]:
                continue  # the group's access is recorded already
            if fetch:
                loaded.add(members[0])
            table, rows = tables.slot_rows(*members)
            handles[index] = worker.virtual_local_access(table, rows, fetch=fetch)
            worker.virtual_post_local_access(handles[index], keep=not fetch)
        elif event.kind == "read_grad":
            handles[index] = open_backward[event.layer] = worker.virtual_read(layer_tables[event.layer], slack=slack)
        else:  # update: the layer's reads are done with once the gradients are final
            if batched:
                handles[index] = worker.virtual_pre_update(layer_tables[event.layer])
                for handle in held.pop(event.layer, ()):
                    worker.virtual_post_read(handle)
                worker.virtual_update(handles[index])
                continue
            for handle in held.pop(event.layer, ()):
                worker.virtual_post_read(handle)
            if event.layer in open_backward:
                worker.virtual_post_read(open_backward.pop(event.layer))
            handles[index] = worker.virtual_pre_update(layer_tables[event.layer])
            worker.virtual_update(handles[index])
    worker.virtual_clock()
    return handles
