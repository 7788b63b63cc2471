"""Mixed precision with a ``torch.amp.GradScaler``: the scale comes off each
layer's gradients before its update leaves the worker.

Plain PyTorch unscales every gradient in ``scaler.step(optimizer)`` and
skips the step when one is inf or NaN. Where the updates ship at step()
(every shard in this process, ``wrap(overlap_updates=False)``), the same
happens here: the gradients sit in ``.grad`` until step(), where the scaler
checks them for infs itself, and ``scaler.step(model.optimizer)`` unscales
every layer's gradients at once and, if one is not finite, the servers
skip the clock's step (``Worker.skip_step``: values and optimizer state
unchanged; its updates are zeros too). A step() of the loop's own, not
through the scaler, unscales nothing, as torch's optimizer would not; after
``scaler.unscale_(model.optimizer)`` (torch's recipe for clipping under
AMP), torch has unscaled them in place, and step() only takes its overflow
(:meth:`ScaledGradients.scaler_step`). Where each layer's update
leaves during ``backward()``, :class:`ScaledGradients` does both per layer:
it unscales with torch's own kernel (the one ``GradScaler.unscale_`` runs),
and from the first non-finite gradient of a clock on the updates it ships
are zeros, so that an overflowing clock adds nothing to the layers not yet
shipped. Layers shipped before the overflow was seen keep their update:
backward runs from the loss down, and the overflow usually shows in the
first layer (the scaled loss gradient is largest there), but not always.

With branches (a tuning session's trials), each branch has its own scaler
state, as each trial of a plain PyTorch search would have its own scaler:
a branch starts from its parent's scale and growth count at the fork, and
the scaler holds a branch's own whenever a clock runs on it (a diverging
trial backing the scale off leaves the others' alone). The states are
copies on the device, switched as a clock on another branch starts: no
host sync.

The zeros come from the engine's copy of the gradients, which reads the
clock's overflow flag on the device (a zeroing kernel per gradient cost
ResNet-18 0.6 ms a clock); gradients torch copies are zeroed in place.

Shipping from the backward pass, the adapter cannot know whether the loss
went through ``scaler.scale()`` before the updates leave, so it unscales
every clock once the scaler has a scale; a clock that then ends with a
step() of the loop's own rather than ``scaler.step()`` gets a warning (its
loss, if not scaled, left divided by the scale).

``scaler.step(model.optimizer)`` then calls the optimizer's ``step()``
whatever the outcome (the clock must end), through GradScaler's contract for
optimizers that handle the scale themselves (``_step_supports_amp_scaling``).
Before that, the scaler checks the gradients of ``optimizer.param_groups``
for infs, to back off the scale in ``scaler.update()``; shipping from the
backward pass the real gradients are gone by then, and ``.grad`` holds
stand-ins (``_shipped.py``) that answer that check with the clock's
overflow flag. No step waits for the GPU: every test stays on the device.
"""

from __future__ import annotations

import warnings
from typing import Any

import torch

from mltuner.exceptions import InvalidArgumentError
from mltuner.torch._clock import ClockDriver

__all__ = ["ScaledGradients", "check_scaler"]

_FREED = -1  # ScaledGradients._branch once the branch it held was freed


def check_scaler(scaler: object, device: torch.device) -> torch.amp.GradScaler:
    """``scaler`` as a GradScaler for ``device``'s type, or the reason not."""
    if not isinstance(scaler, torch.amp.GradScaler):
        raise InvalidArgumentError(f"grad_scaler must be a torch.amp.GradScaler, got {type(scaler).__name__}")
    scaler_device = getattr(scaler, "_device", device.type)
    if scaler_device != device.type:
        raise InvalidArgumentError(
            f"grad_scaler is for {scaler_device!r} but the model is on {device.type!r}: "
            f"create it as torch.amp.GradScaler({device.type!r})"
        )
    return scaler


class ScaledGradients:
    """The driver's :class:`~mltuner.torch._driver_state.GradScale` for a
    model trained with ``scaler`` (module docstring)."""

    def __init__(self, scaler: torch.amp.GradScaler, driver: ClockDriver) -> None:
        self._scaler = scaler
        self._driver = driver
        # 1 once a gradient of the clock was inf or NaN (float32: the engine's
        # copy of the updates and GradScaler's inf check read it as it is).
        self.overflow = torch.zeros(1, dtype=torch.float32, device=driver.device)
        self._clock = -1  # the clock the flag belongs to
        self._unscaled_clock = -1  # the last clock whose gradients unscale() unscaled
        self._warned = False
        # Branches: the branch whose state the scaler holds (None before the
        # first clock; _FREED once that branch was freed), and the others'
        # (scale, growth tracker) copies; None stands for the scaler's
        # initial state (forked before it scaled).
        self._branch: int | None = None
        self._states: dict[int, tuple[torch.Tensor, torch.Tensor] | None] = {}
        driver.worker.add_branch_listener(self.branch_changed)

    def unscale(self, grads: list[torch.Tensor]) -> None:
        """Unscales gradients in place; the overflow flag is set from the
        clock's first non-finite gradient on."""
        self._start_clock()
        scale = self._scale()
        if scale is None:  # disabled, or no loss was scaled yet: nothing to undo
            return
        # As GradScaler.unscale_ computes it: the reciprocal in double precision.
        inv_scale = scale.double().reciprocal().float()
        torch._amp_foreach_non_finite_check_and_unscale_(grads, self.overflow, inv_scale)
        self._unscaled_clock = self._driver.clock

    def zero_on_overflow(self, grads: list[torch.Tensor]) -> None:
        if self._clock != self._driver.clock:  # the flag is an earlier clock's
            return
        overflowed = self.overflow.view(()).bool()  # no host sync: a mask on the device
        for grad in grads:
            grad.masked_fill_(overflowed, 0.0)

    def gate(self) -> int:
        """The overflow flag's address for the engine's copy of this clock's
        updates; 0 where nothing set it this clock (no unscaling)."""
        return self.overflow.data_ptr() if self._clock == self._driver.clock else 0

    def _start_clock(self) -> None:
        if self._driver.clock != self._clock:  # the clock's first layer
            self._clock = self._driver.clock
            self.overflow.zero_()

    def branch_changed(self, branch: int, parent: int | None) -> None:
        """A fork of ``branch`` from ``parent`` takes the parent's state as
        it is now; a freed ``branch`` (``parent`` None) drops its own (the
        id may be forked again)."""
        if parent is None:
            self._states.pop(branch, None)
            if branch == self._branch:
                self._branch = _FREED  # the live state is nobody's now
        elif parent == self._branch or self._branch is None:  # the scaler holds the parent's state
            self._states[branch] = self._live_copy()
            if self._branch is None:  # before the first clock: the parent's, kept for its own clocks
                self._states.setdefault(parent, self._states[branch])
        else:
            self._states[branch] = self._states.get(parent)

    def begin_clock(self) -> None:
        """Before a training clock: the scaler takes the state of the branch
        the clock runs on (``Config.branches``), keeping the last one's."""
        branch = self._driver.worker.next_branch if self._driver.worker.config.branches else None
        if branch is None or branch == self._branch:
            return
        if self._branch is not None and self._branch != _FREED:
            self._states[self._branch] = self._live_copy()
        self._branch = branch
        if branch not in self._states:  # never forked here (the root): it trains on the scaler as it is
            return
        state = self._states[branch]
        scale, tracker = self._live()
        if scale is None or tracker is None:
            return  # nothing scaled yet: the scaler starts from its initial state, as every branch
        if state is None:
            scale.fill_(self._scaler._init_scale)
            tracker.fill_(self._scaler._init_growth_tracker)
        else:
            scale.copy_(state[0])
            tracker.copy_(state[1])

    def _live(self) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        scale, tracker = getattr(self._scaler, "_scale", None), getattr(self._scaler, "_growth_tracker", None)
        return (scale if isinstance(scale, torch.Tensor) else None,
                tracker if isinstance(tracker, torch.Tensor) else None)

    def _live_copy(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        scale, tracker = self._live()
        return None if scale is None or tracker is None else (scale.clone(), tracker.clone())

    def _scale(self) -> torch.Tensor | None:
        if not self._scaler.is_enabled():
            return None
        # The scale tensor itself (made by the first scaler.scale()): reading
        # it with get_scale() would wait for the GPU in every backward pass.
        return self._live()[0]

    def scaler_step(self, found_inf: Any, unscaled: bool) -> None:
        """``scaler.step(model.optimizer)``, before the clock ends. Shipping
        at step(), every gradient is unscaled now, or, after
        ``scaler.unscale_(model.optimizer)`` (``unscaled``: torch's recipe for
        clipping under AMP), torch unscaled them in place and found the
        overflow (``found_inf``), which is taken instead. Shipping from the
        backward pass, each layer was unscaled before it left, and unscale_
        saw only stand-ins."""
        filtered = False
        if not unscaled:
            filtered = self._driver.filter_gradients(self.unscale)
        elif isinstance(found_inf, torch.Tensor):  # else no gradient: step() says what is missing

            def take_overflow(grads: list[torch.Tensor]) -> None:
                self._start_clock()
                self.overflow.copy_(found_inf.reshape(-1)[:1])

            filtered = self._driver.filter_gradients(take_overflow)
        # Nothing of the clock has left yet: an overflow skips the step on the
        # servers, as torch skips optimizer.step(). The engine reads the flag
        # before the first update leaves: no host sync here (reading it here
        # cost a 1-worker float16 ResNet-18 about 4% on an H200).
        if filtered and self._clock == self._driver.clock and self._scale() is not None:  # else nothing unscaled
            self._driver.worker.skip_step(if_set=self.overflow.data_ptr(), stream=self._driver.stream)

    def direct_step(self) -> None:
        """A step() of the loop's own, not ``scaler.step()``: shipping at
        step() nothing is unscaled, as with torch's optimizer. Shipping from
        the backward pass the clock's updates left unscaled already: warns
        once, since a loss that did not go through ``scaler.scale()`` left
        divided by the scale."""
        if self._unscaled_clock != self._driver.clock or self._warned:
            return
        self._warned = True
        warnings.warn(
            "step() without scaler.step(model.optimizer) on a model wrapped with a GradScaler, whose updates leave "
            "during backward(): they were unscaled by the scaler's scale as they left, which is right only if the "
            "loss went through scaler.scale(); end each clock with scaler.step(model.optimizer) and "
            "scaler.update(), or wrap(..., overlap_updates=False) to decide at step()", stacklevel=3)
