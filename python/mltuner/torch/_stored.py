"""Stored activations (``store_activations``): each saved activation is
copied into its rows of a local table in the forward pass and read back in
the backward pass, by the engine's own copy where it can, in one engine
call with the loads recorded after it (a layer's saved tensors) and the
layer's backward read. The tensors the model keeps anyway (buffers, frozen
parameters) are not stored: found here too."""

from __future__ import annotations

import torch

from mltuner.torch._buffers import storage_ptr
from mltuner.torch._clock_checks import ClockChecks
from mltuner.torch._engine_ops import _LOCAL, _POST_LOCAL, EngineOps
from mltuner.torch._recording import Slot
from mltuner.torch._saved import BufferOwners, empty_for, read_back, write_bytes

__all__ = ["StoredActivations"]


_MAX_LOADS_AHEAD = 32  # stored activations read back ahead of their use, in one engine call with the first


class StoredActivations(EngineOps, ClockChecks):
    """Stores and loads a clock driver's saved activations (module
    docstring)."""

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
