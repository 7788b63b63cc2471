"""Gradient accumulation: several forward and backward passes before one
step(), their gradients adding up in ``.grad`` as with a torch optimizer,
where reads are held without stored activations (wrap()'s default without
a budget): freely where updates ship at step(), and where they ship from
the backward pass with every pass but the last under ``model.no_sync()``
(DDP's API), or all of them, step() then shipping the sums.

The reference is plain PyTorch running the same loop (each micro-batch's
loss divided by their count, one optimizer step per clock); under BSP two
workers each accumulating half of the micro-batches equal one process
accumulating all of them. Elsewhere a second forward pass is refused with
the reason, and a second backward through one forward pass still is.
"""

from __future__ import annotations

import contextlib
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

LR, MOMENTUM = 0.05, 0.9
REL_TOL = 1e-5
MICRO, ROWS = 4, 4  # micro-batches per clock, rows each


def mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 3))


def data(clocks: int, seed: int = 1) -> list[list[tuple[torch.Tensor, torch.Tensor]]]:
    generator = torch.Generator().manual_seed(seed)
    return [[(torch.randn(ROWS, 6, generator=generator), torch.randint(0, 3, (ROWS,), generator=generator))
             for _ in range(MICRO)] for _ in range(clocks)]


def config() -> Config:
    return Config(wait_timeout_s=20, update_rule=UpdateRule("damped_momentum", learning_rate=LR, momentum=MOMENTUM))


def plain(model: nn.Module, clocks: list[list[tuple[torch.Tensor, torch.Tensor]]]) -> list[float]:
    optimizer = torch.optim.SGD(model.parameters(), lr=LR * (1 - MOMENTUM), momentum=MOMENTUM)
    losses = []
    for micro in clocks:
        for x, y in micro:
            loss = F.cross_entropy(model(x), y) / len(micro)
            loss.backward()
            losses.append(loss.item())
        optimizer.step()
        optimizer.zero_grad()
    return losses


@pytest.mark.parametrize("together", [False, True], ids=["a backward per pass", "one backward of the sum"])
def test_accumulated_micro_batches_train_as_plain_pytorch(together: bool,
                                                         max_rel_error: Callable[..., float],
                                                         moved: Callable[..., float]) -> None:
    torch.manual_seed(0)
    initial = mlp()
    clocks = data(12)
    reference = copy.deepcopy(initial)
    want_losses = plain(reference, clocks)

    with LocalCluster(1, config()) as cluster:
        ps_model = mt.wrap(copy.deepcopy(initial), cluster.worker(0), example_input=clocks[0][0][0])
        got_losses = []
        for micro in clocks:
            losses = []
            for k, (x, y) in enumerate(micro):
                loss = F.cross_entropy(ps_model(x), y) / len(micro)
                if not together:
                    loss.backward()
                losses.append(loss)
                if k == 1:
                    with torch.no_grad():  # an evaluation between passes reads the servers' values
                        ps_model(x)
            if together:
                torch.stack(losses).sum().backward()
            ps_model.step()
            got_losses += [loss.item() for loss in losses]
        assert ps_model.clock == len(clocks)
        got = ps_model.state_dict()

    assert moved(initial, reference) > 1e-2
    assert got_losses[:MICRO] == want_losses[:MICRO]  # the first clock: the same parameters, bit for bit
    assert max(abs(a - b) / abs(b) for a, b in zip(got_losses, want_losses)) <= REL_TOL
    assert max_rel_error(got, reference.state_dict()) <= REL_TOL


def train_no_sync(ps_model: Any, clocks: list[list[tuple[torch.Tensor, torch.Tensor]]], *,
                  last_outside: bool) -> list[float]:
    """Every micro-batch but the last under no_sync() (or all of them)."""
    losses = []
    for micro in clocks:
        for k, (x, y) in enumerate(micro):
            inside = not (last_outside and k == len(micro) - 1)
            with ps_model.no_sync() if inside else contextlib.nullcontext():
                loss = F.cross_entropy(ps_model(x), y) / len(micro)
            loss.backward()
            losses.append(loss.item())
        ps_model.step()
    return losses


@pytest.mark.parametrize("overlap", [True, False], ids=["shipped from backward", "shipped at step"])
@pytest.mark.parametrize("last_outside", [True, False], ids=["last pass outside", "every pass inside"])
def test_no_sync_accumulates_as_plain_pytorch(overlap: bool, last_outside: bool,
                                              max_rel_error: Callable[..., float]) -> None:
    torch.manual_seed(0)
    initial = mlp()
    clocks = data(8, seed=3)
    reference = copy.deepcopy(initial)
    want_losses = plain(reference, clocks)
    with LocalCluster(1, config()) as cluster:
        ps_model = mt.wrap(copy.deepcopy(initial), cluster.worker(0), example_input=clocks[0][0][0],
                           overlap_updates=overlap)
        got_losses = train_no_sync(ps_model, clocks, last_outside=last_outside)
        got = ps_model.state_dict()
    assert got_losses[:MICRO] == want_losses[:MICRO]
    assert max(abs(a - b) / abs(b) for a, b in zip(got_losses, want_losses)) <= REL_TOL
    assert max_rel_error(got, reference.state_dict()) <= REL_TOL


@pytest.mark.parametrize("with_no_sync", [False, True], ids=["shipped at step", "shipped from backward, no_sync"])
def test_two_workers_accumulating_halves_match_one_process(with_no_sync: bool, run_workers: Callable[..., list[Any]],
                                                           max_rel_error: Callable[..., float],
                                                           moved: Callable[..., float]) -> None:
    """Each worker accumulates two of the four micro-batches (loss / 2); the
    servers average the two workers' sums: the reference's mean over four."""
    torch.manual_seed(0)
    initial = mlp()
    clocks = data(10, seed=2)
    reference = copy.deepcopy(initial)
    plain(reference, clocks)

    def body(worker: Worker) -> dict[str, torch.Tensor]:
        half = MICRO // 2
        ps_model = mt.wrap(copy.deepcopy(initial), worker, example_input=clocks[0][0][0],
                           overlap_updates=with_no_sync)
        for micro in clocks:
            mine = micro[worker.rank * half:(worker.rank + 1) * half]
            for k, (x, y) in enumerate(mine):
                with ps_model.no_sync() if with_no_sync and k < len(mine) - 1 else contextlib.nullcontext():
                    loss = F.cross_entropy(ps_model(x), y) / half
                loss.backward()
            ps_model.step()
        return ps_model.state_dict()

    with LocalCluster(2, config()) as cluster:
        states = run_workers(body, cluster.workers, on_error=cluster.shutdown)
    assert moved(initial, reference) > 1e-2
    for state in states:
        assert max_rel_error(state, reference.state_dict()) <= REL_TOL


def test_shipping_from_backward_a_second_forward_needs_no_sync() -> None:
    x, y = data(1)[0][0]
    with LocalCluster(1, config()) as cluster:
        ps_model = mt.wrap(mlp(), cluster.worker(0), example_input=x, overlap_updates=True)
        F.cross_entropy(ps_model(x), y).backward()  # the updates left during this pass
        with pytest.raises(mltuner.OutOfOrderError, match=r"second training forward.*no_sync"):
            ps_model(x)
        ps_model.step()
        with pytest.raises(mltuner.OutOfOrderError, match="second backward pass through one forward pass"):
            with ps_model.no_sync():
                loss = F.cross_entropy(ps_model(x), y)
            loss.backward(retain_graph=True)
            loss.backward()
        F.cross_entropy(ps_model(x), y).backward()
        ps_model.step()
        assert ps_model.clock == 2


@pytest.mark.parametrize("options", [{"store_activations": True}, {"hold_reads": False}],
                         ids=["stored activations", "fresh backward reads"])
def test_accumulation_is_refused_where_a_clock_takes_one_forward(options: dict[str, Any]) -> None:
    x, y = data(1)[0][0]
    with LocalCluster(1, config()) as cluster:
        ps_model = mt.wrap(mlp(), cluster.worker(0), example_input=x, **options)
        with pytest.raises(mltuner.OutOfOrderError, match="no_sync.*held reads"):
            with ps_model.no_sync():
                pass
        F.cross_entropy(ps_model(x), y).backward()
        with pytest.raises(mltuner.OutOfOrderError, match=r"second training forward.*gradient accumulation.*this "
                                                          r"model: hold_reads="):
            ps_model(x)
        ps_model.step()  # the clock goes on
        F.cross_entropy(ps_model(x), y).backward()
        ps_model.step()
        assert ps_model.clock == 2


def test_a_second_backward_through_one_forward_is_still_refused() -> None:
    x, y = data(1)[0][0]
    with LocalCluster(1, config()) as cluster:
        ps_model = mt.wrap(mlp(), cluster.worker(0), example_input=x)
        first = F.cross_entropy(ps_model(x), y)
        first.backward(retain_graph=True)
        F.cross_entropy(ps_model(x), y).backward()  # a second pass: accumulates
        with pytest.raises(mltuner.OutOfOrderError, match="second backward pass through one forward pass"):
            first.backward()
        ps_model.step()
        assert ps_model.clock == 1
