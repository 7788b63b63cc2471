"""Autograd's saved tensors outside the light clock (the driver's
``saved_tensors_hooks``). On pack, a view of a layer's parameters becomes a
reference to its rows, and an activation is stored, recomputed or left to
autograd (``_saved.py``); on unpack, a reference resolves to the layer's
held read or its backward read (opened on first use), an activation to its
stored or recomputed tensor. The hooks run once per saved tensor: the
adapter's hot path."""

from __future__ import annotations

import weakref
from typing import Any, NoReturn

import torch

from mltuner.exceptions import OutOfOrderError
from mltuner.torch._buffers import is_placeholder, storage_ptr
from mltuner.torch._driver_state import Phase, _ActRef, _ParamUse
from mltuner.torch._errors import IterationMismatchError, UnsupportedModelError
from mltuner.torch._stored import StoredActivations
from mltuner.torch._trace import ParamRef

__all__ = ["SavedTensorHooks"]


class SavedTensorHooks(StoredActivations):
    """A clock driver's pack and unpack hooks (module docstring)."""

    # -- the forward pass ---------------------------------------------------------------
    def _placeholder_user(self, tensor: torch.Tensor) -> str:
        """For an error: which parameter a tensor pointing at the placeholder
        is, or may be (every unbound one of its size, a transposed view
        included; the placeholder is shared, so its address cannot tell)."""
        unbound = [(name, p) for name, p in self.model.named_parameters() if is_placeholder(storage_ptr(p))]
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
            return _ParamUse(ParamRef.of(layer, tensor), self._serial)
        if is_placeholder(address):
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
            if not self._recording:
                self._acts.note_saved(slot, tensor)
                if layout.recomputed:
                    self._acts.check_recomputed(slot, tensor, self.clock)
            self._next_slot += 1
            if index >= 0:
                self._store(index, slot, tensor)
            ref = None if layout.kept else _ActRef(slot, self._serial)  # None: autograd keeps the tensor itself
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
        self._refuse_create_graph()
        if self._phase is not Phase.BACKWARD:
            raise OutOfOrderError(
                f"autograd needs a saved tensor of the wrapped model outside clock {self.clock}'s backward "
                "pass: backward() can run once per forward pass, before step()"
            )
        if self._cursor == len(self._events) and not self._recording:  # every update has left: nothing to touch
            raise OutOfOrderError(
                f"a second backward pass through one forward pass in clock {self.clock}: backward() can run once "
                "per forward pass (was it called twice, with retain_graph=True? For two losses of one forward, "
                "call torch.autograd.backward([loss1, loss2]) once); call step() after each"
            )
        if packed.serial != self._serial:
            raise self._earlier_graph()
        log = self._acts.store_all if self._recording else None
        if isinstance(packed, _ParamUse):
            ref = packed.ref
            if log is not None:
                log.unpack_param(ref.layer)
            return self._grad_read(ref).as_strided(ref.size, ref.stride, ref.offset)
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
        return ParamRef.of(layer, tensor)

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
