"""The MNIST-1D CNN in PyTorch, trained through :mod:`mltuner.torch`.

The architecture of the MNIST-1D authors (three 1-D convolutions of 25
channels with ReLU, then a linear layer), whose reported test accuracy is
94%. torch is imported only by this module: the numpy programs do not need it.
"""

from __future__ import annotations

import argparse
from typing import Literal

import numpy as np
import torch
from torch import nn

import mltuner as mlt
from mltuner.apps.mnist1d import Data, median_seconds
from mltuner.torch import wrap
from mltuner.tune import BranchKind, Step

__all__ = ["TorchCNN", "mnist1d_cnn", "engine_device", "forward_backward_seconds"]

CHANNELS = 25


def mnist1d_cnn(input_length: int = 40, num_classes: int = 10) -> nn.Module:
    """The authors' CNN: conv(1->25, k5, s2) - conv(25->25, k3, s2) -
    conv(25->25, k3, s2), ReLU after each, then a linear layer."""
    length = input_length
    for kernel, stride, padding in ((5, 2, 1), (3, 2, 1), (3, 2, 1)):
        length = (length + 2 * padding - kernel) // stride + 1
    return nn.Sequential(
        nn.Conv1d(1, CHANNELS, 5, stride=2, padding=1), nn.ReLU(),
        nn.Conv1d(CHANNELS, CHANNELS, 3, stride=2, padding=1), nn.ReLU(),
        nn.Conv1d(CHANNELS, CHANNELS, 3, stride=2, padding=1), nn.ReLU(),
        nn.Flatten(), nn.Linear(CHANNELS * length, num_classes))


def forward_backward_seconds(model: nn.Module, x: torch.Tensor, y: torch.Tensor, repeats: int = 15,
                             warmup: int = 3) -> float:
    """Median seconds of one forward and backward pass of ``model`` on a
    batch (``x``, ``y``), cross-entropy loss, waiting for the device."""
    def run() -> None:
        nn.functional.cross_entropy(model(x), y).backward()  # type: ignore[no-untyped-call]
        if x.is_cuda:
            torch.cuda.synchronize(x.device)

    return median_seconds(run, repeats, warmup)


def engine_device() -> Literal["cpu", "cuda"]:
    """CUDA when the engine was built with it and torch and the engine both
    see a GPU; else the CPU."""
    usable = mlt.cuda_built() and mlt.cuda_device_count() > 0 and torch.cuda.is_available()
    return "cuda" if usable else "cpu"


class TorchCNN:
    """One worker's CNN: each clock a forward and backward pass through the
    adapter (TESTING clocks too: their branch has learning rate 0 and is not
    training, so the servers ignore the update, and the logits give the
    accuracy on the branch's own parameters)."""

    def __init__(self, args: argparse.Namespace, data: Data, worker: mlt.Worker) -> None:
        torch.manual_seed(args.seed)
        torch.set_num_threads(1)  # one process per core: intra-op threads would fight each other
        device = torch.device("cuda", worker.rank % max(torch.cuda.device_count(), 1)) \
            if engine_device() == "cuda" else torch.device("cpu")
        self._device = device
        self._tensors = {name: torch.as_tensor(np.asarray(value), device=device)
                         for name, value in vars(data).items()}
        for name in ("x_train", "x_val", "x_test"):
            self._tensors[name] = self._tensors[name].unsqueeze(1)  # (samples, 1 channel, length)
        self._plain = mnist1d_cnn(data.x_train.shape[1], int(data.y_train.max()) + 1).to(device)
        example = self._tensors["x_train"][:args.batch_size]
        self._model = wrap(self._plain, worker, example_input=example,
                           example_loss=lambda out: nn.functional.cross_entropy(
                               out, self._tensors["y_train"][:args.batch_size]))

    def _new_model(self) -> nn.Module:
        """A fresh CNN of this data's input length and classes, on the CPU."""
        return mnist1d_cnn(self._tensors["x_train"].shape[2], int(self._tensors["y_train"].max()) + 1)

    def clock(self, step: Step) -> None:
        testing = step.kind is BranchKind.TESTING
        x = self._tensors["x_val" if testing else "x_train"]
        y = self._tensors["y_val" if testing else "y_train"]
        index = torch.as_tensor(step.indices, device=self._device, dtype=torch.long)
        logits = self._model(x[index])
        if len(index):
            loss = nn.functional.cross_entropy(logits, y[index])
        else:  # a part the others took, or no validation samples left: a zero update, not NaN
            loss = logits.sum() * 0.0
        (loss * step.weight).backward()  # type: ignore[no-untyped-call]
        self._model.step()
        if testing:
            accuracy = (logits.argmax(1) == y[index]).float().mean().item() if len(index) else 0.0
            step.report(loss.item(), accuracy=accuracy)
        else:
            step.report(loss.item())

    def compute_seconds(self, samples: int) -> float:
        return forward_backward_seconds(self._new_model().to(self._device), self._tensors["x_train"][:samples],
                                        self._tensors["y_train"][:samples])

    def test_accuracy(self, branch: int) -> float:
        model = self._new_model()
        model.load_state_dict(self._model.state_dict(branch=branch))
        model.to(self._device).eval()
        with torch.no_grad():
            predictions = model(self._tensors["x_test"]).argmax(1)
        return float((predictions == self._tensors["y_test"]).float().mean())
