"""``wrap(..., optimizer=...)``: the servers take torch.optim's steps.

The reference is torch.optim itself: the same model, data and optimizer
settings trained by plain PyTorch. With one worker (BSP) the parameters
must agree within a relative 1e-6 after 30 steps (both sides compute the
same forward and backward in float32; only the update's rounding differs:
torch's CPU kernels may fuse a multiply-add, the servers' never do). With
two workers, the servers average the workers' gradients, which with equal
batches is the gradient of the whole batch: torch on the concatenated batch.
A wrong formula (an undampened first step, coupled instead of decoupled
weight decay, a missing bias correction) is off by 1e-3 or more.
"""

from __future__ import annotations

import copy
import warnings
from collections.abc import Callable
from typing import Any

import pytest

torch = pytest.importorskip("torch")

import torch.nn.functional as F  # noqa: E402
from torch import nn  # noqa: E402

import mltuner.torch as mt  # noqa: E402
from mltuner import Config, InvalidArgumentError, LocalCluster, OutOfOrderError, UpdateRule, Worker  # noqa: E402

STEPS = 30
REL_TOL = 1e-6

# (optimizer class, keyword arguments): every rule and option the servers implement.
OPTIMIZERS: list[tuple[Any, dict[str, Any]]] = [
    (torch.optim.SGD, {"lr": 0.05}),
    (torch.optim.SGD, {"lr": 0.05, "momentum": 0.9}),
    (torch.optim.SGD, {"lr": 0.05, "momentum": 0.9, "dampening": 0.1, "weight_decay": 0.01}),
    (torch.optim.SGD, {"lr": 0.05, "momentum": 0.8, "nesterov": True, "weight_decay": 1e-3}),
    (torch.optim.Adam, {"lr": 0.01}),
    (torch.optim.Adam, {"lr": 0.01, "betas": (0.8, 0.99), "eps": 1e-6, "weight_decay": 0.01, "amsgrad": True}),
    (torch.optim.AdamW, {"lr": 0.01}),
    (torch.optim.AdamW, {"lr": 0.01, "weight_decay": 0.1, "amsgrad": True}),
]


def optimizer_id(case: tuple[Any, dict[str, Any]]) -> str:
    return case[0].__name__ + "".join(f"-{k}={v}" for k, v in case[1].items() if k != "lr")


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(10, 24)
        self.fc2 = nn.Linear(24, 16)
        self.head = nn.Linear(16, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.fc2(torch.tanh(self.fc1(x)))))


def batches(count: int, size: int, seed: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    generator = torch.Generator().manual_seed(seed)
    return [(torch.randn(size, 10, generator=generator), torch.randint(0, 3, (size,), generator=generator))
            for _ in range(count)]


def train_plain(model: nn.Module, optimizer: Any, data: list[Any], scheduler: Any = None) -> list[float]:
    losses = []
    for x, y in data:
        optimizer.zero_grad()
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        optimizer.step()
        if scheduler is not None:
            scheduler.step()
        losses.append(loss.item())
    return losses


def config() -> Config:
    return Config(wait_timeout_s=20)  # the "add" rule: wrap() must take the optimizer's instead


@pytest.mark.parametrize("case", OPTIMIZERS, ids=optimizer_id)
def test_one_worker_takes_torchs_steps(case: tuple[Any, dict[str, Any]],
                                       max_rel_error: Callable[..., float]) -> None:
    optimizer_class, settings = case
    torch.manual_seed(0)
    initial = Net()
    data = batches(STEPS, 16, seed=1)
    reference = copy.deepcopy(initial)
    want_losses = train_plain(reference, optimizer_class(reference.parameters(), **settings), data)

    with LocalCluster(1, config()) as cluster:
        net = copy.deepcopy(initial)
        optimizer = optimizer_class(net.parameters(), **settings)
        model = mt.wrap(net, cluster.worker(0), example_input=data[0][0], optimizer=optimizer)
        got_losses = train_plain(model, model.optimizer, data)
        got = model.state_dict()

    assert max_rel_error(got, reference.state_dict()) <= REL_TOL
    assert max(abs(a - b) / abs(b) for a, b in zip(got_losses, want_losses)) <= REL_TOL
    assert max_rel_error(got, initial.state_dict()) > 1e-3  # training moved the parameters


def test_without_an_optimizer_the_default_config_trains_as_plain_sgd(max_rel_error: Callable[..., float]) -> None:
    """Config's default rule, add, sums what applications send as deltas; the
    adapter sends gradients, so it became plain SGD at the rule's rate (a
    probe: added, the gradients made the loss climb from 2.4 to 3e11 in 20
    steps), and model.optimizer's rate is that rate and reaches the servers."""
    torch.manual_seed(0)
    initial = Net()
    data = batches(STEPS, 16, seed=3)
    reference = copy.deepcopy(initial)
    plain = torch.optim.SGD(reference.parameters(), lr=Config().update_rule.learning_rate)
    scheduler = torch.optim.lr_scheduler.StepLR(plain, step_size=3, gamma=0.5)
    want_losses = train_plain(reference, plain, data, scheduler)

    with LocalCluster(1, config()) as cluster:
        model = mt.wrap(copy.deepcopy(initial), cluster.worker(0), example_input=data[0][0])
        assert model.optimizer.param_groups[0]["lr"] == Config().update_rule.learning_rate
        got_losses = train_plain(model, model.optimizer,
                                 data, torch.optim.lr_scheduler.StepLR(model.optimizer, step_size=3, gamma=0.5))
        got = model.state_dict()

    assert max_rel_error(got, reference.state_dict()) <= REL_TOL
    assert max(abs(a - b) / abs(b) for a, b in zip(got_losses, want_losses)) <= REL_TOL


@pytest.mark.parametrize("case", [OPTIMIZERS[3], OPTIMIZERS[7]], ids=optimizer_id)
def test_two_workers_take_torchs_steps_on_the_averaged_gradient(
    case: tuple[Any, dict[str, Any]], run_workers: Callable[..., list[Any]], max_rel_error: Callable[..., float]
) -> None:
    optimizer_class, settings = case
    per_worker = 8
    torch.manual_seed(0)
    initial = Net()
    data = batches(20, 2 * per_worker, seed=2)
    reference = copy.deepcopy(initial)
    train_plain(reference, optimizer_class(reference.parameters(), **settings), data)

    def body(worker: Worker) -> dict[str, torch.Tensor]:
        mine = slice(worker.rank * per_worker, (worker.rank + 1) * per_worker)
        net = copy.deepcopy(initial)
        model = mt.wrap(net, worker, example_input=data[0][0][mine],
                        optimizer=optimizer_class(net.parameters(), **settings))
        train_plain(model, model.optimizer, [(x[mine], y[mine]) for x, y in data])
        return model.state_dict()

    with LocalCluster(2, config()) as cluster:
        states = run_workers(body, cluster.workers, on_error=cluster.shutdown)
    assert max_rel_error(states[0], reference.state_dict()) <= 1e-5
    for name, value in states[0].items():
        assert torch.equal(value, states[1][name]), name


def test_step_lr_follows_plain_torch() -> None:
    """The issue's scheduler test: StepLR on SGD with momentum, the loss of
    every step equal within 1e-5 (the rate halves at steps 5, 10, ...)."""
    torch.manual_seed(0)
    initial = Net()
    data = batches(STEPS, 16, seed=3)
    reference = copy.deepcopy(initial)
    plain_optimizer = torch.optim.SGD(reference.parameters(), lr=0.2, momentum=0.9)
    plain_scheduler = torch.optim.lr_scheduler.StepLR(plain_optimizer, step_size=5, gamma=0.5)
    want = train_plain(reference, plain_optimizer, data, plain_scheduler)

    with LocalCluster(1, config()) as cluster:
        net = copy.deepcopy(initial)
        original = torch.optim.SGD(net.parameters(), lr=0.2, momentum=0.9)
        model = mt.wrap(net, cluster.worker(0), example_input=data[0][0], optimizer=original)
        optimizer = model.optimizer
        scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=5, gamma=0.5)
        got = train_plain(model, optimizer, data, scheduler)
        assert optimizer.param_groups[0]["lr"] == pytest.approx(0.2 * 0.5**6)
        assert original.param_groups[0] is optimizer.param_groups[0]  # the same dicts

    assert max(abs(a - b) / abs(b) for a, b in zip(got, want)) <= 1e-5
    # Without the schedule the losses part after step 5.
    constant = train_plain(copy.deepcopy(initial), torch.optim.SGD(copy.deepcopy(initial).parameters(), lr=0.2), data)
    assert abs(constant[-1] - want[-1]) > 1e-3


def test_a_scheduler_on_the_original_optimizer_and_groups_per_layer(max_rel_error: Callable[..., float]) -> None:
    """Two param groups (the head with its own rate, decayed by its own
    lambda), a scheduler built on the user's optimizer before wrap(): each
    layer follows its group."""
    torch.manual_seed(0)
    initial = Net()
    data = batches(STEPS, 16, seed=4)

    def make(model: nn.Module) -> tuple[Any, Any]:
        optimizer = torch.optim.AdamW([
            {"params": list(model.fc1.parameters()) + list(model.fc2.parameters())},
            {"params": model.head.parameters(), "lr": 0.03, "weight_decay": 0.0},
        ], lr=0.01)
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, [lambda s: 0.9**s, lambda s: 1.0 / (1 + s)])
        return optimizer, scheduler

    reference = copy.deepcopy(initial)
    plain_optimizer, plain_scheduler = make(reference)
    train_plain(reference, plain_optimizer, data, plain_scheduler)

    with LocalCluster(1, config()) as cluster:
        net = copy.deepcopy(initial)
        optimizer, scheduler = make(net)
        model = mt.wrap(net, cluster.worker(0), example_input=data[0][0], optimizer=optimizer)
        train_plain(model, model.optimizer, data, scheduler)
        got = model.state_dict()
    assert max_rel_error(got, reference.state_dict()) <= 1e-5


@pytest.mark.parametrize("scheduler_made", ["before wrap()", "after wrap()"])
def test_the_original_optimizers_step_ends_the_clock(scheduler_made: str,
                                                    max_rel_error: Callable[..., float]) -> None:
    """A converted loop that keeps calling the optimizer it gave to wrap()
    (not model.optimizer) trains as plain PyTorch, its scheduler too,
    without torch's warnings about a replaced step(); with a GradScaler it
    is refused, naming model.optimizer; unwrap() gives the optimizer its own
    step back."""
    torch.manual_seed(0)
    initial = Net()
    data = batches(12, 16, seed=5)

    def make(model: nn.Module) -> tuple[Any, Any]:
        optimizer = torch.optim.SGD(model.parameters(), lr=0.2, momentum=0.9)
        return optimizer, torch.optim.lr_scheduler.StepLR(optimizer, step_size=4, gamma=0.5)

    reference = copy.deepcopy(initial)
    plain_optimizer, plain_scheduler = make(reference)
    want = train_plain(reference, plain_optimizer, data, plain_scheduler)

    with LocalCluster(1, config()) as cluster:
        net = copy.deepcopy(initial)
        if scheduler_made == "before wrap()":
            optimizer, scheduler = make(net)
            model = mt.wrap(net, cluster.worker(0), example_input=data[0][0], optimizer=optimizer)
        else:
            optimizer = torch.optim.SGD(net.parameters(), lr=0.2, momentum=0.9)
            model = mt.wrap(net, cluster.worker(0), example_input=data[0][0], optimizer=optimizer)
            scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=4, gamma=0.5)
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # torch's "step() overridden" / "scheduler before step()" warnings
            got = train_plain(model, optimizer, data, scheduler)
        assert model.clock == len(data)
        assert max_rel_error(model.state_dict(), reference.state_dict()) <= 1e-5

        x, y = data[0]
        scaler = torch.amp.GradScaler("cpu")
        scaler.scale(F.cross_entropy(model(x), y)).backward()
        with pytest.raises(InvalidArgumentError, match=r"scaler\.step\(model\.optimizer\)"):
            scaler.step(optimizer)
        model.step()

        unwrapped = model.unwrap()
        before = [p.detach().clone() for p in unwrapped.parameters()]
        F.cross_entropy(unwrapped(x), y).backward()
        with pytest.warns(UserWarning, match="without the servers' optimizer state"):  # its momentum stayed there
            optimizer.step()  # torch's own step again, on the plain module
        assert all(not torch.equal(a, p) for a, p in zip(before, unwrapped.parameters()))
    assert max(abs(a - b) / abs(b) for a, b in zip(got, want)) <= 1e-5


def test_another_optimizer_stepping_on_wrapped_parameters_is_refused() -> None:
    """An optimizer made from the wrapped model's parameters after wrap()
    would update the engine's lent buffers, not the servers' values: its
    step raises, naming the parameter and the way out, and changes nothing;
    optimizers of other models are untouched, and after unwrap() it steps
    as in plain PyTorch."""
    torch.manual_seed(0)
    data = batches(3, 16, seed=6)
    x, y = data[0]
    other = Net()
    other_optimizer = torch.optim.SGD(other.parameters(), lr=0.1)
    with LocalCluster(1, config()) as cluster:
        model = mt.wrap(Net(), cluster.worker(0), example_input=x)
        foreign = torch.optim.Adam(model.parameters(), lr=0.01)
        F.cross_entropy(model(x), y).backward()
        before = model.state_dict()
        with pytest.raises(InvalidArgumentError, match=r"Adam.step\(\) on parameter 'fc1.weight'.*optimizer=..."):
            foreign.step()
        model.step()  # the clock ends as usual
        F.cross_entropy(other(x), y).backward()
        other_optimizer.step()  # a plain model beside it trains as before
        after = model.state_dict()
        assert any(not torch.equal(before[k], after[k]) for k in before)  # the servers' update, not Adam's
        unwrapped = model.unwrap()
    F.cross_entropy(unwrapped(x), y).backward()
    weights = unwrapped.fc1.weight.detach().clone()
    foreign.step()
    assert not torch.equal(weights, unwrapped.fc1.weight)


def test_a_written_rate_reaches_the_servers_at_the_next_clock() -> None:
    """Without an optimizer, model.optimizer's one group holds the Config
    rule's rate; lr 0 freezes the parameters from the next clock on."""
    torch.manual_seed(0)
    data = batches(4, 8, seed=5)
    rule = UpdateRule("sgd", learning_rate=0.1, momentum=0.5)
    with LocalCluster(1, Config(wait_timeout_s=20, update_rule=rule)) as cluster:
        model = mt.wrap(Net(), cluster.worker(0), example_input=data[0][0])
        assert isinstance(model.optimizer, torch.optim.Optimizer)
        assert model.optimizer.param_groups[0]["lr"] == 0.1
        train_plain(model, model.optimizer, data[:2])
        model.optimizer.param_groups[0]["lr"] = 0.0
        before = model.state_dict()
        train_plain(model, model.optimizer, data[2:])
        after = model.state_dict()
    for name, value in before.items():
        assert torch.equal(value, after[name]), name


class Sgdish(torch.optim.SGD):
    pass


def stepped(optimizer: Any) -> Any:
    """The optimizer after one step on a gradient of ones (it has moments now)."""
    for group in optimizer.param_groups:
        for param in group["params"]:
            param.grad = torch.ones_like(param)
    optimizer.step()
    optimizer.zero_grad()
    return optimizer


@pytest.mark.parametrize(("make", "message"), [
    (lambda p: torch.optim.RMSprop(p, lr=0.1), r"optimizer RMSprop is not one the servers implement"),
    # Adagrad has state from its making: the type is what the servers cannot follow.
    (lambda p: torch.optim.Adagrad(p, lr=0.1), r"optimizer Adagrad is not one the servers implement"),
    (lambda p: Sgdish(p, lr=0.1), r"Sgdish is a subclass of torch.optim.SGD"),
    (lambda p: torch.optim.SGD(p, lr=0.1, maximize=True), r"maximize=True"),
    (lambda p: torch.optim.SGD(list(p)[:-1], lr=0.1), r"parameter 'head.bias' is trainable but not in the optimizer"),
    (lambda p: torch.optim.SGD([*p, nn.Parameter(torch.ones(3))], lr=0.1), r"not a trainable parameter"),
    (lambda p: "sgd", r"optimizer must be a torch.optim.Optimizer, got str"),
    (lambda p: stepped(torch.optim.Adam(p)), r"the Adam given to wrap\(\) already has state"),
])
def test_optimizers_the_servers_cannot_follow_are_refused(make: Callable[[Any], Any], message: str) -> None:
    with LocalCluster(1, config()) as cluster:
        net = Net()
        with pytest.raises(InvalidArgumentError, match=message) as caught:
            mt.wrap(net, cluster.worker(0), example_input=torch.zeros(2, 10), optimizer=make(net.parameters()))
        if "Optimizer, got" not in message:
            assert isinstance(caught.value, mt.UnsupportedModelError)
        assert cluster.worker(0).tables == []  # nothing reached the engine


class Attending(nn.Module):
    """Net with a multi-head attention before its head: a whole module
    whose own in_proj_weight and in_proj_bias are read in its forward."""

    def __init__(self) -> None:
        super().__init__()
        self.net = Net()
        self.attention = nn.MultiheadAttention(3, 1, batch_first=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.net(x).unsqueeze(0)
        return self.attention(h, h, h, need_weights=False)[0].squeeze(0)


@pytest.mark.parametrize("store_activations", [False, True], ids=["default", "stored"])
@pytest.mark.parametrize("rule", ["sgd", "adamw"])
def test_weights_decayed_and_biases_not_take_torchs_steps(rule: str, store_activations: bool,
                                                          max_rel_error: Callable[..., float]) -> None:
    """nanoGPT's param groups: weights decayed, biases not. A module's own
    parameters in groups of different rules were refused; now they are a
    table per group, read together in the module's forward."""
    def make(model: nn.Module) -> torch.optim.Optimizer:
        decayed = [p for p in model.parameters() if p.dim() >= 2]
        others = [p for p in model.parameters() if p.dim() < 2]
        groups = [{"params": decayed, "weight_decay": 0.1}, {"params": others, "weight_decay": 0.0}]
        return (torch.optim.SGD(groups, lr=0.05, momentum=0.9) if rule == "sgd"
                else torch.optim.AdamW(groups, lr=0.01))

    torch.manual_seed(0)
    initial = Attending() if rule == "sgd" else Net()  # (Adam magnifies the rounding of the key bias's zero gradient)
    data = batches(STEPS, 16, seed=1)
    reference = copy.deepcopy(initial)
    train_plain(reference, make(reference), data)
    with LocalCluster(1, config()) as cluster:
        net = copy.deepcopy(initial)
        model = mt.wrap(net, cluster.worker(0), example_input=data[0][0], optimizer=make(net),
                        store_activations=store_activations, group_bytes=0)
        train_plain(model, model.optimizer, data)
        got = model.state_dict()
        prefix = "net." if rule == "sgd" else ""
        assert {f"{prefix}fc1 (param group 0)", f"{prefix}fc1 (param group 1)"} <= set(model.layers)
        assert rule != "sgd" or "attention (param group 1)" in model.layers
    assert max_rel_error(got, reference.state_dict()) <= 1e-5
    moved = f"{prefix}head.weight"
    assert max_rel_error({moved: got[moved]}, {moved: initial.state_dict()[moved]}) > 1e-3


def test_each_group_of_a_modules_parameters_follows_its_own_schedule(max_rel_error: Callable[..., float]) -> None:
    """Groups of equal settings on a module's own parameters, each with its
    own warm-up: they shared a table and were refused at the first clock
    ("share a table ... now have the learning rates"); the tables follow the
    groups, not their settings, which also keeps a resumed run's tables
    those of its checkpoint whatever the rates then."""
    def make(model: nn.Module) -> torch.optim.Optimizer:  # the groups' settings equal until a schedule starts
        weights = [p for p in model.parameters() if p.dim() >= 2]
        biases = [p for p in model.parameters() if p.dim() < 2]
        return torch.optim.SGD([{"params": weights}, {"params": biases}], lr=0.05, momentum=0.9)

    def warm_up_weights(optimizer: Any) -> Any:
        return torch.optim.lr_scheduler.LambdaLR(optimizer, [lambda s: min(1.0, (s + 1) / 4), lambda s: 1.0])

    torch.manual_seed(0)
    initial = Net()
    data = batches(STEPS, 16, seed=1)
    reference = copy.deepcopy(initial)
    optimizer = make(reference)
    train_plain(reference, optimizer, data, warm_up_weights(optimizer))
    with LocalCluster(1, config()) as cluster:
        net = copy.deepcopy(initial)
        model = mt.wrap(net, cluster.worker(0), example_input=data[0][0], optimizer=make(net))
        assert model.layers == [f"{name} (param group {g})" for name in ("fc1", "fc2", "head") for g in (0, 1)]
        train_plain(model, model.optimizer, data, warm_up_weights(model.optimizer))
        got = model.state_dict()
    assert max_rel_error(got, reference.state_dict()) <= 1e-5


def test_a_child_spanning_param_groups_is_split_into_tables() -> None:
    net = nn.Sequential(Net(), nn.Linear(3, 2))  # Net is one group-sized child
    optimizer = torch.optim.SGD([{"params": list(net[0].fc1.parameters())},
                                 {"params": [*net[0].fc2.parameters(), *net[0].head.parameters()], "lr": 0.5},
                                 {"params": net[1].parameters()}], lr=0.1)
    with LocalCluster(1, config()) as cluster:
        model = mt.wrap(net, cluster.worker(0), example_input=torch.zeros(2, 10), optimizer=optimizer)
        assert model.layers == ["0.fc1", "0.fc2", "0.head", "1"]
        rules = [cluster.worker(0).update_rule_of(t) for t in cluster.worker(0).tables]
        assert [r.learning_rate if r else None for r in rules] == [0.1, 0.5, 0.5, 0.1]


def test_only_the_rate_may_change_after_wrap() -> None:
    data = batches(2, 8, seed=6)
    with LocalCluster(1, config()) as cluster:
        net = Net()
        model = mt.wrap(net, cluster.worker(0), example_input=data[0][0],
                        optimizer=torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9))
        train_plain(model, model.optimizer, data[:1])
        model.optimizer.param_groups[0]["momentum"] = 0.5
        with pytest.raises(InvalidArgumentError, match=r"param_groups\[0\]\['momentum'\] changed from 0.9 to 0.5"):
            model(data[1][0])
        model.optimizer.param_groups[0]["momentum"] = 0.9  # nothing reached the engine: the clock can run
        model.optimizer.param_groups[0]["lr"] = -1.0
        with pytest.raises(InvalidArgumentError, match=r"param_groups\[0\]\['lr'\] must be a finite number"):
            model(data[1][0])
        model.optimizer.param_groups[0]["lr"] = 0.05
        train_plain(model, model.optimizer, data[1:])
        with pytest.raises(InvalidArgumentError, match="add_param_group"):
            model.optimizer.add_param_group({"params": [torch.zeros(1, requires_grad=True)]})


@pytest.mark.parametrize("make", [lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9),
                                  lambda p: torch.optim.Adam(p, lr=0.01)], ids=["SGD", "Adam"])
def test_maximize_set_after_wrap_is_refused(make: Callable[[Any], Any]) -> None:
    """maximize=True, refused at wrap(), was ignored when set after it: the
    servers went on minimizing, without a word."""
    data = batches(2, 8, seed=6)
    with LocalCluster(1, config()) as cluster:
        net = Net()
        optimizer = make(net.parameters())
        model = mt.wrap(net, cluster.worker(0), example_input=data[0][0], optimizer=optimizer)
        train_plain(model, optimizer, data[:1])
        optimizer.param_groups[0]["maximize"] = True
        with pytest.raises(InvalidArgumentError, match=r"\['maximize'\] changed from False to True.*negate the loss"):
            model(data[1][0])
        optimizer.param_groups[0]["maximize"] = False  # nothing reached the engine: the clock can run
        train_plain(model, optimizer, data[1:])


def test_a_state_dict_loaded_into_the_original_optimizer_keeps_its_rates_reaching_the_servers(
        max_rel_error: Callable[..., float]) -> None:
    """torch's load_state_dict on the optimizer given to wrap() replaced its
    param-group dicts, whose rates reach the servers: a scheduler made after
    it (a torch-style resume) changed nothing there, and a dict with
    momentum buffers loaded without a word. Until unwrap() it is
    model.optimizer's, which sets the groups' settings and refuses state."""
    torch.manual_seed(0)
    initial = Net()
    data = batches(6, 16, seed=5)

    def resume_and_train(model: nn.Module, optimizer: Any, saved: dict[str, Any]) -> list[float]:
        optimizer.load_state_dict(saved)
        scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
        return train_plain(model, optimizer, data, scheduler)

    reference = copy.deepcopy(initial)
    plain_optimizer = torch.optim.SGD(reference.parameters(), lr=0.2, momentum=0.9)
    saved = copy.deepcopy(plain_optimizer.state_dict())  # a checkpoint of the fresh optimizer, lr 0.1
    saved["param_groups"][0]["lr"] = 0.1
    want = resume_and_train(reference, plain_optimizer, saved)
    with LocalCluster(1, config()) as cluster:
        net = copy.deepcopy(initial)
        optimizer = torch.optim.SGD(net.parameters(), lr=0.2, momentum=0.9)
        model = mt.wrap(net, cluster.worker(0), example_input=data[0][0], optimizer=optimizer)
        got = resume_and_train(model, optimizer, saved)
        assert optimizer.param_groups[0]["lr"] == model.optimizer.param_groups[0]["lr"] == 0.1 * 0.5 ** len(data)
        assert max_rel_error(model.state_dict(), reference.state_dict()) <= 1e-5
        with pytest.raises(OutOfOrderError, match="per-parameter optimizer state.*resume_from"):
            optimizer.load_state_dict(plain_optimizer.state_dict())  # with its momentum buffers
    assert max(abs(a - b) / abs(b) for a, b in zip(got, want)) <= 1e-5


def test_add_param_group_on_the_original_optimizer_is_refused_until_unwrap() -> None:
    """It was accepted, and the added parameter (a learnable loss weight)
    never trained: no step but the servers' runs."""
    with LocalCluster(1, config()) as cluster:
        net = Net()
        optimizer = torch.optim.SGD(net.parameters(), lr=0.1)
        model = mt.wrap(net, cluster.worker(0), example_input=torch.zeros(2, 10), optimizer=optimizer)
        with pytest.raises(InvalidArgumentError, match="add_param_group.*a torch optimizer of its own"):
            optimizer.add_param_group({"params": [nn.Parameter(torch.zeros(1))], "lr": 0.1})
        assert len(optimizer.param_groups) == 1
        model.unwrap()
    optimizer.add_param_group({"params": [nn.Parameter(torch.zeros(1))]})  # torch's own again
    assert len(optimizer.param_groups) == 2


def test_the_original_optimizers_state_dict_says_the_servers_state_is_not_in_it() -> None:
    """It left the momentum buffers out without a word, where
    model.optimizer's warns; now it is model.optimizer's, in the groups of
    the original optimizer (and model.optimizer's groups are those too,
    with a GradScaler)."""
    data = batches(1, 8, seed=5)
    with LocalCluster(1, config()) as cluster:
        net = Net()
        optimizer = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)
        model = mt.wrap(net, cluster.worker(0), example_input=data[0][0], optimizer=optimizer,
                        grad_scaler=torch.amp.GradScaler("cpu"))
        train_plain(model, model.optimizer, data)
        with pytest.warns(UserWarning, match="not the servers' optimizer state"):
            saved = optimizer.state_dict()
        assert saved["state"] == {} and saved["param_groups"][0]["momentum"] == 0.9
        assert len(saved["param_groups"]) == 1 and len(model.optimizer.param_groups) == 1
        model.optimizer.state_dict()  # said once per model


def test_workers_that_set_different_rates_fail_with_the_reason(run_workers: Callable[..., list[Any]]) -> None:
    data = batches(3, 8, seed=7)

    def body(worker: Worker) -> None:
        net = Net()
        model = mt.wrap(net, worker, example_input=data[0][0], optimizer=torch.optim.SGD(net.parameters(), lr=0.1))
        for step, (x, y) in enumerate(data):
            if step == 1 and worker.rank == 0:  # a schedule on rank 0 only
                model.optimizer.param_groups[0]["lr"] = 0.01
            F.cross_entropy(model(x), y).backward()
            model.optimizer.step()
        worker.sync()

    with LocalCluster(2, Config(wait_timeout_s=10)) as cluster:
        disagree = r"the workers set different learning rates .*worker 0: 0.01.*worker 1: kept"
        with pytest.raises(AssertionError, match=disagree):
            run_workers(body, cluster.workers, on_error=cluster.shutdown)


def test_a_rate_set_between_backward_and_step_applies_to_that_step_as_in_torch() -> None:
    """llm.c's loop: lr = schedule(step); for g in optimizer.param_groups:
    g["lr"] = lr; optimizer.step() after backward(). Where updates ship at
    step() (wrap()'s default in one process), the rate applies to that step."""
    data = batches(4, 8, seed=5)

    def loop(model: nn.Module, optimizer: Any) -> None:
        for step, (x, y) in enumerate(data):
            optimizer.zero_grad()
            F.cross_entropy(model(x), y).backward()
            for group in optimizer.param_groups:
                group["lr"] = 0.05 * 0.5 ** step
            optimizer.step()

    torch.manual_seed(0)
    reference = Net()
    wrapped = copy.deepcopy(reference)
    loop(reference, torch.optim.SGD(reference.parameters(), lr=0.05, momentum=0.9))
    with LocalCluster(1, config()) as cluster:
        optimizer = torch.optim.SGD(wrapped.parameters(), lr=0.05, momentum=0.9)
        model = mt.wrap(wrapped, cluster.worker(0), example_input=data[0][0], optimizer=optimizer)
        loop(model, optimizer)
        got = model.state_dict()
    for name, value in reference.state_dict().items():
        assert torch.allclose(got[name], value, rtol=1e-5, atol=1e-7), name


def test_a_rate_set_after_the_updates_left_warns_that_it_applies_from_the_next_clock() -> None:
    data = batches(2, 8, seed=5)
    with LocalCluster(1, config()) as cluster:
        net = Net()
        optimizer = torch.optim.SGD(net.parameters(), lr=0.05, momentum=0.9)
        model = mt.wrap(net, cluster.worker(0), example_input=data[0][0], optimizer=optimizer, store_activations=True)
        x, y = data[0]
        F.cross_entropy(model(x), y).backward()  # stored activations: each layer's update leaves here
        optimizer.param_groups[0]["lr"] = 0.01
        with pytest.warns(UserWarning, match=r"changed between backward\(\) and step\(\) of clock 0.*from clock 1"):
            optimizer.step()


def test_model_optimizer_shows_the_config_rules_momentum_and_keeps_it() -> None:
    """Without an optimizer given, model.optimizer's group shows the Config
    rule's momentum, as torch's SGD does: OneCycleLR then finds it, and its
    momentum cycling is refused by the adapter's own check, naming the fix."""
    data = batches(3, 8, seed=5)
    rule = UpdateRule("sgd", learning_rate=0.1, momentum=0.9)
    with LocalCluster(1, Config(wait_timeout_s=20, update_rule=rule)) as cluster:
        model = mt.wrap(Net(), cluster.worker(0), example_input=data[0][0])
        assert model.optimizer.param_groups[0]["momentum"] == 0.9
        torch.optim.lr_scheduler.OneCycleLR(model.optimizer, max_lr=0.1, total_steps=10)  # sets momentum 0.95
        x, y = data[0]
        with pytest.raises(InvalidArgumentError, match=r"'momentum'\] changed from 0\.9 to 0\.95.*cycle_momentum=False"):
            model(x)  # before the clock touches the engine
        model.optimizer.param_groups[0]["momentum"] = 0.9
        F.cross_entropy(model(x), y).backward()  # the clock goes on
        model.step()
