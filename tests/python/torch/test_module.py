"""The wrapped model's API: drop-in use in an existing training script,
evaluation, state_dict, unwrap, what stays local to each worker, and the
recorded accesses."""

from __future__ import annotations

import argparse
import copy
import dataclasses
import gc
import weakref
from collections.abc import Callable
from typing import Any

import pytest

torch = pytest.importorskip("torch")

import torch.nn.functional as F  # noqa: E402
from torch import nn  # noqa: E402
from torch.utils.data import DataLoader, Subset, TensorDataset  # noqa: E402

import mltuner  # noqa: E402
import mltuner.torch as mt  # noqa: E402
from mltuner import Config, LocalCluster, UpdateRule, Worker  # noqa: E402


# -- pytorch/examples mnist/main.py, unchanged but for a narrower Net and no prints ---------------


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(1, 4, 3, 1)
        self.conv2 = nn.Conv2d(4, 8, 3, 1)
        self.dropout1 = nn.Dropout(0.25)
        self.dropout2 = nn.Dropout(0.5)
        self.fc1 = nn.Linear(8 * 4 * 4, 32)
        self.fc2 = nn.Linear(32, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.conv1(x)
        x = F.relu(x)
        x = self.conv2(x)
        x = F.relu(x)
        x = F.max_pool2d(x, 2)
        x = self.dropout1(x)
        x = torch.flatten(x, 1)
        x = self.fc1(x)
        x = F.relu(x)
        x = self.dropout2(x)
        x = self.fc2(x)
        output = F.log_softmax(x, dim=1)
        return output


def train(args: Any, model: Any, device: Any, train_loader: Any, optimizer: Any, epoch: int) -> None:
    model.train()
    for batch_idx, (data, target) in enumerate(train_loader):
        data, target = data.to(device), target.to(device)
        optimizer.zero_grad()
        output = model(data)
        loss = F.nll_loss(output, target)
        loss.backward()
        optimizer.step()
        if batch_idx % args.log_interval == 0:
            if args.dry_run:
                break


def test(model: Any, device: Any, test_loader: Any) -> float:
    model.eval()
    test_loss = 0.0
    correct = 0
    with torch.no_grad():
        for data, target in test_loader:
            data, target = data.to(device), target.to(device)
            output = model(data)
            test_loss += F.nll_loss(output, target, reduction="sum").item()
            pred = output.argmax(dim=1, keepdim=True)
            correct += pred.eq(target.view_as(pred)).sum().item()
    test_loss /= len(test_loader.dataset)
    return correct / len(test_loader.dataset)


test.__test__ = False  # type: ignore[attr-defined]  # the example's function, not a pytest test


def synthetic_digits(n: int, seed: int) -> TensorDataset:
    """12x12 images: one of ten fixed patterns plus noise."""
    generator = torch.Generator().manual_seed(seed)
    patterns = torch.randn(10, 1, 12, 12, generator=torch.Generator().manual_seed(0))
    labels = torch.randint(0, 10, (n,), generator=generator)
    return TensorDataset(patterns[labels] + 0.8 * torch.randn(n, 1, 12, 12, generator=generator), labels)


def test_the_mnist_example_loop_runs_unchanged_on_two_workers(run_workers: Callable[..., list[Any]]) -> None:
    """main() converted as docs/torch.md shows (a LocalCluster here instead of
    a Job); 200 training samples per worker in batches of 32 leave a last
    batch of 8, which is fine without store_activations."""
    args = argparse.Namespace(log_interval=10, dry_run=False)
    device = torch.device("cpu")
    dataset1, dataset2 = synthetic_digits(400, seed=1), synthetic_digits(200, seed=2)
    torch.manual_seed(1)
    nets = [Net(), Net()]
    config = Config(wait_timeout_s=20, update_rule=UpdateRule("adam", learning_rate=1e-2))

    def main(worker: Worker) -> tuple[float, float, dict[str, torch.Tensor]]:
        shard = Subset(dataset1, range(worker.rank, len(dataset1), worker.num_workers))
        train_loader = DataLoader(shard, batch_size=32, generator=torch.Generator().manual_seed(worker.rank))
        test_loader = DataLoader(dataset2, batch_size=100)
        model = mt.wrap(nets[worker.rank].to(device), worker, example_input=next(iter(train_loader))[0].to(device))
        optimizer = model.optimizer
        before = test(model, device, test_loader)
        for epoch in range(1, 5):
            train(args, model, device, train_loader, optimizer, epoch)
            after = test(model, device, test_loader)
        return before, after, model.state_dict()

    with LocalCluster(2, config) as cluster:
        results = run_workers(main, cluster.workers, on_error=cluster.shutdown)
    (before, after, state), (_, after1, state1) = results
    assert before < 0.3 < 0.8 < after  # it learns
    assert after1 == after  # both evaluate the same server values
    plain = Net()
    plain.load_state_dict(state)  # the saved state loads into a plain module
    assert test(plain, device, DataLoader(dataset2, batch_size=100)) == after
    for name, value in state.items():
        if name.endswith(("weight", "bias")):
            assert torch.equal(value, state1[name]), name


# -- evaluation, state_dict, unwrap -------------------------------------------------------------


def mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.LayerNorm(16), nn.Linear(16, 3))


def test_evaluation_state_dict_and_unwrap() -> None:
    x, y = torch.randn(8, 6), torch.randint(0, 3, (8,))
    probe = torch.randn(5, 6)

    def run(evaluate_mid_clock: bool) -> tuple[dict[str, torch.Tensor], nn.Module]:
        config = Config(wait_timeout_s=20, update_rule=UpdateRule("momentum", learning_rate=0.1, momentum=0.5))
        with LocalCluster(1, config) as cluster:
            ps_model = mt.wrap(mlp(), cluster.worker(0), example_input=x)
            assert ps_model.layers == ["0", "2", "3"]
            assert "clock=0" in repr(ps_model)
            with torch.no_grad():
                initial = ps_model(probe)
            torch.testing.assert_close(initial, mlp()(probe), rtol=0, atol=0)  # worker 0's initial values
            for _ in range(4):
                loss = F.cross_entropy(ps_model(x), y)
                if evaluate_mid_clock:  # between forward and backward: no effect on training
                    with torch.inference_mode():
                        ps_model(probe)
                loss.backward()
                ps_model.step()
            state = ps_model.state_dict()
            with torch.no_grad():
                evaluated = ps_model(probe)
            plain = mlp()
            plain.load_state_dict(state)
            with torch.no_grad():
                torch.testing.assert_close(evaluated, plain(probe), rtol=0, atol=0)
            module = ps_model.unwrap()
            with pytest.raises(Exception, match="unwrapped"):
                ps_model.step()
        # The unwrapped module is a plain module again, holding the final values.
        assert module is ps_model.module
        for name, param in module.named_parameters():
            assert torch.equal(param.detach(), state[name]), name
        assert not any(m._forward_pre_hooks or m._forward_hooks for m in module.modules())
        optimizer = torch.optim.SGD(module.parameters(), lr=0.1)
        F.cross_entropy(module(x), y).backward()
        optimizer.step()
        return state, module

    state, _ = run(evaluate_mid_clock=False)
    state_mid, _ = run(evaluate_mid_clock=True)
    for name in state:
        assert torch.equal(state[name], state_mid[name]), name
    assert not torch.equal(state["0.weight"], mlp().state_dict()["0.weight"])


class Decoder(nn.Sequential):
    """A model with a method of its own that calls its forward under
    torch.no_grad(), as Hugging Face's generate() does."""

    @torch.no_grad()
    def generate(self, x: torch.Tensor, steps: int) -> list[torch.Tensor]:
        out = []
        for _ in range(steps):
            x = self(x)[:, :6].tanh()
            out.append(x)
        return out


@pytest.mark.parametrize("store_activations", [False, True], ids=["plain", "store_activations"])
def test_the_original_modules_own_methods_run_on_the_servers_values_between_clocks(store_activations: bool) -> None:
    x, y = torch.randn(8, 6), torch.randint(0, 3, (8,))

    def decoder() -> Decoder:
        torch.manual_seed(0)
        return Decoder(nn.Linear(6, 16), nn.ReLU(), nn.Linear(16, 8))

    plain = decoder()
    optimizer = torch.optim.SGD(plain.parameters(), lr=0.1, momentum=0.5)
    config = Config(wait_timeout_s=20)
    with LocalCluster(1, config) as cluster:
        module = decoder()
        model = mt.wrap(module, cluster.worker(0), example_input=x, store_activations=store_activations,
                        optimizer=torch.optim.SGD(module.parameters(), lr=0.1, momentum=0.5))
        for _ in range(3):
            for net, step in ((plain, optimizer.step), (model, model.optimizer.step)):
                F.cross_entropy(net(x)[:, :3], y).backward()
                step()
            optimizer.zero_grad()
            for got, want in zip(model.module.generate(x, 3), plain.generate(x, 3)):
                torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
            torch.testing.assert_close(model.generate(x, 1)[0], plain.generate(x, 1)[0], rtol=1e-6, atol=1e-6)
            state = model.module.state_dict()  # as save_pretrained() would take it
            for name, value in plain.state_dict().items():
                torch.testing.assert_close(state[name], value, rtol=1e-6, atol=1e-6)
            torch.testing.assert_close(model.module[2].state_dict()["weight"], plain[2].weight, rtol=1e-6, atol=1e-6)
        with pytest.raises(mltuner.OutOfOrderError, match="only without gradients"):
            model.module(x)  # training goes through the wrapped model
        with pytest.raises(AttributeError, match="no attribute 'beam_search'"):
            model.beam_search
        model.module.zero_grad()
        F.cross_entropy(model(x)[:, :3], y).backward()  # and goes on from where it was
        with pytest.raises(mltuner.OutOfOrderError, match="between clocks only"):
            model.module.generate(x, 1)  # between backward() and step(): the clock goes on
        model.optimizer.step()
        F.cross_entropy(plain(x)[:, :3], y).backward()
        optimizer.step()
        for name, value in plain.state_dict().items():
            torch.testing.assert_close(model.state_dict()[name], value, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("store_activations", [False, True], ids=["plain", "store_activations"])
def test_a_dropped_wrapped_model_leaves_nothing_alive(store_activations: bool) -> None:
    """Once the training loop drops the wrapped model, its clock driver (and
    with it the worker's tables and the engine's memory) can be collected:
    torch keeps parameter hooks in C++, out of the garbage collector's sight,
    so a hook holding the driver would keep it forever."""
    x, y = torch.randn(8, 6), torch.randint(0, 3, (8,))
    with LocalCluster(1, Config(wait_timeout_s=20)) as cluster:
        ps_model = mt.wrap(mlp(), cluster.worker(0), example_input=x, store_activations=store_activations)
        for _ in range(2):
            F.cross_entropy(ps_model(x), y).backward()
            ps_model.step()
        driver = weakref.ref(ps_model._driver)
        del ps_model
    gc.collect()
    assert driver() is None


def test_frozen_parameters_and_buffers_stay_with_each_worker(run_workers: Callable[..., list[Any]]) -> None:
    """The servers hold the trainable parameters; batch-norm statistics and
    frozen parameters are each worker's own."""

    def make(rank: int) -> nn.Module:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.Linear(8, 2))
        model[2].bias.requires_grad_(False)
        with torch.no_grad():
            model[2].bias.fill_(float(rank))
        return model

    models = [make(0), make(1)]
    data = [torch.randn(6, 4) + 3 * rank for rank in range(2)]

    def body(worker: Worker) -> dict[str, torch.Tensor]:
        ps_model = mt.wrap(models[worker.rank], worker, example_input=data[worker.rank])
        assert ps_model.layers == ["0", "1", "2"]
        for _ in range(3):
            ps_model(data[worker.rank]).sum().backward()
            ps_model.step()
        return ps_model.state_dict()

    config = Config(wait_timeout_s=20, update_rule=UpdateRule("sgd", learning_rate=0.01))
    with LocalCluster(2, config) as cluster:
        states = run_workers(body, cluster.workers, on_error=cluster.shutdown)
    for name in ("0.weight", "0.bias", "1.weight", "1.bias", "2.weight"):
        assert torch.equal(states[0][name], states[1][name]), name
    assert float(states[0]["2.bias"].max()) == 0.0 and float(states[1]["2.bias"].min()) == 1.0
    assert not torch.equal(states[0]["1.running_mean"], states[1]["1.running_mean"])
    assert int(states[0]["1.num_batches_tracked"]) == 3


def test_accesses_describe_the_recorded_clock() -> None:
    model = nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 3))
    with LocalCluster(1, Config(wait_timeout_s=20)) as cluster:
        ps_model = mt.wrap(model, cluster.worker(0), example_input=torch.randn(4, 6), store_activations=True)
        assert ps_model.accesses == [
            "forward read of layer '0'",
            "store of saved activation #0 (4, 6) torch.float32",  # the input, for the weight gradient
            "end of the forward of layer '0'",
            "store of saved activation #1 (4, 8) torch.float32",  # ReLU's output, also the next input
            "forward read of layer '2'",
            "end of the forward of layer '2'",
            "load of saved activation #1 (4, 8) torch.float32",  # once: kept for ReLU's backward too
            "backward read of layer '2'",  # its weight, for the input gradient
            "update of layer '2'",
            "load of saved activation #0 (4, 6) torch.float32",
            "update of layer '0'",
        ]
        assert ps_model.device == torch.device("cpu")
        assert ps_model.worker is cluster.worker(0)
        optimizer = ps_model.optimizer
        optimizer.zero_grad()
        ps_model(torch.randn(4, 6)).sum().backward()
        optimizer.step()
        assert ps_model.clock == 1


# -- output types -------------------------------------------------------------------------


@dataclasses.dataclass
class Output:
    """A model output type as libraries define them (fields of tensors)."""

    logits: torch.Tensor
    extra: tuple[torch.Tensor, ...]


class WithOutputType(nn.Module):
    def __init__(self, kind: str) -> None:
        super().__init__()
        self.a, self.b, self.kind = nn.Linear(6, 16), nn.Linear(16, 3), kind

    def forward(self, x: torch.Tensor) -> Any:
        hidden = torch.tanh(self.a(x))
        logits = self.b(hidden)
        if self.kind == "dataclass":
            return Output(logits, (hidden,))
        return {"logits": logits, "extra": [hidden]}


@pytest.mark.parametrize("kind", ["dataclass", "dict"])
@pytest.mark.parametrize("overlap", [False, True], ids=["shipped at step", "shipped from backward"])
def test_outputs_in_a_dataclass_or_dict(kind: str, overlap: bool) -> None:
    """wrap()'s default loss and the light clock's hooks on the outputs find
    the tensors inside a dataclass or dict output: the model trains as plain
    PyTorch does, and a second backward pass through its output is refused."""
    torch.manual_seed(0)
    initial = WithOutputType(kind)
    plain = copy.deepcopy(initial)
    optimizer = torch.optim.SGD(plain.parameters(), lr=0.1)
    generator = torch.Generator().manual_seed(1)
    data = [(torch.randn(8, 6, generator=generator), torch.randint(0, 3, (8,), generator=generator))
            for _ in range(4)]
    with LocalCluster(1, Config(update_rule=UpdateRule("sgd", learning_rate=0.1), wait_timeout_s=20)) as cluster:
        ps_model = mt.wrap(copy.deepcopy(initial), cluster.worker(0), example_input=data[0][0],
                           overlap_updates=overlap)
        for clock, (x, y) in enumerate(data):
            loss = F.cross_entropy(ps_model(x)["logits"] if kind == "dict" else ps_model(x).logits, y)
            loss.backward(retain_graph=clock == 0)
            if clock == 0:
                with pytest.raises(mltuner.OutOfOrderError, match="second backward pass|second gradient"):
                    loss.backward()
            ps_model.step()
            out = plain(x)
            F.cross_entropy(out["logits"] if kind == "dict" else out.logits, y).backward()
            optimizer.step()
            optimizer.zero_grad()
        got = ps_model.state_dict()
    for name, value in plain.state_dict().items():
        torch.testing.assert_close(got[name], value, rtol=1e-5, atol=1e-6)
