"""Activation checkpointing (``torch.utils.checkpoint``) re-runs layers in
the backward pass. Holding reads, a layer keeps its read until its update,
so a re-run finds its parameters there: training equals plain PyTorch with
the same checkpointing, both checkpoint implementations, updates shipped at
step() or from the backward pass, one worker or two. Where reads are not
held (``hold_reads=False``, ``store_activations``) wrap() refuses it with
the reason, not wrong gradients."""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import pytest

torch = pytest.importorskip("torch")

import torch.nn.functional as F  # noqa: E402
from torch import nn  # noqa: E402
from torch.utils.checkpoint import checkpoint  # noqa: E402

import mltuner  # noqa: E402
import mltuner.torch as mt  # noqa: E402
from mltuner import Config, LocalCluster, UpdateRule, Worker  # noqa: E402

LR, MOMENTUM = 0.05, 0.9
REL_TOL = 1e-5


class Checkpointed(nn.Module):
    """Two residual blocks run under checkpoint(), a head outside."""

    def __init__(self, reentrant: bool) -> None:
        super().__init__()
        self.reentrant = reentrant
        self.stem = nn.Linear(6, 16)
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 16), nn.LayerNorm(16))
                                    for _ in range(2))
        self.head = nn.Linear(16, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.stem(x)
        for block in self.blocks:
            h = h + checkpoint(block, h, use_reentrant=self.reentrant)
        return self.head(h)


def data(clocks: int, rows: int, seed: int = 1) -> list[tuple[torch.Tensor, torch.Tensor]]:
    generator = torch.Generator().manual_seed(seed)
    return [(torch.randn(rows, 6, generator=generator), torch.randint(0, 3, (rows,), generator=generator))
            for _ in range(clocks)]


def config() -> Config:
    return Config(wait_timeout_s=20, update_rule=UpdateRule("damped_momentum", learning_rate=LR, momentum=MOMENTUM))


def plain(model: nn.Module, batches: list[tuple[torch.Tensor, torch.Tensor]]) -> list[float]:
    optimizer = torch.optim.SGD(model.parameters(), lr=LR * (1 - MOMENTUM), momentum=MOMENTUM)
    losses = []
    for x, y in batches:
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses


@pytest.mark.parametrize("reentrant", [False, True], ids=["non-reentrant", "reentrant"])
@pytest.mark.parametrize("overlap", [False, True], ids=["shipped at step", "shipped from backward"])
def test_checkpointed_layers_train_as_plain_pytorch(reentrant: bool, overlap: bool,
                                                    max_rel_error: Callable[..., float],
                                                    moved: Callable[..., float]) -> None:
    torch.manual_seed(0)
    initial = Checkpointed(reentrant)
    batches = data(12, 8)
    reference = copy.deepcopy(initial)
    want_losses = plain(reference, batches)
    with LocalCluster(1, config()) as cluster:
        ps_model = mt.wrap(copy.deepcopy(initial), cluster.worker(0), example_input=batches[0][0],
                           overlap_updates=overlap)
        assert ps_model.hold_reads
        got_losses = []
        for x, y in batches:
            loss = F.cross_entropy(ps_model(x), y)
            loss.backward()
            ps_model.step()
            got_losses.append(loss.item())
        got = ps_model.state_dict()
    assert moved(initial, reference) > 1e-2
    assert got_losses[0] == want_losses[0]
    assert max(abs(a - b) / abs(b) for a, b in zip(got_losses, want_losses)) <= REL_TOL
    assert max_rel_error(got, reference.state_dict()) <= REL_TOL


def test_two_workers_with_checkpointing_match_one_process(run_workers: Callable[..., list[Any]],
                                                          max_rel_error: Callable[..., float]) -> None:
    torch.manual_seed(0)
    initial = Checkpointed(reentrant=False)
    batches = data(10, 8, seed=2)
    reference = copy.deepcopy(initial)
    plain(reference, batches)

    def body(worker: Worker) -> dict[str, torch.Tensor]:
        mine = slice(worker.rank * 4, (worker.rank + 1) * 4)
        ps_model = mt.wrap(copy.deepcopy(initial), worker, example_input=batches[0][0][mine], overlap_updates=True)
        for x, y in batches:
            F.cross_entropy(ps_model(x[mine]), y[mine]).backward()
            ps_model.step()
        return ps_model.state_dict()

    with LocalCluster(2, config()) as cluster:
        states = run_workers(body, cluster.workers, on_error=cluster.shutdown)
    for state in states:
        assert max_rel_error(state, reference.state_dict()) <= REL_TOL


@pytest.mark.parametrize("options", [{"hold_reads": False}, {"store_activations": True}],
                         ids=["fresh backward reads", "stored activations"])
def test_checkpointing_without_held_reads_is_refused_at_wrap(options: dict[str, Any]) -> None:
    x, _ = data(1, 4)[0]
    with LocalCluster(1, config()) as cluster:
        with pytest.raises(mt.UnsupportedModelError, match=r"'blocks\.0', 'blocks\.1' run again in the backward "
                                                           r"pass \(activation checkpointing"):
            mt.wrap(Checkpointed(reentrant=False), cluster.worker(0), example_input=x, **options)


def test_a_budget_too_small_for_checkpointing_names_it() -> None:
    x, _ = data(1, 4)[0]
    torch.manual_seed(0)
    with LocalCluster(1, config()) as cluster:  # the least budget held reads need, measured
        worker = cluster.worker(0)
        mt.wrap(Checkpointed(reentrant=False), worker, example_input=x)
        need = worker.stats["pool_min_bytes"]
    small = Config(wait_timeout_s=20, device_memory_budget=need // 4,
                   update_rule=UpdateRule("damped_momentum", learning_rate=LR, momentum=MOMENTUM))
    with LocalCluster(1, small) as cluster:
        with pytest.raises(mltuner.ResourceExhaustedError,
                           match=rf"'blocks\.0\.0', .*'blocks\.1\.3' run again in the backward pass \(activation "
                                 rf"checkpointing.*at least \d+ bytes, above the {need // 4} bytes given; drop the "
                                 r"checkpointing to read each layer again"):
            mt.wrap(Checkpointed(reentrant=False), cluster.worker(0), example_input=x)
