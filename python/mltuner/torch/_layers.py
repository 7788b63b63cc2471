"""Layers: the groups of parameters that share one parameter-server table.

A layer is a module that owns trainable parameters directly (``Linear``,
``Conv2d``, ``LayerNorm``, ...), or a whole subtree for module types whose
forward uses their children's parameters without calling the children
(``MultiheadAttention`` reads ``out_proj.weight`` itself). Each layer gets one
table, so its update ships as soon as its own gradients are final and its
next read waits only for its own rows.

Also here: the checks that refuse what the adapter cannot take, each with a
message naming the parameter or module.
"""

from __future__ import annotations

import dataclasses
import sys
from collections.abc import Sequence

import torch
from torch import nn

from mltuner.client._layout import TensorLayout
from mltuner.torch._buffers import placeholder
from mltuner.torch._errors import UnsupportedModelError

__all__ = ["Layer", "ParamSlot", "find_layers", "DEFAULT_WHOLE_MODULES"]

# Module types whose forward reads their children's parameters directly.
DEFAULT_WHOLE_MODULES: tuple[type[nn.Module], ...] = (nn.MultiheadAttention,)


@dataclasses.dataclass(frozen=True)
class ParamSlot:
    """One parameter of a layer and where it sits in the layer's rows."""

    name: str  # qualified name in the wrapped model, as in its state_dict
    param: nn.Parameter
    offset: int  # first element in the layer's flat (rows * row_width) buffer
    shape: torch.Size

    @property
    def numel(self) -> int:
        return int(self.shape.numel())


@dataclasses.dataclass
class Layer:
    """The parameters of one table, in a fixed order."""

    index: int
    name: str  # the module's qualified name; "<root>" for the model itself
    module: nn.Module
    params: list[ParamSlot]
    layout: TensorLayout
    device: torch.device

    @property
    def num_values(self) -> int:
        return self.layout.num_rows * self.layout.row_width

    def views(self, flat: torch.Tensor) -> list[torch.Tensor]:
        """Each parameter's view inside a flat buffer of this layer's rows."""
        return [flat[p.offset : p.offset + p.numel].view(p.shape) for p in self.params]

    def bind(self, flat: torch.Tensor) -> None:
        """Points every parameter at its rows in ``flat`` (no copy)."""
        for slot, view in zip(self.params, self.views(flat)):
            slot.param.data = view

    def unbind(self) -> None:
        """Points every parameter at a NaN placeholder of its shape."""
        nan = placeholder(self.device)
        for slot in self.params:
            slot.param.data = nan.expand(slot.shape)


def _check_module_types(model: nn.Module) -> None:
    compiled: type | None = None
    if "torch._dynamo" in sys.modules:  # nothing can be compiled unless dynamo was imported
        from torch._dynamo.eval_frame import OptimizedModule

        compiled = OptimizedModule
    parallel = (nn.DataParallel, nn.parallel.DistributedDataParallel)
    for name, module in model.named_modules():
        where = f"module {name!r}" if name else "the model"
        if compiled is not None and isinstance(module, compiled):
            raise UnsupportedModelError(
                f"{where} is compiled with torch.compile: wrap the eager module (the adapter needs its "
                "forward hooks and autograd hooks), e.g. wrap(model) rather than wrap(torch.compile(model))"
            )
        if isinstance(module, torch.jit.ScriptModule):
            raise UnsupportedModelError(f"{where} is a TorchScript module: wrap the eager module")
        if isinstance(module, parallel):
            raise UnsupportedModelError(
                f"{where} is {type(module).__name__}: the parameter server replaces it; wrap the plain module"
            )
        if isinstance(module, (nn.Embedding, nn.EmbeddingBag)) and module.sparse:
            raise UnsupportedModelError(
                f"{where} ({type(module).__name__}) has sparse=True: sparse gradients are not supported; "
                "use sparse=False"
            )


def _check_shared(model: nn.Module) -> None:
    names: dict[int, list[str]] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(param), []).append(name)
    shared = [n for n in names.values() if len(n) > 1]
    if shared:
        raise UnsupportedModelError(
            f"parameter shared between modules (tied weights): {' = '.join(shared[0])}; every parameter "
            "must belong to one module"
        )


def _check_param(name: str, param: nn.Parameter) -> None:
    if param.layout != torch.strided:
        raise UnsupportedModelError(f"parameter {name!r} has layout {param.layout}: only dense parameters")
    if param.dtype != torch.float32:
        raise UnsupportedModelError(
            f"parameter {name!r} has dtype {param.dtype}: the parameter server holds float32 only; "
            "convert the model with model.float() (mixed precision via torch.autocast is fine), or freeze "
            "the parameter with requires_grad_(False) to keep it local"
        )
    if param.device.type == "meta":
        raise UnsupportedModelError(f"parameter {name!r} is on the meta device: materialize the model first")


def find_layers(model: nn.Module, row_width: int,
                whole_modules: Sequence[type[nn.Module]] = DEFAULT_WHOLE_MODULES) -> list[Layer]:
    """The model's layers in ``named_modules`` order (the same on every
    worker that builds the same model). Only parameters with
    ``requires_grad`` go to the parameter server; frozen ones stay local.

    Raises:
        UnsupportedModelError: see :func:`mltuner.torch.wrap`.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"expected a torch.nn.Module, got {type(model).__name__}")
    _check_module_types(model)
    _check_shared(model)
    whole = tuple(whole_modules)
    layers: list[Layer] = []
    inside_whole: list[str] = []  # prefixes of whole modules already taken
    devices: set[torch.device] = set()
    for module_name, module in model.named_modules():
        if any(module_name.startswith(prefix + ".") for prefix in inside_whole):
            continue
        recurse = isinstance(module, whole)
        if recurse:
            inside_whole.append(module_name)
        trainable = [(n, p) for n, p in module.named_parameters(recurse=recurse) if p.requires_grad]
        if not trainable:
            continue
        layout = TensorLayout(row_width)
        for local_name, param in trainable:
            qualified = f"{module_name}.{local_name}" if module_name else local_name
            _check_param(qualified, param)
            layout.add(local_name, tuple(param.shape))
            devices.add(param.device)
        slots = [
            ParamSlot(f"{module_name}.{n}" if module_name else n, p, layout.slot(n).first_row * row_width, p.shape)
            for n, p in trainable
        ]
        layers.append(Layer(len(layers), module_name or "<root>", module, slots, layout, trainable[0][1].device))
    if not layers:
        raise UnsupportedModelError("the model has no trainable parameters (requires_grad=True) to train")
    if len(devices) > 1:
        raise UnsupportedModelError(
            f"the model's parameters are on several devices ({', '.join(sorted(map(str, devices)))}): "
            "a worker drives one device; move the whole model to it"
        )
    return layers
