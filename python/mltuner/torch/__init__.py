"""The PyTorch adapter: train an ``nn.Module`` through a parameter-server worker.

:func:`wrap` records the virtual iteration from one forward and backward pass
and returns a :class:`PSModule`; each clock is then ``model(x)``,
``loss.backward()`` and ``model.step()``. Every layer's parameters live in
their own table and are read into engine buffers that back the module's
tensors without a copy; the gradients go to the engine at ``step()``, or each
layer's as soon as it is final where the plan ships from the backward pass
(wait-free backpropagation: ``wrap(overlap_updates=)``), and the servers
apply the update rule. docs/torch.md has the details and limits.

torch is an optional dependency: ``pip install "mltuner[torch]"``.
"""

from __future__ import annotations

try:
    import torch as _torch  # noqa: F401 - only to fail early with a clear message
except ImportError as error:  # pragma: no cover - only without torch
    raise ImportError(
        f"mltuner.torch needs PyTorch, which could not be imported ({error}); install it with "
        "`pip install \"mltuner[torch]\"`"
    ) from error

from mltuner.torch._errors import IterationMismatchError, UnsupportedModelError
from mltuner.torch._layers import DEFAULT_WHOLE_MODULES
from mltuner.torch._module import ClockOptimizer, PSModule, wrap
from mltuner.torch._recompute import Recompute
from mltuner.torch._resume import Resumed

__all__ = [
    "wrap",
    "PSModule",
    "ClockOptimizer",
    "UnsupportedModelError",
    "IterationMismatchError",
    "DEFAULT_WHOLE_MODULES",
    "Recompute",
    "Resumed",
]
