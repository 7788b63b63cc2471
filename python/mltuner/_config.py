"""Engine configuration as a typed dataclass."""

from __future__ import annotations

import dataclasses
from typing import Literal

from mltuner import _core

__all__ = ["Config", "UpdateRule"]

RuleName = Literal["add", "sgd", "momentum", "adam"]


@dataclasses.dataclass(frozen=True)
class UpdateRule:
    """The server-side update rule applied once per clock to the combined
    updates of all workers.

    ``add`` adds the sum of the workers' updates (the application sends deltas).
    ``sgd``, ``momentum`` and ``adam`` treat updates as gradients, average them
    over workers (as synchronous data-parallel SGD does) and take one step:
    momentum is ``h = (1 - m) g + m h; w -= lr h``.
    """

    kind: RuleName = "add"
    learning_rate: float = 0.01
    momentum: float = 0.9
    beta1: float = 0.9
    beta2: float = 0.999
    epsilon: float = 1e-8

    def __post_init__(self) -> None:
        if self.kind not in ("add", "sgd", "momentum", "adam"):
            raise ValueError(f"unknown update rule {self.kind!r}: use add, sgd, momentum or adam")
        if not self.learning_rate >= 0:
            raise ValueError(f"learning_rate must be >= 0, got {self.learning_rate}")
        if not 0 <= self.momentum < 1:
            raise ValueError(f"momentum must be in [0, 1), got {self.momentum}")


@dataclasses.dataclass(frozen=True)
class Config:
    """Settings of every worker's engine.

    Args:
        device_memory_budget: bytes of device memory for the parameter cache,
            local data and access buffers; 0 means as much as needed. With a
            smaller budget, parameters and local data live in host memory and
            are swapped in ahead of use; below the least access-buffer pool
            (``1 + prefetch_clocks`` regions, each one clock's buffers packed
            by lifetime; ``Worker.stats["pool_min_bytes"]``),
            :class:`~mltuner.ResourceExhaustedError` says exactly how much is
            needed.
        wait_timeout_s: every blocking wait gives up after this many seconds
            with :class:`~mltuner.WaitTimeoutError`.
        prefetch_clocks: how many clocks the allocator thread may prepare
            ahead of the application (1 = double buffering).
        partitions_per_table: partition locks per table in the client cache.
        update_rule: the server-side update rule.
        device: ``"cpu"`` (host memory, buffers are numpy arrays) or ``"cuda"``
            (worker r on GPU r mod count; buffers are :class:`DeviceArray`
            objects for ``torch.from_dlpack`` / ``cupy.from_dlpack``).
        branches: run each clock on the branch the application scheduled
            (:meth:`Worker.schedule_branch`), as the tuner does; off, every
            clock runs on branch 0 and nothing needs scheduling.
        max_branches: live branches (copies of the parameters and optimizer
            state) a shard may hold at once.
    """

    device_memory_budget: int = 0
    wait_timeout_s: float = 60.0
    prefetch_clocks: int = 1
    partitions_per_table: int = 8
    update_rule: UpdateRule = dataclasses.field(default_factory=UpdateRule)
    device: Literal["cpu", "cuda"] = "cpu"
    branches: bool = False
    max_branches: int = 40

    def __post_init__(self) -> None:
        if self.device not in ("cpu", "cuda"):
            raise ValueError(f"unknown device {self.device!r}: use 'cpu' or 'cuda'")
        if self.device_memory_budget < 0:
            raise ValueError("device_memory_budget must be >= 0")
        if not self.wait_timeout_s > 0:
            raise ValueError("wait_timeout_s must be > 0")
        if self.prefetch_clocks < 1:
            raise ValueError("prefetch_clocks must be >= 1")
        if self.partitions_per_table < 1:
            raise ValueError("partitions_per_table must be >= 1")
        if self.max_branches < 1:
            raise ValueError("max_branches must be >= 1")

    def to_core(self) -> _core.Config:
        """The engine's own config object."""
        core = _core.Config()
        core.device_memory_budget = int(self.device_memory_budget)
        core.wait_timeout_ms = max(1, int(self.wait_timeout_s * 1000))
        core.prefetch_clocks = int(self.prefetch_clocks)
        core.partitions_per_table = int(self.partitions_per_table)
        rule = _core.UpdateRuleConfig()
        rule.kind = getattr(_core.UpdateRuleKind, self.update_rule.kind)
        rule.learning_rate = self.update_rule.learning_rate
        rule.momentum = self.update_rule.momentum
        rule.beta1 = self.update_rule.beta1
        rule.beta2 = self.update_rule.beta2
        rule.epsilon = self.update_rule.epsilon
        core.update_rule = rule
        core.branches = bool(self.branches)
        core.max_branches = int(self.max_branches)
        return core
