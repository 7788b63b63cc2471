"""Engine configuration as a typed dataclass."""

from __future__ import annotations

import dataclasses
import numbers
import os
from typing import Literal

from mltuner import _core
from mltuner._validate import boolean, choice, integer, real
from mltuner.exceptions import ArgumentTypeError, InvalidArgumentError

__all__ = ["Config", "UpdateRule"]

RuleName = Literal["add", "sgd", "damped_momentum", "momentum", "adam", "adamw"]
RULE_NAMES = ("add", "sgd", "damped_momentum", "momentum", "adam", "adamw")

# Ranges of the settings: what the engine's types hold and what is sane.
MAX_BYTES = 2**62
MAX_WAIT_S = 10.0**6  # 11.6 days; the engine counts milliseconds in int64
MAX_PREFETCH_CLOCKS = 64  # every clock ahead holds a copy of every access buffer
# Config.prefetch_clocks=None in the engine's Config (kAutoPrefetchClocks, config.h).
_AUTO_PREFETCH_CLOCKS = -1
# The most clocks ahead the plan chooses when prefetch_clocks is None.
MOST_AUTO_PREFETCH_CLOCKS = 1
MAX_PARTITIONS = 1 << 16
MAX_BRANCHES = 1 << 16
MAX_LEARNING_RATE = 1e6
MAX_WEIGHT_DECAY = 1e6

# The fields each rule reads besides the learning rate; setting another one
# is refused, so that a misplaced argument does not silently do nothing.
_RULE_FIELDS = {
    "add": set(),
    "sgd": {"learning_rate", "momentum", "dampening", "nesterov", "weight_decay"},
    "damped_momentum": {"learning_rate", "momentum"},
    "adam": {"learning_rate", "beta1", "beta2", "epsilon", "weight_decay", "amsgrad"},
    "adamw": {"learning_rate", "beta1", "beta2", "epsilon", "weight_decay", "amsgrad"},
}
_FIELD_DEFAULTS = {"learning_rate": 0.01, "beta1": 0.9, "beta2": 0.999, "epsilon": 1e-8, "dampening": 0.0,
                   "nesterov": False, "amsgrad": False}


@dataclasses.dataclass(frozen=True)
class UpdateRule:
    """The server-side update rule, applied once per clock to the combined
    updates of all workers.

    ``add`` adds the sum of the workers' updates (the application sends
    deltas). Every other rule treats the updates as gradients, averages them
    over the workers (as synchronous data-parallel SGD does) and takes one
    step with torch.optim's formulas and argument names, so that with one
    worker the values follow the torch optimizer step for step:

    - ``sgd`` is ``torch.optim.SGD(lr, momentum, dampening, weight_decay,
      nesterov)``, including torch's first step, where the momentum buffer
      is the gradient itself.
    - ``adam`` is ``torch.optim.Adam(lr, betas=(beta1, beta2), eps,
      weight_decay, amsgrad)``; ``adamw`` is ``torch.optim.AdamW(...)``,
      whose weight decay is decoupled (``w *= 1 - lr * weight_decay``).
    - ``damped_momentum`` is MLtuner's rule: ``h = (1 - m) g + m h;
      w -= lr h``. It takes the steps of ``torch.optim.SGD(lr * (1 - m),
      momentum=m)``: use ``sgd`` for torch's momentum. ``momentum`` is its
      old name, still accepted (it becomes ``damped_momentum``).

    ``mltuner.torch.wrap(..., optimizer=...)`` makes these from a torch
    optimizer. A field the rule does not use must stay unset (None or its
    default): ``UpdateRule("adam", momentum=0.9)`` is refused.

    Args:
        kind: the rule.
        learning_rate: the step size (every rule but ``add``).
        momentum: ``sgd``: torch's momentum (default 0); ``damped_momentum``:
            m (default 0.9).
        beta1, beta2, epsilon: Adam's ``betas`` and ``eps``.
        dampening, nesterov: ``sgd``'s, as in torch.
        weight_decay: ``sgd`` and ``adam``: L2 added to the gradient;
            ``adamw``: decoupled. Default 0, or 0.01 for ``adamw`` (torch's).
        amsgrad: ``adam``/``adamw``: divide by the largest second moment
            seen so far.
    """

    kind: RuleName = "add"
    learning_rate: float = 0.01
    momentum: float | None = None
    beta1: float = 0.9
    beta2: float = 0.999
    epsilon: float = 1e-8
    dampening: float = 0.0
    nesterov: bool = False
    weight_decay: float | None = None
    amsgrad: bool = False

    def __post_init__(self) -> None:
        choice("UpdateRule.kind", self.kind, RULE_NAMES)
        if self.kind == "momentum":  # the damped rule's old name
            object.__setattr__(self, "kind", "damped_momentum")
        _check_fields_used(self)
        if self.momentum is None:
            object.__setattr__(self, "momentum", 0.9 if self.kind == "damped_momentum" else 0.0)
        if self.weight_decay is None:
            object.__setattr__(self, "weight_decay", 0.01 if self.kind == "adamw" else 0.0)
        _validate_rule(self)

    @property
    def state_arrays(self) -> int:
        """Floats of optimizer state the servers keep per parameter value."""
        if self.kind == "sgd":
            return 1 if self.momentum else 0
        if self.kind in ("adam", "adamw"):
            return 3 if self.amsgrad else 2
        return 1 if self.kind == "damped_momentum" else 0

    def to_core(self) -> _core.UpdateRuleConfig:
        """The engine's own rule object."""
        rule = _core.UpdateRuleConfig()
        rule.kind = getattr(_core.UpdateRuleKind, self.kind)
        rule.learning_rate = self.learning_rate
        rule.momentum = float(self.momentum or 0.0)
        rule.dampening = self.dampening
        rule.nesterov = self.nesterov
        rule.weight_decay = float(self.weight_decay or 0.0)
        rule.beta1 = self.beta1
        rule.beta2 = self.beta2
        rule.epsilon = self.epsilon
        rule.amsgrad = self.amsgrad
        return rule


@dataclasses.dataclass(frozen=True)
class Config:
    """Settings of every worker's engine.

    Args:
        device_memory_budget: bytes of device memory for the parameter cache,
            local data and access buffers; 0 means as much as needed. With a
            smaller budget, parameters and local data live in host memory and
            are swapped in ahead of use; below the least access-buffer pool
            (``1 + prefetch_clocks`` regions, each one clock's buffers packed
            by lifetime, one region when ``prefetch_clocks`` is None;
            ``Worker.stats["pool_min_bytes"]`` for the plan's regions),
            :class:`~mltuner.ResourceExhaustedError` says exactly how much is
            needed. Left at 0 on a device of known capacity (CUDA), a plan
            that needs more device memory than the device has free when the
            plan is made, less ``device_memory_reserve``, is made under a
            budget of exactly that (an automatic budget;
            ``Worker.stats["budget_bytes"]`` and ``["automatic_budget"]``,
            and the plan's first line, say which was used).
        device_memory_reserve: bytes of device memory the automatic budget
            leaves to what the engine does not allocate: the framework's own
            tensors (activations not stored as local data, gradients before
            they are handed over, workspaces, its allocator's cache) and the
            server shard's buffers in flight. None: a tenth of the device's
            memory. The server shard's state (values and optimizer state)
            stays on the device when the room left after the workers' plans,
            less this reserve, holds it; otherwise it lives in pinned host
            memory that the device's update kernels read and write in place
            (``Worker.stats["shard_in_host_memory"]``).
        cpu_device_capacity: for tests, on the CPU backend: make it behave as
            a device of this many bytes (allocations past it fail, and the
            automatic budget and the shard's placement see its free memory).
            0 (the default): unbounded, as before.
        wait_timeout_s: every blocking wait gives up after this many seconds
            with :class:`~mltuner.WaitTimeoutError`.
        prefetch_clocks: how many clocks the allocator thread may prepare
            ahead of the application (1 = double buffering). 0: only the
            clock the application is in, so the access-buffer pool is one
            region, half the least pool of 1, which leaves more of a tight
            ``device_memory_budget`` to lookahead within the clock; nothing
            of the next clock is prepared before this one ends (under BSP,
            its reads wait for this clock's updates anyway). None (the
            default): the plan chooses 0 or 1. 1 with no budget, or where
            the budget holds two regions at the full lookahead; 0 where the
            budget cannot hold two regions' least pool but holds one's, or
            where one region prepares more ops ahead under the budget than
            two; else 1 (on an H100, ResNet-18 at a quarter of its need ran
            at 0.37 of no budget with 0, 0.27 with 1). The value used and
            why are on the plan's second line (``Worker.plan``), and in
            ``Worker.stats["prefetch_clocks"]``.
        partitions_per_table: partition locks per table in the client cache.
        clock_part_bytes: a table whose rows on one server shard exceed this
            many bytes moves its clock in parts of about this size (at most
            64 per shard): each part's update leaves as soon as it is packed,
            the shard applies the rule to a part once every worker's part is
            in and pushes its fresh rows at once, so one large table's
            copies, sends, rule and installs overlap as those of many smaller
            tables do. Results are bit-identical; between the parts of a
            clock a worker's cache may hold some rows a clock fresher than
            the table's data age (as between shards). 0: every shard's rows
            move whole. None (the default): 1 MiB on the CPU backend (16
            cores, one 100-MiB table between 2 processes: 208 -> 96 ms a
            clock), 16 MiB on a GPU, where a part costs more (events,
            kernels, a CUDA IPC notice; two H200s, one 256-MiB table: 2.05
            ms a clock whole, 1.72 in 16-MiB parts). Every worker of a job
            must use the same value.
        update_rule: the server-side update rule.
        device: ``"cpu"`` (host memory, buffers are numpy arrays) or ``"cuda"``
            (worker r on GPU r mod count; buffers are :class:`DeviceArray`
            objects for ``torch.from_dlpack`` / ``cupy.from_dlpack``).
        branches: run each clock on the branch the application scheduled
            (:meth:`Worker.schedule_branch`), as the tuner does; off, every
            clock runs on branch 0 and nothing needs scheduling.
        max_branches: live branches (copies of the parameters and optimizer
            state) a shard may hold at once.
        read_my_writes: a read with slack >= 1 sees this worker's own
            updates through the previous clock (the step the servers' rule
            takes for them is added to the worker's cache at once), while the
            other workers' may arrive up to the slack late, as in Bösen's
            SSP; with momentum, the other workers' momentum is carried over
            the clocks their rows lag. For tables whose rule is ``add``, ``sgd`` or
            ``damped_momentum`` without weight decay and whose rows all live
            on the device, with no device-memory budget (set or automatic),
            at slack 1 to 8; other reads are as without it. Reads at slack 0
            are the same either way. With branches, a read holds the own
            updates since the cache last switched to its branch: a switch
            starts from the shards' rows. Costs device memory of the table's size
            per clock the reads may lag (at most slack + 1), and a pass over
            each such table a clock on the worker (the step) plus one per
            install. None (the default) takes it from the environment
            variable ``MLTUNER_READ_MY_WRITES`` (``0`` turns it off; unset:
            on).
        host_memory_limit: bytes of host memory this process's engines may
            hold; None or 0 means no limit of its own (the host's is
            detected). Tables and plans that need more than the smallest of
            this, the memory available (``MemAvailable``), the cgroup's
            limit and ``RLIMIT_AS`` are refused with
            :class:`~mltuner.ResourceExhaustedError`, naming the need part by
            part and the limit, before anything is allocated. A plan's need
            (``Worker.preview_plan().host_memory``) counts its host-resident
            caches, update logs and local data, the staging buffer, update
            payloads in flight, the server shard's state when it lives in
            host memory and, on the CPU backend, the buffer pool and the
            device-resident stores. A branch fork's copy of that state is
            not counted here: the shard checks it against the memory
            available when it forks (``fork_branch`` raises
            :class:`~mltuner.ResourceExhaustedError`).
        check_finite: the servers refuse an update of a training branch (or
            initial values) that holds a NaN or an infinity, before any of it
            is applied (``Worker.write_initial`` refuses them at the call): the
            clock fails and every worker's next call raises
            :class:`~mltuner.NonFiniteError` naming the table, branch, clock
            and the worker that sent it. Costs one more pass over every
            update on the server (and a wait on the GPU for the count). A
            refusal stops the job, so the tuner leaves it off: a diverging
            trial is an outcome it handles itself (non-finite loss).
        debug_buffers: fill every buffer handed back to the engine with NaN
            once the engine is done with it (a read buffer at its post, an
            update buffer once shipped), so code that keeps using a buffer
            after its post reads NaN instead of another clock's values.
            None (the default) takes it from the environment variable
            ``MLTUNER_DEBUG_BUFFERS`` (``1`` turns it on). Costs a fill of
            every buffer every clock: for debugging only.

    Every setting is checked when the object is made: a bad value raises
    :class:`~mltuner.InvalidArgumentError` naming it and its range.
    """

    device_memory_budget: int = 0
    wait_timeout_s: float = 60.0
    prefetch_clocks: int | None = None
    partitions_per_table: int = 8
    clock_part_bytes: int | None = None
    update_rule: UpdateRule = dataclasses.field(default_factory=UpdateRule)
    device: Literal["cpu", "cuda"] = "cpu"
    branches: bool = False
    max_branches: int = 40
    read_my_writes: bool | None = None
    host_memory_limit: int | None = None
    check_finite: bool = False
    debug_buffers: bool | None = None
    device_memory_reserve: int | None = None
    cpu_device_capacity: int = 0

    def __post_init__(self) -> None:
        choice("Config.device", self.device, ("cpu", "cuda"))
        integer("Config.device_memory_budget", self.device_memory_budget, 0, MAX_BYTES)
        real("Config.wait_timeout_s", self.wait_timeout_s, 0, MAX_WAIT_S, low_open=True)
        _check_prefetch_clocks(self.prefetch_clocks)
        integer("Config.partitions_per_table", self.partitions_per_table, 1, MAX_PARTITIONS)
        if self.clock_part_bytes is not None:
            integer("Config.clock_part_bytes", self.clock_part_bytes, 0, MAX_BYTES)
        if not isinstance(self.update_rule, UpdateRule):
            raise InvalidArgumentError(f"Config.update_rule must be an UpdateRule, got "
                                       f"{type(self.update_rule).__name__}")
        boolean("Config.branches", self.branches)
        integer("Config.max_branches", self.max_branches, 1, MAX_BRANCHES)
        check_engine_environment()
        if self.read_my_writes is None:
            object.__setattr__(self, "read_my_writes", read_my_writes_from_environment())
        boolean("Config.read_my_writes", self.read_my_writes)
        if self.host_memory_limit is not None:
            limit = integer("Config.host_memory_limit", self.host_memory_limit, 0, MAX_BYTES)
            if 0 < limit < 1 << 20:
                raise InvalidArgumentError(f"Config.host_memory_limit must be 0 (detect) or in [1048576, 2**62], "
                                           f"got {limit}")
        if self.device_memory_reserve is not None:
            integer("Config.device_memory_reserve", self.device_memory_reserve, 0, MAX_BYTES)
        integer("Config.cpu_device_capacity", self.cpu_device_capacity, 0, MAX_BYTES)
        boolean("Config.check_finite", self.check_finite)
        if self.debug_buffers is None:
            object.__setattr__(self, "debug_buffers", debug_buffers_from_environment())
        boolean("Config.debug_buffers", self.debug_buffers)

    def to_core(self) -> _core.Config:
        """The engine's own config object."""
        core = _core.Config()
        core.device_memory_budget = int(self.device_memory_budget)
        core.host_memory_limit = int(self.host_memory_limit or 0)
        core.device_memory_reserve = -1 if self.device_memory_reserve is None else int(self.device_memory_reserve)
        core.cpu_device_capacity = int(self.cpu_device_capacity)
        core.wait_timeout_ms = max(1, int(self.wait_timeout_s * 1000))
        core.prefetch_clocks = _AUTO_PREFETCH_CLOCKS if self.prefetch_clocks is None else int(self.prefetch_clocks)
        core.partitions_per_table = int(self.partitions_per_table)
        core.clock_part_bytes = -1 if self.clock_part_bytes is None else int(self.clock_part_bytes)
        core.update_rule = self.update_rule.to_core()
        core.branches = bool(self.branches)
        core.max_branches = int(self.max_branches)
        core.read_my_writes = bool(self.read_my_writes)
        core.check_finite = bool(self.check_finite)
        core.debug_buffers = bool(self.debug_buffers)
        return core


def _check_prefetch_clocks(value: object) -> None:
    """None (the plan chooses) or an integer in [0, MAX_PREFETCH_CLOCKS]."""
    if value is None:
        return
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise ArgumentTypeError(f"Config.prefetch_clocks must be an integer in [0, {MAX_PREFETCH_CLOCKS}] or None "
                                f"(the plan chooses), got {type(value).__name__} {value!r}")
    if not 0 <= int(value) <= MAX_PREFETCH_CLOCKS:
        raise InvalidArgumentError(f"Config.prefetch_clocks must be in [0, {MAX_PREFETCH_CLOCKS}] or None (the "
                                   f"plan chooses), got {int(value)}")


def _check_fields_used(rule: UpdateRule) -> None:
    """Refuses a field set away from its default that the rule never reads."""
    used = _RULE_FIELDS[rule.kind]
    for name in ("momentum", "weight_decay", *_FIELD_DEFAULTS):
        value = getattr(rule, name)
        if name in ("momentum", "weight_decay"):
            unset = value is None
        else:  # numbers compare by value (np.float64(0.9) is the default 0.9); anything else is set
            unset = isinstance(value, numbers.Real) and value == _FIELD_DEFAULTS[name]
        if name not in used and not unset:
            raise InvalidArgumentError(f"UpdateRule.{name} is set to {value!r}, but the {rule.kind!r} rule does not "
                                       f"use it (its fields: {', '.join(sorted(used)) or 'none'})")


DEBUG_BUFFERS_VARIABLE = "MLTUNER_DEBUG_BUFFERS"
READ_MY_WRITES_VARIABLE = "MLTUNER_READ_MY_WRITES"


def debug_buffers_from_environment() -> bool:
    """``MLTUNER_DEBUG_BUFFERS``: unset, empty or ``0`` is off, ``1`` is on;
    anything else is refused (a typo must not silently leave it off)."""
    return _switch_from_environment(DEBUG_BUFFERS_VARIABLE, default=False)


def read_my_writes_from_environment() -> bool:
    """``MLTUNER_READ_MY_WRITES``: unset or empty is on, ``0`` off, ``1`` on;
    anything else is refused."""
    return _switch_from_environment(READ_MY_WRITES_VARIABLE, default=True)


# The engine's own tuning variables, read in C++ where a bad value would
# only leave the default: checked here, where a job starts, with their ranges.
_ENGINE_VARIABLES: dict[str, tuple[int, int] | tuple[str, ...]] = {
    "MLTUNER_CPU_PASS_THREADS": (1, 64),
    "MLTUNER_SPIN_WAIT_US": (0, 10_000),
    "MLTUNER_SOCKET_THREADS": ("python",),
    "MLTUNER_MALLOC_TUNING": ("0", "1"),
}


def check_engine_environment() -> None:
    """Refuses a set engine variable whose value the engine would ignore
    (InvalidArgumentError naming it and what it takes); unset or empty is
    the default."""
    for variable, accepted in _ENGINE_VARIABLES.items():
        value = os.environ.get(variable, "").strip()
        if not value:
            continue
        if isinstance(accepted[0], int):
            low, high = accepted
            if not (value.isdigit() and low <= int(value) <= high):
                raise InvalidArgumentError(f"{variable} must be an integer in [{low}, {high}], got {value!r}")
        elif value.lower() not in accepted:
            raise InvalidArgumentError(f"{variable} must be {' or '.join(map(str, accepted))} (or unset), "
                                       f"got {value!r}")


def _switch_from_environment(variable: str, *, default: bool) -> bool:
    value = os.environ.get(variable, "").strip()
    if value == "":
        return default
    if value in ("0", "1"):
        return value == "1"
    raise InvalidArgumentError(f"{variable} must be 0 or 1, got {value!r}")


def _validate_rule(rule: UpdateRule) -> None:
    """Checks an UpdateRule's values (kept apart from the class so that new
    fields add their own lines here)."""
    real("UpdateRule.learning_rate", rule.learning_rate, 0, MAX_LEARNING_RATE)
    real("UpdateRule.momentum", rule.momentum, 0, 1, high_open=True)
    real("UpdateRule.beta1", rule.beta1, 0, 1, high_open=True)
    real("UpdateRule.beta2", rule.beta2, 0, 1, high_open=True)
    real("UpdateRule.epsilon", rule.epsilon, 0, 1, low_open=True)
    real("UpdateRule.dampening", rule.dampening, 0, 1)
    real("UpdateRule.weight_decay", rule.weight_decay, 0, MAX_WEIGHT_DECAY)
    boolean("UpdateRule.nesterov", rule.nesterov)
    boolean("UpdateRule.amsgrad", rule.amsgrad)
    if rule.nesterov and (not rule.momentum or rule.dampening != 0):
        raise InvalidArgumentError("UpdateRule: nesterov needs momentum > 0 and dampening 0 (as torch.optim.SGD)")
