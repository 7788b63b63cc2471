"""A model whose parameters and optimizer state exceed the device trains with
no budget set by hand (issue 16's third benchmark, on the CPU): the engine
chooses a budget from the device's free memory less the reserve, the server
shard's state goes to host memory, the parameters equal an unconstrained
run's bit for bit, and a host too small for that is refused by the guard at
wrap(), before the first clock, with the sizes named.

The CPU backend is given a capacity (Config.cpu_device_capacity): its
allocations past it fail as cudaMalloc's do, and it reports its free memory
as cudaMemGetInfo would.
"""

from __future__ import annotations

import re
from typing import Any

import pytest

torch = pytest.importorskip("torch")

from torch import nn  # noqa: E402

import mltuner  # noqa: E402
import mltuner.torch as mt  # noqa: E402
from mltuner import Config, LocalCluster, UpdateRule  # noqa: E402

WIDTH, DEPTH, BATCH, CLOCKS = 128, 6, 8, 5
RULE = UpdateRule("momentum", learning_rate=0.05, momentum=0.9)


def make_model() -> nn.Module:
    torch.manual_seed(0)
    layers: list[nn.Module] = []
    for i in range(DEPTH):
        layers.append(nn.Linear(WIDTH, WIDTH, bias=False))
        if i + 1 < DEPTH:
            layers.append(nn.ReLU())
    return nn.Sequential(*layers)


def train(**config: Any) -> dict[str, Any]:
    x = torch.randn(CLOCKS, BATCH, WIDTH, generator=torch.Generator().manual_seed(1))
    with LocalCluster(1, Config(wait_timeout_s=20, update_rule=RULE, **config)) as cluster:
        worker = cluster.worker(0)
        model = mt.wrap(make_model(), worker, example_input=x[0])
        for c in range(CLOCKS):
            model(x[c]).pow(2).mean().backward()
            model.step()
        return {"state": model.state_dict(), "stats": worker.stats, "plan": worker.plan,
                "hold_reads": model.hold_reads, "released": worker._host_freed_during_init}


def model_bytes() -> int:
    return sum(p.numel() * 4 for p in make_model().parameters())


def test_model_larger_than_the_device_trains_bit_identically_with_an_automatic_budget() -> None:
    unconstrained = train()
    stats = unconstrained["stats"]
    assert stats["budget_bytes"] == 0 and not stats["automatic_budget"], unconstrained["plan"]
    assert stats["device_free_at_plan_bytes"] == -1  # no capacity: nothing to choose
    need = stats["pool_bytes"] + stats["device_store_bytes"]
    weights = model_bytes()
    assert need >= 2 * weights  # the cache and its update log
    # A device smaller than the plan and far smaller than the shard's
    # weights + momentum (2 x weights), no budget set; a reserve for torch.
    reserve = 4 * WIDTH * WIDTH * 4  # torch is on the CPU here; the engine's initial-value buffers (a layer each) use it
    capacity = weights + reserve
    assert capacity < need and capacity < 2 * weights
    small = train(cpu_device_capacity=capacity, device_memory_reserve=reserve)
    stats = small["stats"]
    assert stats["automatic_budget"], small["plan"]
    assert stats["device_free_at_plan_bytes"] == capacity  # nothing was on the device before the plan
    assert stats["device_reserve_bytes"] == reserve
    assert stats["budget_bytes"] == capacity - reserve
    assert stats["pool_bytes"] + stats["device_store_bytes"] <= stats["budget_bytes"]
    assert stats["host_store_bytes"] > 0 and stats["bytes_swapped_in"] > 0, small["plan"]
    # What does not fit after the plan: the shard's state, in host memory.
    assert stats["shard_in_host_memory"], small["plan"]
    assert re.match(r"automatic device_memory_budget \d+ B \(none set", small["plan"]), small["plan"]
    assert small["hold_reads"] is False  # the whole model cannot be held through the backward pass
    for name, value in unconstrained["state"].items():
        assert torch.equal(small["state"][name], value), name
    assert not torch.equal(unconstrained["state"]["0.weight"], make_model().state_dict()["0.weight"])  # it trained


def test_the_initial_values_freed_as_written_make_room_for_the_shard_state(monkeypatch: pytest.MonkeyPatch) -> None:
    """wrap() frees its host copy of each layer's initial values once worker
    0 wrote it, and says so (Worker.release_host_memory_during_init): a
    shard whose state lives in host memory allocates each table's as it is
    written, so the host needs the state, not the state and the copies. With
    the kernel's headroom patched to exactly that, the model trains to the
    same bits."""
    import mltuner.client._host_memory as host_memory

    weights = model_bytes()
    reserve = 4 * WIDTH * WIDTH * 4
    config = {"cpu_device_capacity": weights + reserve, "device_memory_reserve": reserve}
    reference = train(**config)
    assert reference["stats"]["shard_in_host_memory"] and reference["released"] == weights
    need = reference["stats"]["host_memory_bytes"]  # the shard's state (2 x weights) included
    monkeypatch.setattr(host_memory, "headroom", lambda: host_memory.Headroom(need - weights, "a patched headroom"))
    tight = train(**config)
    for name, value in reference["state"].items():
        assert torch.equal(tight["state"][name], value), name
    monkeypatch.setattr(host_memory, "headroom", lambda: host_memory.Headroom(need - weights - 1, "a patched headroom"))
    with pytest.raises(mltuner.ResourceExhaustedError,
                       match=rf"may use only {need - 1} bytes .*a patched headroom, and the {weights} bytes the "
                             r"application frees while it writes initial values"):
        train(**config)


def test_host_too_small_for_the_shard_state_is_refused_at_wrap_with_the_sizes() -> None:
    weights = model_bytes()
    x = torch.randn(BATCH, WIDTH)
    model = make_model()
    with LocalCluster(1, Config(wait_timeout_s=20, update_rule=RULE, cpu_device_capacity=weights,
                                device_memory_reserve=0, host_memory_limit=1 << 20)) as cluster:
        worker = cluster.worker(0)
        with pytest.raises(mltuner.ResourceExhaustedError) as refused:
            mt.wrap(model, worker, example_input=x)
        assert worker.stats["clock"] == 0
    message = str(refused.value)
    # The shard's rows of every table with their momentum: 2 x the weights.
    assert f"the server shard's state {2 * weights} B" in message, message
    assert "host_memory_limit=1048576" in message, message
