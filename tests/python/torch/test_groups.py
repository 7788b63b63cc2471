"""Layers as groups of modules, held reads and cached buffer views: fewer
engine calls per clock, the same values.

Each child of the model is one table (a residual block here) unless it holds
more than ``group_bytes``; ``hold_reads`` keeps a layer's forward read for
its backward pass instead of reading the rows again. Every combination
trains bit for bit like the others and like plain torch.
"""

from __future__ import annotations

import copy

import pytest

torch = pytest.importorskip("torch")

import torch.nn.functional as F  # noqa: E402
from torch import nn  # noqa: E402

import mltuner.torch as mt  # noqa: E402
from mltuner import Config, LocalCluster, UpdateRule  # noqa: E402

CLOCKS, LR, MOMENTUM = 12, 0.05, 0.9


class Block(nn.Module):
    """A residual block: convolution, batch norm, convolution, shortcut."""

    def __init__(self, channels: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv1d(channels, channels, 3, padding=1, bias=False)
        self.bn = nn.BatchNorm1d(channels)
        self.conv2 = nn.Conv1d(channels, channels, 3, padding=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.relu(x + self.conv2(F.relu(self.bn(self.conv1(x)))))


def make_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv1d(2, 6, 1), Block(6), Block(6), nn.Flatten(), nn.Linear(6 * 5, 3))


def batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    generator = torch.Generator().manual_seed(1)
    return [(torch.randn(4, 2, 5, generator=generator), torch.randint(0, 3, (4,), generator=generator))
            for _ in range(CLOCKS)]


def train(model: nn.Module, **options: object) -> tuple[list[str], list[str], dict[str, torch.Tensor]]:
    data = batches()
    config = Config(wait_timeout_s=20, update_rule=UpdateRule("momentum", learning_rate=LR, momentum=MOMENTUM))
    with LocalCluster(1, config) as cluster:
        ps_model = mt.wrap(model, cluster.worker(0), example_input=data[0][0], **options)  # type: ignore[arg-type]
        for x, y in data:
            F.cross_entropy(ps_model(x), y).backward()
            ps_model.step()
        return ps_model.layers, ps_model.accesses, ps_model.state_dict()


def test_children_are_tables_and_every_variant_trains_identically() -> None:
    reference = make_model()
    optimizer = torch.optim.SGD(reference.parameters(), lr=LR * (1 - MOMENTUM), momentum=MOMENTUM)
    for x, y in batches():
        F.cross_entropy(reference(x), y).backward()
        optimizer.step()
        optimizer.zero_grad()

    layers, accesses, state = train(make_model())
    assert layers == ["0", "1", "2", "4"]  # one table per child; Block's members share one
    # One read per layer, held through the backward pass and posted with the update.
    assert not any(a.startswith("backward read") for a in accesses)
    assert sum(a.startswith("forward read") for a in accesses) == 4
    for name, value in reference.state_dict().items():
        torch.testing.assert_close(state[name], value, rtol=1e-5, atol=1e-6)

    variants = {
        "per module": {"group_bytes": 0},
        "fresh backward reads": {"hold_reads": False},
        "per module, fresh backward reads": {"group_bytes": 0, "hold_reads": False},
        "stored activations": {"store_activations": True},
    }
    for what, options in variants.items():
        other_layers, other_accesses, other = train(make_model(), **options)
        if options.get("group_bytes") == 0:
            assert other_layers == ["0", "1.conv1", "1.bn", "1.conv2", "2.conv1", "2.bn", "2.conv2", "4"], what
        if options.get("hold_reads") is False or options.get("store_activations"):
            assert any(a.startswith("backward read") for a in other_accesses), what
        for name, value in state.items():
            assert torch.equal(other[name], value), (what, name)


def test_a_child_over_the_byte_limit_is_split() -> None:
    block_bytes = sum(p.numel() * 4 for p in Block(6).parameters())
    layers, _, _ = train(make_model(), group_bytes=block_bytes - 1)
    assert layers == ["0", "1.conv1", "1.bn", "1.conv2", "2.conv1", "2.bn", "2.conv2", "4"]


class Bypass(nn.Module):
    """Calls a member of a block from outside the block's forward: the block
    cannot be one table (its parameters would be placeholders there)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.inner = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 3))
        self.head = nn.Linear(3, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.inner[2](self.inner[1](self.inner[0](x))))


def test_a_group_whose_member_runs_outside_it_is_split_automatically() -> None:
    model = Bypass()
    reference = copy.deepcopy(model)
    x, y = torch.randn(5, 4), torch.randint(0, 2, (5,))
    config = Config(wait_timeout_s=20, update_rule=UpdateRule("sgd", learning_rate=0.1))
    with LocalCluster(1, config) as cluster:
        ps_model = mt.wrap(model, cluster.worker(0), example_input=x)
        assert ps_model.layers == ["inner.0", "inner.2", "head"]
        for _ in range(3):
            F.cross_entropy(ps_model(x), y).backward()
            ps_model.step()
        state = ps_model.state_dict()
    optimizer = torch.optim.SGD(reference.parameters(), lr=0.1)
    for _ in range(3):
        F.cross_entropy(reference(x), y).backward()
        optimizer.step()
        optimizer.zero_grad()
    for name, value in reference.state_dict().items():
        torch.testing.assert_close(state[name], value, rtol=1e-6, atol=1e-7)


def test_buffer_views_are_made_once_per_buffer() -> None:
    """The engine's pool places each access at one of a few recurring
    addresses: after some clocks, no new views of the layers' buffers are
    made."""
    x, y = batches()[0]
    with LocalCluster(1, Config(wait_timeout_s=20)) as cluster:
        ps_model = mt.wrap(make_model(), cluster.worker(0), example_input=x)
        layers = ps_model._driver.layers
        for _ in range(10):
            F.cross_entropy(ps_model(x), y).backward()
            ps_model.step()
        cached = [dict(layer._cache) for layer in layers]
        for _ in range(10):
            F.cross_entropy(ps_model(x), y).backward()
            ps_model.step()
        for layer, before in zip(layers, cached):
            assert layer._cache.keys() == before.keys(), layer.name
            for key, (flat, views) in before.items():
                assert layer._cache[key][0] is flat and all(a is b for a, b in zip(layer._cache[key][1], views))


class Mixture(nn.Module):
    """Parameters in containers its own forward uses: a ParameterList of
    scales and a ParameterDict of offsets (never called themselves)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.first = nn.Linear(6, 6)
        self.scales = nn.ParameterList([nn.Parameter(torch.rand(6) + 0.5) for _ in range(3)])
        self.offsets = nn.ParameterDict({"a": nn.Parameter(torch.randn(6)), "b": nn.Parameter(torch.randn(6))})
        self.last = nn.Linear(6, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.first(x)
        for scale in self.scales:
            h = torch.tanh(h * scale + self.offsets["a"])
        return self.last(h - self.offsets["b"])


@pytest.mark.parametrize("reads", [{}, {"hold_reads": False}, {"store_activations": True}],
                         ids=["held", "per-layer", "stored"])
@pytest.mark.parametrize("group_bytes", [0, 1 << 20], ids=["ungrouped", "grouped"])
def test_parameter_lists_and_dicts_are_read_with_the_module_that_uses_them(reads: dict[str, object],
                                                                         group_bytes: int) -> None:
    xs = torch.randn(4, 5, 6, generator=torch.Generator().manual_seed(1))
    reference = Mixture()
    optimizer = torch.optim.SGD(reference.parameters(), lr=LR, momentum=MOMENTUM)
    for x in xs:
        reference(x).square().mean().backward()
        optimizer.step()
        optimizer.zero_grad()
    config = Config(update_rule=UpdateRule("sgd", learning_rate=LR, momentum=MOMENTUM))
    with LocalCluster(1, config) as cluster:
        ps_model = mt.wrap(Mixture(), cluster.worker(0), example_input=xs[0], group_bytes=group_bytes, **reads)
        for x in xs:
            ps_model(x).square().mean().backward()
            ps_model.step()
        got = ps_model.state_dict()
    assert got.keys() == reference.state_dict().keys()
    for name, value in reference.state_dict().items():
        assert torch.allclose(got[name], value, rtol=1e-5, atol=1e-7), name
