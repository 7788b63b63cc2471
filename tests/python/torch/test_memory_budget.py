"""A model larger than the engine's memory budget trains, with activations
stored as local data, and gives bit for bit the results of an unlimited run;
wrap() chooses held reads or the GeePS pattern by the budget (issue 16
item 5), and refuses a budget or a host-memory limit that cannot work, with
the bytes needed.

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
import re
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


def train(budget: int, store_activations: bool, run_workers: Callable[..., list[Any]],
          hold_reads: bool | None = None, prefetch_clocks: int | None = 1) -> dict[str, Any]:
    """Trains a model on 2 workers. ``prefetch_clocks`` is 1 unless given
    (None: the plan chooses), so the sizes asserted on are two regions'."""
    x, y = make_data()
    initial = make_model()
    models = [copy.deepcopy(initial) for _ in range(NUM_WORKERS)]
    config = Config(device_memory_budget=budget, wait_timeout_s=20, prefetch_clocks=prefetch_clocks,
                    update_rule=UpdateRule("momentum", learning_rate=0.05, momentum=0.9))

    def body(worker: Worker) -> tuple[dict[str, torch.Tensor], list[float], bool, str]:
        r = worker.rank
        ps_model = mt.wrap(models[r], worker, example_input=x[0, r], store_activations=store_activations,
                           hold_reads=hold_reads)
        losses = []
        for c in range(CLOCKS):
            loss = F.cross_entropy(ps_model(x[c, r]), y[c, r])
            loss.backward()
            ps_model.step()
            losses.append(loss.item())
        return ps_model.state_dict(), losses, ps_model.hold_reads, ps_model.plan

    with LocalCluster(NUM_WORKERS, config) as cluster:
        results = run_workers(body, cluster.workers, on_error=cluster.shutdown)
        return {
            "state": results[0][0],
            "losses": [result[1] for result in results],
            "hold_reads": [result[2] for result in results],
            "model_plans": [result[3] for result in results],
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
        # Parameters (cache rows; each layer is updated once a clock, so no
        # update log) and activations all live in host memory ...
        assert small["device_store_bytes"] == 0, limited["plans"][rank]
        assert small["host_store_bytes"] > model_bytes, limited["plans"][rank]
        # ... and reach the pool by swapping.
        assert small["bytes_swapped_in"] > CLOCKS * model_bytes, limited["plans"][rank]
        assert small["pool_bytes"] == budget

    # A budget between: placed by value, some stores keep the device and
    # the rest swap, within one clock.
    local_bytes = unlimited["stats"][0]["device_store_bytes"] - model_bytes
    assert local_bytes > 0, unlimited["plans"][0]
    split = train(budget + local_bytes // 2, store_activations=True, run_workers=run_workers)
    for rank in range(NUM_WORKERS):
        assert re.search(r"device stores [1-9]\d* B, host stores [1-9]\d* B", split["plans"][rank]), \
            split["plans"][rank]
        assert "predicted per clock: host->device" in split["model_plans"][rank]
        assert split["stats"][rank]["predicted_bytes_to_device_per_clock"] > 0

    # Storing activations and swapping change where bytes live, never a value.
    assert unlimited["losses"] == plain["losses"]
    assert limited["losses"] == plain["losses"]
    assert split["losses"] == plain["losses"]
    assert plain["losses"][0][-1] < plain["losses"][0][0]  # it trains
    for name, value in plain["state"].items():
        assert torch.equal(unlimited["state"][name], value), name
        assert torch.equal(limited["state"][name], value), name


def test_one_pool_region_trains_bit_identically(run_workers: Callable[..., list[Any]]) -> None:
    # prefetch_clocks=0: one region, so the least pool is half that of two,
    # and the budget beside it buys lookahead or stores; nothing is prepared
    # across the clock boundary, and no value changes.
    plain = train(0, store_activations=False, run_workers=run_workers)
    two = train(0, store_activations=True, run_workers=run_workers)["stats"][0]["pool_min_bytes"]
    one = train(0, store_activations=True, run_workers=run_workers, prefetch_clocks=0)["stats"][0]["pool_min_bytes"]
    assert 2 * one == two, (one, two)
    for budget in (one, one + one // 2):
        limited = train(budget, store_activations=True, run_workers=run_workers, prefetch_clocks=0)
        assert limited["stats"][0]["bytes_swapped_in"] > 0, limited["plans"][0]
        assert limited["losses"] == plain["losses"]
        for name, value in plain["state"].items():
            assert torch.equal(limited["state"][name], value), name


@pytest.mark.usefixtures("stores_as_planned")
def test_the_plan_chooses_one_region_below_two_regions_least_pool(run_workers: Callable[..., list[Any]]) -> None:
    # Config.prefetch_clocks left at None: without a budget the plan takes 1
    # (two regions, the next clock prepared during this one); under a budget
    # below two regions' least pool but above one's, 0, and the run is the
    # same bit for bit.
    plain = train(0, store_activations=False, run_workers=run_workers, prefetch_clocks=None)
    free = train(0, store_activations=True, run_workers=run_workers, prefetch_clocks=None)
    two = free["stats"][0]["pool_min_bytes"]
    one = train(0, store_activations=True, run_workers=run_workers, prefetch_clocks=0)["stats"][0]["pool_min_bytes"]
    assert 2 * one == two, (one, two)
    for rank in range(NUM_WORKERS):
        assert free["stats"][rank]["prefetch_clocks"] == 1, free["plans"][rank]
        assert "\nprefetch_clocks 1 (chosen: no device_memory_budget)\n" in free["plans"][rank]
    budget = (one + two) // 2
    limited = train(budget, store_activations=True, run_workers=run_workers, prefetch_clocks=None)
    for rank in range(NUM_WORKERS):
        stats, plan = limited["stats"][rank], limited["plans"][rank]
        assert stats["prefetch_clocks"] == 0, plan
        assert (f"\nprefetch_clocks 0 (chosen: the budget of {budget} bytes is below the least pool of two regions "
                f"({two} bytes), not of one ({one} bytes))\n") in plan, plan
        assert stats["pool_min_bytes"] == one and one <= stats["pool_bytes"] <= budget, plan
        assert stats["bytes_swapped_in"] > 0, plan
    # prefetch_clocks=1 set by hand: refused (run_workers re-raises a worker's error as an AssertionError).
    with pytest.raises(AssertionError, match=rf"ResourceExhaustedError: Config.device_memory_budget of {budget} bytes "
                                             rf"is too small for this model: it needs at least {two} bytes"):
        train(budget, store_activations=True, run_workers=run_workers, prefetch_clocks=1)
    assert limited["losses"] == plain["losses"] == free["losses"]
    for name, value in plain["state"].items():
        assert torch.equal(limited["state"][name], value), name
        assert torch.equal(free["state"][name], value), name


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


def least_pools(run_workers: Callable[..., list[Any]], prefetch_clocks: int = 1) -> tuple[int, int]:
    """The least budgets of the two access patterns (pool_min_bytes of each
    plan): reading each layer again for its backward pass, and holding reads.
    With prefetch_clocks 0 (one region), those of the default Config
    (prefetch_clocks None), which takes one region rather than refuse."""
    rereading = train(0, False, run_workers, hold_reads=False,
                      prefetch_clocks=prefetch_clocks)["stats"][0]["pool_min_bytes"]
    holding = train(0, False, run_workers, hold_reads=True,
                    prefetch_clocks=prefetch_clocks)["stats"][0]["pool_min_bytes"]
    return rereading, holding


def test_wrap_chooses_held_reads_when_they_fit_and_rereads_below(run_workers: Callable[..., list[Any]]) -> None:
    """Every budget from the least up to unlimited trains to the same bits;
    wrap() holds reads where the budget holds their pool and the plan swaps
    no more than reading again would, and otherwise posts each layer's read
    after its forward and reads it again for the backward pass (what
    hold_reads=False used to have to be told): below held reads' least pool,
    and at it, where their pool leaves the parameters in host memory."""
    rereading, holding = least_pools(run_workers)
    assert rereading < holding / 2, (rereading, holding)  # one layer at a time against every layer at once
    reference = train(0, False, run_workers)
    assert reference["hold_reads"] == [True] * NUM_WORKERS
    assert "hold_reads=True (no Config.device_memory_budget)" in reference["model_plans"][0]
    # Held reads with every parameter on the device: their pool, and the stores.
    everything = max(stats["pool_bytes"] + stats["device_store_bytes"] for stats in reference["stats"])
    middle = (rereading + holding) // 2
    for budget, holds in [(rereading, False), (middle, False), (holding - 1, False), (holding, False),
                          (everything, True)]:
        run = train(budget, False, run_workers)
        assert run["hold_reads"] == [holds] * NUM_WORKERS, (budget, run["model_plans"])
        plan = run["model_plans"][0]
        if holds:
            assert f"the device_memory_budget of {budget} bytes holds the {holding} bytes" in plan, plan
            assert all(stats["predicted_bytes_to_device_per_clock"] == 0 for stats in run["stats"]), run["plans"]
        elif budget < holding:
            assert (f"hold_reads=False (the device_memory_budget of {budget} bytes is below the {holding} bytes "
                    f"of access-buffer pool that held reads need; reading each layer again for its backward pass "
                    f"needs {rereading} bytes)") in plan, plan
        else:  # held reads fit, with every parameter swapped in each clock: reading again keeps them
            match = re.search(rf"hold_reads=False \(the device_memory_budget of {budget} bytes holds the {holding} "
                              rf"bytes of access-buffer pool that held reads need, but then swaps (\d+) bytes a clock "
                              rf"over the host link; reading each layer again for its backward pass needs "
                              rf"{rereading} bytes of pool and swaps (\d+)\)", plan)
            assert match and int(match[2]) < int(match[1]), plan
        assert all(stats["pool_bytes"] <= budget for stats in run["stats"]), run["plans"]
        assert run["losses"] == reference["losses"], budget
        for name, value in reference["state"].items():
            assert torch.equal(run["state"][name], value), (budget, name)
    assert reference["losses"][0][-1] < reference["losses"][0][0]  # it trains


def test_a_budget_below_the_least_is_refused_at_wrap_with_the_bytes(run_workers: Callable[..., list[Any]]) -> None:
    x, _ = make_data()
    # The default Config refuses a budget below one region's least pool;
    # prefetch_clocks=1 one below two regions'.
    for prefetch_clocks, pool in [(None, r"1 region \(Config.prefetch_clocks=None takes one"), (1, "2 regions")]:
        rereading, holding = least_pools(run_workers, 0 if prefetch_clocks is None else 1)
        model = make_model()
        before = {n: p.detach().clone() for n, p in model.named_parameters()}
        config = Config(device_memory_budget=rereading - 1, wait_timeout_s=20, prefetch_clocks=prefetch_clocks)
        with LocalCluster(1, config) as cluster:
            with pytest.raises(mltuner.ResourceExhaustedError,
                               match=rf"Config.device_memory_budget of {rereading - 1} bytes is too small for this "
                                     rf"model: it needs at least {rereading} bytes .*\(hold_reads=False; the access-"
                                     rf"buffer pool: {pool}.*\); holding reads would need {holding} bytes"):
                mt.wrap(model, cluster.worker(0), example_input=x[0, 0])
        for name, param in model.named_parameters():
            assert torch.equal(param.detach(), before[name]), name  # given back as it was


def test_hold_reads_true_under_a_budget_too_small_for_it_is_refused_at_wrap(
        run_workers: Callable[..., list[Any]]) -> None:
    rereading, holding = least_pools(run_workers, prefetch_clocks=0)  # the default Config's: one region
    x, _ = make_data()
    for budget, advice in [(holding - 1, rf"without hold_reads \(unset, or False\) each layer's rows are read "
                                          rf"again for its backward pass, which needs {rereading} bytes"),
                           (rereading - 1, rf"even reading each layer again for its backward pass "
                                           rf"\(hold_reads=False\) needs {rereading} bytes")]:
        with LocalCluster(1, Config(device_memory_budget=budget, wait_timeout_s=20)) as cluster:
            with pytest.raises(mltuner.ResourceExhaustedError,
                               match=rf"wrap\(hold_reads=True\) needs a Config.device_memory_budget of at least "
                                     rf"{holding} bytes .* but the budget is {budget} bytes; {advice}"):
                mt.wrap(make_model(), cluster.worker(0), example_input=x[0, 0], hold_reads=True)
    with LocalCluster(1, Config(device_memory_budget=rereading - 1, wait_timeout_s=20)) as cluster:
        with pytest.raises(mltuner.ResourceExhaustedError, match=rf"it needs at least {rereading} bytes"):
            mt.wrap(make_model(), cluster.worker(0), example_input=x[0, 0], hold_reads=False)


def test_the_host_memory_guard_refuses_a_plan_over_the_limit_at_wrap() -> None:
    """Config.host_memory_limit below what the plan needs (on the CPU
    backend: the pool, the caches and update logs, staging, the update
    payloads in flight and the shard's state, which create_table counted
    and the plan counts in its place) is refused at wrap() with the sizes;
    at the need, it trains."""
    width = 384  # 4 layers of 0.6 MB: the plan needs several MiB (the limit's least is 1 MiB)

    def wide_model() -> nn.Module:
        torch.manual_seed(0)
        return nn.Sequential(*[nn.Linear(width, width) for _ in range(4)])

    x = torch.randn(BATCH, width, generator=torch.Generator().manual_seed(1))
    with LocalCluster(1, Config(wait_timeout_s=20)) as cluster:
        ps_model = mt.wrap(wide_model(), cluster.worker(0), example_input=x)
        plan_bytes = cluster.worker(0).stats["host_memory_bytes"]
        match = re.search(r"the server shard holds (\d+) B per branch in host memory", ps_model.plan)
        assert match is not None, ps_model.plan
        shard_bytes = int(match.group(1))
    assert f"the server shard's state {shard_bytes} B" in ps_model.plan, ps_model.plan  # in plan_bytes
    limit = plan_bytes
    too_little = limit - plan_bytes // 4  # the shard's slice fits (create_table), the plan does not
    assert too_little > max(shard_bytes, 2**20), (shard_bytes, plan_bytes)
    with LocalCluster(1, Config(wait_timeout_s=20, host_memory_limit=too_little)) as cluster:
        with pytest.raises(mltuner.ResourceExhaustedError,
                           match=rf"finish_virtual_iteration needs {plan_bytes} bytes .*: parameter stores and "
                                 rf"update logs 0 B, local data 0 B, device memory \(pool and device stores\) \d+ "
                                 rf"B, staging \d+ B, update payloads in flight \d+ B.* may use only "
                                 rf"{too_little} bytes .*Config\(host_memory_limit={too_little}\) minus the 0 bytes"):
            mt.wrap(wide_model(), cluster.worker(0), example_input=x)
    with LocalCluster(1, Config(wait_timeout_s=20, host_memory_limit=limit)) as cluster:
        ps_model = mt.wrap(wide_model(), cluster.worker(0), example_input=x)
        ps_model(x).sum().backward()
        ps_model.step()
        assert ps_model.clock == 1


def test_under_a_budget_wrap_chooses_smaller_layer_groups() -> None:
    """A child of four Linear layers is one layer (group_bytes): its least
    budget reads all four at once. Between that and the least of one module
    at a time, group_bytes=32 MiB is refused, naming smaller groups; the
    default (None) drops the refused plan's tables, reads the model in
    smaller layers and trains as group_bytes=0 does. Below the least of one
    module at a time the default is refused, saying what it tried. A
    refused wrap() leaves the worker without tables, to be wrapped again."""
    x = torch.randn(BATCH, WIDTH)

    def make() -> nn.Module:
        torch.manual_seed(0)
        return nn.Sequential(nn.Sequential(*(nn.Linear(WIDTH, WIDTH) for _ in range(4))), nn.Linear(WIDTH, CLASSES))

    def least(group_bytes: int) -> int:
        with LocalCluster(1, Config(device_memory_budget=4096, wait_timeout_s=20)) as cluster:
            with pytest.raises(mltuner.ResourceExhaustedError) as refused:
                mt.wrap(make(), cluster.worker(0), example_input=x, group_bytes=group_bytes)
        found = re.search(r"it needs at least (\d+) bytes", str(refused.value))
        assert found is not None, refused.value
        return int(found.group(1))

    grouped, one_by_one = least(32 << 20), least(0)
    assert one_by_one < grouped
    budget = (grouped + one_by_one) // 2
    with LocalCluster(1, Config(device_memory_budget=budget, wait_timeout_s=20)) as cluster:
        with pytest.raises(mltuner.ResourceExhaustedError, match=r"smaller groups \(group_bytes=4 << 20, or 0"):
            mt.wrap(make(), cluster.worker(0), example_input=x, group_bytes=32 << 20)
        # The refusal gave the tables back: the same worker takes other arguments.
        mt.wrap(make(), cluster.worker(0), example_input=x, group_bytes=0)
    losses = {}
    for group_bytes in (None, 0):
        with LocalCluster(1, Config(device_memory_budget=budget, wait_timeout_s=20)) as cluster:
            worker = cluster.worker(0)
            ps_model = mt.wrap(make(), worker, example_input=x, group_bytes=group_bytes)
            assert [t.name for t in worker.tables if not t.local] == [f"torch:0.{i}" for i in range(4)] + ["torch:1"], worker.tables
            steps = []
            for _ in range(3):
                loss = ps_model(x).square().mean()
                loss.backward()
                ps_model.step()
                steps.append(loss.item())
            losses[group_bytes] = steps
    assert losses[None] == losses[0]
    with LocalCluster(1, Config(device_memory_budget=one_by_one // 2, wait_timeout_s=20)) as cluster:
        with pytest.raises(mltuner.ResourceExhaustedError, match=r"tried smaller layer groups, down to group_bytes=0"):
            mt.wrap(make(), cluster.worker(0), example_input=x)
        assert cluster.worker(0).tables == []


def test_smaller_batches_and_shorter_sequences_train_like_torch_at_every_budget() -> None:
    """The recording's tensors size the local tables: a later clock may save
    smaller ones (a partial last batch, a shorter sequence), which their rows
    hold, at every budget from the least to unlimited."""
    torch.manual_seed(0)
    initial = nn.Sequential(nn.TransformerEncoderLayer(16, 2, 32, dropout=0.0, batch_first=True),
                            nn.TransformerEncoderLayer(16, 2, 32, dropout=0.0, batch_first=True),
                            nn.Linear(16, 4))
    generator = torch.Generator().manual_seed(1)
    shapes = [(4, 10), (4, 7), (3, 10), (1, 2), (4, 10), (2, 9)]  # the first, recorded, is the largest
    batches = [torch.randn(b, t, 16, generator=generator) for b, t in shapes]
    reference = copy.deepcopy(initial)
    optimizer = torch.optim.SGD(reference.parameters(), lr=0.05, momentum=0.9)
    want = []
    for x in batches:
        loss = reference(x).square().mean()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        want.append(loss.item())

    def run(budget: int) -> tuple[list[float], dict[str, torch.Tensor], dict[str, Any]]:
        config = Config(device_memory_budget=budget, wait_timeout_s=20,
                        update_rule=UpdateRule("sgd", learning_rate=0.05, momentum=0.9))
        with LocalCluster(1, config) as cluster:
            worker = cluster.worker(0)
            ps_model = mt.wrap(copy.deepcopy(initial), worker, example_input=batches[0], store_activations=True,
                               recompute="none")
            losses = []
            for x in batches:
                loss = ps_model(x).square().mean()
                loss.backward()
                ps_model.step()
                losses.append(loss.item())
            return losses, ps_model.state_dict(), worker.stats

    unlimited = run(0)
    least = unlimited[2]["pool_min_bytes"]
    for budget in (0, least, (least + unlimited[2]["device_store_bytes"]) // 2):
        losses, state, stats = run(budget)
        assert losses == unlimited[0]
        assert losses[0] == want[0] and losses == pytest.approx(want, rel=1e-5)
        for name, value in reference.state_dict().items():
            assert torch.equal(state[name], unlimited[1][name]), name
            assert torch.allclose(state[name], value, rtol=1e-5, atol=1e-6), name
        if budget == least:
            assert stats["bytes_swapped_in"] > 0  # the smaller tensors went through host memory too
