"""Models that change their parameters' use around the forward pass: forward
pre-hooks registered before wrap() (torch.nn.utils.prune, the old
weight_norm and spectral_norm compute the weight from other parameters in a
pre-hook), and in-place writes to a parameter during the forward, which the
engine cannot keep (nn.Embedding(max_norm=...)).

Each hooked model trains a few clocks through one worker and is compared
with plain PyTorch (SGD with momentum, the rule's twin) on the same batches,
for every way the adapter reads a layer: held reads bound before the
forward, reads opened by the layer's own pre-hook, and stored activations.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import pytest

torch = pytest.importorskip("torch")

from torch import nn  # noqa: E402
from torch.nn.utils import prune  # noqa: E402

import mltuner  # noqa: E402
import mltuner.torch as mt  # noqa: E402
from mltuner import Config, LocalCluster, UpdateRule  # noqa: E402

CLOCKS, BATCH = 3, 4
LR, MOMENTUM = 0.05, 0.9


def pruned() -> nn.Module:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 5))
    prune.l1_unstructured(model[0], "weight", amount=0.3)
    return model


def weight_normed() -> nn.Module:
    torch.manual_seed(0)
    with pytest.warns(FutureWarning):  # the old API, which torch deprecates but keeps
        first = nn.utils.weight_norm(nn.Linear(8, 16))
    return nn.Sequential(first, nn.Tanh(), nn.Linear(16, 5))


def spectral_normed() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.utils.spectral_norm(nn.Linear(8, 16)), nn.Tanh(), nn.Linear(16, 5))


def plain_torch(model: nn.Module, xs: torch.Tensor) -> tuple[list[float], dict[str, torch.Tensor]]:
    optimizer = torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM)
    losses = []
    for x in xs:
        loss = model(x).square().mean()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses, model.state_dict()


@pytest.mark.parametrize("make", [pruned, weight_normed, spectral_normed], ids=["prune", "weight_norm", "spectral_norm"])
@pytest.mark.parametrize("reads", [{}, {"hold_reads": False}, {"store_activations": True}],
                         ids=["held", "per-layer", "stored"])
def test_pre_hooks_registered_before_wrap_see_the_layers_values(make: Callable[[], nn.Module],
                                                                 reads: dict[str, Any]) -> None:
    xs = torch.randn(CLOCKS, BATCH, 8, generator=torch.Generator().manual_seed(1))
    want_losses, want = plain_torch(make(), xs)  # (a hooked model's weight is no leaf: deepcopy refuses it)
    model = make()
    config = Config(update_rule=UpdateRule("sgd", learning_rate=LR, momentum=MOMENTUM), wait_timeout_s=20)
    with LocalCluster(1, config) as cluster:
        ps_model = mt.wrap(model, cluster.worker(0), example_input=xs[0], **reads)
        losses = []
        for x in xs:
            loss = ps_model(x).square().mean()
            loss.backward()
            ps_model.step()
            losses.append(loss.item())
        got = ps_model.state_dict()
    assert all(loss == loss for loss in losses), losses  # no NaN: the hooks read values, not placeholders
    assert losses[0] == want_losses[0]
    assert losses == pytest.approx(want_losses, rel=1e-5)
    assert got.keys() == want.keys()
    for name, value in want.items():
        assert torch.allclose(got[name], value, rtol=1e-5, atol=1e-6), name


class Clamped(nn.Module):
    """A linear layer whose forward pre-hook clamps its weight in place
    (while ``clamping``)."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(8, 5)
        self.clamping = True
        self.linear.register_forward_pre_hook(self._clamp)

    def _clamp(self, module: nn.Module, args: Any) -> None:
        if self.clamping:
            with torch.no_grad():
                module.weight.clamp_(-0.1, 0.1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(x)


@pytest.mark.parametrize("reads", [{}, {"store_activations": True}], ids=["held", "stored"])
@pytest.mark.parametrize("kind", ["embedding", "clamp"])
def test_a_parameter_written_in_place_in_the_forward_is_refused_at_wrap(kind: str, reads: dict[str, Any]) -> None:
    torch.manual_seed(0)
    if kind == "embedding":  # renormalises the rows it looks up, in place
        model: nn.Module = nn.Sequential(nn.Embedding(20, 8, max_norm=0.5), nn.Flatten(), nn.Linear(48, 5))
        x = torch.randint(0, 20, (BATCH, 6), generator=torch.Generator().manual_seed(1))
        name = "0.weight"
    else:
        model, x, name = Clamped(), torch.randn(BATCH, 8), "linear.weight"
    config = Config(update_rule=UpdateRule("sgd", learning_rate=LR, momentum=MOMENTUM))
    with LocalCluster(1, config) as cluster:
        with pytest.raises(mt.UnsupportedModelError, match=rf"parameter '{name}' was written in place"):
            mt.wrap(model, cluster.worker(0), example_input=x, **reads)


def test_a_write_in_a_later_clock_is_refused_and_named_again_after() -> None:
    torch.manual_seed(0)
    model = Clamped()
    model.clamping = False
    x = torch.randn(BATCH, 8, generator=torch.Generator().manual_seed(1))
    config = Config(update_rule=UpdateRule("sgd", learning_rate=LR, momentum=MOMENTUM))
    with LocalCluster(1, config) as cluster:
        ps_model = mt.wrap(model, cluster.worker(0), example_input=x)
        ps_model(x).square().mean().backward()
        ps_model.step()
        assert ps_model.state_dict()["linear.weight"].abs().max() > 0.1  # the clamp changes it
        model.clamping = True
        with pytest.raises(mt.UnsupportedModelError, match="'linear.weight' was written in place"):
            ps_model(x)
        with pytest.raises(mltuner.OutOfOrderError, match="'linear.weight' was written in place"):
            ps_model(x)  # the clock's reads were open: the model cannot go on, and says why


@pytest.mark.parametrize("reads", [{}, {"store_activations": True}], ids=["held", "stored"])
def test_pruning_after_wrap_is_refused_and_the_loop_goes_on(reads: dict[str, Any]) -> None:
    """prune() after wrap() ranked the NaN placeholder the weight holds
    between clocks, and with held reads pruned the wrong weights without a
    word. It is refused before it changes the module."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 5))
    xs = torch.randn(CLOCKS, BATCH, 8, generator=torch.Generator().manual_seed(1))
    config = Config(update_rule=UpdateRule("sgd", learning_rate=LR, momentum=MOMENTUM))
    with LocalCluster(1, config) as cluster:
        ps_model = mt.wrap(model, cluster.worker(0), example_input=xs[0], **reads)
        for number, x in enumerate(xs):
            if number == 1:
                with pytest.raises(mt.UnsupportedModelError, match=r"parameter '0\.weight' of a wrapped model "
                                                                   r"registered again, as 'weight_orig'.*before wrap"):
                    prune.l1_unstructured(model[0], "weight", amount=0.5)
                assert [name for name, _ in model[0].named_parameters()] == ["weight", "bias"]
                assert not dict(model[0].named_buffers())
            ps_model(x).square().mean().backward()
            ps_model.step()
        unwrapped = ps_model.unwrap()
    prune.l1_unstructured(unwrapped[0], "weight", amount=0.5)  # a plain module's again


def l2(model: nn.Module) -> torch.Tensor:
    return sum(p.pow(2).sum() for p in model.parameters())  # type: ignore[return-value]


@pytest.mark.parametrize("reads", [{"hold_reads": False}, {"store_activations": True}], ids=["per-layer", "stored"])
@pytest.mark.parametrize("in_example_loss", [True, False])
def test_a_parameter_used_by_the_loss_is_refused_where_layers_are_read_in_their_forward(
        reads: dict[str, Any], in_example_loss: bool) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 5))
    x = torch.randn(BATCH, 8, generator=torch.Generator().manual_seed(1))
    config = Config(update_rule=UpdateRule("sgd", learning_rate=LR, momentum=MOMENTUM))
    with LocalCluster(1, config) as cluster:
        if in_example_loss:  # the recording pass runs the loss: wrap() refuses it
            with pytest.raises(mt.UnsupportedModelError, match="used outside its module's forward.*L2 penalty"):
                mt.wrap(model, cluster.worker(0), example_input=x,
                        example_loss=lambda out: out.square().mean() + 1e-3 * l2(model), **reads)
            return
        ps_model = mt.wrap(model, cluster.worker(0), example_input=x, **reads)
        with pytest.raises(mt.UnsupportedModelError, match="used outside its module's forward.*weight_decay"):
            ps_model(x).square().mean() + 1e-3 * l2(ps_model)


@pytest.mark.parametrize("reads", [{"hold_reads": False}, {"store_activations": True}], ids=["per-layer", "stored"])
def test_a_parameter_used_before_the_forward_is_refused_and_the_loop_goes_on(reads: dict[str, Any]) -> None:
    """Between clocks the parameters hold the NaN placeholder: a term taken
    from them before the forward gave a NaN loss whose gradient, shipped,
    made every parameter on the servers NaN, without a word."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 5))
    reference = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 5))
    reference.load_state_dict(model.state_dict())
    xs = torch.randn(CLOCKS, BATCH, 8, generator=torch.Generator().manual_seed(1))
    config = Config(update_rule=UpdateRule("sgd", learning_rate=LR, momentum=MOMENTUM))
    result: dict[str, Any] = {}

    def train() -> None:  # on a thread of its own: saved-tensor hooks are a per-thread stack, empty here
        with LocalCluster(1, config) as cluster:
            ps_model = mt.wrap(model, cluster.worker(0), example_input=xs[0], **reads)
            for x in xs:
                with pytest.raises(mt.UnsupportedModelError, match="used between clocks.*before the forward pass"):
                    1e-3 * l2(ps_model)  # before the first clock, and after each step()
                with torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t):  # a script's own hooks
                    loss = ps_model(x).square().mean()
                loss.backward()
                ps_model.step()
            result["got"] = ps_model.unwrap().state_dict()
        # Each guard pushed met one pop (unwrap() took the last): nothing is left on the stack.
        result["left"] = torch._C._autograd._top_saved_tensors_default_hooks(False)

    errors: list[BaseException] = []
    thread = threading.Thread(target=lambda: _capture(train, errors))
    thread.start()
    thread.join(60)
    assert not thread.is_alive() and not errors, errors
    assert result["left"] is None
    got = result["got"]
    optimizer = torch.optim.SGD(reference.parameters(), lr=LR, momentum=MOMENTUM)
    for x in xs:
        reference(x).square().mean().backward()
        optimizer.step()
        optimizer.zero_grad()
    for name, value in reference.state_dict().items():
        assert torch.allclose(got[name], value, rtol=1e-5, atol=1e-6), name


def _capture(run: Callable[[], None], errors: list[BaseException]) -> None:
    try:
        run()
    except BaseException as error:  # noqa: BLE001 - handed to the test's thread
        errors.append(error)


def test_a_penalty_on_the_parameters_trains_like_torch_with_held_reads() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 5))
    xs = torch.randn(CLOCKS, BATCH, 8, generator=torch.Generator().manual_seed(1))
    reference = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 5))
    reference.load_state_dict(model.state_dict())
    optimizer = torch.optim.SGD(reference.parameters(), lr=LR, momentum=MOMENTUM)
    for x in xs:
        (reference(x).square().mean() + 1e-2 * l2(reference)).backward()
        optimizer.step()
        optimizer.zero_grad()
    config = Config(update_rule=UpdateRule("sgd", learning_rate=LR, momentum=MOMENTUM))
    with LocalCluster(1, config) as cluster:
        ps_model = mt.wrap(model, cluster.worker(0), example_input=xs[0])  # held reads: bound until step()
        for x in xs:
            (ps_model(x).square().mean() + 1e-2 * l2(ps_model)).backward()
            ps_model.step()
        got = ps_model.state_dict()
    for name, value in reference.state_dict().items():
        assert torch.allclose(got[name], value, rtol=1e-5, atol=1e-6), name


def test_the_loss_keeps_torchs_check_of_tensors_changed_in_place() -> None:
    """Between the forward pass and step() the refusal above is a saved-tensor
    hook, and hooks turn torch's own check of saved tensors changed in place
    off: the hook makes it instead."""
    torch.manual_seed(0)
    x = torch.randn(BATCH, 8)
    config = Config(update_rule=UpdateRule("sgd", learning_rate=LR, momentum=MOMENTUM))
    with LocalCluster(1, config) as cluster:
        ps_model = mt.wrap(nn.Sequential(nn.Linear(8, 5), nn.Tanh()), cluster.worker(0), example_input=x,
                           store_activations=True)
        grown = torch.exp(ps_model(x))  # exp saves its output
        loss = grown.sum()
        grown.mul_(2)
        with pytest.raises(RuntimeError, match="modified by an inplace operation"):
            loss.backward()
