"""Wait-free backpropagation: a layer's update goes to the engine as soon as
its gradient is final, so its communication overlaps the backward pass of
the layers below it.

The model has a probe between the bottom layer and the rest: an identity
whose backward runs when the gradient reaches the bottom layer, i.e. after
the upper layers' backward and before the bottom layer's. There it records
how many updates the adapter has handed to the engine, and waits (bounded)
until the server has applied the top layer's update of this clock and
pushed the fresh rows back (the top table's data age reaches the clock),
all while the bottom layer's backward has not even started. The same holds
when a layer is a group of modules (one table for a whole block): a group's
update leaves when its last gradient is final.
"""

from __future__ import annotations

import time
from typing import Any

import pytest

torch = pytest.importorskip("torch")

from torch import nn  # noqa: E402

import mltuner.torch as mt  # noqa: E402
from mltuner.client._worker import OP_KINDS  # noqa: E402
from mltuner import Config, LocalCluster, UpdateRule  # noqa: E402

CLOCKS = 3


class _Probe(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, on_backward: Any) -> torch.Tensor:  # type: ignore[override]
        ctx.on_backward = on_backward
        return x.clone()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:  # type: ignore[override]
        ctx.on_backward()
        return grad, None


class Probe(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.on_backward: Any = lambda: None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _Probe.apply(x, self.on_backward)  # type: ignore[no-any-return]


def block(width_in: int, width_out: int, grouped: bool) -> nn.Module:
    """A layer: one Linear, or a group of two (one table, one update)."""
    if not grouped:
        return nn.Linear(width_in, width_out)
    return nn.Sequential(nn.Linear(width_in, 32), nn.ReLU(), nn.Linear(32, width_out))


@pytest.mark.parametrize("grouped", [False, True], ids=["modules", "groups"])
def test_top_layer_ships_before_the_bottom_layer_backward_starts(grouped: bool) -> None:
    probe = Probe()
    model = nn.Sequential(block(16, 32, grouped), probe, nn.ReLU(), block(32, 32, grouped), nn.ReLU(),
                          block(32, 4, grouped))
    x = torch.randn(8, 16)
    config = Config(wait_timeout_s=20, update_rule=UpdateRule("sgd", learning_rate=0.1))
    with LocalCluster(1, config) as cluster:
        worker = cluster.worker(0)
        ps_model = mt.wrap(model, worker, example_input=x, overlap_updates=True)
        assert ps_model.layers == ["0", "3", "5"]
        # Backward order: top layer first, bottom layer last.
        updates = [a for a in ps_model.accesses if a.startswith("update")]
        assert updates == ["update of layer '5'", "update of layer '3'", "update of layer '0'"]
        top = next(t for t in worker.tables if t.name == "torch:5")

        log: list[str] = []
        real_update = worker.update

        def spy_update(handle: int, *, stream: int = 0) -> None:
            log.append("update")
            real_update(handle, stream=stream)

        real_run = worker._run_ops

        def spy_run(ops: Any, stream: int) -> Any:  # the light clock posts updates in batches
            log.extend("update" for op in ops if op[0] == OP_KINDS["update"])
            return real_run(ops, stream)

        worker.update = spy_update  # type: ignore[method-assign]
        worker._run_ops = spy_run  # type: ignore[method-assign]
        for clock in range(CLOCKS):
            shipped: list[bool] = []

            def bottom_backward_starts(clock: int = clock, shipped: list[bool] = shipped) -> None:
                log.append("bottom layer's backward starts")
                deadline = time.monotonic() + 10
                while worker.data_age(top) < clock and time.monotonic() < deadline:
                    time.sleep(0.001)
                shipped.append(worker.data_age(top) == clock)

            probe.on_backward = bottom_backward_starts
            log.clear()
            ps_model(x).square().mean().backward()
            assert log == ["update", "update", "bottom layer's backward starts", "update"], log
            # The server applied this clock's top-layer update and the new rows
            # arrived while the bottom layer's gradient was not even computed.
            assert shipped == [True]
            ps_model.step()


def test_shipping_at_step_sends_every_update_in_one_call_in_forward_order() -> None:
    """Every shard in this process (the default there): no update leaves
    during backward; step() posts them all in one engine call, the first
    layer's first, since the next clock's first read waits for it."""
    model = nn.Sequential(block(16, 32, False), nn.ReLU(), block(32, 32, False), nn.ReLU(), block(32, 4, False))
    x = torch.randn(8, 16)
    config = Config(wait_timeout_s=20, update_rule=UpdateRule("sgd", learning_rate=0.1))
    with LocalCluster(1, config) as cluster:
        worker = cluster.worker(0)
        ps_model = mt.wrap(model, worker, example_input=x)
        updates = [a for a in ps_model.accesses if a.startswith("update")]
        assert updates == ["update of layer '0'", "update of layer '2'", "update of layer '4'"]
        calls: list[int] = []
        real_run = worker._run_ops

        def spy_run(ops: Any, stream: int) -> Any:
            calls.append(sum(op[0] == OP_KINDS["update"] for op in ops))
            return real_run(ops, stream)

        worker._run_ops = spy_run  # type: ignore[method-assign]
        for _ in range(CLOCKS):
            ps_model(x).square().mean().backward()
            assert calls[-1:] == [0]  # the forward's read batch only: nothing left in backward
            ps_model.step()
            assert calls[-1] == 3
