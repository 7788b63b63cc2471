"""The loss guard. Where layers are read in their own forward, a parameter
holds a NaN placeholder outside its layer's forward, so a loss term
computed from the parameters (an L2 penalty over ``model.parameters()``)
would train on NaN: from the end of a forward pass to step(), and from
step() to the next forward, saved-tensor hooks refuse a saved tensor
that lies in the placeholder."""

from __future__ import annotations

import threading
import weakref

import torch

from mltuner.torch._buffers import is_placeholder, storage_ptr
from mltuner.torch._driver_state import DriverState
from mltuner.torch._errors import UnsupportedModelError

__all__ = ["LossGuard"]


def _weak_guard(driver: LossGuard) -> torch.autograd.graph.saved_tensors_hooks:
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


class LossGuard(DriverState):
    """Sets and ends a clock driver's loss guard (module docstring)."""

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
        if is_placeholder(storage_ptr(tensor)):
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
