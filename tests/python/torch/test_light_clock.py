"""The light clock: holding reads without stored activations (the default),
clocks after the recording pass run without saved-tensor hooks, and each
layer's parameters keep their values until the layer's update, then hold
the NaN placeholder again. Gradients the hooks refuse (a second backward
pass, a stale graph after step()) must not leak into a later clock.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

torch = pytest.importorskip("torch")

from torch import nn  # noqa: E402

import mltuner  # noqa: E402
import mltuner.torch as mt  # noqa: E402
from mltuner import Config, LocalCluster, UpdateRule  # noqa: E402

LR = 0.1


def cnn() -> nn.Module:
    """Conv2d and BatchNorm2d save their weight itself (the parameter, not a
    view) for the backward pass."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(2, 4, 3, padding=1, bias=False), nn.BatchNorm2d(4), nn.ReLU(),
                         nn.Conv2d(4, 4, 3, padding=1), nn.Flatten(), nn.Linear(4 * 5 * 5, 3))


def batch(clock: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(100 + clock)
    return torch.randn(6, 2, 5, 5, generator=generator), torch.randint(0, 3, (6,), generator=generator)


def loss_of(model: Any, clock: int) -> torch.Tensor:
    x, y = batch(clock)
    return nn.functional.cross_entropy(model(x), y)


def config() -> Config:
    return Config(wait_timeout_s=20, update_rule=UpdateRule("sgd", learning_rate=LR))


@pytest.mark.parametrize(("options", "hooked"), [({}, False), ({"hold_reads": False}, True),
                                                 ({"store_activations": True}, True)],
                         ids=["default", "fresh backward reads", "stored activations"])
def test_saved_tensor_hooks_only_where_they_have_work(options: dict[str, Any], hooked: bool) -> None:
    with LocalCluster(1, config()) as cluster:
        ps_model = mt.wrap(cnn(), cluster.worker(0), example_input=batch(0)[0], **options)
        driver = ps_model._driver
        calls = [0]
        real_pack = driver._pack

        def counting_pack(tensor: torch.Tensor) -> Any:
            calls[0] += 1
            return real_pack(tensor)

        driver._pack = counting_pack  # looked up by each training forward
        for clock in range(3):
            loss_of(ps_model, clock).backward()
            ps_model.step()
        assert (calls[0] > 0) == hooked, calls[0]


def test_parameters_hold_the_placeholder_after_their_update() -> None:
    """Shipping from the backward pass: each layer's update takes its
    gradients and values away at once."""
    with LocalCluster(1, config()) as cluster:
        ps_model = mt.wrap(cnn(), cluster.worker(0), example_input=batch(0)[0], overlap_updates=True)
        for clock in range(2):
            loss = loss_of(ps_model, clock)
            loss.backward()
            for name, param in ps_model.module.named_parameters():
                assert torch.isnan(param).all(), name
                assert "shipped to the parameter servers" in repr(param.grad), name  # _shipped.py
            ps_model.step()
            assert all(param.grad is None for param in ps_model.module.parameters())


def test_shipping_at_step_leaves_gradients_to_the_script_until_step(max_rel_error: Callable[..., float]) -> None:
    """Shipping at step() (every shard in this process, the default here):
    between backward and step the parameters hold their values and their
    gradients, as with a torch optimizer, so a script may clip them; step()
    ships what it finds and leaves placeholders and no gradients."""
    clocks = 4
    with LocalCluster(1, config()) as cluster:
        ps_model = mt.wrap(cnn(), cluster.worker(0), example_input=batch(0)[0])
        assert ps_model._driver._at_step
        for clock in range(clocks):
            loss_of(ps_model, clock).backward()
            for name, param in ps_model.module.named_parameters():
                assert not torch.isnan(param).any(), name
                assert param.grad is not None, name
            torch.nn.utils.clip_grad_norm_(ps_model.parameters(), 0.5)
            ps_model.step()
            for name, param in ps_model.module.named_parameters():
                assert torch.isnan(param).all(), name
                assert param.grad is None, name
        state = ps_model.state_dict()
    model = cnn()
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    for clock in range(clocks):
        optimizer.zero_grad()
        loss_of(model, clock).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
        optimizer.step()
    assert max_rel_error(state, model.state_dict()) < 1e-5


def plain_run(clocks: int) -> dict[str, torch.Tensor]:
    model = cnn()
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    for clock in range(clocks):
        optimizer.zero_grad()
        loss_of(model, clock).backward()
        optimizer.step()
    return model.state_dict()


@pytest.mark.parametrize("options", [{"overlap_updates": False}, {"overlap_updates": True}, {"hold_reads": False}],
                         ids=["light, at step", "light, from backward", "fresh backward reads"])
def test_refused_gradients_do_not_reach_a_later_clock(options: dict[str, Any],
                                                      max_rel_error: Callable[..., float]) -> None:
    clocks = 6
    with LocalCluster(1, config()) as cluster:
        ps_model = mt.wrap(cnn(), cluster.worker(0), example_input=batch(0)[0], **options)
        for clock in range(clocks):
            loss = loss_of(ps_model, clock)
            loss.backward(retain_graph=True)
            if clock == 1:
                with pytest.raises(mltuner.OutOfOrderError, match="second backward pass|second gradient"):
                    loss.backward(retain_graph=True)
            ps_model.step()
            if clock == 3:
                with pytest.raises(mltuner.OutOfOrderError, match=f"outside clock {clock + 1}'s backward pass"):
                    loss.backward()
        state = ps_model.state_dict()
    assert max_rel_error(state, plain_run(clocks)) < 1e-5


def test_evaluation_between_forward_and_backward(max_rel_error: Callable[..., float]) -> None:
    """An evaluation forward or state_dict() before the backward pass binds
    the parameters to the servers' values; the backward pass must still see
    the held reads, which autograd's saved parameters point into."""
    clocks = 4
    with LocalCluster(1, config()) as cluster:
        ps_model = mt.wrap(cnn(), cluster.worker(0), example_input=batch(0)[0])
        driver = ps_model._driver
        for clock in range(clocks):
            loss = loss_of(ps_model, clock)
            if clock in (1, 2):
                if clock == 1:
                    with torch.no_grad():
                        ps_model(batch(clock)[0])
                else:
                    ps_model.state_dict()
                for layer in driver.layers:
                    (index,) = driver._held_by_layer[layer.index]
                    held = driver._held[index].untyped_storage().data_ptr()
                    for slot in layer.params:
                        assert slot.param.untyped_storage().data_ptr() == held, slot.name
            loss.backward()
            ps_model.step()
        state = ps_model.state_dict()
    model = cnn()
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    for clock in range(clocks):
        optimizer.zero_grad()
        loss = loss_of(model, clock)
        if clock == 1:
            with torch.no_grad():
                model(batch(clock)[0])  # BatchNorm's running statistics see it too
        loss.backward()
        optimizer.step()
    assert max_rel_error(state, model.state_dict()) < 1e-5


def test_the_forward_at_step_runs_without_the_layer_hooks_but_keeps_the_users(
        max_rel_error: Callable[..., float]) -> None:
    """Shipping at step(), the forward binds every layer up front and takes
    the driver's layer hooks out while it runs: the driver's hooks never
    fire, a hook of the user's on the same module still does (every clock),
    and between clocks the driver's hooks are back to refuse a layer called
    outside the wrapped model."""
    clocks = 4
    with LocalCluster(1, config()) as cluster:
        model = cnn()
        ps_model = mt.wrap(model, cluster.worker(0), example_input=batch(0)[0], overlap_updates=False)
        driver = ps_model._driver
        seen: list[int] = []
        model[0].register_forward_hook(lambda module, args, out: seen.append(out.shape[0]))
        fired = [0]
        real_before = driver._before_layer

        def counting_before(layer: Any) -> None:
            fired[0] += 1
            real_before(layer)
        driver._before_layer = counting_before  # type: ignore[method-assign]
        for clock in range(clocks):
            loss_of(ps_model, clock).backward()
            ps_model.step()
        assert fired[0] == 0 and seen == [6] * clocks
        with pytest.raises(mltuner.OutOfOrderError, match="outside a forward pass of the wrapped model"):
            model[0](batch(0)[0])
        assert fired[0] == 1
        state = ps_model.state_dict()
    assert max_rel_error(state, plain_run(clocks)) < 1e-5
