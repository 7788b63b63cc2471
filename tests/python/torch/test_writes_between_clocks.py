"""What a loop may not do to a wrapped model's parameters between clocks,
since the servers hold them: write them in place (a late initialiser,
``model.module.load_state_dict``, WGAN's weight clipping), which would be
lost or, written into the NaN placeholder every parameter points at between
clocks, would hide later misuse; copy or pickle the model. Each is refused
with what to do instead, and the model trains on as if it never happened."""

from __future__ import annotations

import copy
import io
import pickle
from collections.abc import Callable

import pytest

torch = pytest.importorskip("torch")

from torch import nn  # noqa: E402

import mltuner  # noqa: E402
import mltuner.torch as mt  # noqa: E402

X = torch.randn(16, 8, generator=torch.Generator().manual_seed(0))
Y = torch.randint(0, 3, (16,), generator=torch.Generator().manual_seed(1))
CLOCKS = 4


def net() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 3))


def clock(model: mt.PSModule) -> None:
    nn.functional.cross_entropy(model(X), Y).backward()
    model.step()


def trained(between: Callable[[mt.PSModule], None] | None) -> dict[str, torch.Tensor]:
    """CLOCKS clocks, calling ``between`` (which must be refused) after the second."""
    with mltuner.Job() as job:
        module = net()
        model = mt.wrap(module, job.worker, example_input=X,
                        optimizer=torch.optim.SGD(module.parameters(), lr=0.1, momentum=0.9))
        for number in range(CLOCKS):
            clock(model)
            if number == 1 and between is not None:
                between(model)
        return model.state_dict()


def _zero_bias(model: mt.PSModule) -> None:
    with torch.no_grad():
        model.module[0].bias.zero_()


def _clamp_after_evaluation(model: mt.PSModule) -> None:
    model.eval()  # (batch norm's statistics stay as they are)
    with torch.no_grad():
        model(X)  # the parameters now hold a copy of the servers' values
        model.train()
        for parameter in model.module.parameters():
            parameter.clamp_(-0.01, 0.01)


def _initialise(model: mt.PSModule) -> None:
    model.module.apply(lambda m: nn.init.zeros_(m.weight) if isinstance(m, nn.Linear) else None)


WRITES = {"zero_": _zero_bias, "clamp-after-eval": _clamp_after_evaluation, "init": _initialise}


@pytest.mark.parametrize("write", WRITES.values(), ids=list(WRITES))
@pytest.mark.parametrize("then", ["train", "evaluate", "state_dict"])
def test_a_parameter_written_between_clocks_is_refused_and_dropped(write: Callable[[mt.PSModule], None],
                                                                   then: str) -> None:
    want = trained(None)

    def write_then(model: mt.PSModule) -> None:
        write(model)
        with pytest.raises(mltuner.OutOfOrderError, match="changed in place between clocks"):
            if then == "train":
                clock(model)
            elif then == "evaluate":
                with torch.no_grad():
                    model.eval()(X)
            else:
                model.state_dict()
        model.train()
        if write is _zero_bias:  # the write went into the placeholder every parameter points at: NaN again
            assert all(torch.isnan(p).all() for p in model.module.parameters())

    got = trained(write_then)
    for name in want:
        assert torch.equal(got[name], want[name]), name


def test_loading_parameters_into_the_module_is_refused_and_buffers_may_load() -> None:
    with mltuner.Job() as job:
        module = net()
        model = mt.wrap(module, job.worker, example_input=X)
        clock(model)
        with pytest.raises(mltuner.OutOfOrderError, match="load_state_dict on a wrapped model's module"):
            module.load_state_dict(net().state_dict())
        buffers = {name: torch.full_like(value, 2) for name, value in net().state_dict().items() if "running" in name}
        module.load_state_dict(buffers, strict=False)  # local to the worker: allowed
        assert torch.equal(module[1].running_var, torch.full((16,), 2.0))
        clock(model)
        plain = model.unwrap()
        plain.load_state_dict(net().state_dict())  # the plain module again


@pytest.mark.parametrize("what", ["model", "module"])
def test_a_wrapped_model_or_its_module_cannot_be_copied_or_pickled(what: str) -> None:
    with mltuner.Job() as job:
        module = net()
        model = mt.wrap(module, job.worker, example_input=X)
        clock(model)
        target = model if what == "model" else module
        with pytest.raises(mltuner.ArgumentTypeError, match="deepcopy the module before wrap"):
            copy.deepcopy(target)
        with pytest.raises(mltuner.ArgumentTypeError, match=r"save model.state_dict\(\)"):
            torch.save(target, io.BytesIO())
        with pytest.raises(TypeError):
            pickle.dumps(target)
        clock(model)  # nothing happened to the model
        plain = model.unwrap()
        copy.deepcopy(plain)  # the plain module again


@pytest.mark.parametrize("kind", ["adam", "sgd"])
def test_the_optimizer_unwrap_gives_back_warns_at_its_first_step_that_its_state_stayed_behind(kind: str) -> None:
    with mltuner.Job() as job:
        module = net()
        optimizer = torch.optim.Adam(module.parameters(), lr=0.01) if kind == "adam" else \
            torch.optim.SGD(module.parameters(), lr=0.1)
        model = mt.wrap(module, job.worker, example_input=X, optimizer=optimizer)
        clock(model)
        plain = model.unwrap()  # no warning: exporting the model is fine
        for _ in range(2):
            nn.functional.cross_entropy(plain(X), Y).backward()
            if kind == "adam":  # the first step warns, once
                with pytest.warns(UserWarning, match="without the servers' optimizer state"):
                    optimizer.step()
                kind = "adam, warned"
            else:
                optimizer.step()  # plain SGD keeps no state: nothing to say


def test_a_write_through_data_after_an_evaluation_is_refused_at_the_next_clock() -> None:
    """p.data has a version counter of its own, so the check above cannot
    see it; after an evaluation the parameters hold copies whose sums tell."""
    want = trained(None)

    def clip_data(model: mt.PSModule) -> None:
        model.eval()
        with torch.no_grad():
            model(X)
        model.train()
        for parameter in model.module.parameters():
            parameter.data.clamp_(-0.01, 0.01)  # the original WGAN code's clipping
        with pytest.raises(mltuner.OutOfOrderError, match="layer '0' were changed after an evaluation"):
            clock(model)

    got = trained(clip_data)
    for name in want:
        assert torch.equal(got[name], want[name]), name


@pytest.mark.parametrize("then", ["evaluate", "state_dict"])
def test_a_nan_that_training_put_in_the_weights_is_no_write_after_an_evaluation(then: str) -> None:
    """One corrupt sample poisons the weights with NaN, in torch as here;
    the loop goes on with NaN losses. The copies an evaluation or
    state_dict() binds then hold NaN, whose sum is no number equal to
    itself: the check for writes through p.data must not take that for one."""
    corrupt = X.clone()
    corrupt[0, 0] = float("nan")
    batches = [X, corrupt, X, X]

    def run(model: nn.Module, optimizer: torch.optim.Optimizer) -> tuple[list[float], dict[str, torch.Tensor]]:
        losses = []
        for x in batches:
            optimizer.zero_grad()
            loss = nn.functional.cross_entropy(model(x), Y)
            loss.backward()
            optimizer.step()
            losses.append(loss.item())
            if then == "evaluate":
                with torch.no_grad():
                    model.eval()(x)
                model.train()
            else:
                model.state_dict()
        return losses, {name: value.clone() for name, value in model.state_dict().items()}

    plain = net()
    want_losses, want = run(plain, torch.optim.SGD(plain.parameters(), lr=0.1, momentum=0.9))
    with mltuner.Job() as job:
        module = net()
        optimizer = torch.optim.SGD(module.parameters(), lr=0.1, momentum=0.9)
        model = mt.wrap(module, job.worker, example_input=X, optimizer=optimizer)
        got_losses, got = run(model, optimizer)
    assert torch.tensor(want_losses).isnan().tolist() == [False, True, True, True]
    torch.testing.assert_close(torch.tensor(got_losses), torch.tensor(want_losses), equal_nan=True)
    for name in want:
        torch.testing.assert_close(got[name], want[name], equal_nan=True, msg=name)
