"""``wrap()``'s last step under a device budget: stored activations that the
plan keeps on the device anyway are kept by autograd instead.

A stored activation costs the clock two device copies (into the local
table in the forward, out of it in the backward pass), a hook each way and
two engine ops, even when the plan never swaps it: measured on an H100,
ResNet-18 on 224x224 images given FSDP's peak memory ran at 0.75 of no
budget with nothing swapped (1.00 with this step). Kept by autograd, as without
``store_activations``, it costs nothing; its bytes are reserved from the
engine's budget instead (:meth:`mltuner.Worker.reserve_device_memory`), so
that the two together hold what the budget allows.

After the plan is final (``recompute="auto"`` has chosen), the clock is
recorded again with, in order of preference:

1. no stored activations at all, when the plan kept every stored one on the
   device and ``recompute`` is ``"auto"``: autograd keeps every saved
   tensor, recomputed ones too, and the clock takes the path of a model
   without ``store_activations`` (reserving every saved byte);
2. the stored activations the plan kept on the device, kept by autograd.

The first whose plan fits and moves no more bytes over the host link than
the plan before it is kept; if none does, the plan before it is recorded
again.
"""

from __future__ import annotations

import dataclasses

from mltuner.torch._clock import ClockDriver

__all__ = ["KeepOnDevice", "Variant"]


@dataclasses.dataclass(frozen=True)
class Variant:
    """One way to record the clock: what to recompute (``"cheap"``,
    ``"compute"`` or ``"none"``), whether to store activations, which saved
    activations (by slot) autograd keeps on the device, and their bytes."""

    recompute: str
    store: bool
    keep: frozenset[int] = frozenset()
    reserved: int = 0
    name: str = ""  # in words, for PSModule.plan
    why: str = ""  # ... when this variant is kept


class KeepOnDevice:
    """The keep step of one ``wrap()`` (module docstring): told of each
    final plan, it says which variant to record next, if any."""

    def __init__(self, *, recompute_auto: bool) -> None:
        self._auto = recompute_auto
        self._left: list[Variant] | None = None  # None: no final plan seen yet
        self._base: Variant | None = None
        self._base_link = 0
        self._trying: Variant | None = None
        self._refused: list[str] = []
        self.choice = ""  # what was kept, and why (for PSModule.plan)

    def after_plan(self, driver: ClockDriver, current: Variant) -> Variant | None:
        """``driver`` prepared a final plan of ``current``: the variant to
        record next, or None to commit this plan."""
        if self._left is None:
            self._base, self._base_link = current, driver.link_bytes
            self._left = self._variants(driver, current)
        elif self._trying is not None:
            if driver.link_bytes <= self._base_link:
                self.choice = "; ".join([self._trying.why, *self._refused])
                self._trying, self._left = None, []
                return None
            self._refused.append(f"{self._trying.name}: moves {driver.link_bytes} B a clock over the host link, more "
                                 f"than {self._base_link} B")
        return self._next()

    def refused(self, why: str) -> Variant | None:
        """The variant being tried did not fit (``why``): the next to
        record, or None when no variant was being tried."""
        if self._trying is None:
            return None
        self._refused.append(f"{self._trying.name}: did not fit ({why})")
        return self._next()

    def _next(self) -> Variant | None:
        if self._left:
            self._trying = self._left.pop(0)
            return self._trying
        if self._trying is None:
            return None
        self._trying = None  # every variant refused: the plan before them again
        self.choice = "kept none with autograd: " + "; ".join(self._refused)
        return self._base

    def _variants(self, driver: ClockDriver, current: Variant) -> list[Variant]:
        if not current.store or driver.budget_bytes == 0:
            return []
        slots, every_one = driver.device_slots()
        if not slots:
            return []
        sizes = driver.slot_bytes
        variants = []
        if self._auto and every_one and current.recompute != "none":
            total = sum(sizes)
            variants.append(Variant("none", False, reserved=total, name="storing none", why=(
                f"no activation stored: the plan kept every stored one on the device, so autograd keeps all "
                f"{len(sizes)} saved tensors, {total} B reserved from the device budget")))
        kept = sum(sizes[slot] for slot in slots)
        variants.append(Variant(current.recompute, True, slots, kept, name="keeping those on the device",
                                why="autograd keeps the stored activations the plan kept on the device"))
        return variants
