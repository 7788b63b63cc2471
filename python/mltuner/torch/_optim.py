"""The user's torch optimizer on the servers (``wrap(..., optimizer=...)``).

``torch.optim.SGD``, ``Adam`` and ``AdamW`` become the servers' rules of
the same names (:class:`mltuner.UpdateRule`, torch's formulas), one rule
per table: a layer's table takes the settings of the param group its
parameters are in. A child module whose parameters span several groups is
split into smaller layers, and a module whose own parameters are in several
groups becomes a table per group (``find_layers``'s ``by_group``), read
together in its forward: every table is in one group.

After ``wrap()`` the groups' learning rates may change (by hand or by a
``torch.optim.lr_scheduler``): :class:`LearningRates` sends a changed rate to
the servers with the next clock, the same on every worker because every
worker runs the same schedule. The other settings of a group are fixed.

Any other torch optimizer that steps on a wrapped model's parameters (one
made from ``model.parameters()`` after ``wrap()``) is refused by a global
step pre-hook (:func:`guard_parameters`): its update would run on the
buffers the engine lends for the clock, or on the NaN placeholders between
clocks, while the servers apply theirs. So is, by a global parameter
registration hook, a wrapped parameter registered in another place
(``torch.nn.utils.prune`` moves a weight to ``weight_orig`` and computes its
mask from the placeholder then).
"""

from __future__ import annotations

import math
import threading
import weakref
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
from torch import nn
from torch.nn.modules.module import register_module_parameter_registration_hook
from torch.optim.optimizer import register_optimizer_step_pre_hook

from mltuner._config import MAX_LEARNING_RATE, RuleName, UpdateRule
from mltuner._validate import real
from mltuner.client._worker import Table, Worker
from mltuner.exceptions import InvalidArgumentError
from mltuner.torch._errors import UnsupportedModelError
from mltuner.torch._layers import Layer

__all__ = ["check_optimizer", "rule_for_group", "groups_of_layers", "LearningRates", "SUPPORTED_OPTIMIZERS",
           "guard_parameters", "release_parameters"]

SUPPORTED_OPTIMIZERS = (torch.optim.SGD, torch.optim.Adam, torch.optim.AdamW)

# The keys of each optimizer's param groups that change its step's math,
# besides "lr" (the only one that may change after wrap()): the server rule
# takes them, or refuses them (maximize=True). The others ("foreach",
# "fused", "capturable", "differentiable") choose how torch computes the
# same step.
_RULE_KEYS = {
    torch.optim.SGD: ("momentum", "dampening", "weight_decay", "nesterov", "maximize"),
    torch.optim.Adam: ("betas", "eps", "weight_decay", "amsgrad", "decoupled_weight_decay", "maximize"),
    torch.optim.AdamW: ("betas", "eps", "weight_decay", "amsgrad", "decoupled_weight_decay", "maximize"),
}

# What to do instead of changing a group setting after wrap(), where the
# general advice (_check_frozen) does not fit.
_INSTEAD = {"maximize": "the servers minimize: negate the loss instead of setting maximize=True"}


# The trainable parameters of the wrapped models in this process, until
# unwrap(): id -> (the parameter, weakly; its name). By id, not in a
# WeakKeyDictionary, whose lookups compare tensors with ==.
_WRAPPED: dict[int, tuple[weakref.ref[torch.Tensor], str]] = {}
_WRAPPED_LOCK = threading.Lock()  # workers of a LocalCluster wrap on threads of their own
_hook_installed = False


def guard_parameters(layers: Sequence[Layer]) -> None:
    """From now on a torch optimizer other than a wrapped model's own that
    steps on these layers' parameters raises, and so does registering one
    of them in another place (module docstring)."""
    global _hook_installed
    with _WRAPPED_LOCK:
        for key in [key for key, (ref, _) in _WRAPPED.items() if ref() is None]:
            del _WRAPPED[key]  # models dropped without unwrap()
        for layer in layers:
            for slot in layer.params:
                _WRAPPED[id(slot.param)] = (weakref.ref(slot.param), slot.name)
        if not _hook_installed:
            register_optimizer_step_pre_hook(_refuse_foreign_step)
            register_module_parameter_registration_hook(_refuse_moved_parameter)
            _hook_installed = True


def release_parameters(layers: Sequence[Layer]) -> None:
    """unwrap(): the parameters are a plain module's again."""
    with _WRAPPED_LOCK:
        for layer in layers:
            for slot in layer.params:
                _WRAPPED.pop(id(slot.param), None)


def _refuse_foreign_step(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
    """torch's global step pre-hook: refuses a step on wrapped parameters,
    unless the optimizer is a wrapped model's own (it ends the clock)."""
    if not _WRAPPED or getattr(optimizer, "_steps_a_clock", False):
        return
    for group in optimizer.param_groups:
        for param in group["params"]:
            entry = _WRAPPED.get(id(param))
            if entry is not None and entry[0]() is param:
                raise InvalidArgumentError(
                    f"{type(optimizer).__name__}.step() on parameter {entry[1]!r} of a wrapped model: the servers "
                    "hold its values and apply the update rule, so a torch step here would change only the "
                    "buffers the engine lends for the clock. Give the optimizer to wrap(..., optimizer=...) "
                    "(its step() then ends the clock) or call model.step() / model.optimizer.step()"
                )


def _refuse_moved_parameter(module: nn.Module, name: str, param: nn.Parameter) -> None:
    """torch's global parameter registration hook: refuses registering a
    wrapped parameter anywhere but where it is. Found at once, before the
    module changes: ``torch.nn.utils.prune`` registers the weight as
    ``weight_orig`` before it computes the mask, from the NaN placeholder
    the parameter holds between clocks, which would prune the wrong weights
    unseen where layers are read in the clock's forward only."""
    if not _WRAPPED:
        return
    entry = _WRAPPED.get(id(param))
    if entry is None or entry[0]() is not param or module._parameters.get(name) is param:
        return
    raise UnsupportedModelError(
        f"parameter {entry[1]!r} of a wrapped model registered again, as {name!r} of a {type(module).__name__} "
        "(torch.nn.utils.prune moves a weight to '<name>_orig' so, as do parametrize.register_parametrization "
        "and a weight tied after wrap()): between clocks it holds a NaN placeholder (the servers hold its "
        "values), so a mask or reparametrization computed from it now would be wrong, and wrap() fixed where "
        "each parameter is used. Prune or reparametrize the module before wrap() (its hooks then see each "
        "clock's values), or unwrap() and wrap the module on a new job's worker"
    )


def _number(value: Any) -> float:
    """A group setting as a Python float (torch allows 0-d tensors)."""
    return float(value.item()) if isinstance(value, torch.Tensor) else float(value)


def check_optimizer(optimizer: object) -> torch.optim.Optimizer:
    """``optimizer`` if the servers can apply its step, else the reason not."""
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise InvalidArgumentError(f"optimizer must be a torch.optim.Optimizer, got {type(optimizer).__name__}")
    # The type first: some optimizers have state from the start (Adagrad's sums).
    if type(optimizer) not in SUPPORTED_OPTIMIZERS:
        subclass = next((c.__name__ for c in SUPPORTED_OPTIMIZERS if isinstance(optimizer, c)), None)
        why = (f"a subclass of torch.optim.{subclass}, whose step may differ from torch's" if subclass
               else "not one the servers implement")
        raise UnsupportedModelError(
            f"optimizer {type(optimizer).__name__} is {why}: the servers apply torch.optim.SGD, Adam and AdamW "
            "(pass one of those, or leave optimizer out and set mltuner.Config(update_rule=...))"
        )
    if any(optimizer.state.values()):
        # Momentum buffers or Adam moments that would silently restart at zero on the servers.
        raise UnsupportedModelError(
            f"the {type(optimizer).__name__} given to wrap() already has state (it has stepped, or loaded a "
            "state_dict): the servers start the optimizer's state at zero, so give wrap() a fresh optimizer "
            "(wrap(..., resume_from=path) restores the servers' state from a wrapped model's save_checkpoint())"
        )
    return optimizer


def rule_for_group(optimizer: torch.optim.Optimizer, index: int) -> UpdateRule:
    """The server rule that takes the steps ``optimizer`` takes for its
    param group ``index``."""
    group = optimizer.param_groups[index]
    name = f"{type(optimizer).__name__} param_groups[{index}]"
    if group.get("maximize", False):
        raise UnsupportedModelError(f"{name} has maximize=True: the servers minimize; negate the loss instead")
    lr = _number(group["lr"])
    try:
        if isinstance(optimizer, torch.optim.SGD):
            return UpdateRule("sgd", lr, momentum=_number(group["momentum"]), dampening=_number(group["dampening"]),
                              nesterov=bool(group["nesterov"]), weight_decay=_number(group["weight_decay"]))
        beta1, beta2 = (_number(b) for b in group["betas"])
        kind: RuleName = "adamw" if group.get("decoupled_weight_decay", False) else "adam"
        return UpdateRule(kind, lr, beta1=beta1, beta2=beta2, epsilon=_number(group["eps"]),
                          weight_decay=_number(group["weight_decay"]), amsgrad=bool(group["amsgrad"]))
    except InvalidArgumentError as error:
        raise InvalidArgumentError(f"{name}: {error}") from None


def groups_of_layers(optimizer: torch.optim.Optimizer, layers: Sequence[Layer]) -> list[list[int]]:
    """Per layer, the indices of the param groups its parameters are in.

    Raises:
        UnsupportedModelError: a trainable parameter of the model that the
            optimizer does not hold (torch would never update it), or a
            parameter of the optimizer that is not one of the model's.
    """
    group_of: dict[int, int] = {}
    for index, group in enumerate(optimizer.param_groups):
        for param in group["params"]:
            group_of[id(param)] = index
    trainable: set[int] = set()
    per_layer: list[list[int]] = []
    for layer in layers:
        groups: set[int] = set()
        for slot in layer.params:
            trainable.add(id(slot.param))
            if id(slot.param) not in group_of:
                raise UnsupportedModelError(
                    f"parameter {slot.name!r} is trainable but not in the optimizer's param groups, so torch would "
                    "never update it: add it to the optimizer, or freeze it (requires_grad_(False))"
                )
            groups.add(group_of[id(slot.param)])
        per_layer.append(sorted(groups))
    for index, group in enumerate(optimizer.param_groups):
        for param in group["params"]:
            if id(param) not in trainable and param.requires_grad:
                raise UnsupportedModelError(
                    f"param_groups[{index}] of the optimizer holds a tensor of shape {tuple(param.shape)} that is "
                    "not a trainable parameter of the wrapped module: build the optimizer from "
                    "module.parameters()"
                )
    return per_layer


def plain_setting(value: Any) -> Any:
    """A group setting in a form that compares by value (tensors as floats)."""
    if isinstance(value, torch.Tensor):
        return _number(value)
    if isinstance(value, (tuple, list)):
        return tuple(plain_setting(v) for v in value)
    return value


def _frozen_settings(optimizer: torch.optim.Optimizer | None, group: dict[str, Any]) -> dict[str, Any]:
    if optimizer is None:  # Config's rule: the group shows its momentum or betas (_module._param_groups)
        return {key: plain_setting(value) for key, value in group.items() if key not in ("params", "lr")}
    return {key: plain_setting(group.get(key)) for key in _RULE_KEYS[type(optimizer)]}


class LearningRates:
    """Follows each param group's ``"lr"`` to the servers: called at the
    start of every training clock, it sets each changed rate on the tables
    of the group's layers (the engine sends it with that clock's updates).

    ``groups`` are the param-group dicts (shared with the user's optimizer
    and with ``model.optimizer``); ``layer_groups`` gives, per layer, the
    group its parameters are in (``wrap()`` gives each group tables of its
    own); ``optimizer`` is the user's, or None when
    the single group stands for ``Config.update_rule``.
    """

    def __init__(self, worker: Worker, groups: Sequence[dict[str, Any]], layer_groups: Sequence[Sequence[int]],
                 optimizer: torch.optim.Optimizer | None) -> None:
        self._worker = worker
        self._groups = list(groups)
        self._layer_groups = [list(g) for g in layer_groups]
        # The groups with a table (one of only frozen parameters has none): the
        # servers' rates, whose ratios a session keeps.
        self._rated = sorted({group for groups in self._layer_groups for group in groups})
        self._optimizer = optimizer
        self._sent = [_number(group["lr"]) for group in self._groups]
        # The groups' ratios of the last session's rates, and the rates they
        # gave: a shard's fork inherits them while no rate changed (ForkRates).
        self._ratios: list[float] | None = None
        self._ratio_rates: list[float] = []
        # The groups' rates when a session that tunes lr started: the session's
        # branches set the rate, so only a change from these is the loop's.
        self._session_rates: list[float] = []
        self._frozen = [_frozen_settings(optimizer, group) for group in self._groups]
        self._tables: list[Table] = []

    def set_tables(self, tables: Sequence[Table]) -> None:
        """The layers' tables, once created (``ClockDriver.prepare_plan``)."""
        self._tables = list(tables)

    def changed(self) -> bool:
        """Whether a group's ``lr`` differs from the rate last sent (in a
        session that tunes lr, from the rate when it started)."""
        return any(_number(group["lr"]) != self._compared(index) for index, group in enumerate(self._groups))

    def _compared(self, index: int) -> float:
        """What group ``index``'s ``lr`` is compared with to see a change."""
        tuned = "lr" in self._worker.tuned_settings and self._session_rates
        return self._session_rates[index] if tuned else self._sent[index]

    def sync(self) -> None:
        """Before a training clock: sends every changed rate.

        Raises:
            mltuner.InvalidArgumentError: a group setting other than ``lr``
                changed, or a rate is not a finite number >= 0.
        """
        for index, group in enumerate(self._groups):
            self._check_frozen(index, group)
            lr = _number(group["lr"])
            if "lr" in self._worker.tuned_settings:  # the session's branches set the rates
                if lr != self._compared(index):
                    raise InvalidArgumentError(
                        f"param_groups[{index}]['lr'] changed from {self._compared(index)} to {lr} during a tuning "
                        "session that tunes lr: the tuner sets the rate of each of its branches, which this would "
                        "overwrite. Set it back (and step schedulers after the session, which leaves the tuned rate "
                        "in the groups)")
                continue
            if lr == self._sent[index]:
                continue
            rate = real(f"param_groups[{index}]['lr']", lr, 0, MAX_LEARNING_RATE)
            for layer_index, groups in enumerate(self._layer_groups):
                if index in groups:  # a table holds one group's parameters (_module._assign_rules)
                    self._worker.set_learning_rate(self._tables[layer_index], rate)
            self._sent[index] = rate

    def check_session_start(self, settings: frozenset[str]) -> None:
        """When a tuning session that tunes ``lr`` starts
        (``Worker.add_session_check``): rates written since the last clock
        whose ratios differ from the servers' are refused, since the session
        forks its branches from the rates the servers hold and keeps their
        ratios; rates in the same ratios (a scheduler's step) are the
        session's to set.

        Raises:
            mltuner.InvalidArgumentError: the groups' ratios changed since
                the last clock.
        """
        if "lr" not in settings:
            return
        rates = [_number(group["lr"]) for group in self._groups]
        now, held = _rate_ratios([rates[i] for i in self._rated]), _rate_ratios([self._sent[i] for i in self._rated])
        if (now is None) != (held is None) or (now is not None and held is not None and not all(
                math.isclose(a, b, rel_tol=1e-6) for a, b in zip(now, held))):  # float32's rounding aside
            raise InvalidArgumentError(
                f"the param groups' rates {rates} were written after the last clock, which trained at {self._sent}, "
                "and their ratios changed with them: a tuning session that tunes lr forks its branches from the "
                "rates the servers hold, keeping the groups' ratios, so it would keep the old ones; run one clock "
                "at the new rates before the session (or set them back)")
        self._session_rates = rates

    def adopt_trained(self) -> None:
        """When a tuning session ends (``Worker.set_trained`` calls it):
        every group takes the ``lr`` (and, where it was tuned and the rule
        has one, the ``momentum``) its final branch trained with, which the
        servers apply there already, so that the loop, a scheduler made
        after the session and a checkpoint go on from the tuned setting.
        The tuned ``lr`` is the fastest group's; the others keep their
        ratio to it, as the session's forks did."""
        tunables = self._worker.trained_tunables or {}
        adopted: dict[int, float] = {}
        if "lr" in tunables:
            sent = [self._sent[index] for index in self._rated]
            untouched = [float(np.float32(rate)) for rate in sent] == [
                float(np.float32(rate)) for rate in self._ratio_rates]
            self._ratios = _rate_ratios(sent) if self._ratios is None or not untouched else self._ratios
            self._ratio_rates = _scaled(self._ratios, float(tunables["lr"]), len(sent))
            adopted = dict(zip(self._rated, self._ratio_rates))
        for index, group in enumerate(self._groups):
            if index in adopted:  # a group without a table keeps its rate: no server applies it
                group["lr"] = self._sent[index] = adopted[index]
                if "initial_lr" in group:  # a scheduler made from now on starts from it
                    group["initial_lr"] = adopted[index]
            if "momentum" in tunables and "momentum" in self._frozen[index]:
                group["momentum"] = float(tunables["momentum"])
                self._frozen[index]["momentum"] = plain_setting(group["momentum"])

    def check_loaded(self, saved: Sequence[dict[str, Any]]) -> None:
        """Refuses, before anything is set, param groups (of a state dict
        to load) whose settings other than ``lr`` differ from wrap()'s: the
        next clock would refuse them, with the groups already changed."""
        for index, (group, frozen) in enumerate(zip(saved, self._frozen)):
            for key, value in frozen.items():
                if key in group and plain_setting(group[key]) != value:
                    raise InvalidArgumentError(
                        f"load_state_dict: param_groups[{index}][{key!r}] is {plain_setting(group[key])!r} there, "
                        f"{value!r} here: after wrap() only 'lr' can change (the servers' rule holds the others)")

    def _check_frozen(self, index: int, group: dict[str, Any]) -> None:
        frozen = self._frozen[index]
        for key, value in frozen.items():
            now = plain_setting(group.get(key))
            if now != value:
                instead = _INSTEAD.get(key, "a scheduler that cycles momentum or betas needs cycle_momentum=False")
                raise InvalidArgumentError(
                    f"param_groups[{index}][{key!r}] changed from {value!r} to {now!r}: after wrap() only 'lr' can "
                    f"change (the servers' rule holds the others); {instead}"
                )


def _rate_ratios(rates: Sequence[float]) -> list[float] | None:
    """Each group's rate over the fastest's, from the float32 rates the
    servers hold, as a shard's fork computes them (``ForkRates``); None
    where every rate is 0."""
    single = [float(np.float32(rate)) for rate in rates]
    fastest = max(single, default=0.0)
    return None if fastest <= 0 else [rate / fastest for rate in single]


def _scaled(ratios: list[float] | None, fastest_rate: float, count: int) -> list[float]:
    """The groups' rates once the fastest is ``fastest_rate``: float32 as a
    shard's fork makes them; the fastest's (and every one without ratios)
    ``fastest_rate`` itself."""
    if ratios is None:
        return [fastest_rate] * count
    target = float(np.float32(fastest_rate))
    return [fastest_rate if ratio == 1.0 else float(np.float32(ratio * target)) for ratio in ratios]
