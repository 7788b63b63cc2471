"""PSModule: a torch module whose parameters live in the parameter server,
and :func:`wrap`, which makes one."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, NoReturn

import torch
from torch import nn

from mltuner.client._worker import Worker
from mltuner.exceptions import InvalidArgumentError, OutOfOrderError
from mltuner.torch._amp import ScaledGradients, check_scaler
from mltuner.torch._clock import ClockDriver, tensors_in
from mltuner.torch._layers import DEFAULT_GROUP_BYTES, DEFAULT_WHOLE_MODULES, find_layers

__all__ = ["PSModule", "ClockOptimizer", "wrap"]


class PSModule(nn.Module):
    """A model trained through a parameter-server worker; made by :func:`wrap`.

    Each clock is one ``model(x)`` with gradients enabled, one
    ``loss.backward()`` and one :meth:`step`. The gradients never stay on the
    worker: each layer's update goes to the engine as soon as its gradient
    is final, and the servers apply the update rule of
    :class:`mltuner.Config` (learning rate and momentum per branch), so no
    torch optimizer is involved.

    A forward under ``torch.no_grad()`` (or ``torch.inference_mode()``) is an
    evaluation: it takes no part in the clock and runs on a copy of the
    servers' values after the clocks this worker finished (fetched once per
    clock; it waits until every worker's updates of those clocks are in).

    Between accesses the wrapped module's parameters hold NaN placeholders:
    use :meth:`state_dict` or :meth:`unwrap` to get the trained values.
    ``ps_model.to(...)``, ``load_state_dict`` and the like are refused; set
    up the module before wrapping it.
    """

    def __init__(self, module: nn.Module, driver: ClockDriver, scaled: ScaledGradients | None = None) -> None:
        super().__init__()
        self.module = module
        self._driver = driver
        self._scaled = scaled  # the GradScaler's side, when wrap() got one

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        """The wrapped module's forward: a training forward when gradients
        are enabled, an evaluation otherwise."""
        return self._driver.forward(lambda: self.module(*args, **kwargs))

    def step(self) -> None:
        """Ends the clock, after ``loss.backward()``.

        Raises:
            mltuner.OutOfOrderError: no forward pass, or its backward pass
                has not delivered every layer's gradient yet.
        """
        self._driver.step()

    @property
    def optimizer(self) -> ClockOptimizer:
        """An object with ``step()`` and ``zero_grad()``, for training loops
        written against a torch optimizer."""
        return ClockOptimizer(self)

    @property
    def worker(self) -> Worker:
        return self._driver.worker

    @property
    def clock(self) -> int:
        """The number of clocks this worker finished."""
        return self._driver.clock

    @property
    def device(self) -> torch.device:
        """The device of the model's parameters (and of the engine's buffers)."""
        return self._driver.device

    @property
    def layers(self) -> list[str]:
        """The layers (one table each), by module name, in table order."""
        return [layer.name for layer in self._driver.layers]

    @property
    def accesses(self) -> list[str]:
        """What one clock does, in order, as recorded by wrap(): each layer's
        forward read and its end, the stores and loads of saved activations,
        each layer's backward read and update. The ``update of layer ...``
        entries show the order in which the layers' updates leave during the
        backward pass."""
        return self._driver.accesses

    def state_dict(self, *args: Any, branch: int | None = None,  # type: ignore[override]
                   **kwargs: Any) -> dict[str, Any]:
        """The wrapped module's state dict, with the parameters fetched from
        the servers (as of the clocks this worker finished; waits until every
        worker's updates of those clocks are in), from ``branch`` (default:
        the branch of the last finished clock; a tuning session's final
        branch is ``session.final_branch``). Buffers, such as batch-norm
        running statistics, are this worker's own. The keys are those of the
        original module, so ``plain_model.load_state_dict(ps_model.state_dict())``
        works. The tensors are copies."""
        self._driver.check_usable()
        self._driver.bind_server_values(branch)
        try:
            state = self.module.state_dict(*args, **kwargs)
            return {name: value.detach().clone() if isinstance(value, torch.Tensor) else value
                    for name, value in state.items()}
        finally:
            self._driver.rebind_held()

    def unwrap(self) -> nn.Module:
        """Ends the adapter and returns the original module, its parameters
        holding the servers' values and its hooks removed. Call it between
        clocks; the worker stays up (shut it down separately)."""
        self._driver.close()
        return self.module

    def load_state_dict(self, *args: Any, **kwargs: Any) -> NoReturn:
        raise OutOfOrderError(
            "load_state_dict on a wrapped model: the servers hold the parameters; load the state into the "
            "module before wrap() (worker 0's values become the servers' initial values)"
        )

    def _apply(self, fn: Any, recurse: bool = True) -> NoReturn:
        raise OutOfOrderError(
            "moving or converting a wrapped model (to(), cuda(), float(), ...) is not supported: do it before "
            "wrap(), whose engine buffers are made for the parameters' device and dtype"
        )

    def extra_repr(self) -> str:
        return f"worker={self.worker.rank}, clock={self.clock}, layers={len(self._driver.layers)}"


class ClockOptimizer:
    """Stands in for a torch optimizer in an existing training loop:
    :meth:`step` ends the clock (the servers apply the update rule) and
    :meth:`zero_grad` does nothing, because the adapter hands each gradient
    to the engine and clears it during the backward pass.

    ``scaler.step(optimizer)`` of a ``torch.amp.GradScaler`` passed to
    ``wrap(..., grad_scaler=scaler)`` works as with a torch optimizer, except
    that the clock ends even when the gradients overflowed (mltuner/torch/_amp.py).
    """

    # GradScaler.step calls step() itself, overflow or not: the clock must end.
    _step_supports_amp_scaling = True

    def __init__(self, model: PSModule) -> None:
        self._model = model

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        """What a GradScaler checks for infs: a stand-in for the gradients,
        which have left by then (none without a scaler)."""
        scaled = self._model._scaled
        return scaled.param_groups if scaled is not None else []

    def step(self, closure: Callable[[], Any] | None = None) -> None:
        if closure is not None:
            raise InvalidArgumentError("ClockOptimizer.step takes no closure (one backward pass per clock)")
        if hasattr(self, "found_inf") and self._model._scaled is None:  # set by GradScaler.step
            raise InvalidArgumentError(
                "scaler.step(model.optimizer) with a GradScaler that wrap() was not given: the gradients have "
                "left scaled; pass it as wrap(..., grad_scaler=scaler)"
            )
        self._model.step()

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Nothing to do: gradients are cleared as they are handed over."""


def _default_loss(output: Any) -> torch.Tensor:
    """The sum of every floating output that needs a gradient: only the
    shape of the backward graph matters for the recording, not the values."""
    parts = [t.float().sum() for t in tensors_in(output) if t.requires_grad and t.is_floating_point()]
    if not parts:
        raise InvalidArgumentError(
            "the model's output on example_input needs no gradient: pass example_loss, or check that the "
            "model's parameters take part in its output"
        )
    total = parts[0]
    for part in parts[1:]:
        total = total + part
    return total


def _parameter_device(module: nn.Module) -> torch.device:
    for param in module.parameters():
        return param.device
    return torch.device("cpu")


def wrap(
    module: nn.Module,
    worker: Worker,
    *,
    example_input: Any,
    example_loss: Callable[[Any], torch.Tensor] | None = None,
    slack: int = 0,
    store_activations: bool = False,
    row_width: int = 128,
    whole_modules: Sequence[type[nn.Module]] = DEFAULT_WHOLE_MODULES,
    group_bytes: int = DEFAULT_GROUP_BYTES,
    hold_reads: bool | None = None,
    grad_scaler: torch.amp.GradScaler | None = None,
) -> PSModule:
    """Moves ``module``'s trainable parameters into ``worker``'s parameter
    server and returns the model to train with.

    Runs one forward and backward pass on ``example_input`` to record the
    virtual iteration (the model's buffers and the RNG are restored
    afterwards), creates one table per layer (plus a local table for
    activations), and starts the engine's iterations. A layer is a child
    of the model with at most ``group_bytes`` of parameters (a residual
    block, say), or a module owning parameters directly. Every worker of the
    job calls it, on its own thread or process, with the same architecture:
    it waits for all of them. Worker 0's initial parameter values become the
    servers' values; the other workers' are ignored.

    Example:
        >>> ps_model = mltuner.torch.wrap(Net(), worker, example_input=x0)
        >>> for x, y in batches:
        ...     loss = loss_fn(ps_model(x), y)
        ...     loss.backward()   # each layer's update ships as soon as it is final
        ...     ps_model.step()   # ends the clock

    Args:
        module: an eager model on the device of the worker's engine (CPU, or
            on CUDA worker r's GPU), with float32 trainable parameters.
            Parameters with ``requires_grad=False`` and buffers (batch-norm
            running statistics) stay local to each worker.
        worker: a worker whose virtual iteration has not been recorded (no
            tables yet); the adapter owns its access sequence.
        example_input: a tensor, or a tuple of positional arguments, shaped
            like a training batch (with ``store_activations`` the batch size
            is fixed by it).
        example_loss: maps the output to a scalar for the recording's backward
            pass; by default the sum of all outputs. Pass the real loss if the
            model has outputs the loss does not use.
        slack: staleness of every read: 0 is BSP; s > 0 lets a worker run s
            clocks ahead of the slowest one (SSP).
        store_activations: keep the activations autograd saves for the
            backward pass in the engine's local tables, which the memory
            manager places in host memory when ``Config.device_memory_budget``
            is short, so the model's tensors need not all fit at once. The
            shapes of every clock must then equal the recorded ones.
        row_width: floats per table row; each parameter starts on a fresh
            row, so at most ``row_width - 1`` values per tensor are padding.
        whole_modules: module types read as one layer with all their
            submodules' parameters, because their forward uses those
            parameters without calling the submodules.
        group_bytes: each child of ``module`` whose trainable parameters
            take at most this many bytes is one layer (one table, one read
            and one update per clock); larger children are split into their
            own parameters and their children, recursively. 0: one layer per
            module that owns parameters directly. A group whose submodule
            runs outside the group's forward is split automatically.
        hold_reads: keep each layer's forward read open for its backward
            pass instead of reading the rows again (half the reads, but the
            buffer pool holds every layer's parameters at once). Default:
            hold unless ``store_activations`` (which is for models larger
            than the memory budget); under ``Config.device_memory_budget``
            without ``store_activations``, pass False. Under BSP both give
            the same values; under SSP a held read gives the backward the
            forward's values.
        grad_scaler: the ``torch.amp.GradScaler`` of a float16 autocast
            loop (``scaler.scale(loss).backward(); scaler.step(optimizer);
            scaler.update()`` with ``optimizer = model.optimizer``): each
            layer's gradients are unscaled before its update leaves, and
            zeroed from the clock's first inf or NaN on. bfloat16 autocast
            needs no scaler.

    Raises:
        UnsupportedModelError: a non-float32 or sparse trainable parameter,
            a parameter shared between modules, a compiled, scripted or
            DataParallel module, a module whose parameters get no gradient or
            are used outside its forward.
        mltuner.InvalidArgumentError: a used worker, bad arguments, a model
            on another device than the engine.
        mltuner.ResourceExhaustedError: the memory budget cannot hold the
            access-buffer pool (about the largest layer's working set once
            per clock in flight); the message gives the bytes needed.
    """
    if not isinstance(worker, Worker):
        raise TypeError(f"expected a mltuner.Worker, got {type(worker).__name__}")
    if worker.tables:
        raise InvalidArgumentError(
            f"worker {worker.rank} already has tables ({', '.join(t.name for t in worker.tables)}): wrap() needs "
            "a fresh worker, whose virtual iteration it records"
        )
    if slack < 0:
        raise InvalidArgumentError(f"slack must be >= 0, got {slack}")
    if row_width < 1:
        raise InvalidArgumentError(f"row_width must be >= 1, got {row_width}")
    if group_bytes < 0:
        raise InvalidArgumentError(f"group_bytes must be >= 0, got {group_bytes}")
    hold = not store_activations if hold_reads is None else bool(hold_reads)
    scaler = None if grad_scaler is None else check_scaler(grad_scaler, _parameter_device(module))
    args = example_input if isinstance(example_input, tuple) else (example_input,)
    split: set[str] = set()  # groups whose members run outside the group's forward
    while True:
        layers = find_layers(module, row_width, whole_modules, group_bytes, split)
        driver = ClockDriver(module, layers, worker, slack=slack, store_activations=store_activations,
                             row_width=row_width, hold_reads=hold)
        try:
            driver.record(lambda: module(*args), example_loss or _default_loss)
        except BaseException:
            driver.abandon()
            if driver.misgrouped is None or driver.misgrouped in split:
                raise
            split.add(driver.misgrouped)  # nothing reached the engine yet: record again
            continue
        try:
            driver.plan()
        except BaseException:
            driver.abandon()
            raise
        scaled = None
        if scaler is not None:
            scaled = ScaledGradients(scaler, driver)
            driver.grad_filter = scaled
        return PSModule(module, driver, scaled)
