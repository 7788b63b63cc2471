"""Mixed precision through wrap(): the same torch.autocast loop as plain
PyTorch trains alike, bfloat16 as is and float16 with a torch.amp.GradScaler
whose scale comes off each layer's gradients before the update leaves.

One worker under BSP with the servers' "sgd" rule, which is
torch.optim.SGD(lr). Both sides run the same low-precision forward and
backward on bit-identical parameters at the first step, and differ only in
the rounding of the update, so the losses agree to float rounding (the
tolerances leave room for a rounding step of the cast weights). The GPU
variant runs where tests/python/torch/test_cuda.py does.
"""

from __future__ import annotations

import copy
import re
from collections.abc import Callable
from contextlib import nullcontext
from typing import Any

import pytest

torch = pytest.importorskip("torch")

import torch.nn.functional as F  # noqa: E402
from torch import nn  # noqa: E402

import mltuner  # noqa: E402
import mltuner.torch as mt  # noqa: E402
from mltuner import Config, InvalidArgumentError, LocalCluster, UpdateRule  # noqa: E402

LR, STEPS, BATCH = 0.1, 30, 16


def make_net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv1d(1, 8, 5, stride=2, padding=2), nn.ReLU(), nn.Flatten(),
                         nn.Linear(8 * 20, 32), nn.ReLU(), nn.Linear(32, 10))


def make_batches(device: torch.device) -> list[tuple[torch.Tensor, torch.Tensor]]:
    generator = torch.Generator().manual_seed(1)
    return [(torch.randn(BATCH, 1, 40, generator=generator).to(device),
             torch.randint(0, 10, (BATCH,), generator=generator).to(device)) for _ in range(STEPS)]


def train(model: Any, optimizer: Any, batches: list[tuple[torch.Tensor, torch.Tensor]], dtype: torch.dtype,
          scaler: torch.amp.GradScaler | None, unscale: bool = False,
          clip: float | None = None) -> tuple[list[float], list[float]]:
    """The standard autocast loop (the scaler's where given; with
    ``unscale``, torch's recipe for clipping: ``scaler.unscale_`` before
    ``scaler.step``, and clipping to ``clip`` between them); returns the loss
    and the scale after each step."""
    losses, scales = [], []
    device_type = batches[0][0].device.type
    for x, y in batches:
        optimizer.zero_grad()
        with torch.autocast(device_type, dtype=dtype):
            output = model(x)
            assert output.dtype == dtype  # autocast is in effect
            loss = F.cross_entropy(output, y)
        if scaler is None:
            loss.backward()
            optimizer.step()
        else:
            scaler.scale(loss).backward()
            if unscale:
                scaler.unscale_(optimizer)
            if clip is not None:
                torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
            scaler.step(optimizer)
            scaler.update()
            scales.append(scaler.get_scale())
        losses.append(loss.item())
    return losses, scales


def compare(device: torch.device, dtype: torch.dtype, scaler_args: dict[str, Any] | None,
            unscale: bool = False, clip: float | None = None, budget: int = 0,
            optimizer: Callable[[Any], torch.optim.Optimizer] | None = None,
            **wrap_args: Any) -> tuple[list[float], list[float]]:
    """Trains plain and wrapped (with ``optimizer``'s rule, else SGD at
    LR); asserts equal losses, scales and weights; returns the plain run's
    losses and scales."""
    net = make_net().to(device)
    plain = copy.deepcopy(net)
    batches = make_batches(device)
    new_scaler = (lambda: torch.amp.GradScaler(device.type, **scaler_args)) if scaler_args is not None else None
    plain_scaler = new_scaler() if new_scaler else None
    plain_optimizer = optimizer(plain.parameters()) if optimizer else torch.optim.SGD(plain.parameters(), lr=LR)
    want, want_scales = train(plain, plain_optimizer, batches, dtype, plain_scaler, unscale, clip)
    if optimizer is not None:
        wrap_args["optimizer"] = optimizer(net.parameters())

    cluster = LocalCluster(1, Config(update_rule=UpdateRule("sgd", learning_rate=LR), device=device.type,
                                     device_memory_budget=budget))
    try:
        ps_scaler = new_scaler() if new_scaler else None
        # With stored activations, the recording runs under the loop's
        # autocast, so that it saves the dtypes the clocks save (the slots are
        # sized by it); otherwise wrap() runs outside, as it usually would.
        recording = torch.autocast(device.type, dtype=dtype) if wrap_args.get("store_activations") else nullcontext()
        with recording:
            model = mt.wrap(net, cluster.worker(0), example_input=batches[0][0], grad_scaler=ps_scaler,
                            **wrap_args)
        got, got_scales = train(model, model.optimizer, batches, dtype, ps_scaler, unscale, clip)
        state = model.state_dict()
    finally:
        cluster.shutdown()
    assert got_scales == want_scales
    worst = max(abs(a - b) for a, b in zip(got, want))
    assert worst <= 1e-4, f"losses differ by {worst:.3g}"
    for name, value in plain.state_dict().items():
        torch.testing.assert_close(state[name], value, rtol=1e-4, atol=1e-5)
    assert want[-1] < want[0]  # it trains
    return want, want_scales


@pytest.mark.parametrize("wrap_args", [{}, {"store_activations": True}], ids=["held reads", "stored activations"])
def test_bfloat16_autocast_trains_like_plain_pytorch(wrap_args: dict[str, Any]) -> None:
    compare(torch.device("cpu"), torch.bfloat16, None, **wrap_args)


@pytest.mark.parametrize("overlap", [False, True], ids=["shipped at step", "shipped from backward"])
def test_float16_with_a_grad_scaler_trains_like_plain_pytorch(overlap: bool) -> None:
    # A start scale that overflows float16 for some clocks and a short growth
    # interval: the scale backs off and grows exactly as in plain PyTorch,
    # which skips the overflowing steps; here their updates are zero.
    _, scales = compare(torch.device("cpu"), torch.float16, {"init_scale": 2.0**30, "growth_interval": 4},
                        overlap_updates=overlap)
    assert scales[1] < scales[0] and any(later > earlier for earlier, later in zip(scales, scales[1:]))


@pytest.mark.parametrize("unscale", [False, True], ids=["scaler.step", "scaler.unscale_ first"])
@pytest.mark.parametrize("optimizer", [
    lambda params: torch.optim.SGD(params, lr=0.02, momentum=0.9, weight_decay=1e-3),
    lambda params: torch.optim.Adam(params, lr=1e-3),
], ids=["sgd momentum", "adam"])
def test_an_overflowing_clock_skips_the_step_as_plain_pytorch_does(
        optimizer: Callable[[Any], torch.optim.Optimizer], unscale: bool) -> None:
    # Shipping at step() the overflow is known before any update leaves:
    # the servers skip the step, so momentum, weight decay and Adam's
    # moments and step count stay as they were (a zero update moved the
    # weights). The start scale overflows float16 in several clocks.
    _, scales = compare(torch.device("cpu"), torch.float16, {"init_scale": 2.0**30, "growth_interval": 4},
                        unscale=unscale, optimizer=optimizer, overlap_updates=False)
    assert sum(later < earlier for earlier, later in zip(scales, scales[1:])) >= 2  # clocks that overflowed


@pytest.mark.parametrize("overlap", [False, True], ids=["shipped at step", "shipped from backward"])
def test_scaler_unscale_before_step_trains_like_plain_pytorch(overlap: bool) -> None:
    # torch's recipe for clipping under AMP: scaler.unscale_(), then
    # scaler.step(). Shipping at step(), torch unscales the gradients and
    # the adapter must not again; from the backward pass, each layer was
    # unscaled before it left. Overflowing clocks included, as above.
    _, scales = compare(torch.device("cpu"), torch.float16, {"init_scale": 2.0**30, "growth_interval": 4},
                        unscale=True, overlap_updates=overlap)
    assert scales[1] < scales[0]


def test_scaler_unscale_then_clipping_trains_like_plain_pytorch() -> None:
    # Shipping at step(): clip_grad_norm_ sees the unscaled gradients, as
    # with torch.optim (shipping from the backward pass it raises:
    # test_gradient_clipping.py).
    losses, scales = compare(torch.device("cpu"), torch.float16, {"init_scale": 2.0**30, "growth_interval": 4},
                             unscale=True, clip=0.05, overlap_updates=False)
    assert scales[1] < scales[0]
    unclipped, _ = compare(torch.device("cpu"), torch.float16, {"init_scale": 2.0**30, "growth_interval": 4},
                           unscale=True, overlap_updates=False)
    assert abs(losses[-1] - unclipped[-1]) > 1e-3  # the clipping bit: the comparison above can fail


def train_mixed(model: Any, optimizer: Any, batches: list[tuple[torch.Tensor, torch.Tensor]],
                scaler: torch.amp.GradScaler, scheduler: Any = None, mixed: bool = True) -> list[float]:
    """Five clocks under float16 autocast with the scaler, then (``mixed``)
    five in float32 without it (``loss.backward(); optimizer.step()``), and
    so on; the scheduler, where given, steps after each clock. Returns the
    losses."""
    losses = []
    for step, (x, y) in enumerate(batches):
        optimizer.zero_grad()
        if step % 10 < 5 or not mixed:
            with torch.autocast("cpu", dtype=torch.float16):
                loss = F.cross_entropy(model(x), y)
            scaler.scale(loss).backward()
            scaler.step(optimizer)
            scaler.update()
        else:
            loss = F.cross_entropy(model(x), y)
            loss.backward()
            optimizer.step()
        if scheduler is not None:
            scheduler.step()
        losses.append(loss.item())
    return losses


def compare_mixed(overlap: bool, groups: bool = False, mixed: bool = True) -> None:
    """train_mixed plain and wrapped (two param groups at different rates
    under a per-group LambdaLR with ``groups``); asserts equal losses and
    weights."""
    device = torch.device("cpu")
    net = make_net()
    plain = copy.deepcopy(net)
    batches = make_batches(device)

    def optimizer_of(module: nn.Module) -> torch.optim.Optimizer:
        if not groups:
            return torch.optim.SGD(module.parameters(), lr=LR)
        layers = list(module.children())
        return torch.optim.SGD([{"params": layers[0].parameters()},
                                {"params": [p for layer in layers[1:] for p in layer.parameters()], "lr": LR / 2}],
                               lr=LR)

    def scheduler_of(optimizer: torch.optim.Optimizer) -> Any:
        if not groups:
            return None
        return torch.optim.lr_scheduler.LambdaLR(optimizer, [lambda clock: 0.95**clock, lambda clock: 1.0])

    plain_optimizer = optimizer_of(plain)
    want = train_mixed(plain, plain_optimizer, batches, torch.amp.GradScaler("cpu"), scheduler_of(plain_optimizer),
                       mixed)
    cluster = LocalCluster(1, Config(update_rule=UpdateRule("sgd", learning_rate=LR)))
    try:
        scaler = torch.amp.GradScaler("cpu")
        model = mt.wrap(net, cluster.worker(0), example_input=batches[0][0], grad_scaler=scaler,
                        overlap_updates=overlap, optimizer=optimizer_of(net) if groups else None)
        assert len(model.optimizer.param_groups) == (2 if groups else 1)  # the optimizer's own groups
        got = train_mixed(model, model.optimizer, batches, scaler, scheduler_of(model.optimizer), mixed)
        state = model.state_dict()
    finally:
        cluster.shutdown()
    worst = max(abs(a - b) for a, b in zip(got, want))
    assert worst <= 1e-4, f"losses differ by {worst:.3g}"
    for name, value in plain.state_dict().items():
        torch.testing.assert_close(state[name], value, rtol=1e-4, atol=1e-5)


def test_clocks_stepped_without_the_scaler_train_at_their_full_step() -> None:
    # Shipping at step(), only scaler.step() unscales, as with torch: the
    # float32 clocks in between were steps divided by the scale (65536).
    compare_mixed(overlap=False)


def test_clocks_stepped_without_the_scaler_from_the_backward_pass_warn() -> None:
    # Shipping from the backward pass the updates left unscaled before the
    # step() that shows the scaler was not used: said once, not silent.
    with pytest.warns(UserWarning, match="step\\(\\) without scaler.step") as warned:
        with pytest.raises(AssertionError, match="losses differ"):
            compare_mixed(overlap=True)
    assert sum("without scaler.step" in str(w.message) for w in warned) == 1


@pytest.mark.parametrize("overlap", [False, True], ids=["shipped at step", "shipped from backward"])
def test_a_per_group_scheduler_sees_the_optimizers_own_groups(overlap: bool) -> None:
    # LambdaLR with one function per group raised ValueError: with a scaler,
    # model.optimizer.param_groups had one group more (the scaler's inf check
    # reads the clock's overflow from .grad's stand-ins now).
    compare_mixed(overlap, groups=True, mixed=False)


@pytest.mark.parametrize("overlap", [False, True], ids=["shipped at step", "shipped from backward"])
def test_gradients_torch_copies_are_zeroed_on_an_overflow(overlap: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    # Gradients the engine cannot take as they are (another dtype or layout:
    # rare, autograd gives a parameter's gradient its layout) are copied by
    # torch, which zeroes them itself on an overflow: every layer so here.
    from mltuner.torch._updates import GradientUpdates

    monkeypatch.setattr(GradientUpdates, "_pieces", lambda self, layer, grads: None)
    _, scales = compare(torch.device("cpu"), torch.float16, {"init_scale": 2.0**30, "growth_interval": 4},
                        overlap_updates=overlap)
    assert scales[1] < scales[0]


def test_a_scaler_step_that_raises_leaves_nothing_for_the_next_step() -> None:
    # GradScaler.step sets found_inf and grad_scale on the optimizer and
    # deletes them only after a step that returns: a later step() of the
    # loop's own took them as the scaler's.
    batches = make_batches(torch.device("cpu"))
    with LocalCluster(1, Config(update_rule=UpdateRule("sgd", learning_rate=LR))) as cluster:
        scaler = torch.amp.GradScaler("cpu")
        model = mt.wrap(make_net(), cluster.worker(0), example_input=batches[0][0], grad_scaler=scaler)
        x, y = batches[0]
        with torch.autocast("cpu", dtype=torch.float16):
            loss = F.cross_entropy(model(x), y)
        scaler.scale(loss)
        with pytest.raises(mltuner.OutOfOrderError, match="call loss.backward"):
            scaler.step(model.optimizer)  # before the backward pass
        assert not hasattr(model.optimizer, "found_inf") and not hasattr(model.optimizer, "grad_scale")
        scaler.scale(loss).backward()
        scaler.step(model.optimizer)  # the clock goes on
        scaler.update()
        assert model.clock == 1


def test_an_optimizer_state_saved_with_the_old_scaler_group_loads() -> None:
    # model.optimizer.state_dict() once ended with a GradScaler's group (one
    # tensor at rate 0): such a dict still loads; another extra group does not.
    with LocalCluster(1, Config(update_rule=UpdateRule("sgd", learning_rate=LR))) as cluster:
        model = mt.wrap(make_net(), cluster.worker(0), example_input=make_batches(torch.device("cpu"))[0][0],
                        grad_scaler=torch.amp.GradScaler("cpu"))
        saved = model.optimizer.state_dict()
        saved["param_groups"][0]["lr"] = LR / 2
        next_id = len(saved["param_groups"][0]["params"])
        old = {**saved, "param_groups": [*saved["param_groups"], {"params": [next_id], "lr": 0.0}]}
        model.optimizer.load_state_dict(old)
        assert model.optimizer.param_groups[0]["lr"] == LR / 2
        other = {**saved, "param_groups": [*saved["param_groups"], {**saved["param_groups"][0], "params": [next_id]}]}
        with pytest.raises(InvalidArgumentError, match="param groups"):
            model.optimizer.load_state_dict(other)


def least_budget(**wrap_args: Any) -> int:
    """The least device-memory budget wrap() takes for make_net (its refusal says)."""
    x = make_batches(torch.device("cpu"))[0][0]
    with LocalCluster(1, Config(update_rule=UpdateRule("sgd", learning_rate=LR), device_memory_budget=1)) as cluster:
        with pytest.raises(mltuner.ResourceExhaustedError) as refused:
            mt.wrap(make_net(), cluster.worker(0), example_input=x, **wrap_args)
    found = re.search(r"needs at least (\d+) bytes", str(refused.value))
    assert found is not None, refused.value
    return int(found.group(1))


def test_bfloat16_autocast_under_a_budget_trains_like_plain_pytorch() -> None:
    # wrap() records the clock several times under a budget, all inside the
    # loop's autocast: its cache of cast weights must not carry over from one
    # recording to the next (the backward pass then read them in another order).
    budget = 2 * least_budget(store_activations=True, recompute="none")
    compare(torch.device("cpu"), torch.bfloat16, None, budget=budget, store_activations=True, recompute="none")


@pytest.mark.parametrize("wrap_args", [{"store_activations": True}, {"hold_reads": False}],
                         ids=["stored activations", "reads in each layer's forward"])
def test_a_clock_under_another_autocast_than_the_recording_is_refused_before_it_starts(
        wrap_args: dict[str, Any]) -> None:
    x, y = make_batches(torch.device("cpu"))[0]
    cluster = LocalCluster(1, Config(update_rule=UpdateRule("sgd", learning_rate=LR)))
    try:
        model = mt.wrap(make_net(), cluster.worker(0), example_input=x, **wrap_args)  # without autocast
        with pytest.raises(mt.IterationMismatchError, match="runs under cpu autocast to torch.bfloat16, but wrap\\(\\) "
                                                            "recorded the clock without autocast.*call wrap\\(\\) inside "
                                                            "the same autocast.*nothing of this clock was done"):
            with torch.autocast("cpu", dtype=torch.bfloat16):
                model(x)
        F.cross_entropy(model(x), y).backward()  # the loop goes on, as recorded
        model.step()
    finally:
        cluster.shutdown()


def test_a_scaler_that_wrap_was_not_given_is_refused() -> None:
    net = make_net()
    x, y = make_batches(torch.device("cpu"))[0]
    cluster = LocalCluster(1, Config(update_rule=UpdateRule("sgd", learning_rate=LR)))
    try:
        model = mt.wrap(net, cluster.worker(0), example_input=x)
        scaler = torch.amp.GradScaler("cpu")
        with torch.autocast("cpu", dtype=torch.float16):
            loss = F.cross_entropy(model(x), y)
        scaler.scale(loss).backward()
        with pytest.raises(InvalidArgumentError, match=r"wrap\(\.\.\., grad_scaler=scaler\)"):
            scaler.step(model.optimizer)
    finally:
        cluster.shutdown()


@pytest.mark.parametrize("scaler, message", [(object(), "must be a torch.amp.GradScaler"),
                                             ("cuda", "is for 'cuda' but the model is on 'cpu'")])
def test_a_bad_scaler_is_refused(scaler: Any, message: str) -> None:
    if scaler == "cuda":
        if torch.cuda.is_available():  # the model would run on the GPU: nothing wrong with the scaler
            pytest.skip("a CUDA scaler is the model's own type here")
        with pytest.warns(UserWarning):  # CPU-only torch disables it, and says so
            scaler = torch.amp.GradScaler("cuda")
    cluster = LocalCluster(1, Config(update_rule=UpdateRule("sgd", learning_rate=LR)))
    try:
        with pytest.raises(InvalidArgumentError, match=message):
            mt.wrap(make_net(), cluster.worker(0), example_input=torch.zeros(2, 1, 40), grad_scaler=scaler)
    finally:
        cluster.shutdown()


gpu = pytest.mark.skipif(mltuner.cuda_device_count() == 0 or not torch.cuda.is_available(),
                         reason="needs the CUDA backend, a visible GPU and torch with CUDA")


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16 + GradScaler"])
@pytest.mark.parametrize("overlap", [False, True], ids=["shipped at step", "shipped from backward"])
def test_mixed_precision_on_the_gpu(dtype: torch.dtype, overlap: bool) -> None:
    # From the backward pass, each layer's update is queued and copied by the
    # engine on the stream after later layers' inf checks: the overflow flag
    # it reads is the clock's, set or not, never the clock before's.
    scaler_args = {"init_scale": 2.0**30, "growth_interval": 4} if dtype == torch.float16 else None
    compare(torch.device("cuda", 0), dtype, scaler_args, overlap_updates=overlap)


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("unscale", [False, True], ids=["scaler.step", "scaler.unscale_ first"])
def test_an_overflowing_clock_skips_the_step_on_the_gpu(unscale: bool) -> None:
    # The engine reads the overflow flag the scaler's inf check sets on the
    # stream (copied into pinned memory there), not the training thread.
    compare(torch.device("cuda", 0), torch.float16, {"init_scale": 2.0**30, "growth_interval": 4}, unscale=unscale,
            optimizer=lambda params: torch.optim.SGD(params, lr=0.02, momentum=0.9, weight_decay=1e-3),
            overlap_updates=False)


@gpu
def test_scaler_unscale_then_clipping_on_the_gpu() -> None:
    compare(torch.device("cuda", 0), torch.float16, {"init_scale": 2.0**30, "growth_interval": 4}, unscale=True,
            clip=0.05, overlap_updates=False)


@pytest.mark.gpu
@gpu
def test_the_engines_copy_reads_the_overflow_flag_when_the_stream_reaches_it() -> None:
    # The flag is set by work queued on the stream before the copy (a
    # scaler's inf check) and still running when the op is handed over: the
    # copy must see it set, not the 0 it held when the op was queued.
    source = torch.arange(1, 25, dtype=torch.float32, device="cuda")
    flag = torch.zeros(1, dtype=torch.float32, device="cuda")
    got: list[Any] = []

    def body(worker: mltuner.Worker) -> None:
        table = worker.create_tensor_table("t", mltuner.TensorLayout(row_width=8).add("w", (24,)))
        update = worker.virtual_pre_update(table)
        worker.virtual_update(update)
        worker.virtual_clock()
        worker.finish_virtual_iteration()
        worker.start_iterations()
        stream = torch.cuda.current_stream()
        for value in (0.0, 1.0):
            worker.pre_update(update, stream=stream.cuda_stream)
            torch.cuda._sleep(20_000_000)  # tens of ms of GPU time before the flag is written
            flag.fill_(value)
            worker._run_ops([(3, update, [(source.data_ptr(), 0, 24)], [], flag.data_ptr()), (6, -1)],
                            stream.cuda_stream)
        worker.sync()
        got.append(worker.fetch(table))

    with LocalCluster(1, Config(update_rule=UpdateRule("add"), device="cuda", wait_timeout_s=30)) as cluster:
        cluster.run(body)
    assert got[0].reshape(-1).tolist() == source.tolist()  # the first clock's pieces, the second's zeros
