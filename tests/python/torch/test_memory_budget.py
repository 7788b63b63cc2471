"""A model larger than the engine's memory budget trains, with activations
stored as local data, and gives bit for bit the results of an unlimited run.

On the CPU backend the "device" memory is host memory too, but the budget
applies all the same (Config.device_memory_budget): the engine places what
does not fit in its host stores and swaps it into the buffer pool ahead of
each access, exactly as on a GPU. The adapter holds only one layer's
parameters at a time (each layer is read for its forward and again for its
backward), so the pool needs twice the largest layer's working set, not the
model.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import pytest

torch = pytest.importorskip("torch")

import torch.nn.functional as F  # noqa: E402
from torch import nn  # noqa: E402

import mltuner  # noqa: E402
import mltuner.torch as mt  # noqa: E402
from mltuner import Config, LocalCluster, UpdateRule, Worker  # noqa: E402

WIDTH, DEPTH, BATCH, CLASSES, CLOCKS, NUM_WORKERS = 64, 8, 16, 10, 8, 2


def make_model() -> nn.Module:
    torch.manual_seed(0)
    layers: list[nn.Module] = []
    for _ in range(DEPTH):
        layers += [nn.Linear(WIDTH, WIDTH), nn.ReLU()]
    return nn.Sequential(*layers, nn.LayerNorm(WIDTH), nn.Linear(WIDTH, CLASSES))


def make_data() -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(3)
    x = torch.randn(CLOCKS, NUM_WORKERS, BATCH, WIDTH, generator=generator)
    y = torch.randint(0, CLASSES, (CLOCKS, NUM_WORKERS, BATCH), generator=generator)
    return x, y


def train(budget: int, store_activations: bool, run_workers: Callable[..., list[Any]]) -> dict[str, Any]:
    x, y = make_data()
    initial = make_model()
    models = [copy.deepcopy(initial) for _ in range(NUM_WORKERS)]
    config = Config(device_memory_budget=budget, wait_timeout_s=20,
                    update_rule=UpdateRule("momentum", learning_rate=0.05, momentum=0.9))

    def body(worker: Worker) -> tuple[dict[str, torch.Tensor], list[float]]:
        r = worker.rank
        ps_model = mt.wrap(models[r], worker, example_input=x[0, r], store_activations=store_activations)
        losses = []
        for c in range(CLOCKS):
            loss = F.cross_entropy(ps_model(x[c, r]), y[c, r])
            loss.backward()
            ps_model.step()
            losses.append(loss.item())
        return ps_model.state_dict(), losses

    with LocalCluster(NUM_WORKERS, config) as cluster:
        results = run_workers(body, cluster.workers, on_error=cluster.shutdown)
        return {
            "state": results[0][0],
            "losses": [losses for _, losses in results],
            "stats": [w.stats for w in cluster.workers],
            "plans": [w.plan for w in cluster.workers],
        }


def test_model_larger_than_the_budget_trains_bit_identically(run_workers: Callable[..., list[Any]]) -> None:
    model_bytes = sum(p.numel() * 4 for p in make_model().parameters())
    plain = train(0, store_activations=False, run_workers=run_workers)
    unlimited = train(0, store_activations=True, run_workers=run_workers)
    # The least budget the engine accepts: the packed pool, a region per
    # clock in flight.
    budget = unlimited["stats"][0]["pool_min_bytes"]
    assert budget < model_bytes / 2, (budget, model_bytes)  # the parameters alone need twice the budget
    limited = train(budget, store_activations=True, run_workers=run_workers)

    for rank in range(NUM_WORKERS):
        big, small = unlimited["stats"][rank], limited["stats"][rank]
        assert big["host_store_bytes"] == 0 and big["bytes_swapped_in"] == 0, unlimited["plans"][rank]
        # Parameters (cache and update log) and activations all live in host memory ...
        assert small["device_store_bytes"] == 0, limited["plans"][rank]
        assert small["host_store_bytes"] > 2 * model_bytes, limited["plans"][rank]
        # ... and reach the pool by swapping.
        assert small["bytes_swapped_in"] > CLOCKS * model_bytes, limited["plans"][rank]
        assert small["pool_bytes"] == budget

    # Storing activations and swapping change where bytes live, never a value.
    assert unlimited["losses"] == plain["losses"]
    assert limited["losses"] == plain["losses"]
    assert plain["losses"][0][-1] < plain["losses"][0][0]  # it trains
    for name, value in plain["state"].items():
        assert torch.equal(unlimited["state"][name], value), name
        assert torch.equal(limited["state"][name], value), name


def test_budget_below_twice_the_largest_layer_is_refused_clearly() -> None:
    x, _ = make_data()
    model = make_model()
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    with LocalCluster(1, Config(device_memory_budget=4096, wait_timeout_s=20)) as cluster:
        with pytest.raises(mltuner.ResourceExhaustedError, match="budget"):
            mt.wrap(model, cluster.worker(0), example_input=x[0, 0], store_activations=True)
    # A failed wrap gives the module back as it was, hooks removed.
    for name, param in model.named_parameters():
        assert torch.equal(param.detach(), before[name]), name
    assert not any(m._forward_pre_hooks for m in model.modules())
    model(x[0, 0]).sum().backward()
