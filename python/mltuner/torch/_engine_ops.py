"""The driver's engine calls: the recorded clock's ops queued and handed
to the engine in as few calls as their order allows (an open goes with the
posts queued before it and returns its buffer), local-table buffers as
torch views made once, and the layers' forward reads opened and held."""

from __future__ import annotations

from typing import Any

import torch

from mltuner.client._worker import OP_KINDS
from mltuner.torch._buffers import as_tensor, buffer_key
from mltuner.torch._driver_state import DriverState
from mltuner.torch._errors import UnsupportedModelError
from mltuner.torch._layers import Layer

__all__ = ["EngineOps"]


# The engine's op numbers for the light clock's batches (Worker._run_ops).
_READ, _POST_READ, _PRE_UPDATE, _UPDATE = (OP_KINDS[k] for k in ("read", "post_read", "pre_update", "update"))
_LOCAL, _POST_LOCAL, _CLOCK = (OP_KINDS[k] for k in ("local_access", "post_local_access", "clock"))
_MAX_LOCAL_VIEWS = 4096  # cached torch views of local-table buffers (one per buffer address and shape)
_OPENS = frozenset((_READ, _PRE_UPDATE, _LOCAL))  # the ops whose engine call returns a buffer


class EngineOps(DriverState):
    """Queues a clock driver's engine ops and opens its reads (module
    docstring)."""

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

    def _queue_read(self, handle: int) -> int:
        """Queues the open of a backward read for the next engine call;
        returns its place among the buffers that call opens."""
        position = sum(op[0] in _OPENS for op in self._queued)
        self._queued.append((_READ, handle))
        return position

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

    # -- reads ----------------------------------------------------------------------------
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

    def _held_read(self, number: int) -> tuple[int, torch.Tensor] | None:
        """Layer ``number``'s held forward read this clock, its event and flat
        buffer (holding, a layer has one: _recording.for_holding); None when
        not holding or not read yet."""
        indices = self._held_by_layer.get(number) if self._hold else None
        return (indices[0], self._held[indices[0]]) if indices else None

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
