"""What ``.grad`` holds once a layer's update has left in the backward pass.

Where updates ship from the backward pass (``overlap_updates=True``, or
stored activations / reads not held), a layer's gradients go to the engine
as soon as they are final, long before ``step()``. A script that then reads or changes ``.grad`` (global-norm
clipping, a gradient-norm log) would find ``None`` and quietly clip or log
nothing, while the servers apply the unclipped update. Instead, each
parameter's ``.grad`` holds a :class:`ShippedGradient` until ``step()``:
a tensor of the gradient's shape, dtype and device with no storage, whose
use of its values raises :class:`mltuner.OutOfOrderError` naming the
parameter, why this model ships from the backward pass and the way out, if
there is one. ``p.grad is None`` checks still see a gradient, as they would
with torch's optimizers, and its shape, dtype and device can be read. One
use is let through: ``torch.amp.GradScaler``'s inf check over the param
groups (``scaler.step``, ``scaler.unscale_``), where the stand-ins answer
with the clock's overflow flag: the scale already came off each layer's
gradients before they shipped (``_amp.py``), and ``scaler.update()`` backs
off after an overflowing clock as it would with torch's optimizer.

Made once per parameter (about 2 us each) and assigned per clock (a
fraction of a microsecond).
"""

from __future__ import annotations

from typing import Any

import torch

from mltuner.exceptions import OutOfOrderError

__all__ = ["ShippedGradient"]

# Properties a stand-in answers (torch's GradScaler and clip_grad_norm_ read
# them before touching any value).
_METADATA = frozenset({"shape", "dtype", "device", "layout", "is_sparse", "is_cuda", "ndim", "requires_grad",
                       "grad_fn", "is_leaf"})


class ShippedGradient(torch.Tensor):
    """A stand-in for the gradient of parameter ``param_name`` after its
    update left for the servers (module docstring); ``why`` is the model's
    reason to ship from the backward pass, for the error."""

    param_name: str
    why: str
    overflow: torch.Tensor | None  # a GradScaler's overflow flag (_amp.py), for its inf check

    @staticmethod
    def __new__(cls, like: torch.Tensor, name: str, why: str,
                overflow: torch.Tensor | None = None) -> ShippedGradient:
        made = torch.Tensor._make_wrapper_subclass(
            cls, like.shape, dtype=like.dtype, device=like.device, requires_grad=False)
        made.param_name, made.why, made.overflow = name, why, overflow
        return made

    def __repr__(self, *args: Any, **kwargs: Any) -> str:  # type: ignore[override]
        return f"<gradient of {self.param_name!r}: shipped to the parameter servers in the backward pass>"

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if func is torch.Tensor.__repr__:
            return args[0].__repr__()
        if getattr(getattr(func, "__self__", None), "__name__", None) in _METADATA:
            with torch._C.DisableTorchFunctionSubclass():
                return func(*args, **(kwargs or {}))
        if func is torch._amp_foreach_non_finite_check_and_unscale_:
            # GradScaler's inf check over every param group: the scale came
            # off each layer's gradients before they shipped (_amp.py), so a
            # stand-in adds its clock's overflow flag to the found infs; real
            # tensors among them (a parameter outside the model) are checked.
            tensors = args[0]
            found_inf = args[1] if len(args) > 1 else (kwargs or {})["found_inf"]
            real = [tensor for tensor in tensors if not isinstance(tensor, ShippedGradient)]
            if real:
                func(real, *args[1:], **(kwargs or {}))
            flags = {id(t.overflow): t.overflow for t in tensors
                     if isinstance(t, ShippedGradient) and t.overflow is not None}
            for flag in flags.values():
                torch.maximum(found_inf, flag.to(found_inf.device).reshape(found_inf.shape), out=found_inf)
            return None
        name, why = _stand_in(args, kwargs)
        if torch._C._current_autograd_node() is not None:  # in the backward pass: a hook of the loop's own
            raise OutOfOrderError(
                f"the gradient of {name!r} was read or changed during backward(), by a hook that runs after the "
                "one that ships its update (a register_post_accumulate_grad_hook or a tensor hook registered after "
                f"wrap()): register the hook before wrap(), so that it runs before the update leaves ({why})"
            )
        raise OutOfOrderError(
            f"the gradient of {name!r} was read or changed between backward() and step(), but it had already "
            "left for the parameter servers during backward(), so an operation over the gradients there "
            f"(clip_grad_norm_, a gradient-norm log) would see nothing and change nothing: {why}"
        )

    @classmethod
    def __torch_dispatch__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:  # type: ignore[override]
        # Autograd adding to a gradient already shipped: a second backward
        # pass through the clock's graph (its first one shipped the update).
        raise OutOfOrderError(
            f"{_stand_in(args, kwargs)[0]!r} received a second gradient after its update left in this clock's backward "
            "pass: backward() ran twice (retain_graph=True?); call step() after each backward pass"
        )


def _stand_in(args: Any, kwargs: Any) -> tuple[str, str]:
    """The parameter name and reason of the first stand-in among an op's
    arguments."""
    for value in (*args, *(kwargs or {}).values()):
        for item in value if isinstance(value, (list, tuple)) else (value,):
            if isinstance(item, ShippedGradient):
                return item.param_name, item.why
    return "a parameter", ""
