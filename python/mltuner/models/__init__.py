"""Reference models for examples, tests and benchmarks.

:class:`MLP` is a plain numpy multi-layer perceptron whose parameters are one
flat float32 vector: the shape the parameter server stores and the tuner's
trials fork. It needs nothing but numpy.
"""

from __future__ import annotations

from mltuner.models.numpy_mlp import MLP

__all__ = ["MLP"]
