"""Errors of the PyTorch adapter.

Both derive from :class:`mltuner.InvalidArgumentError` (and so from
``ValueError``): they name something about the model or the training loop
that the adapter cannot take. Calls made in the wrong order (a second
``backward``, ``step`` without ``backward``) raise the engine's own
:class:`mltuner.OutOfOrderError`.
"""

from __future__ import annotations

from mltuner.exceptions import InvalidArgumentError

__all__ = ["UnsupportedModelError", "IterationMismatchError"]


class UnsupportedModelError(InvalidArgumentError):
    """The model holds something the adapter cannot put in a parameter
    server: a non-float32 or sparse parameter, a compiled or scripted
    module, a parameter used outside the forward of the modules that hold
    it, ..."""


class IterationMismatchError(InvalidArgumentError):
    """A clock's forward or backward pass differs from the one recorded by
    :func:`mltuner.torch.wrap`: another layer order, a skipped layer, or a
    saved activation of another shape (with ``store_activations=True``, the
    batch size must stay as recorded)."""
