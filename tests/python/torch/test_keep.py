"""Stored activations the plan keeps on the device stay with autograd
(wrap()'s keep step, mltuner/torch/_keep.py): the same bits as storing
them, their bytes reserved from the engine's budget, no more bytes over
the host link than the plan that stored them.

The models and the training loop are test_recompute's. Budgets are counted
from twice the least pool of the recomputing plan without a budget (two
regions): there the plan keeps three of the seven stored activations on the
device; eight activations more and it keeps all seven."""

from __future__ import annotations

import functools
import re
from typing import Any

import pytest

torch = pytest.importorskip("torch")

import mltuner  # noqa: E402
from mltuner.torch._clock import ClockDriver  # noqa: E402
from test_recompute import (ACT_BYTES, assert_same_training, resnet, resnet_data,  # type: ignore[import-not-found]  # noqa: E402
                            resnet_loss, train)

make = functools.partial(resnet, False)


def base_budget() -> int:
    return 2 * int(train(make, resnet_data(), resnet_loss, "cheap")["stats"]["pool_min_bytes"])


def local_data(plan: str) -> tuple[int, int]:
    """The plan's stored activations on the device: (entries, bytes)."""
    found = re.search(r"local data: (\d+) entries on the device \((\d+) B\)", plan)
    assert found, plan
    return int(found[1]), int(found[2])


def kept_on_device(saved: list[str]) -> set[str]:
    return {line.split(" ")[0] for line in saved if line.endswith(": kept by autograd (on the device)")}


def stores(run: dict[str, Any]) -> set[str]:
    return {access.split("saved activation ")[1].split(" ")[0] for access in run["accesses"]
            if "store of saved activation" in access}


def test_the_activations_the_plan_keeps_on_the_device_stay_with_autograd(monkeypatch: pytest.MonkeyPatch) -> None:
    data = resnet_data()
    budget = base_budget()
    with monkeypatch.context() as patch:
        patch.setattr("mltuner.torch._keep.KeepOnDevice._variants", lambda self, driver, current: [])
        planned = train(make, data, resnet_loss, "cheap", budget)
    kept = train(make, data, resnet_loss, "cheap", budget)
    assert_same_training(kept, train(make, data, resnet_loss, "none"))

    entries, device_bytes = local_data(planned["plan"])
    assert (entries, device_bytes) == (3, 2 * ACT_BYTES + ACT_BYTES * 3 // 8), planned["plan"]  # the input and two
    numbers = kept_on_device(kept["saved"])
    assert len(numbers) == entries, kept["saved"]
    assert (f"{entries} of the stored ones kept by autograd on the device ({device_bytes} B, reserved from the "
            f"device budget) (autograd keeps the stored activations the plan kept on the device)") in kept["plan"]
    assert (f"device_memory_budget {budget - device_bytes} B for the engine ({budget} B set by hand, less the "
            f"{device_bytes} B the application keeps beside it)") in kept["plan"], kept["plan"]
    assert not numbers & stores(kept) and stores(kept) == stores(planned) - numbers
    # The pool lost the buffers of their stores and loads: the engine's own
    # stores moved no more bytes over the host link, here fewer.
    moved = [r["stats"]["predicted_bytes_to_device_per_clock"] for r in (planned, kept)]
    assert moved[1] < moved[0], moved


def test_a_recomputation_reads_an_activation_autograd_keeps() -> None:
    """With every stored activation on the device (recompute='cheap' given:
    the keep step cannot drop the recomputation), the batch norms' inputs are
    kept by autograd and the recomputations read them from there."""
    data = resnet_data()
    kept = train(make, data, resnet_loss, "cheap", base_budget() + 8 * ACT_BYTES)
    assert_same_training(kept, train(make, data, resnet_loss, "none"))
    numbers = kept_on_device(kept["saved"])
    assert len(numbers) == 7 and not stores(kept), kept["saved"]
    sources = [re.findall(r"#\d+", line.split("recomputed from ")[1]) for line in kept["saved"]
               if ": recomputed from " in line]
    assert len(sources) == 4 and all(set(found) <= numbers | {"#4"} for found in sources), kept["saved"]
    assert local_data(kept["plan"]) == (0, 0)


def test_auto_stores_nothing_when_the_plan_keeps_every_stored_activation_on_the_device() -> None:
    """recompute='auto': autograd keeps every saved tensor (recomputed ones
    too), and the clock is the one of a model without store_activations."""
    data = resnet_data()
    budget = base_budget() + 16 * ACT_BYTES
    auto = train(make, data, resnet_loss, "auto", budget)
    assert_same_training(auto, train(make, data, resnet_loss, "none"))
    assert auto["saved"] == [] and not stores(auto)
    assert "no activation stored: the plan kept every stored one on the device, so autograd keeps all 22 saved " \
           "tensors" in auto["plan"], auto["plan"]
    assert auto["plan"].startswith("hold_reads=True"), auto["plan"]


def test_keeping_is_given_up_where_it_does_not_fit(monkeypatch: pytest.MonkeyPatch) -> None:
    """A kept plan that does not fit, or moves more bytes than storing (both
    made to happen here), gives way to the plan before it, recorded again."""
    data = resnet_data()
    budget = base_budget() + 16 * ACT_BYTES
    with monkeypatch.context() as patch:
        patch.setattr("mltuner.torch._keep.KeepOnDevice._variants", lambda self, driver, current: [])
        planned = train(make, data, resnet_loss, "auto", budget)
    prepare = ClockDriver.prepare_plan

    def refuse_keeping(driver: ClockDriver, hold_reads: bool | None, tables: Any = None, reserved: int = 0) -> None:
        prepare(driver, hold_reads, tables, reserved)
        if reserved:
            raise mltuner.ResourceExhaustedError("a test refusal")

    with monkeypatch.context() as patch:
        patch.setattr(ClockDriver, "prepare_plan", refuse_keeping)
        refused = train(make, data, resnet_loss, "auto", budget)
    assert ("kept none with autograd: storing none: did not fit (a test refusal); keeping those on the device: did "
            "not fit (a test refusal)") in refused["plan"], refused["plan"]
    assert refused["saved"] == planned["saved"] and stores(refused) == stores(planned)
    assert refused["stats"]["device_store_bytes"] == planned["stats"]["device_store_bytes"]
    assert_same_training(refused, planned)

    real = ClockDriver.link_bytes

    def more_when_kept(driver: ClockDriver) -> int:
        return int(real.fget(driver)) + (1 if driver._acts.kept_bytes or not driver._store_activations else 0)

    with monkeypatch.context() as patch:
        patch.setattr(ClockDriver, "link_bytes", property(more_when_kept))
        more = train(make, data, resnet_loss, "auto", budget)
    assert ("kept none with autograd: storing none: moves 1 B a clock over the host link, more than 0 B; keeping "
            "those on the device: moves 1 B") in more["plan"], more["plan"]
    assert more["saved"] == planned["saved"]
