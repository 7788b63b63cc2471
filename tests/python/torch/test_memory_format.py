"""A wrapped model's parameters keep their memory format: a channels_last
convolution's weight is channels_last in every forward, in its gradient
(which the engine then copies as it is) and in ``state_dict()``, and
trains as plain PyTorch does. A checkpoint keeps the format: resumed into
a model of another format it is refused, as are workers whose models
differ in format."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

from torch import nn  # noqa: E402

import mltuner  # noqa: E402
import mltuner.torch as mt  # noqa: E402
from mltuner.torch import _updates  # noqa: E402

CL = torch.channels_last
X = torch.randn(4, 3, 8, 8, generator=torch.Generator().manual_seed(0)).contiguous(memory_format=CL)
Y = torch.randint(0, 10, (4,), generator=torch.Generator().manual_seed(1))


def convnet(memory_format: torch.memory_format = CL) -> nn.Module:
    """Convolutions of each kind: full, depthwise (its [C, 1, k, k] weight
    and a 1x1 one are channels_last with the contiguous order of values)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(),
                          nn.Conv2d(8, 8, 3, groups=8), nn.Conv2d(8, 8, 1), nn.Flatten(), nn.Linear(8 * 6 * 6, 10))
    return model.to(memory_format=memory_format)


def sgd(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)


def step(model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
    optimizer.zero_grad()
    nn.functional.cross_entropy(model(X), Y).backward()
    optimizer.step()


@pytest.mark.parametrize("options", [{}, {"hold_reads": False}, {"store_activations": True}],
                         ids=["held reads", "reads afresh", "stored activations"])
def test_a_channels_last_model_keeps_its_format_and_trains_as_plain_torch(
        monkeypatch: pytest.MonkeyPatch, options: dict[str, bool]) -> None:
    """Every pattern: between clocks a parameter points at a NaN placeholder
    of its own layout, so its gradient arrives laid out as it is."""
    module = convnet()
    reference = copy.deepcopy(module)
    reference_optimizer = sgd(reference)
    in_forward: list[bool] = []
    module[3].register_forward_pre_hook(
        lambda m, args: in_forward.append(m.weight.is_contiguous(memory_format=CL)))
    copied_by_torch = []
    original_copy = _updates.GradientUpdates._copy_grads
    monkeypatch.setattr(_updates.GradientUpdates, "_copy_grads",
                        lambda self, views, grads: copied_by_torch.append(1) or original_copy(self, views, grads))
    with mltuner.LocalCluster(1) as cluster:
        model = mt.wrap(module, cluster.worker(0), example_input=X, optimizer=sgd(module), **options)
        for _ in range(3):
            step(model, model.optimizer)
            step(reference, reference_optimizer)
        state = model.state_dict()
    assert in_forward and all(in_forward)
    assert not copied_by_torch  # the engine took every gradient as torch laid it out
    for name, expected in reference.state_dict().items():
        assert state[name].stride() == expected.stride(), name  # torch reads the format from all of them
        torch.testing.assert_close(state[name], expected, rtol=1e-5, atol=1e-6)
    assert (reference[0].weight - convnet()[0].weight).abs().max() > 1e-3  # it trained


def _saved(root: Path) -> tuple[Path, dict[str, torch.Tensor]]:
    with mltuner.Job() as job:
        module = convnet()
        model = mt.wrap(module, job.worker, example_input=X, optimizer=sgd(module))
        step(model, model.optimizer)
        path = model.save_checkpoint(root)
        return path, {name: value.clone() for name, value in model.state_dict().items()}


def test_a_checkpoint_resumes_in_its_format_and_refuses_another(tmp_path: Path) -> None:
    path, saved = _saved(tmp_path / "root")
    with mltuner.Job() as job:
        contiguous = convnet(torch.contiguous_format)
        with pytest.raises(mltuner.InvalidArgumentError,
                           match=r"'0\.weight' has its values in another memory order there \(strides "
                                 r"\(27, 1, 9, 3\), here \(27, 9, 3, 1\)\): give the module that memory format, "
                                 r"module.to\(memory_format=torch.channels_last\)"):
            mt.wrap(contiguous, job.worker, example_input=X, optimizer=sgd(contiguous), resume_from=path)
        module = convnet()
        model = mt.wrap(module, job.worker, example_input=X, optimizer=sgd(module), resume_from=path)
        for name, value in model.state_dict().items():
            torch.testing.assert_close(value, saved[name], rtol=0, atol=0)


def test_workers_whose_models_differ_in_format_are_refused() -> None:
    formats = [CL, torch.contiguous_format]

    def body(worker: mltuner.Worker) -> None:
        module = convnet(formats[worker.rank])
        mt.wrap(module, worker, example_input=X, optimizer=sgd(module))

    with mltuner.LocalCluster(2, mltuner.Config(wait_timeout_s=10.0)) as cluster:
        with pytest.raises(Exception, match="same tables"):
            cluster.run(body, timeout_s=30.0)


def test_a_replaced_dense_placeholder_keeps_its_memory(monkeypatch: pytest.MonkeyPatch) -> None:
    """A larger channels_last parameter replaces the shared dense
    placeholder; the old one's address stays a placeholder's, so its memory
    must never go to another tensor (a probe's saved ReLU output and a loss
    scalar were taken for parameters: "used outside the forward of the
    module that owns it")."""
    from mltuner.torch import _buffers

    device = torch.device("cpu")
    monkeypatch.delitem(_buffers._DENSE_PLACEHOLDERS, device, raising=False)  # a placeholder of this test's size
    first = _buffers.dense_placeholder(device, 1000)
    del first
    _buffers.dense_placeholder(device, 1001)  # what a wider model's wrap() asks for
    fresh = [torch.empty(n) for n in range(500, 1064, 4) for _ in range(2)]
    taken = [t.numel() for t in fresh if _buffers.is_placeholder(_buffers.storage_ptr(t))]
    assert not taken, f"tensors of {taken} elements got a replaced placeholder's memory"
