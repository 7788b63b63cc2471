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
