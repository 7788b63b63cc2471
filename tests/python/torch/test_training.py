"""Training through the adapter equals plain PyTorch, step for step.

The servers' rules (mltuner/update_step.h) average the workers' gradients g
and then take one step. Here with the Config's rule (test_optim.py covers
``wrap(optimizer=...)`` and every torch option):

  damped_momentum  h = (1 - m) g + m h;  w -= lr h          (MLtuner's rule)
  adam             torch.optim.Adam (bias-corrected, eps outside the root)

MLtuner's damped rule is not torch.optim.SGD(lr, momentum=m), whose buffer
is b = m b + g: the server's h is (1 - m) b, so it equals
torch.optim.SGD(lr=lr * (1 - m), momentum=m). The reference here is the
server's formula written in plain torch, and the test also checks it against
that torch.optim.SGD equivalent.

Tolerance: both sides compute the same forward and backward in float32 on
bit-identical parameters at the first step; they differ only in the rounding
of the update (different operation order, ~1e-7 relative per step), which 50
steps of a contractive training run do not blow up. A lost, doubled, stale or
mis-averaged update, or a wrong rule, shows up at 1e-3 or more.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import pytest

torch = pytest.importorskip("torch")

import torch.nn.functional as F  # noqa: E402
from torch import nn  # noqa: E402

import mltuner.torch as mt  # noqa: E402
from mltuner import Config, LocalCluster, UpdateRule, Worker  # noqa: E402

VOCAB, SEQ, CLASSES = 17, 6, 5
LR = {"damped_momentum": 0.05, "adam": 0.01}
MOMENTUM = 0.9
REL_TOL = 1e-5


class Mixed(nn.Module):
    """One of each common layer type: Embedding, Conv1d, BatchNorm1d,
    Conv2d, LayerNorm, Linear, ReLU, Dropout."""

    def __init__(self, batch_norm: bool = True, dropout: float = 0.1) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, 8)
        # No bias where a normalisation cancels it: its gradient would be pure
        # rounding noise, which Adam scales up to full steps on either side.
        self.conv = nn.Conv1d(8, 12, 3, padding=1, bias=not batch_norm)
        self.bn = nn.BatchNorm1d(12) if batch_norm else nn.Identity()
        self.conv2 = nn.Conv2d(1, 2, 3, padding=1, bias=False)
        self.ln = nn.LayerNorm(12)
        self.fc1 = nn.Linear(12 * SEQ, 32)
        self.drop = nn.Dropout(dropout)
        self.fc2 = nn.Linear(32, CLASSES)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.emb(tokens).transpose(1, 2)  # (B, 8, SEQ)
        h = F.relu(self.bn(self.conv(h)))  # (B, 12, SEQ)
        h = h + self.conv2(h.unsqueeze(1)).sum(1)  # (B, 12, SEQ)
        h = self.ln(h.transpose(1, 2)).flatten(1)  # (B, SEQ * 12)
        return self.fc2(self.drop(F.relu(self.fc1(h))))


def make_batches(sizes: list[int], seed: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    generator = torch.Generator().manual_seed(seed)
    return [(torch.randint(0, VOCAB, (n, SEQ), generator=generator),
             torch.randint(0, CLASSES, (n,), generator=generator)) for n in sizes]


class ServerMomentum:
    """The server's momentum rule in plain torch (see the module docstring)."""

    def __init__(self, params: list[nn.Parameter], lr: float, momentum: float) -> None:
        self.params, self.lr, self.m = params, lr, momentum
        self.history = [torch.zeros_like(p) for p in params]

    @torch.no_grad()
    def step(self) -> None:
        for p, h in zip(self.params, self.history):
            assert p.grad is not None
            h.copy_((1 - self.m) * p.grad + self.m * h)
            p.sub_(self.lr * h)
            p.grad = None


def reference_optimizer(rule: str, model: nn.Module, *, torch_sgd: bool = False) -> Any:
    params = list(model.parameters())
    if rule == "adam":
        return torch.optim.Adam(params, lr=LR["adam"], betas=(0.9, 0.999), eps=1e-8)
    if torch_sgd:
        return torch.optim.SGD(params, lr=LR["damped_momentum"] * (1 - MOMENTUM), momentum=MOMENTUM)
    return ServerMomentum(params, LR["damped_momentum"], MOMENTUM)


def config(rule: str) -> Config:
    momentum = MOMENTUM if rule == "damped_momentum" else None
    return Config(wait_timeout_s=20, update_rule=UpdateRule(rule, learning_rate=LR[rule],  # type: ignore[arg-type]
                                                            momentum=momentum))


@pytest.mark.parametrize("rule", ["damped_momentum", "adam"])
def test_one_worker_matches_torch_step_for_step(rule: str, max_rel_error: Callable[..., float],
                                                moved: Callable[..., float]) -> None:
    """50 clocks of varying batch size (allowed without store_activations);
    the dropout masks come from the same seeds on both sides."""
    torch.manual_seed(0)
    initial = Mixed()
    batches = make_batches([8, 5, 8, 3, 6] * 10, seed=1)

    reference = copy.deepcopy(initial)
    optimizers = [reference_optimizer(rule, reference)]
    twin = copy.deepcopy(initial)  # the torch.optim.SGD form of the momentum rule
    if rule == "damped_momentum":
        optimizers.append(reference_optimizer(rule, twin, torch_sgd=True))
    want_losses = []
    for step, (x, y) in enumerate(batches):
        for model, optimizer in zip([reference, twin], optimizers):
            torch.manual_seed(100 + step)
            loss = F.cross_entropy(model(x), y)
            loss.backward()
            optimizer.step()
            optimizer_zero = getattr(optimizer, "zero_grad", None)
            if optimizer_zero is not None:
                optimizer_zero()
            if model is reference:
                want_losses.append(loss.item())

    with LocalCluster(1, config(rule)) as cluster:
        ps_model = mt.wrap(copy.deepcopy(initial), cluster.worker(0), example_input=batches[0][0])
        got_losses = []
        for step, (x, y) in enumerate(batches):
            torch.manual_seed(100 + step)
            loss = F.cross_entropy(ps_model(x), y)
            loss.backward()
            ps_model.step()
            got_losses.append(loss.item())
        got = ps_model.state_dict()

    want = reference.state_dict()
    assert moved(initial, reference) > 1e-2  # training did something
    assert max_rel_error(got, want) <= REL_TOL
    # Batch-norm running statistics are each worker's own: with one worker, torch's.
    assert got["bn.num_batches_tracked"].item() == len(batches)
    assert got_losses[0] == want_losses[0]  # the same parameters and data: bit for bit
    assert max(abs(a - b) / abs(b) for a, b in zip(got_losses, want_losses)) <= REL_TOL
    if rule == "damped_momentum":
        assert max_rel_error(twin.state_dict(), want) <= REL_TOL


def test_two_workers_match_one_process_on_the_concatenated_batches(
    run_workers: Callable[..., list[Any]], max_rel_error: Callable[..., float], moved: Callable[..., float]) -> None:
    """Under BSP the servers average the two workers' gradients, each the
    mean over its own batch of 6: with equal batches that is the gradient of
    the mean loss over the concatenated 12 samples. (No batch norm, whose
    statistics are per batch, and no dropout, whose RNG the threads share.)"""
    clocks, per_worker = 20, 6
    torch.manual_seed(0)
    initial = Mixed(batch_norm=False, dropout=0.0)
    batches = make_batches([2 * per_worker] * clocks, seed=2)

    reference = copy.deepcopy(initial)
    optimizer = ServerMomentum(list(reference.parameters()), LR["damped_momentum"], MOMENTUM)
    for x, y in batches:
        F.cross_entropy(reference(x), y).backward()
        optimizer.step()

    torch.manual_seed(7)
    models = [copy.deepcopy(initial), Mixed(batch_norm=False, dropout=0.0)]  # worker 1's values are ignored

    def body(worker: Worker) -> dict[str, torch.Tensor]:
        mine = slice(worker.rank * per_worker, (worker.rank + 1) * per_worker)
        ps_model = mt.wrap(models[worker.rank], worker, example_input=batches[0][0][mine])
        for x, y in batches:
            F.cross_entropy(ps_model(x[mine]), y[mine]).backward()
            ps_model.step()
        return ps_model.state_dict()

    with LocalCluster(2, config("damped_momentum")) as cluster:
        states = run_workers(body, cluster.workers, on_error=cluster.shutdown)

    want = reference.state_dict()
    assert moved(initial, reference) > 1e-2
    assert max_rel_error(states[0], want) <= REL_TOL
    for name in want:  # both workers fetch the same server values
        assert torch.equal(states[0][name], states[1][name]), name
