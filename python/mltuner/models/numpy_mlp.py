"""A numpy multi-layer perceptron over one flat parameter vector.

Data-parallel training through the parameter server needs a model whose
state is one array that workers read, differentiate and push updates to;
this one is. ``MLP([40, 10])`` is logistic regression and
``MLP([40, 100, 100, 10])`` is the MLP of the MNIST-1D authors
(:func:`mltuner.datasets.load_mnist1d`). Their reference test accuracies on
MNIST-1D, after full training:

====================  =============
model                 test accuracy
====================  =============
logistic regression   32%
MLP (100, 100)        68%
CNN                   94%
====================  =============

(Greydanus & Steinbach, "Scaling down deep learning with MNIST-1D", ICML
2024.) The gap between them is what makes the data set a useful check that
a training system trains: a broken update rule stays near 10%, chance.

Hidden layers use ReLU; the loss is softmax cross-entropy, averaged over the
batch. The flat vector holds, layer by layer, the weight matrix W (fan_in x
fan_out, row-major) and then the bias b: logits = relu(x W1 + b1) W2 + b2.
Arithmetic is done in float64 (these models are small, and it keeps the
gradient exact enough for finite-difference checks); parameters and
gradients are float32, as the parameter server stores them.

Thread safety: an MLP holds only its sizes; every method is a pure function
of its arguments and may be called from any thread.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from mltuner.exceptions import InvalidArgumentError

__all__ = ["MLP"]


class MLP:
    """A ReLU MLP with softmax cross-entropy over a flat float32 parameter vector.

    Args:
        layer_sizes: inputs, then each hidden layer's width, then the number
            of classes; at least two entries, all positive. [40, 10] is
            logistic regression.

    Example::

        model = MLP([40, 100, 100, 10])
        params = model.init_params(np.random.default_rng(0))
        loss, grad = model.loss_and_grad(params, x_batch, y_batch)
        params -= 0.1 * grad
    """

    def __init__(self, layer_sizes: Sequence[int]) -> None:
        sizes = [int(s) for s in layer_sizes]
        if len(sizes) < 2 or any(s < 1 for s in sizes):
            raise InvalidArgumentError(
                f"layer_sizes needs the input size, any hidden widths and the number of "
                f"classes, all positive; got {list(layer_sizes)}"
            )
        self.layer_sizes: tuple[int, ...] = tuple(sizes)
        # (offset of W, offset of b, end) of each layer in the flat vector.
        self._slices: list[tuple[int, int, int]] = []
        offset = 0
        for fan_in, fan_out in zip(sizes[:-1], sizes[1:]):
            w_end = offset + fan_in * fan_out
            self._slices.append((offset, w_end, w_end + fan_out))
            offset = w_end + fan_out
        self.num_params: int = offset
        """Length of the flat parameter vector."""

    @property
    def input_length(self) -> int:
        return self.layer_sizes[0]

    @property
    def num_classes(self) -> int:
        return self.layer_sizes[-1]

    def __repr__(self) -> str:
        return f"MLP({list(self.layer_sizes)}, num_params={self.num_params})"

    def init_params(self, rng: np.random.Generator) -> np.ndarray:
        """A new flat float32 parameter vector: He-normal weights for layers
        followed by a ReLU (std sqrt(2 / fan_in)), Glorot-normal for the
        output layer (std sqrt(2 / (fan_in + fan_out))), zero biases."""
        params = np.zeros(self.num_params, dtype=np.float32)
        last = len(self._slices) - 1
        for i, (w0, w1, _) in enumerate(self._slices):
            fan_in, fan_out = self.layer_sizes[i], self.layer_sizes[i + 1]
            std = np.sqrt(2.0 / (fan_in + fan_out)) if i == last else np.sqrt(2.0 / fan_in)
            params[w0:w1] = rng.normal(0.0, std, size=w1 - w0)
        return params

    def logits(self, params: np.ndarray, x: np.ndarray) -> np.ndarray:
        """The float64 logits, shape (batch, num_classes)."""
        return self._forward(self._layers(params), self._inputs(x))[-1]

    def loss_and_grad(self, params: np.ndarray, x: np.ndarray,
                      y: np.ndarray) -> tuple[float, np.ndarray]:
        """The mean softmax cross-entropy of the batch and its gradient.

        Args:
            params: the flat vector (num_params,); any float dtype.
            x: inputs, (batch, input_length).
            y: integer labels in [0, num_classes), (batch,).

        Returns:
            (loss, grad): a Python float and a new flat float32 array.
        """
        layers = self._layers(params)
        x64 = self._inputs(x)
        labels = self._labels(y, len(x64))
        acts = self._forward(layers, x64)
        logits = acts[-1]
        shifted = logits - logits.max(axis=1, keepdims=True)  # log-sum-exp without overflow
        log_z = np.log(np.exp(shifted).sum(axis=1))
        rows = np.arange(len(labels))
        loss = float(np.mean(log_z - shifted[rows, labels]))

        # d loss / d logits = (softmax - one_hot) / batch
        delta = np.exp(shifted - log_z[:, None])
        delta[rows, labels] -= 1.0
        delta /= len(labels)
        grad = np.empty(self.num_params, dtype=np.float32)
        for i in range(len(layers) - 1, -1, -1):
            w, _ = layers[i]
            w0, w1, b1 = self._slices[i]
            grad[w0:w1] = (acts[i].T @ delta).ravel()
            grad[w1:b1] = delta.sum(axis=0)
            if i > 0:
                # acts[i] = relu(z): the ReLU passes gradient where it was positive.
                delta = (delta @ w.T) * (acts[i] > 0)
        return loss, grad

    def accuracy(self, params: np.ndarray, x: np.ndarray, y: np.ndarray) -> float:
        """The fraction of samples whose largest logit is their label."""
        logits = self.logits(params, x)
        labels = self._labels(y, len(logits))
        return float(np.mean(np.argmax(logits, axis=1) == labels))

    # -- helpers -----------------------------------------------------------------------

    def _layers(self, params: np.ndarray) -> list[tuple[np.ndarray, np.ndarray]]:
        flat = np.asarray(params)
        if flat.shape != (self.num_params,) or not np.issubdtype(flat.dtype, np.floating):
            raise InvalidArgumentError(
                f"params must be a flat float vector of {self.num_params} values for "
                f"{self!r}, got {flat.dtype}{list(flat.shape)}"
            )
        flat = flat.astype(np.float64, copy=False)
        layers = []
        for i, (w0, w1, b1) in enumerate(self._slices):
            shape = (self.layer_sizes[i], self.layer_sizes[i + 1])
            layers.append((flat[w0:w1].reshape(shape), flat[w1:b1]))
        return layers

    def _inputs(self, x: np.ndarray) -> np.ndarray:
        x = np.asarray(x)
        if x.ndim != 2 or x.shape[1] != self.input_length or len(x) == 0:
            raise InvalidArgumentError(
                f"x must be (batch >= 1, {self.input_length}), got {list(x.shape)}"
            )
        return x.astype(np.float64, copy=False)

    def _labels(self, y: np.ndarray, batch: int) -> np.ndarray:
        y = np.asarray(y)
        if y.shape != (batch,) or not np.issubdtype(y.dtype, np.integer):
            raise InvalidArgumentError(
                f"y must be {batch} integer labels, got {y.dtype}{list(y.shape)}"
            )
        if batch and (y.min() < 0 or y.max() >= self.num_classes):
            raise InvalidArgumentError(
                f"labels must lie in [0, {self.num_classes}), got [{y.min()}, {y.max()}]"
            )
        return y

    @staticmethod
    def _forward(layers: list[tuple[np.ndarray, np.ndarray]],
                 x: np.ndarray) -> list[np.ndarray]:
        # acts[0] = x, acts[i] = the input of layer i, acts[-1] = the logits.
        acts = [x]
        for i, (w, b) in enumerate(layers):
            z = acts[-1] @ w + b
            acts.append(np.maximum(z, 0.0) if i < len(layers) - 1 else z)
        return acts
