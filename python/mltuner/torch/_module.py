"""PSModule: a torch module whose parameters live in the parameter server,
and :func:`wrap`, which makes one."""

from __future__ import annotations

import contextlib
import dataclasses
import os
import sys
import types
import warnings
import weakref
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, NoReturn

import torch
from torch import nn

from mltuner._config import UpdateRule
from mltuner.client._worker import Worker
from mltuner.exceptions import (ArgumentTypeError, InternalError, InvalidArgumentError, MltunerError, OutOfOrderError,
                                ResourceExhaustedError)
from mltuner.launch import _checkpoint
from mltuner.torch._amp import ScaledGradients, check_scaler
from mltuner.torch._buffers import check_same_device
from mltuner.torch._clock import ClockDriver
from mltuner.torch._driver_state import refuse_copy
from mltuner.torch._errors import UnsupportedModelError
from mltuner.torch._inputs import input_layouts, input_shapes, tensors_in
from mltuner.torch._keep import KeepOnDevice, Variant
from mltuner.torch._layers import DEFAULT_GROUP_BYTES, DEFAULT_WHOLE_MODULES, Layer, check_module_types, find_layers
from mltuner.torch._optim import (LearningRates, check_optimizer, groups_of_layers, guard_parameters,
                                  release_parameters, rule_for_group)
from mltuner.torch._recompute import (LINK_BOUND_BYTES_PER_OP, LINK_BOUND_FLOPS_PER_BYTE, RECOMPUTE_CHOICES, Recompute,
                                      link_bound)
from mltuner.torch._recording import Tables
from mltuner.torch._resume import Resumed, SavedModelState, attachments, read_saved, set_group_settings
from mltuner.torch._shipping import choose_overlap

__all__ = ["PSModule", "ClockOptimizer", "wrap"]


class PSModule(nn.Module):
    """A model trained through a parameter-server worker; made by :func:`wrap`.

    Each clock is one ``model(x)`` with gradients enabled, one
    ``loss.backward()`` and one :meth:`step`. The gradients never stay on the
    worker: all layers' updates go to the engine at :meth:`step` (or, on a
    GPU with a shard in another process, each layer's as its gradient is
    final; see ``wrap(overlap_updates=)``), and the servers apply the
    update rule: the one of the torch optimizer given to :func:`wrap` (SGD,
    Adam, AdamW, per param group), or :class:`mltuner.Config`'s. No torch optimizer step runs on the worker;
    :attr:`optimizer` stands in for one, with the optimizer's param groups.

    A forward under ``torch.no_grad()`` (or ``torch.inference_mode()``) is an
    evaluation: it takes no part in the clock and runs on a copy of the
    servers' values after the clocks this worker finished (fetched once per
    clock; it waits until every worker's updates of those clocks are in).

    Between accesses the wrapped module's parameters hold NaN placeholders:
    use :meth:`state_dict` or :meth:`unwrap` to get the trained values.
    ``ps_model.to(...)``, ``load_state_dict`` and the like are refused; set
    up the module before wrapping it. Between clocks the module's own methods
    that call its forward without gradients (Hugging Face's ``generate()``)
    and its own ``state_dict()`` run on the servers' values; other public
    attributes of the module are reached through the wrapped model too
    (``ps_model.generate(...)``, ``ps_model.config``), as through
    ``torch.compile``'s.
    """

    def __init__(self, module: nn.Module, driver: ClockDriver, groups: list[dict[str, Any]],
                 scaled: ScaledGradients | None = None, source: torch.optim.Optimizer | None = None,
                 resumed: Resumed | None = None) -> None:
        super().__init__()
        self.module = module
        self._driver = driver
        self._resumed = resumed
        self._scaled = scaled  # the GradScaler's side, when wrap() got one
        self._optimizer = ClockOptimizer(self, groups, source)
        self._optimizer.take_over_source()
        guard_parameters(driver.layers)

    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)
        except AttributeError:
            # Not a name of this class (a property that failed inside says
            # so itself), nor a private one, nor before __init__ made it.
            module = self.__dict__.get("_modules", {}).get("module")
            if name.startswith("_") or module is None or hasattr(type(self), name):
                raise
            return getattr(module, name)  # the module's own methods and settings

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        """The wrapped module's forward: a training forward when gradients
        are enabled, an evaluation otherwise."""
        if _under_torch_compile():
            raise UnsupportedModelError(_COMPILED_CALL)  # before anything of a clock: the model goes on
        return self._driver.forward(lambda: self.module(*args, **kwargs), (args, kwargs))

    def compile(self, *args: Any, **kwargs: Any) -> NoReturn:
        """Refused (:data:`_COMPILED_CALL`): compile submodules instead."""
        raise UnsupportedModelError(_COMPILED_CALL)

    def zero_grad(self, set_to_none: bool = True) -> None:
        """As ``model.optimizer.zero_grad()``: where updates ship at step()
        and none has left, drops the gradients of the passes since the last
        step(), as torch's would; elsewhere gradients are cleared as they are
        handed over (their stand-ins stay until step())."""
        self._driver.zero_grad(set_to_none)

    def step(self) -> None:
        """Ends the clock, after ``loss.backward()``.

        Raises:
            mltuner.OutOfOrderError: no forward pass, or its backward pass
                has not delivered every layer's gradient yet.
        """
        if self._scaled is not None:
            self._scaled.direct_step()
        self._driver.step()

    def no_sync(self) -> contextlib.AbstractContextManager[None]:
        """DDP's ``no_sync``: the forward and backward passes run inside
        leave their gradients in ``.grad``, to add up with the next ones
        (gradient accumulation). The first pass outside ships the sums as
        usual, or ``step()`` does when every pass ran inside. Where updates
        ship at ``step()`` (the default but for GPUs across processes)
        gradients add up without it, and it changes nothing.

        Raises:
            mltuner.OutOfOrderError: reads are not held or activations are
                stored (``store_activations``, a device budget), where a
                clock takes one forward pass.
        """
        return self._driver.no_sync()

    @property
    def optimizer(self) -> ClockOptimizer:
        """The torch optimizer of the training loop: ``step()`` ends the
        clock, and its ``param_groups`` are those of the optimizer given to
        :func:`wrap` (the same dicts), so a changed ``"lr"`` and
        ``torch.optim.lr_scheduler`` schedulers reach the servers at the
        next clock. One object for the model's life."""
        return self._optimizer

    @property
    def worker(self) -> Worker:
        return self._driver.worker

    @property
    def clock(self) -> int:
        """The number of clocks this worker finished with this model (from
        0 after a resume too; ``resumed.clock`` counts those before)."""
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
    def hold_reads(self) -> bool:
        """Whether each layer's forward read is held through the backward
        pass (True) or posted after the layer's forward and read again for
        the backward pass (False, GeePS's pattern): as given to
        :func:`wrap`, or chosen by it (see :attr:`plan`)."""
        return self._driver.hold_reads

    @property
    def overlap_updates(self) -> bool:
        """Whether each layer's update ships from the backward pass (True)
        or all of them at :meth:`step` (False): as given to :func:`wrap`, or
        chosen by it (see :attr:`plan`). Only a clock with held reads and no
        stored activations ships at step(); otherwise the backward pass
        ships each layer's update whatever this says."""
        return self._driver.overlap_updates

    @property
    def plan(self) -> str:
        """The engine's plan in words: which access pattern :func:`wrap`
        chose and why (``hold_reads=False (the device_memory_budget of ...
        bytes is below the ... bytes of access-buffer pool that held reads
        need; ...)``) and when updates ship (``overlap_updates=False (a CPU
        worker: ...)``), then the placement: the access-buffer pool, the
        device and host stores, and the host memory the plan needs, part by
        part; how many layers' parameters and stored activations went to the
        device and to host memory; and the bytes the plan predicts it moves
        per clock each way (:attr:`mltuner.Worker.plan`). With
        ``store_activations`` the access pattern is followed by how many
        saved activations are stored and how many recomputed
        (``saved activations: 63 stored (358080 B per clock), 16 recomputed
        in the backward pass from stored ones (245760 B not stored)``; each
        one in :attr:`saved_activations`)."""
        summary = self._driver.recompute_summary
        return (f"{self._driver.hold_choice}; {self._driver.overlap_choice}; "
                f"{summary + '; ' if summary else ''}{self.worker.plan}")

    @property
    def saved_activations(self) -> list[str]:
        """With ``store_activations``: each tensor autograd saves in a clock
        (other than parameters and buffers), in the order the forward saves
        them, and what becomes of it: ``#3 (16, 64) torch.float32: stored``
        (in the local table: the plan places it on the device or in host
        memory), or ``#4 (16, 64) torch.float32: recomputed from #1 and
        parameters by native_batch_norm, relu`` (the aten ops the backward
        pass runs again, from the stored activations named). Empty without
        ``store_activations``."""
        return self._driver.saved_activations

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
        after a tuning session ended, its final branch, ``session.final_branch``;
        else the branch of the last finished clock). Buffers, such as batch-norm
        running statistics, are this worker's own. The keys are those of the
        original module, so ``plain_model.load_state_dict(ps_model.state_dict())``
        works. The tensors are copies."""
        self._driver.check_usable(recover=True)
        self._driver.bind_server_values(branch)
        self._driver._own_state_dict = True  # the module's hooks leave the branch bound
        try:
            state = self.module.state_dict(*args, **kwargs)
            return {name: value.detach().clone() if isinstance(value, torch.Tensor) else value
                    for name, value in state.items()}
        finally:
            self._driver._own_state_dict = False
            self._driver.rebind_held()

    @property
    def resumed(self) -> Resumed | None:
        """Where ``wrap(..., resume_from=...)`` started this model: the
        checkpoint's ``path``, its ``clock`` (clocks trained before it was
        saved) and the ``user_state`` given to :meth:`save_checkpoint`;
        None for a model that started from its module's values."""
        return self._resumed

    def save_checkpoint(self, root: str | os.PathLike[str], *, keep: int = 2, user_state: Any = None) -> Path:
        """Saves what resuming the training needs, between clocks, on every
        rank at the same clock: the servers' parameters and optimizer state
        (momentum buffers, Adam's moments and step count; sharded as the
        servers hold them, ``Job.save_checkpoint``), and from rank 0 the
        module's buffers (batch-norm statistics), frozen parameters and
        extra state, the optimizer's param groups (a scheduler's ``lr``) and
        ``user_state``: JSON values of the loop's own (its epoch, a
        scheduler's ``state_dict()``). ``root/clock-NNNNNNNN`` appears
        atomically, ``root/latest`` names the newest, and the newest
        ``keep`` are kept. ``wrap(..., resume_from=root)`` resumes from it,
        on as many processes as before or not. Returns its directory.

        Raises:
            mltuner.OutOfOrderError: in the middle of a clock, or before the
                first clock ends.
            mltuner.InvalidArgumentError: the worker is not a Job's, or
                ``user_state`` or a module's extra state is not JSON values.
        """
        checkpoints = self.worker.checkpoints
        if checkpoints is None:
            raise InvalidArgumentError("save_checkpoint needs the worker of a mltuner.Job (job.worker): a "
                                       "LocalCluster's workers have no checkpoints")
        self._driver.check_between_clocks("save_checkpoint()")
        files = {} if self.worker.rank != 0 else attachments(self.module, self._driver.layers,
                                                             self._optimizer.param_groups,
                                                             self._optimizer.source_name, user_state)
        return checkpoints.save_checkpoint(root, keep=keep, attachments=files)

    def unwrap(self) -> nn.Module:
        """Ends the adapter and returns the original module, its parameters
        holding the servers' values and its hooks removed. Call it between
        clocks; the worker stays up (shut it down separately)."""
        self._driver.close()
        self._optimizer.give_back_source(warn_on_step=self._driver.rule_has_state())
        release_parameters(self._driver.layers)
        return self.module

    def load_state_dict(self, *args: Any, **kwargs: Any) -> NoReturn:
        """Refused: the servers hold the parameters. Load the state into the
        module before :func:`wrap`, or resume with ``wrap(...,
        resume_from=...)``.

        Raises:
            mltuner.OutOfOrderError: always.
        """
        raise OutOfOrderError(
            "load_state_dict on a wrapped model: the servers hold the parameters; load the state into the "
            "module before wrap() (worker 0's values become the servers' initial values)"
        )

    def __deepcopy__(self, memo: dict[int, Any]) -> NoReturn:
        refuse_copy("deepcopy")

    def __reduce_ex__(self, protocol: Any) -> NoReturn:
        refuse_copy("pickle")

    def _apply(self, fn: Any, recurse: bool = True) -> NoReturn:
        raise OutOfOrderError(
            "moving or converting a wrapped model (to(), cuda(), float(), ...) is not supported: do it before "
            "wrap(), whose engine buffers are made for the parameters' device and dtype"
        )

    def extra_repr(self) -> str:
        return (f"worker={self.worker.rank}, clock={self.clock}, layers={len(self._driver.layers)}, "
                f"hold_reads={self.hold_reads}")


# The original optimizer's instance attributes take_over_source() sets.
_COMPILED_CALL = (
    "the wrapped model cannot run under torch.compile (torch.compile(model), model.compile(), or a compiled "
    "function that calls it): its forward opens and posts engine accesses and binds parameters to engine buffers, "
    "which dynamo cannot trace. Compile the parts instead after wrap(), e.g. model.module.encoder.compile() or "
    "model.module.encoder = torch.compile(model.module.encoder) (held reads, the default without "
    "store_activations), or the loss function; the model's own call stays eager")


def _under_torch_compile() -> bool:
    """Whether this call runs inside torch.compile: dynamo's frame callback
    is set (the wrapped model's frames run eagerly, as a library's, while
    its submodules' frames would be traced)."""
    return "torch._dynamo" in sys.modules and torch._C._dynamo.eval_frame.get_eval_frame_callback() not in (None, False)


_TAKEN_OVER = ("step", "zero_grad", "_step_supports_amp_scaling", "state_dict", "load_state_dict",
               "add_param_group")


def _old_stand_in_group(group: Any) -> bool:
    """Whether a saved param group is the one a GradScaler added to
    ``model.optimizer`` before stop 66: one tensor, at rate 0, nothing else."""
    return isinstance(group, dict) and len(group.get("params", ())) == 1 and set(group) == {"params", "lr"} \
        and group["lr"] == 0.0


class ClockOptimizer(torch.optim.Optimizer):
    """Stands in for the torch optimizer in a training loop: :meth:`step`
    ends the clock (the servers apply the update rule) and :meth:`zero_grad`
    does nothing, because the adapter hands each gradient to the engine and
    clears it during the backward pass.

    ``param_groups`` are the param-group dicts of the optimizer given to
    ``wrap(..., optimizer=...)`` (without one: a single group whose ``"lr"``
    is ``Config.update_rule``'s). Write ``param_groups[i]["lr"]``, or attach
    a ``torch.optim.lr_scheduler`` to this object or to the original
    optimizer: the next clock's updates carry the new rate to the servers.
    The groups' other settings are the servers' rule and cannot change; new
    groups cannot be added.

    Until :meth:`PSModule.unwrap`, the original optimizer's own ``step()``
    ends the clock too, and its ``zero_grad()``, ``state_dict()``,
    ``load_state_dict()`` and ``add_param_group()`` are this object's
    (:meth:`take_over_source`).

    ``scaler.step(model.optimizer)`` of a ``torch.amp.GradScaler`` passed to
    ``wrap(..., grad_scaler=scaler)`` works as with a torch optimizer, after
    ``scaler.unscale_(model.optimizer)`` too, except that the clock ends even
    when the gradients overflowed: the servers skip the step where the
    updates ship at step(), else the update is zero (mltuner/torch/_amp.py).
    """

    # GradScaler.step calls step() itself, overflow or not: the clock must end.
    _step_supports_amp_scaling = True
    # The step that ends a clock, which _optim's guard against torch steps on
    # wrapped parameters lets through.
    _steps_a_clock = True

    def __init__(self, model: PSModule, groups: list[dict[str, Any]],
                 source: torch.optim.Optimizer | None = None) -> None:
        # torch's constructor sets up hooks and state; its one group is a
        # placeholder, replaced by the shared groups below.
        super().__init__([torch.zeros(1)], {"lr": 0.0})
        self._model = model
        self._groups = groups
        self._source = source
        self._warned_stateless = False  # state_dict() said it lacks the servers' state
        # The source's own instance attributes take_over_source() replaced.
        self._saved_source_attrs: dict[str, Any] = {}
        self.defaults = {key: value for key, value in groups[0].items() if key != "params"} if groups else {}

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        return self._groups if hasattr(self, "_groups") else self._init_groups

    @param_groups.setter
    def param_groups(self, groups: list[dict[str, Any]]) -> None:
        self._init_groups = groups  # torch.optim.Optimizer.__init__'s own list

    @property
    def source_name(self) -> str | None:
        """The class name of the optimizer given to wrap(), None without one."""
        return type(self._source).__name__ if self._source is not None else None

    def state_dict(self) -> dict[str, Any]:
        """torch's format, with the param groups' settings and no
        per-parameter state: the servers keep the momentum buffers and Adam's
        moments (``model.save_checkpoint()`` saves them, ``wrap(...,
        resume_from=)`` restores them). Warns once where the rule keeps such
        state, which a checkpoint of this dict alone would lose."""
        self._warn_stateless()
        return super().state_dict()

    def _warn_stateless(self) -> None:
        """For a state_dict() call (this one's or the original
        optimizer's): warns once where the rule keeps state that the dict
        lacks."""
        if not self._warned_stateless and self._model._driver.rule_has_state():
            self._warned_stateless = True
            warnings.warn("the wrapped model's optimizer.state_dict() holds the param groups but not the servers' "
                          "optimizer state (momentum buffers, Adam's moments): save model.save_checkpoint() to "
                          "resume with them", stacklevel=3)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Sets the param groups' settings (a schedule's ``lr``), as torch
        does; a state dict with per-parameter state (momentum buffers, Adam's
        moments) is refused, since the servers hold that state: resume with
        ``wrap(..., resume_from=...)``.

        Raises:
            mltuner.OutOfOrderError: ``state_dict`` has per-parameter state.
            mltuner.InvalidArgumentError: its param groups do not match.
        """
        if not isinstance(state_dict, dict) or not isinstance(state_dict.get("param_groups"), list):
            raise InvalidArgumentError("load_state_dict: expected an optimizer state dict (with 'param_groups')")
        if state_dict.get("state"):
            raise OutOfOrderError(
                "load_state_dict with per-parameter optimizer state (momentum buffers, Adam's moments) on a "
                "wrapped model's optimizer: the servers hold that state. Resume from model.save_checkpoint() "
                "with wrap(..., resume_from=...)")
        saved = state_dict["param_groups"]
        if len(saved) == len(self._groups) + 1 and _old_stand_in_group(saved[-1]):
            saved = saved[:-1]  # saved by an mltuner whose GradScaler had a group of its own
        sizes = [len(group.get("params", ())) if isinstance(group, dict) else -1 for group in saved]
        if sizes != [len(group["params"]) for group in self._groups]:
            raise InvalidArgumentError(f"load_state_dict: param groups of {sizes} parameters, the optimizer has "
                                       f"{[len(group['params']) for group in self._groups]}")
        if self._model._driver.check_loaded_groups is not None:
            self._model._driver.check_loaded_groups(saved)
        set_group_settings(self._groups, saved)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Refused: :func:`wrap` makes the tables and their rules, so give it
        an optimizer with every group.

        Raises:
            mltuner.InvalidArgumentError: always (after construction).
        """
        if not hasattr(self, "_groups"):  # torch.optim.Optimizer.__init__
            super().add_param_group(param_group)
            return
        raise InvalidArgumentError("add_param_group on a wrapped model's optimizer: the tables and their rules are "
                                   "made by wrap(); give wrap() an optimizer with every group (a parameter outside "
                                   "the model, as a learnable loss weight, may have a torch optimizer of its own)")

    def step(self, closure: Callable[[], Any] | None = None) -> None:  # type: ignore[override]
        """Ends the clock (:meth:`PSModule.step`); under a ``GradScaler``
        given to :func:`wrap`, called by ``scaler.step(model.optimizer)``.

        Raises:
            mltuner.InvalidArgumentError: a ``closure`` (one backward pass per
                clock), or ``scaler.step`` of a scaler :func:`wrap` was not
                given.
            mltuner.OutOfOrderError: as :meth:`PSModule.step`.
        """
        if closure is not None:
            raise InvalidArgumentError("ClockOptimizer.step takes no closure (one backward pass per clock)")
        if hasattr(self, "found_inf") and self._model._scaled is None:  # set by GradScaler.step
            raise InvalidArgumentError(
                "scaler.step(model.optimizer) with a GradScaler that wrap() was not given: the gradients have "
                "left scaled; pass it as wrap(..., grad_scaler=scaler)"
            )
        scaled = self._model._scaled
        try:
            if scaled is not None and hasattr(self, "found_inf"):
                # GradScaler.step passes grad_scale=None after scaler.unscale_(): the
                # gradients were unscaled there, and must not be again.
                scaled.scaler_step(self.found_inf, unscaled=getattr(self, "grad_scale", 0) is None)
                self._model._driver.step()
            else:
                self._model.step()
        except BaseException:
            # GradScaler.step deletes them only after a step that returns: a
            # later step() of the loop's own must not take this one's.
            for name in ("found_inf", "grad_scale"):
                self.__dict__.pop(name, None)
            raise
        if self._source is not None:
            # What a scheduler built on the original optimizer checks to see
            # that a step came before its own (torch's LRScheduler marks
            # this in the wrapper it puts around the optimizer's step).
            self._source._opt_called = True  # type: ignore[attr-defined]

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Gradients are cleared as they are handed over; where updates ship
        at step(), those of the passes since the last step() are dropped, as
        torch's zero_grad drops them."""
        self._model._driver.zero_grad(set_to_none)

    def take_over_source(self) -> None:
        """Makes the original optimizer this one until unwrap(): its
        ``step()`` ends the clock, so that a converted loop may keep calling
        it (its own step would run a torch update on the parameters the
        engine lent for the clock, or on nothing, beside the servers'), and
        its ``zero_grad()``, ``state_dict()``, ``load_state_dict()`` and
        ``add_param_group()`` are this one's: torch's load would replace the param-group dicts
        whose rates reach the servers, its add_param_group would add a group
        that no table holds, and its state_dict would leave out the servers'
        state without a word. Instance attributes, bound like methods, so
        that a scheduler made later can wrap step() as usual; the optimizer
        holds the wrapped model weakly."""
        source = self._source
        if source is None:
            return
        self._saved_source_attrs = {name: source.__dict__[name] for name in _TAKEN_OVER if name in source.__dict__}
        for name, method in _source_methods(weakref.ref(self)).items():
            setattr(source, name, types.MethodType(method, source))
        # GradScaler.step then calls step() whatever the overflow, so that
        # the error of its step says what to do instead of a clock left open.
        source._step_supports_amp_scaling = True  # type: ignore[attr-defined]

    def give_back_source(self, warn_on_step: bool) -> None:
        """unwrap(): the original optimizer steps on its own again; with
        ``warn_on_step`` its first step warns that the servers' optimizer
        state (momentum, Adam's moments) did not come with it."""
        source = self._source
        if source is None:
            return
        for name in _TAKEN_OVER:
            source.__dict__.pop(name, None)
        source.__dict__.update(self._saved_source_attrs)
        if not warn_on_step:
            return

        def warn_once(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
            handle.remove()
            warnings.warn(
                f"the {type(optimizer).__name__} given back by unwrap() steps without the servers' optimizer state "
                "(momentum buffers, Adam's moments): it starts them afresh, as a new optimizer would. "
                "model.save_checkpoint() before unwrap() keeps them, for wrap(..., resume_from=...)", stacklevel=3)

        handle = source.register_step_pre_hook(warn_once)


def _source_methods(me: weakref.ref[ClockOptimizer]) -> dict[str, Callable[..., Any]]:
    """The methods :meth:`ClockOptimizer.take_over_source` gives the
    original optimizer: each one calls the wrapped model's optimizer
    (``me``, held weakly)."""

    def clock_optimizer() -> ClockOptimizer:
        found = me()
        if found is None:
            raise OutOfOrderError("the model this optimizer was given to wrap() with is gone")
        return found

    def step(optimizer: torch.optim.Optimizer, closure: Callable[[], Any] | None = None) -> None:
        found = clock_optimizer()
        if hasattr(optimizer, "found_inf"):  # set by GradScaler.step: its inf check read only these groups
            for name in ("found_inf", "grad_scale"):  # GradScaler removes them only after a step that returns
                optimizer.__dict__.pop(name, None)
            raise InvalidArgumentError(
                "scaler.step() on the optimizer given to wrap(): with a wrapped model, call "
                "scaler.step(model.optimizer), whose step ends the clock whether or not it overflowed"
                + ("" if found._model._scaled is not None else ", and pass the scaler as wrap(..., grad_scaler=scaler)")
            )
        found.step(closure)

    def state_dict(optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        clock_optimizer()._warn_stateless()
        # torch's, of the optimizer's own groups; its per-parameter state is
        # empty, as check_optimizer found it.
        return torch.optim.Optimizer.state_dict(optimizer)

    def load_state_dict(optimizer: torch.optim.Optimizer, state_dict: dict[str, Any]) -> None:
        clock_optimizer().load_state_dict(state_dict)

    def add_param_group(optimizer: torch.optim.Optimizer, param_group: dict[str, Any]) -> None:
        clock_optimizer().add_param_group(param_group)

    def zero_grad(optimizer: torch.optim.Optimizer, set_to_none: bool = True) -> None:
        clock_optimizer().zero_grad(set_to_none)

    # What torch's LRScheduler puts on a step it wraps: a scheduler made
    # before wrap() then does not warn that step() was replaced (step()
    # marks _opt_called itself), and one made after leaves it as it is.
    step._wrapped_by_lr_sched = True  # type: ignore[attr-defined]
    return {"step": step, "zero_grad": zero_grad, "state_dict": state_dict, "load_state_dict": load_state_dict,
            "add_param_group": add_param_group}


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


def _assign_rules(layers: list[Layer], optimizer: torch.optim.Optimizer | None, config_rule: UpdateRule,
                  split: set[str], by_group: set[str]) -> list[list[int]] | None:
    """Gives each layer the rule of its parameters' param group and returns,
    per layer, the groups it holds (one). None after adding to ``split`` a
    grouped layer that spans several param groups, or to ``by_group`` a
    module whose own parameters are in several groups (find the layers
    again: one table per module, then per group). By the groups alone, not
    their settings: a rate that differs now may be equal at a checkpoint,
    and the tables must be the same at its resume. Without an optimizer
    every layer is in the one group of ``Config.update_rule``; its ``add``
    (Config's default, which adds what applications send as deltas) becomes
    plain SGD at its rate, since the adapter sends gradients: added, they
    made the model climb its loss."""
    if optimizer is None:
        if config_rule.kind == "add":
            for layer in layers:
                layer.update_rule = UpdateRule("sgd", learning_rate=config_rule.learning_rate)
        return [[0] for _ in layers]
    per_layer = groups_of_layers(optimizer, layers)
    for layer, groups in zip(layers, per_layer):
        if len(groups) > 1 and len(layer.members) > 1 and layer.name not in split:
            split.add(layer.name)  # one table per module where the modules allow it
            return None
        if len(groups) > 1:
            if layer.name in by_group:
                raise InternalError(f"layer {layer.name!r} spans param groups {groups} after its split")
            by_group.add(layer.name)  # a Linear's weight decayed and its bias not: a table each
            return None
        layer.update_rule = rule_for_group(optimizer, groups[0])
    return per_layer


def _param_groups(optimizer: torch.optim.Optimizer | None, layers: list[Layer],
                  rule: UpdateRule | None) -> list[dict[str, Any]]:
    """The param groups ``model.optimizer`` shows: the optimizer's own dicts,
    or one group over every trainable parameter with the Config rule's rate."""
    if optimizer is not None:
        return list(optimizer.param_groups)
    params = [slot.param for layer in layers for slot in layer.params]
    group: dict[str, Any] = {"params": params, "lr": float(rule.learning_rate) if rule is not None else 0.0}
    if rule is not None and rule.kind in ("sgd", "damped_momentum"):
        group["momentum"] = float(rule.momentum or 0.0)  # shown, as torch's SGD has it; fixed (_optim)
    elif rule is not None and rule.kind in ("adam", "adamw"):
        group["betas"] = (rule.beta1, rule.beta2)
    return [group]


def _give_tables_back(worker: Worker) -> None:
    """After a failed wrap(): drops the recording and the tables it made,
    unless the plan was committed (then the worker is spent)."""
    try:
        worker.reset_virtual_iteration()
        if worker.tables:
            worker.drop_tables(worker.tables[0])
    except MltunerError:
        pass  # finished, or shut down: nothing to give back


# wrap(group_bytes=None) under a budget: groups are made 4x smaller down to
# this size, then 0 (one layer per module).
_SMALLEST_GROUP_BYTES = 1 << 20


def _smaller_groups(module: nn.Module, row_width: int, whole_modules: Sequence[type[nn.Module]], group_bytes: int,
                    split: set[str], layer_count: int, by_group: set[str], group_of: dict[int, int] | None
                    ) -> int | None:
    """The largest of group_bytes / 4, / 16, ... (0 last) that reads the
    model as more layers than ``layer_count``; None when none does."""
    while group_bytes > 0:
        group_bytes = group_bytes // 4 if group_bytes > _SMALLEST_GROUP_BYTES else 0
        if len(find_layers(module, row_width, whole_modules, group_bytes, split, by_group, group_of)) > layer_count:
            return group_bytes
    return None


def _recompute_choice(recompute: object, store_activations: bool, worker: Worker) -> str:
    """What to recompute (``wrap(recompute=)``, "auto" resolved): "cheap",
    "compute" or "none"."""
    if recompute not in RECOMPUTE_CHOICES:
        raise InvalidArgumentError(
            f"recompute must be one of {', '.join(repr(c) for c in RECOMPUTE_CHOICES)}, got {recompute!r}"
        )
    if recompute in ("cheap", "compute") and not store_activations:
        raise InvalidArgumentError(
            f"recompute={recompute!r} needs store_activations=True: it decides which saved activations the "
            "engine's local table stores and which the backward pass makes again; without store_activations "
            "torch keeps every saved tensor itself"
        )
    if recompute == "auto":
        return "cheap" if store_activations and worker.config.device_memory_budget > 0 else "none"
    return str(recompute)


def _record_again(driver: ClockDriver, planned: str, link_bytes: dict[str, int]) -> tuple[str, str]:
    """``recompute="auto"``, after a plan with ``planned`` ("cheap" or
    "compute"; ``link_bytes``: what each plan made so far moves over the
    busier direction of the host link a clock): the choice to record the
    clock again with, and why; ("", why) to keep this plan. "compute" where
    the link bounds the "cheap" plan (``_recompute.link_bound``), then
    "cheap" again unless "compute" moves fewer bytes. "none" (store every
    activation) where the link would not bound the clock even with the
    activations "cheap" recomputes stored too: recomputing costs the host
    time per op, which is then what bounds the clock (on a device with a
    link model, a GPU)."""
    cheap = link_bytes["cheap"]
    if planned == "cheap" and "compute" not in link_bytes and cheap > 0:
        flops, ops = work = driver.forward_work
        moved = (f"its first plan moves {cheap} B a clock over the busier direction of the host link, "
                 f"{3 * flops // cheap} flops of a step per byte and {cheap // max(1, ops)} B per op of the forward")
        bound = LINK_BOUND_FLOPS_PER_BYTE.get(driver.device.type, 0)
        limits = (f" (the link bounds the clock below {bound} flops per byte and above {LINK_BOUND_BYTES_PER_OP} B "
                  "per op)")
        if link_bound(driver.device, work, cheap):
            return "compute", f"recompute='auto' chose 'compute': {moved}{limits}"
        # Stored too, the recomputed activations cross the link at most once each way.
        every = cheap + driver.recomputed_bytes
        if bound and every > cheap and not link_bound(driver.device, work, every):
            return "none", (f"recompute='auto' stores every activation: {moved}, and storing the "
                            f"{driver.recomputed_bytes} B it recomputes too moves at most {every} B, "
                            f"{3 * flops // every} flops per byte and {every // max(1, ops)} B per op, which the link "
                            f"does not bound either{limits}; recomputing would cost the host time per op")
        return "", f"recompute='auto' kept its first plan: {moved}{limits if bound else ''}"
    if planned == "compute" and link_bytes["compute"] >= cheap:
        return "cheap", (f"recompute='auto' went back to 'cheap': 'compute' moves {link_bytes['compute']} B a clock "
                         f"over the host link, not fewer than {cheap} B")
    return "", ""


def _saved_state(path: str | os.PathLike[str], module: nn.Module, worker: Worker,
                 optimizer: torch.optim.Optimizer | None) -> SavedModelState:
    """wrap(resume_from=): the checkpoint's model state, checked against the
    module; its param groups' settings are loaded into ``optimizer`` (as
    torch's ``load_state_dict`` does) before they become the servers' rules."""
    if worker.checkpoints is None:
        raise InvalidArgumentError("resume_from needs the worker of a mltuner.Job (job.worker): a LocalCluster's "
                                   "workers have no checkpoints")
    if not isinstance(module, nn.Module):
        raise TypeError(f"expected a torch.nn.Module, got {type(module).__name__}")
    saved = read_saved(path, module, type(optimizer).__name__ if optimizer is not None else None,
                       len(optimizer.param_groups) if optimizer is not None else 1,
                       rank=worker.rank, agree=worker.checkpoints.allgather)
    if optimizer is not None:
        set_group_settings(optimizer.param_groups, saved.groups)
    return saved


def _restorer(worker: Worker, saved: SavedModelState, resumed: list[Resumed],
              sources: _checkpoint.Sources | None) -> Callable[[], None]:
    """What commit_plan calls instead of writing the initial values: the
    checkpoint's values and optimizer state into every shard (from
    ``sources`` in its tables, where they differ from this model's)."""
    checkpoints = worker.checkpoints
    assert checkpoints is not None

    def restore() -> None:
        clock = checkpoints.restore_checkpoint(saved.path, sources=sources)
        resumed.append(Resumed(saved.path, clock, saved.user_state, {"state": {}, "param_groups": saved.groups}))

    return restore


def _parameter_device(module: nn.Module) -> torch.device:
    for param in module.parameters():
        return param.device
    return torch.device("cpu")


def wrap(
    module: nn.Module,
    worker: Worker,
    *,
    example_input: Any,
    example_kwargs: dict[str, Any] | None = None,
    example_loss: Callable[[Any], torch.Tensor] | None = None,
    slack: int = 0,
    store_activations: bool = False,
    row_width: int = 128,
    whole_modules: Sequence[type[nn.Module]] = DEFAULT_WHOLE_MODULES,
    group_bytes: int | None = None,
    hold_reads: bool | None = None,
    overlap_updates: bool | None = None,
    grad_scaler: torch.amp.GradScaler | None = None,
    optimizer: torch.optim.Optimizer | None = None,
    recompute: Recompute = "auto",
    resume_from: str | os.PathLike[str] | None = None,
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

    The update rule is the one of ``optimizer``, a ``torch.optim.SGD``,
    ``Adam`` or ``AdamW`` made from ``module.parameters()`` (or param
    groups): its class and each group's settings become the servers' rule
    of each table, with torch's formulas, and ``model.optimizer`` keeps its
    param groups, whose ``"lr"`` may change between clocks (schedulers).
    Without ``optimizer``, every table takes ``Config.update_rule`` (its
    default ``add`` as plain SGD at 0.01: the adapter sends gradients).

    Example:
        >>> net = Net()
        >>> optimizer = torch.optim.SGD(net.parameters(), lr=0.05, momentum=0.9)
        >>> ps_model = mltuner.torch.wrap(net, worker, example_input=x0, optimizer=optimizer)
        >>> optimizer = ps_model.optimizer  # step() ends the clock
        >>> for x, y in batches:
        ...     loss = loss_fn(ps_model(x), y)
        ...     loss.backward()   # the gradients (see overlap_updates for when updates leave)
        ...     optimizer.step()  # ends the clock

    Args:
        module: an eager model on the device of the worker's engine (CPU, or
            on CUDA worker r's GPU), with float32 trainable parameters.
            Parameters with ``requires_grad=False`` and buffers (batch-norm
            running statistics) stay local to each worker.
        worker: a worker whose virtual iteration has not been recorded (no
            tables yet); the adapter owns its access sequence.
        example_input: a tensor, or a tuple of positional arguments, shaped
            like a training batch (with ``store_activations``, the largest:
            later batches may be smaller, not larger).
        example_kwargs: the keyword arguments of that forward call, where
            the model's forward takes some (an attention mask, say).
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
            runs outside the group's forward is split automatically. None
            (the default): 32 MiB, or, where the device-memory budget cannot
            hold the plan of such groups, the first of 8 MiB, 2 MiB, 512 KiB
            and 0 whose plan it holds (smaller layers need a smaller pool).
        hold_reads: keep each layer's forward read open for its backward
            pass (True: half the reads, the light clock, but the buffer pool
            holds every layer's parameters at once) or post it after the
            layer's forward and read the rows again for the backward pass
            (False: GeePS's pattern, one layer's parameters in the pool at a
            time). None (the default) chooses: False with
            ``store_activations``; otherwise True when
            ``Config.device_memory_budget`` is 0 or holds the pool that held
            reads need (the engine's plan says, by a dry run) and their plan
            swaps no more bytes over the host link than reading again
            would, else False.
            ``model.hold_reads`` and ``model.plan`` say what was chosen and
            why. Under BSP both give the same values; under SSP a held read
            gives the backward the forward's values.
        overlap_updates: ship each layer's update from the backward pass as
            soon as its gradients are final (Poseidon's wait-free
            backpropagation: the transfer overlaps the layers below) rather
            than all at :meth:`PSModule.step`, in one engine call that also
            ends the clock. None (the default) chooses: overlap only on a
            GPU worker (``Config.device == "cuda"``) with a shard in another
            process (``Worker.shards_in_process`` is False) that some
            payloads reach through host frames (``Worker.peers_by_cuda_ipc``
            is False: another host, or no CUDA IPC), where a transfer of
            milliseconds runs while the GPU computes. Elsewhere shipping at
            step() wins: within one process nothing crosses a socket; on a
            CPU worker the backward pass, the engine's threads and the
            transport share the cores and the GIL, so shipping early adds a
            Python call per parameter and an engine call per layer to
            autograd's thread and hides nothing; and a CUDA IPC copy costs
            less than those hooks (docs/torch.md, "When updates leave", has
            the measurements). ``model.overlap_updates`` and
            ``model.plan`` say what was chosen and why. Either way the
            values are the same. Applies when reads are held and activations
            are not stored (otherwise the backward pass ships each layer's
            update).
        grad_scaler: the ``torch.amp.GradScaler`` of a float16 autocast
            loop (``scaler.scale(loss).backward(); scaler.step(optimizer);
            scaler.update()`` with ``optimizer = model.optimizer``): the
            gradients are unscaled before they leave, and an inf or NaN
            skips the step on the servers as torch does (shipping from the
            backward pass it zeroes the updates instead, per layer: from the
            first inf or NaN on).
            bfloat16 autocast needs no scaler.
        optimizer: the training script's ``torch.optim.SGD``, ``Adam`` or
            ``AdamW`` over the module's trainable parameters (every one of
            them, in any param groups). Until :meth:`PSModule.unwrap` its
            ``step()``, ``zero_grad()``, ``state_dict()``, ``load_state_dict()`` and
            ``add_param_group()`` are ``model.optimizer``'s (torch's never
            run: :meth:`ClockOptimizer.take_over_source`). A child module
            whose parameters are in several groups becomes several tables,
            and so do a module's own parameters in groups of different
            settings (one rule per table). None: ``Config.update_rule`` for
            every table (its default ``add`` as plain SGD at 0.01: the
            adapter sends gradients).
        recompute: with ``store_activations``, which saved activations the
            backward pass makes again instead of storing them. ``"cheap"``:
            those made by a few memory-bound ops (ReLU, GELU, batch and layer
            norm, dropout with its random numbers replayed, adds, views,
            casts, pooling) from stored ones, parameters or buffers; the
            outputs of matmuls, convolutions and attention, and what cannot
            be made from stored tensors, are stored. Fewer bytes are stored
            and swapped per clock, for the time of running those ops again
            (the cost model: ``mltuner.torch._recompute``). Results are bit
            for bit those of storing everything (the recording pass checks
            each recomputed tensor against the forward's and stores the ones
            that differ). ``"compute"``: ``"cheap"``, and convolutions and
            matrix products run again too where their work is at most 2,048
            flops per byte saved (activation checkpointing's trade): for
            budgets where the host link bounds the clock, i.e. large
            activations swapped to host memory (ResNet-18 on 224x224 images
            at a quarter of its need: about 1.5x faster than ``"cheap"`` on
            an H100).
            ``"none"``: store every saved activation. ``"auto"`` (the
            default), when storing activations under a
            ``Config.device_memory_budget``: ``"cheap"``, or ``"compute"``
            where the plan with ``"cheap"`` would be bound by the host link
            (a step does under 1,280 flops per byte its swaps move, and they
            move over 2 MiB per op of the forward; the clock is then
            recorded again); else ``"none"``.
            ``model.plan`` and ``model.saved_activations`` say what was
            chosen.
        resume_from: a checkpoint written by a wrapped model's
            :meth:`PSModule.save_checkpoint` (its directory, or the root: its
            newest), on any number of processes: the servers start from its
            parameters and optimizer state instead of worker 0's module, the
            module's buffers, frozen parameters and extra state from the
            ones rank 0 saved, and the optimizer's param groups from the
            saved ones (as ``Optimizer.load_state_dict`` would set them; a
            fresh ``optimizer`` of the same kind and groups is given).
            ``model.resumed`` says from which clock, with the loop's
            ``user_state``. The worker must be a ``mltuner.Job``'s.

    Raises:
        UnsupportedModelError: a non-float32 or sparse trainable parameter,
            a lazy module that has not run yet (``nn.LazyLinear``: run one
            forward first), a compiled, scripted or DataParallel module, a module whose
            parameters get no gradient or are used outside the forward of
            the modules that hold them, activation checkpointing without
            held reads; an optimizer other than SGD, Adam
            and AdamW (or ``maximize=True``), one that already has state or
            leaves out a trainable parameter.
        mltuner.InvalidArgumentError: a used worker, bad arguments, a model
            on another device than the engine; ``recompute="cheap"`` or
            ``"compute"`` without ``store_activations``; a ``resume_from``
            checkpoint saved from another model (its tables, buffers, param
            groups or update rules differ; nothing is changed then).
        mltuner.NotFoundError: no complete checkpoint at ``resume_from``,
            or one without the model state ``save_checkpoint`` adds.
        mltuner.ResourceExhaustedError: ``Config.device_memory_budget``
            cannot hold the access-buffer pool of the access pattern given
            (``hold_reads``), or of either when choosing (about the largest
            layer's working set once per clock in flight); the message gives
            the bytes each pattern needs and the budget, and names smaller
            ``group_bytes`` where the model has grouped layers (with
            ``group_bytes=None``: even one module at a time). Also: the plan
            needs more host memory than the process may have (see
            ``Config.host_memory_limit``; the message gives the need part by
            part and the limit).
    """
    if not isinstance(worker, Worker):
        raise TypeError(f"expected a mltuner.Worker, got {type(worker).__name__}")
    if worker.tables:
        raise InvalidArgumentError(
            f"worker {worker.rank} already has tables ({', '.join(t.name for t in worker.tables)}): wrap() needs "
            "a fresh worker, whose virtual iteration it records"
        )
    if isinstance(module, nn.Module):  # find_layers refuses anything else
        check_module_types(module)  # first: DataParallel moves the module to a GPU, which is not the point
        check_same_device(torch.device(worker.device), _parameter_device(module))
        synced = [name or "the model" for name, m in module.named_modules() if isinstance(m, nn.SyncBatchNorm)]
        distributed = torch.distributed.is_available() and torch.distributed.is_initialized()
        if synced and worker.num_workers > 1 and not distributed:
            raise UnsupportedModelError(
                f"module {synced[0]!r} is nn.SyncBatchNorm on a job of {worker.num_workers} workers: mltuner does not "
                "synchronise batch statistics across workers (torch.distributed is not initialised, so it would "
                "normalise each worker's batch alone, silently unlike SyncBatchNorm under DDP); use nn.BatchNorm "
                "layers, whose statistics are per worker as with DDP without SyncBatchNorm")
    if slack < 0:
        raise InvalidArgumentError(f"slack must be >= 0, got {slack}")
    if row_width < 1:
        raise InvalidArgumentError(f"row_width must be >= 1, got {row_width}")
    choose_groups = group_bytes is None
    if group_bytes is None:
        group_bytes = DEFAULT_GROUP_BYTES
    elif group_bytes < 0:
        raise InvalidArgumentError(f"group_bytes must be >= 0, got {group_bytes}")
    if hold_reads is not None and not isinstance(hold_reads, bool):
        raise ArgumentTypeError(f"hold_reads must be True, False or None (choose), got {type(hold_reads).__name__}")
    # How the clock is recorded: what is recomputed, stored and kept (changed
    # by recompute="auto" and the keep step, which record the clock again).
    attempt = Variant(_recompute_choice(recompute, store_activations, worker), store_activations)
    if overlap_updates is not None and not isinstance(overlap_updates, bool):
        raise ArgumentTypeError(
            f"overlap_updates must be True, False or None (choose), got {type(overlap_updates).__name__}")
    overlap, overlap_choice = choose_overlap(worker, overlap_updates)
    scaler = None if grad_scaler is None else check_scaler(grad_scaler, _parameter_device(module))
    if optimizer is not None:
        check_optimizer(optimizer)
    settings = [{key: value for key, value in group.items() if key != "params"}  # resume_from may change them
                for group in (optimizer.param_groups if optimizer is not None else ())]
    saved = None if resume_from is None else _saved_state(resume_from, module, worker, optimizer)
    args = example_input if isinstance(example_input, tuple) else (example_input,)
    kwargs = dict(example_kwargs or {})
    split: set[str] = set()  # groups whose members run outside the group's forward, or span param groups
    by_group: set[str] = set()  # modules whose own parameters are in several param groups
    group_of = None if optimizer is None else {id(p): index for index, group in enumerate(optimizer.param_groups)
                                               for p in group["params"]}
    stored: dict[int, str] = {}  # saved activations the recording could not recompute bit for bit, and why
    tables: Tables | None = None  # made by the first plan, kept when the clock is recorded again
    link_bytes: dict[str, int] = {}  # recompute="auto": each choice planned, and the bytes over the busier link way
    auto_choice = ""  # why recompute="auto" recorded again with "compute", or went back to "cheap"
    keeper = KeepOnDevice(recompute_auto=recompute == "auto")
    try:
        while True:
            layers = find_layers(module, row_width, whole_modules, group_bytes, split, by_group, group_of)
            layer_groups = _assign_rules(layers, optimizer, worker.config.update_rule, split, by_group)
            if layer_groups is None:
                continue  # a grouped layer spanned param groups: split it and look again
            # recompute="auto": storing everything is the fallback of "cheap" when
            # its plan does not fit; "compute" falls back to "cheap", which did.
            driver = ClockDriver(module, layers, worker, slack=slack, store_activations=attempt.store,
                                 row_width=row_width, overlap_updates=overlap, recompute=attempt.recompute,
                                 recompute_fallback=recompute == "auto" and attempt.recompute == "cheap", stored=stored,
                                 hold_reads=hold_reads, keep=attempt.keep)
            driver.overlap_choice = overlap_choice
            driver.auto_choice = auto_choice
            driver.input_shapes = input_shapes(args, kwargs)
            driver.input_layouts = input_layouts(args, kwargs)
            try:
                driver.record(lambda: module(*args, **kwargs), example_loss or _default_loss)
            except BaseException:
                driver.abandon()
                if driver.misgrouped is None or driver.misgrouped in split:
                    raise
                split.add(driver.misgrouped)  # nothing reached the engine yet: record again
                continue
            if driver.unreproducible:  # recomputations that differ from the forward: record again, storing them
                driver.abandon()
                stored = {**stored, **driver.unreproducible}
                continue
            try:
                driver.prepare_plan(hold_reads, tables, attempt.reserved)
            except ResourceExhaustedError as error:
                variant = keeper.refused(str(error))
                if variant is not None:
                    tables, attempt = driver.release_tables(), variant
                    continue
                if recompute == "auto" and attempt.recompute == "none" and "cheap" in link_bytes:
                    tables, attempt = driver.release_tables(), dataclasses.replace(attempt, recompute="cheap")
                    auto_choice = (f"recompute='auto' went back to 'cheap': storing every activation did not fit "
                                   f"({error})")
                    continue
                if attempt.recompute != "compute" or "cheap" not in link_bytes:
                    smaller = _smaller_groups(module, row_width, whole_modules, group_bytes, split, len(layers),
                                              by_group, group_of)
                    if choose_groups and smaller is not None:
                        # Smaller layers need a smaller pool: record again with
                        # them, on new tables (the refused plan's are dropped).
                        driver.release_tables()
                        worker.drop_tables(worker.tables[0])
                        group_bytes, tables, link_bytes, auto_choice = smaller, None, {}, ""
                        attempt = Variant(_recompute_choice(recompute, store_activations, worker), store_activations)
                        keeper = KeepOnDevice(recompute_auto=recompute == "auto")
                        continue
                    driver.abandon()
                    if smaller is not None:
                        raise ResourceExhaustedError(
                            f"{error}; wrap() read children of up to group_bytes={group_bytes} as one layer each: "
                            "smaller groups (group_bytes=4 << 20, or 0 for one module at a time) need less") from error
                    if choose_groups and group_bytes < DEFAULT_GROUP_BYTES:
                        tried = f"wrap() tried smaller layer groups, down to group_bytes={group_bytes}"
                        raise ResourceExhaustedError(f"{error} ({tried})") from error
                    raise
                tables, attempt = driver.release_tables(), dataclasses.replace(attempt, recompute="cheap")
                link_bytes["compute"] = -1
                auto_choice = f"recompute='auto' went back to 'cheap': 'compute' did not fit ({error})"
                continue
            except BaseException:
                driver.abandon()
                raise
            if recompute == "auto" and attempt.recompute != "none" and attempt.recompute not in link_bytes:
                link_bytes[attempt.recompute] = driver.link_bytes
                again, why = _record_again(driver, attempt.recompute, link_bytes)
                if again:
                    tables, auto_choice = driver.release_tables(), why
                    attempt = dataclasses.replace(attempt, recompute=again)
                    continue
                auto_choice = driver.auto_choice = why or auto_choice
            variant = keeper.after_plan(driver, attempt)
            if variant is not None:
                tables, attempt = driver.release_tables(), variant
                continue
            driver.keep_choice = keeper.choice
            resumed: list[Resumed] = []
            try:
                restore = None
                if saved is not None:
                    # Another budget or batch may group the layers otherwise.
                    sources = saved.sources(module, layers)
                    restore = _restorer(worker, saved, resumed, sources)
                    earlier = "" if saved.tables is not None else (
                        " (saved by an earlier version, which did not record where each parameter lies: resume with "
                        "the layers it was saved with, under the same device-memory budget, batch per worker and "
                        "group_bytes)")
                    # Before the plan is committed.
                    _checkpoint.check_tables(saved.path, worker, sources, mismatch_hint=earlier,
                                             agree=worker.checkpoints.allgather if worker.checkpoints else None)
                driver.commit_plan(restore)
            except BaseException:
                driver.abandon()
                raise
            if saved is not None:
                saved.load_local(module)
            scaled = None
            if scaler is not None:
                scaled = ScaledGradients(scaler, driver)
                driver.grad_scale = scaled
            config_rule = None if optimizer is not None else worker.update_rule_of(driver.tables[0])
            groups = _param_groups(optimizer, layers, config_rule)
            rates = LearningRates(worker, groups, layer_groups, optimizer)
            rates.set_tables(driver.tables)
            driver.clock_start = rates.sync
            driver.rates_changed = rates.changed
            driver.check_loaded_groups = rates.check_loaded
            worker.add_trained_listener(rates.adopt_trained)  # the groups show a session's setting when it ends
            worker.add_session_check(rates.check_session_start)
            model = PSModule(module, driver, groups, scaled, optimizer, resumed[0] if resumed else None)
            if saved is not None and optimizer is None:  # the Config's group: its lr moves with a schedule
                set_group_settings(model.optimizer.param_groups, saved.groups, keys=("lr", "initial_lr"))
            return model
    except BaseException:
        _give_tables_back(worker)  # the worker can be wrapped again, say with other arguments
        for group, setting in zip(optimizer.param_groups if optimizer is not None else (), settings):
            group.update(setting)  # as before resume_from's saved settings were set
        raise
