"""The tuner's runtime error (bad input raises :class:`~mltuner.InvalidArgumentError`)."""

from __future__ import annotations

from mltuner.exceptions import MltunerError

__all__ = ["TuningError"]


class TuningError(MltunerError, RuntimeError):
    """Tuning cannot go on: the loss is not finite before any training, every
    trial of the initial search diverged, the training loss became non-finite,
    or the training system broke its contract. The message says which."""
