"""A clock the loop leaves half done by an exception of its own (a Ctrl-C,
a CUDA out-of-memory error, a bug in the model's code) is ended on the
engine at the next use of the model (Worker.finish_clock): the layers whose
updates had not left send zeros, a step of zero gradient, and the model
goes on; it can be saved at once. Plain torch with that clock's gradients
all zero is the reference (SGD with momentum: the weights still move)."""

from __future__ import annotations

from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

from torch import nn  # noqa: E402

import mltuner  # noqa: E402
import mltuner.torch as mt  # noqa: E402

generator = torch.Generator().manual_seed(3)
BATCHES = [(torch.randn(16, 8, generator=generator), torch.randint(0, 3, (16,), generator=generator))
           for _ in range(6)]
INTERRUPTED = 3  # the clock a Ctrl-C leaves in its forward pass


def net() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 3))


def reference() -> dict[str, torch.Tensor]:
    module = net()
    optimizer = torch.optim.SGD(module.parameters(), lr=0.1, momentum=0.9)
    for clock, (x, y) in enumerate(BATCHES):
        optimizer.zero_grad()
        if clock == INTERRUPTED:
            for p in module.parameters():
                p.grad = torch.zeros_like(p)
        else:
            nn.functional.cross_entropy(module(x), y).backward()
        optimizer.step()
    return {name: value.detach().clone() for name, value in module.state_dict().items()}


CUDA = pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(
    mltuner.cuda_device_count() == 0 or not torch.cuda.is_available(),
    reason="needs the CUDA backend, a visible GPU and torch with CUDA")])


@pytest.mark.parametrize("device", ["cpu", CUDA])
@pytest.mark.parametrize("store_activations", [False, True])
def test_a_clock_left_by_a_ctrl_c_ends_with_zero_updates_and_the_model_goes_on(
        tmp_path: Path, store_activations: bool, device: str) -> None:
    module = net().to(device)
    interrupt = {"armed": False}

    def ctrl_c(*_: object) -> None:
        if interrupt["armed"]:
            interrupt["armed"] = False
            raise KeyboardInterrupt

    module[2].register_forward_pre_hook(ctrl_c)  # after the first layer's read
    with mltuner.Job(mltuner.Config(device=device)) as job:
        model = mt.wrap(module, job.worker, example_input=BATCHES[0][0].to(device),
                        store_activations=store_activations,
                        optimizer=torch.optim.SGD(module.parameters(), lr=0.1, momentum=0.9))
        for clock, (x, y) in enumerate(BATCHES):
            x, y = x.to(device), y.to(device)
            if clock == INTERRUPTED:
                interrupt["armed"] = True
                with pytest.raises(KeyboardInterrupt):
                    model(x)
                with pytest.warns(UserWarning, match=f"clock {clock} of the wrapped model was left half done by "
                                                     "KeyboardInterrupt"):
                    model.save_checkpoint(tmp_path)  # at once, as an `except KeyboardInterrupt:` would
                assert model.clock == clock + 1
                continue
            nn.functional.cross_entropy(model(x), y).backward()
            model.step()
        trained = {name: value.cpu() for name, value in model.state_dict().items()}
    want = reference()
    for name, value in want.items():
        torch.testing.assert_close(trained[name], value, rtol=1e-5, atol=1e-5, msg=name)
    with mltuner.Job(mltuner.Config(device=device)) as job:  # the checkpoint saved after the interruption resumes
        module = net().to(device)
        model = mt.wrap(module, job.worker, example_input=BATCHES[0][0].to(device),
                        store_activations=store_activations,
                        optimizer=torch.optim.SGD(module.parameters(), lr=0.1, momentum=0.9),
                        resume_from=tmp_path)
        assert model.resumed is not None and model.resumed.clock == INTERRUPTED + 1


@pytest.mark.parametrize("then", ["step", "forward"])
@pytest.mark.parametrize("store_activations", [False, True])
def test_an_error_in_the_backward_pass_leaves_the_model_going_on(store_activations: bool, then: str) -> None:
    """An exception inside loss.backward() (a CUDA OOM, an error in a custom
    backward) leaves no mark of the adapter's. Where updates ship at step()
    (held reads) nothing has left: the loop's zero_grad() drops the pass's
    gradients, as torch's does, and the clock goes on with the next batch
    (torch: that batch takes no step). Where they ship from the backward
    pass (stored activations) the loop's next call (here step(); the next
    forward alike) finds the backward begun and not finished and ends that
    clock, with the gradients that arrived (the last layer's) and zeros for
    the others (torch: a step with those)."""
    module = net()
    interrupt = {"armed": False}

    def fail_in_backward(_: nn.Module, __: object, output: torch.Tensor) -> None:
        def hook(grad: torch.Tensor) -> torch.Tensor:
            if interrupt["armed"]:
                interrupt["armed"] = False
                raise RuntimeError("CUDA out of memory (simulated)")
            return grad
        if output.requires_grad:
            output.register_hook(hook)

    module[2].register_forward_hook(fail_in_backward)  # after the last layer's gradient, before the others'
    with mltuner.Job() as job:
        model = mt.wrap(module, job.worker, example_input=BATCHES[0][0], store_activations=store_activations,
                        optimizer=torch.optim.SGD(module.parameters(), lr=0.1, momentum=0.9))
        ended = pytest.warns(UserWarning, match=f"clock {INTERRUPTED} of the wrapped model was left half done")
        for clock, (x, y) in enumerate(BATCHES):
            model.optimizer.zero_grad()
            if clock == INTERRUPTED + 1 and store_activations and then == "forward":
                with ended:
                    loss = nn.functional.cross_entropy(model(x), y)
            else:
                loss = nn.functional.cross_entropy(model(x), y)
            if clock == INTERRUPTED:
                interrupt["armed"] = True
                with pytest.raises(RuntimeError, match="simulated"):
                    loss.backward()
                if store_activations and then == "step":  # a loop that steps anyway: that ends the clock
                    with ended:
                        model.step()
                continue
            loss.backward()
            model.step()
        assert model.clock == job.worker.stats["clock"] == len(BATCHES) - (0 if store_activations else 1)
        trained = model.state_dict()
    module = net()
    optimizer = torch.optim.SGD(module.parameters(), lr=0.1, momentum=0.9)
    for clock, (x, y) in enumerate(BATCHES):
        optimizer.zero_grad()
        nn.functional.cross_entropy(module(x), y).backward()
        if clock == INTERRUPTED:
            if not store_activations:
                continue
            for name, p in module.named_parameters():
                if not name.startswith("4."):
                    p.grad = torch.zeros_like(p)
        optimizer.step()
    for name, value in module.state_dict().items():
        torch.testing.assert_close(trained[name], value, rtol=1e-5, atol=1e-6, msg=name)


def test_a_ctrl_c_after_steps_last_engine_call_keeps_the_clocks_in_step(monkeypatch: pytest.MonkeyPatch) -> None:
    """A Ctrl-C that lands as step()'s last engine call returns (its clock
    op already ran) ends nothing more: the model's clock follows the
    engine's (it stayed one behind for good), and training equals the
    uninterrupted run."""
    module = net()
    with mltuner.Job() as job:
        model = mt.wrap(module, job.worker, example_input=BATCHES[0][0],
                        optimizer=torch.optim.SGD(module.parameters(), lr=0.1, momentum=0.9))
        run_ops = job.worker._run_ops
        calls = {"armed": False}

        def interrupted(ops: list[tuple[object, ...]], stream: int) -> object:
            buffers = run_ops(ops, stream)
            if calls["armed"] and any(op[0] == 6 for op in ops):  # OpKind::kClock
                calls["armed"] = False
                raise KeyboardInterrupt
            return buffers

        monkeypatch.setattr(job.worker, "_run_ops", interrupted)
        for clock, (x, y) in enumerate(BATCHES):
            nn.functional.cross_entropy(model(x), y).backward()
            calls["armed"] = clock == INTERRUPTED
            if clock == INTERRUPTED:
                with pytest.raises(KeyboardInterrupt):
                    model.step()
                continue
            model.step()
            assert model.clock == job.worker.stats["clock"] == clock + 1
        trained = model.state_dict()
    module = net()
    optimizer = torch.optim.SGD(module.parameters(), lr=0.1, momentum=0.9)
    for x, y in BATCHES:
        optimizer.zero_grad()
        nn.functional.cross_entropy(module(x), y).backward()
        optimizer.step()
    for name, value in module.state_dict().items():
        torch.testing.assert_close(trained[name], value, rtol=1e-5, atol=1e-6, msg=name)
