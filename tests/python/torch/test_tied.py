"""Parameters used by several modules: tied weights (a language model whose
output projection reuses the token embedding) and a module called more than
once per forward (one block applied at several depths).

The reference is plain PyTorch on the same model: autograd sums every use's
gradient into the one parameter, and torch.optim.SGD(lr * (1 - m), m) is the
servers' damped momentum rule (test_training.py). The first loss is equal
bit for bit (same parameters, same data); after training, every parameter
within float rounding. A shared parameter read from the wrong layer, a use's
gradient lost or counted twice, or the tie broken by the adapter shows at
1e-2 or more.
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

VOCAB, WIDTH, SEQ = 23, 8, 5
LR, MOMENTUM = 0.05, 0.9
REL_TOL = 1e-5


class TiedLM(nn.Module):
    """The output projection's weight is the embedding's (GPT-2, T5)."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, WIDTH)
        self.body = nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.Tanh(), nn.LayerNorm(WIDTH))
        self.head = nn.Linear(WIDTH, VOCAB)
        self.head.weight = self.emb.weight

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(self.emb(tokens)))


class HeadFirstLM(nn.Module):
    """The same tie, the projection declared first: the layer that owns the
    weight (the first in named_modules) runs last, after its other holder."""

    def __init__(self) -> None:
        super().__init__()
        self.head = nn.Linear(WIDTH, VOCAB)
        self.emb = nn.Embedding(VOCAB, WIDTH)
        self.emb.weight = self.head.weight
        self.body = nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.Tanh(), nn.LayerNorm(WIDTH))

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(self.emb(tokens)))


class SharedBlock(nn.Module):
    """One block applied at two depths (ALBERT's sharing across layers)."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, WIDTH)
        self.block = nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.Tanh())
        self.head = nn.Linear(WIDTH, VOCAB)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(self.block(self.block(self.emb(tokens))))


class TiedInsideOwner(nn.Module):
    """The module that owns the shared weight (the root, read for its whole
    forward with group_bytes=0) calls the other holder inside its forward."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, WIDTH)
        self.inner = nn.Linear(WIDTH, WIDTH)
        self.mix = self.inner.weight  # the root's own parameter: the first holder
        self.head = nn.Linear(WIDTH, VOCAB)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.emb(tokens)
        return self.head(torch.tanh(self.inner(h)) @ self.mix)


def batches(count: int, size: int, seed: int = 1) -> list[tuple[torch.Tensor, torch.Tensor]]:
    generator = torch.Generator().manual_seed(seed)
    return [(torch.randint(0, VOCAB, (size, SEQ), generator=generator),
             torch.randint(0, VOCAB, (size, SEQ), generator=generator)) for _ in range(count)]


def loss_of(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


def config(**options: Any) -> Config:
    return Config(wait_timeout_s=20, update_rule=UpdateRule("damped_momentum", learning_rate=LR, momentum=MOMENTUM),
                  **options)


def train_plain(model: nn.Module, data: list[tuple[torch.Tensor, torch.Tensor]]) -> list[float]:
    optimizer = torch.optim.SGD(model.parameters(), lr=LR * (1 - MOMENTUM), momentum=MOMENTUM)
    losses = []
    for x, y in data:
        loss = loss_of(model(x), y)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses


CASES = [
    ("default", TiedLM, {}, {}),
    ("fresh backward reads", TiedLM, {"hold_reads": False}, {}),
    ("stored activations", TiedLM, {"store_activations": True}, {}),
    ("stored and held", TiedLM, {"store_activations": True, "hold_reads": True}, {}),
    ("stored, held, recomputed", TiedLM, {"store_activations": True, "hold_reads": True, "recompute": "compute"}, {}),
    ("shipped from backward", TiedLM, {"overlap_updates": True}, {}),
    ("one table per module", TiedLM, {"group_bytes": 0}, {}),
    ("under a budget", TiedLM, {"store_activations": True}, {"device_memory_budget": 6000}),
    ("owner runs last", HeadFirstLM, {}, {}),
    ("owner runs last, fresh reads", HeadFirstLM, {"hold_reads": False, "store_activations": True}, {}),
    ("block called twice", SharedBlock, {}, {}),
    ("block called twice, fresh reads", SharedBlock, {"hold_reads": False, "store_activations": True}, {}),
    ("block called twice, held, recomputed", SharedBlock,
     {"store_activations": True, "hold_reads": True, "recompute": "compute"}, {}),
    ("holder inside the owner", TiedInsideOwner, {"group_bytes": 0}, {}),
    ("holder inside the owner, fresh reads", TiedInsideOwner, {"group_bytes": 0, "hold_reads": False}, {}),
]


@pytest.mark.parametrize(("make", "options", "settings"), [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_shared_parameters_train_as_plain_pytorch(make: Callable[[], nn.Module], options: dict[str, Any],
                                                  settings: dict[str, Any],
                                                  max_rel_error: Callable[..., float],
                                                  moved: Callable[..., float]) -> None:
    torch.manual_seed(0)
    initial = make()
    data = batches(15, 8)
    reference = copy.deepcopy(initial)
    want_losses = train_plain(reference, data)

    with LocalCluster(1, config(**settings)) as cluster:
        ps_model = mt.wrap(copy.deepcopy(initial), cluster.worker(0), example_input=data[0][0], **options)
        got_losses = []
        for x, y in data:
            loss = loss_of(ps_model(x), y)
            loss.backward()
            ps_model.step()
            got_losses.append(loss.item())
        got = ps_model.state_dict()
        plain = ps_model.unwrap()

    want = reference.state_dict()
    assert moved(initial, reference) > 1e-2  # training did something
    assert got_losses[0] == want_losses[0]
    assert max(abs(a - b) / abs(b) for a, b in zip(got_losses, want_losses)) <= REL_TOL
    assert max_rel_error(got, want) <= REL_TOL
    # The tie survives the adapter: one parameter, the servers' values.
    for name, param in reference.named_parameters(remove_duplicate=False):
        assert torch.equal(plain.get_parameter(name).detach(), got[name]), name
    if make in (TiedLM, HeadFirstLM):
        assert plain.head.weight is plain.emb.weight  # type: ignore[union-attr]


@pytest.mark.parametrize("make", [TiedLM, HeadFirstLM, SharedBlock])
def test_holding_reads_every_layer_once_a_clock(make: Callable[[], nn.Module]) -> None:
    """Holding reads, a layer's later calls use its held read, so the clock
    stays light (no saved-tensor hooks); reading afresh, each call reads."""
    data = batches(1, 4)
    with LocalCluster(1, config()) as cluster:
        ps_model = mt.wrap(make(), cluster.worker(0), example_input=data[0][0])
        reads = [a for a in ps_model.accesses if a.startswith("forward read")]
        assert len(reads) == len(set(reads)) == len(ps_model._driver.layers), reads
        assert ps_model._driver._light
    with LocalCluster(1, config()) as cluster:
        ps_model = mt.wrap(make(), cluster.worker(0), example_input=data[0][0], hold_reads=False)
        reads = [a for a in ps_model.accesses if a.startswith("forward read")]
        assert len(reads) == len(ps_model._driver.layers) + 1, reads  # the shared layer twice


def test_two_workers_with_tied_weights_match_one_process(run_workers: Callable[..., list[Any]],
                                                         max_rel_error: Callable[..., float],
                                                         moved: Callable[..., float]) -> None:
    """BSP averages the workers' gradients, each the mean over its half of
    the batch: the gradient of the whole batch's mean loss, which the
    reference takes in one process."""
    torch.manual_seed(0)
    initial = TiedLM()
    data = batches(10, 8, seed=2)
    reference = copy.deepcopy(initial)
    train_plain(reference, data)

    def body(worker: Worker) -> dict[str, torch.Tensor]:
        mine = slice(worker.rank * 4, (worker.rank + 1) * 4)
        ps_model = mt.wrap(copy.deepcopy(initial), worker, example_input=data[0][0][mine])
        for x, y in data:
            loss_of(ps_model(x[mine]), y[mine]).backward()
            ps_model.step()
        return ps_model.state_dict()

    with LocalCluster(2, config()) as cluster:
        states = run_workers(body, cluster.workers, on_error=cluster.shutdown)
    want = reference.state_dict()
    assert moved(initial, reference) > 1e-2
    for state in states:
        assert max_rel_error(state, want) <= REL_TOL
