"""Operations over all gradients between ``backward()`` and ``step()``
(global-norm clipping): where updates ship at step() they see the
gradients and change what ships, as with torch.optim (compared with plain
PyTorch clipping the same way); where updates ship from the backward pass
(``overlap_updates=True``, or stored activations) the gradients are gone by then, so ``.grad``
holds stand-ins whose every use raises, naming the parameter and
``overlap_updates=False``, instead of a ``None`` that clipping would skip
without a word. The clock then finishes and training goes on as if the
clipping had not been tried.
"""

from __future__ import annotations

import copy
from collections.abc import Callable

import pytest

torch = pytest.importorskip("torch")

import torch.nn.functional as F  # noqa: E402
from torch import nn  # noqa: E402

import mltuner  # noqa: E402
import mltuner.torch as mt  # noqa: E402
from mltuner import Config, LocalCluster, UpdateRule  # noqa: E402

LR, MOMENTUM, MAX_NORM = 0.05, 0.9, 0.1  # MAX_NORM well under the gradients' norm: every clock clips
CLOCKS = 8


def mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 3))


def batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    generator = torch.Generator().manual_seed(1)
    return [(torch.randn(8, 6, generator=generator), torch.randint(0, 3, (8,), generator=generator))
            for _ in range(CLOCKS)]


def config() -> Config:
    return Config(wait_timeout_s=20, update_rule=UpdateRule("damped_momentum", learning_rate=LR, momentum=MOMENTUM))


def plain(model: nn.Module, clip: bool) -> list[float]:
    optimizer = torch.optim.SGD(model.parameters(), lr=LR * (1 - MOMENTUM), momentum=MOMENTUM)
    norms = []
    for x, y in batches():
        F.cross_entropy(model(x), y).backward()
        if clip:
            norms.append(float(nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)))
        optimizer.step()
        optimizer.zero_grad()
    return norms


def test_clipping_between_backward_and_step_clips_what_ships(max_rel_error: Callable[..., float]) -> None:
    initial = mlp()
    reference = copy.deepcopy(initial)
    want_norms = plain(reference, clip=True)
    unclipped = copy.deepcopy(initial)
    plain(unclipped, clip=False)
    assert max(want_norms) > 2 * MAX_NORM  # the reference clipped: the comparison below can fail

    with LocalCluster(1, config()) as cluster:
        ps_model = mt.wrap(copy.deepcopy(initial), cluster.worker(0), example_input=batches()[0][0],
                           overlap_updates=False)
        norms = []
        for x, y in batches():
            F.cross_entropy(ps_model(x), y).backward()
            norms.append(float(nn.utils.clip_grad_norm_(ps_model.parameters(), MAX_NORM)))
            ps_model.step()
        got = ps_model.state_dict()
    assert norms == pytest.approx(want_norms, rel=1e-5)
    assert max_rel_error(got, reference.state_dict()) < 1e-5
    assert max_rel_error(got, unclipped.state_dict()) > 1e-3  # clipping changed what shipped


@pytest.mark.parametrize("kwargs", [{"overlap_updates": True}, {"store_activations": True}],
                         ids=["overlap_updates", "stored activations"])
def test_gradients_shipped_in_the_backward_pass_refuse_every_use_until_step(
        kwargs: dict[str, bool], max_rel_error: Callable[..., float]) -> None:
    initial = mlp()
    reference = copy.deepcopy(initial)
    plain(reference, clip=False)

    with LocalCluster(1, config()) as cluster:
        ps_model = mt.wrap(copy.deepcopy(initial), cluster.worker(0), example_input=batches()[0][0],
                           **kwargs)
        for clock, (x, y) in enumerate(batches()):
            loss = F.cross_entropy(ps_model(x), y)
            loss.backward(retain_graph=clock == 0)
            params = list(ps_model.parameters())
            assert all(p.grad is not None for p in params)  # `if p.grad is not None` loops reach the stand-in
            if clock == 0:
                with pytest.raises(mltuner.OutOfOrderError, match=r"'0\.weight'.*overlap_updates=False"):
                    nn.utils.clip_grad_norm_(params, MAX_NORM)
                with pytest.raises(mltuner.OutOfOrderError, match="overlap_updates=False"):
                    params[-1].grad.norm()  # type: ignore[union-attr]
                with pytest.raises(mltuner.OutOfOrderError, match="overlap_updates=False"):
                    params[-1].grad.mul_(0.5)  # type: ignore[union-attr]
                assert "shipped to the parameter servers" in repr(params[0].grad)
                with pytest.raises(mltuner.OutOfOrderError, match="second backward pass|second gradient"):
                    loss.backward()
            if clock == 1:  # a gradient replaced, not used: seen at step(), which still ends the clock
                params[0].grad = torch.zeros_like(params[0])
                params[1].grad = None
                with pytest.raises(mltuner.OutOfOrderError, match=r"the \.grad of '0\.weight', '0\.bias' was "
                                                                  r"replaced .* not applied: .*overlap_updates=False"):
                    ps_model.step()
                continue
            ps_model.step()
            assert all(p.grad is None for p in params)  # step() takes the stand-ins away
        got = ps_model.state_dict()
        unwrapped = ps_model.unwrap()
    # Nothing tried on the stand-ins reached the updates.
    assert max_rel_error(got, reference.state_dict()) < 1e-5
    assert all(p.grad is None for p in unwrapped.parameters())


def test_a_grad_scaler_loop_with_clipping_is_refused_at_the_clipping_and_trains_on() -> None:
    """A GradScaler loop that clips, with updates shipped from the backward
    pass: the clipping raises; scaler.step(), whose inf check reads every
    param group's gradients, skips the stand-ins (the scale came off each
    layer before it shipped), and the loop goes on."""
    with LocalCluster(1, config()) as cluster:
        scaler = torch.amp.GradScaler("cpu", init_scale=2.0**8)
        model = mlp()
        ps_model = mt.wrap(model, cluster.worker(0), example_input=batches()[0][0], overlap_updates=True,
                           grad_scaler=scaler, optimizer=torch.optim.SGD(model.parameters(), lr=LR))
        losses = []
        for clock, (x, y) in enumerate(batches()):
            with torch.autocast("cpu", dtype=torch.float16):
                loss = F.cross_entropy(ps_model(x), y)
            scaler.scale(loss).backward()
            if clock == 0:
                with pytest.raises(mltuner.OutOfOrderError, match="overlap_updates=False"):
                    nn.utils.clip_grad_norm_(ps_model.parameters(), MAX_NORM)
            scaler.step(ps_model.optimizer)
            scaler.update()
            losses.append(loss.item())
    assert scaler.get_scale() == 2.0**8  # no overflow was seen
    assert losses[-1] < losses[0]
