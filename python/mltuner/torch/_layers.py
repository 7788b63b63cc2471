"""Layers: the groups of parameters that share one parameter-server table.

A layer is a module subtree whose trainable parameters live in one table,
read before the subtree's root module runs its forward and released after.
By default each child of the model becomes one layer (a residual block, a
transformer block, a single ``Linear``), as long as its parameters take at
most ``group_bytes``; a larger child is split into its own parameters (if
any) and its children, recursively. ``group_bytes=0`` gives one layer per
module that owns trainable parameters directly (``Linear``, ``Conv2d``,
``BatchNorm2d``, ...). Module types whose forward uses their children's
parameters without calling the children (``MultiheadAttention`` reads
``out_proj.weight`` itself) are always one layer, whatever their size.

Fewer, larger tables mean fewer engine calls and hooks per clock; each one
still ships its update as soon as its own gradients are final, and its next
read waits only for its own rows.

A parameter shared by several modules (tied weights: a language model's
output projection that reuses the token embedding) belongs to the first
layer that holds it, in ``named_modules`` order. Every other module that
holds it directly is one of that layer's ``callers``: its forward reads the
layer again, as a second call of the layer's own module would, so the
shared values are there wherever they are used, under a budget too.
Autograd sums both uses' gradients into the one parameter, and the layer's
update carries that sum.

A parameter keeps its memory format: one dense in another order of its
dimensions (``model.to(memory_format=torch.channels_last)``) has its
values in the table in that memory order and is bound as a view with its
strides, so convolutions see the layout they were given (no conversion of
the weight and its gradient each call) and the engine copies its gradient,
which torch lays out as the parameter, as it is.

Also here: the checks that refuse what the adapter cannot take, each with a
message naming the parameter or module.
"""

from __future__ import annotations

import dataclasses
import math
import sys
from collections.abc import Collection, Mapping, Sequence
from typing import Any

import torch
from torch import nn
from torch.nn.parameter import is_lazy

from mltuner._config import UpdateRule
from mltuner.client._layout import TensorLayout
from mltuner.exceptions import InternalError
from mltuner.torch._buffers import as_tensor, buffer_key, dense_placeholder, placeholder
from mltuner.torch._errors import UnsupportedModelError
from mltuner.torch._shipped import ShippedGradient

__all__ = ["Layer", "ParamSlot", "check_module_types", "find_layers", "memory_strides", "memory_order",
           "contiguous_strides", "covers_once", "DEFAULT_WHOLE_MODULES", "DEFAULT_GROUP_BYTES"]

# Module types whose forward reads their children's parameters directly.
DEFAULT_WHOLE_MODULES: tuple[type[nn.Module], ...] = (nn.MultiheadAttention,)

# The largest child of the model read as one table (trainable float32 bytes).
DEFAULT_GROUP_BYTES = 32 << 20

# Buffer addresses remembered per layer. The engine's pool places each
# access at one of a few addresses that recur clock after clock (about a
# dozen per table for ResNet-18); past the bound the oldest is dropped.
_MAX_CACHED_BUFFERS = 64


@dataclasses.dataclass(frozen=True)
class ParamSlot:
    """One parameter of a layer and where it sits in the layer's rows."""

    name: str  # qualified name in the wrapped model, as in its state_dict
    param: nn.Parameter
    offset: int  # first element in the layer's flat (rows * row_width) buffer
    shape: torch.Size
    stride: tuple[int, ...] | None = None  # a memory format other than the contiguous one (memory_strides)

    @property
    def numel(self) -> int:
        return int(self.shape.numel())

    def view(self, flat: torch.Tensor, offset: int | None = None) -> torch.Tensor:
        """The parameter's view inside a flat buffer of its layer's rows (at
        ``offset`` instead of its own)."""
        start = self.offset if offset is None else offset
        values = flat[start : start + self.numel]
        return values.view(self.shape) if self.stride is None else values.as_strided(self.shape, self.stride)

    @property
    def reordered(self) -> bool:
        """Whether its rows hold it in another order than the contiguous one."""
        return memory_order(self.shape, self.stride) != memory_order(self.shape, None)

    def laid_out_as(self, tensor: torch.Tensor) -> bool:
        """Whether ``tensor`` (a gradient) has the parameter's memory layout,
        so that its memory is the parameter's rows as they are: the same
        strides along every dimension of more than one element (those of the
        others do not matter, as in torch's own layout checks)."""
        if self.stride is None:
            return tensor.is_contiguous()
        return all(a == b for a, b, size in zip(tensor.stride(), self.stride, self.shape) if size != 1)


def memory_strides(tensor: torch.Tensor) -> tuple[int, ...] | None:
    """The strides of a tensor that covers its memory exactly once with
    other strides than the contiguous ones (``channels_last``, a transposed
    weight, or a channels_last 1x1 or depthwise weight, whose order is the
    contiguous one but whose strides along its dimensions of one element
    differ, which torch reads as the memory format); None for a contiguous
    one, and for one with gaps or overlaps, whose rows are laid out
    contiguously."""
    strides = tuple(tensor.stride())
    if strides == contiguous_strides(tensor.shape) or not covers_once(tensor.shape, strides):
        return None
    return strides


def covers_once(shape: Sequence[int], strides: Sequence[int]) -> bool:
    """Whether a tensor of this shape and these strides covers its memory
    span exactly once: contiguous in some order of its dimensions."""
    expected = 1
    for stride, size in sorted((st, sz) for sz, st in zip(shape, strides) if sz != 1):
        if stride != expected:
            return False
        expected *= size
    return True


def contiguous_strides(shape: Sequence[int]) -> tuple[int, ...]:
    """A contiguous tensor's strides, as torch gives them (dimensions of no
    element count as one)."""
    return tuple(math.prod(max(size, 1) for size in shape[d + 1:]) for d in range(len(shape)))


def memory_order(shape: Sequence[int], strides: Sequence[int] | None) -> tuple[int, ...]:
    """The dimensions of more than one element from the outermost in memory
    to the innermost (``strides`` None: contiguous, in index order): two
    dense layouts of one shape hold the values in the same order exactly
    when these agree."""
    dims = [d for d, size in enumerate(shape) if size != 1]
    return tuple(dims if strides is None else sorted(dims, key=lambda d: -strides[d]))


@dataclasses.dataclass
class Layer:
    """The parameters of one table, in a fixed order.

    ``module`` is the subtree's root, whose forward hooks open and close the
    layer's reads; ``members`` are the modules inside it that own some of
    the parameters (the root alone for an ungrouped layer).
    """

    index: int
    name: str  # the module's qualified name; "<root>" for the model itself
    module: nn.Module
    params: list[ParamSlot]
    layout: TensorLayout
    device: torch.device
    members: list[tuple[str, nn.Module]] = dataclasses.field(default_factory=list)
    # Modules outside the subtree that hold some of these parameters too
    # (tied weights): each call of one reads the layer again.
    callers: list[tuple[str, nn.Module]] = dataclasses.field(default_factory=list)
    # The table's own update rule (from wrap()'s optimizer); None: the Config's.
    update_rule: UpdateRule | None = None
    _cache: dict[tuple[int, tuple[int, ...]], tuple[torch.Tensor, list[torch.Tensor]]] = dataclasses.field(
        default_factory=dict, repr=False)
    _nan_views: list[torch.Tensor] = dataclasses.field(default_factory=list, repr=False)
    _shipped_grads: list[ShippedGradient] = dataclasses.field(default_factory=list, repr=False)
    _params: list[nn.Parameter] = dataclasses.field(init=False, repr=False)
    shipped: bool = dataclasses.field(default=False, init=False)  # .grad holds the stand-ins

    def __post_init__(self) -> None:
        self._params = [slot.param for slot in self.params]

    @property
    def num_values(self) -> int:
        return self.layout.num_rows * self.layout.row_width

    def views(self, flat: torch.Tensor) -> list[torch.Tensor]:
        """Each parameter's view inside a flat buffer of this layer's rows."""
        return [slot.view(flat) for slot in self.params]

    def buffer_views(self, buffer: Any) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """An engine buffer of this layer's rows as a flat tensor and the
        parameters' views inside it, made once per buffer address (see
        :func:`mltuner.torch._buffers.buffer_key`) and reused after."""
        key = buffer_key(buffer)
        cached = self._cache.get(key)
        if cached is None:
            flat = as_tensor(buffer, self.device).view(-1)
            if flat.numel() < self.num_values:
                raise InternalError(f"engine buffer of {flat.numel()} values for layer {self.name!r} "
                                    f"of {self.num_values}")
            if len(self._cache) >= _MAX_CACHED_BUFFERS:
                del self._cache[next(iter(self._cache))]
            cached = self._cache[key] = (flat, self.views(flat))
        return cached

    def bind(self, views: Sequence[torch.Tensor]) -> None:
        """Points every parameter at its view (no copy); ``views`` as made by
        :meth:`views` or :meth:`buffer_views`."""
        for param, view in zip(self._params, views):
            param.data = view

    def bind_flat(self, flat: torch.Tensor) -> None:
        """Points every parameter at its rows in ``flat`` (no copy)."""
        self.bind(self.views(flat))

    def versions(self) -> list[int]:
        """The parameters' version counters (bumped by every in-place write
        through a parameter; binding does not bump them)."""
        return [param._version for param in self._params]

    def changed_since(self, versions: list[int]) -> str | None:
        """The name of the first parameter written in place since
        :meth:`versions` gave ``versions``, or None."""
        for slot, param, version in zip(self.params, self._params, versions):
            if param._version != version:
                return slot.name
        return None

    def unbind(self) -> None:
        """Points every parameter at a NaN placeholder of its shape."""
        if not self._nan_views:
            nan = placeholder(self.device)
            # One in an order of its own points at a dense NaN buffer with
            # its strides: autograd then lays its gradient out the same way.
            largest = max((slot.numel for slot in self.params if slot.reordered), default=0)
            dense = dense_placeholder(self.device, largest) if largest else nan
            self._nan_views = [slot.view(dense, 0) if slot.reordered else nan.expand(slot.shape)
                               for slot in self.params]
        self.bind(self._nan_views)

    def clear_grads(self, set_to_none: bool = True) -> None:
        """Drops the parameters' gradients (or zeroes them in place, as
        torch's ``zero_grad(set_to_none=False)``, where they are real)."""
        for param in self._params:
            if set_to_none or param.grad is None or self.shipped:
                param.grad = None
            else:
                param.grad.zero_()
        self.shipped = False

    def mark_shipped(self, why: str, overflow: torch.Tensor | None = None) -> None:
        """The update left in the backward pass (``why``: the model's reason,
        for the error; ``overflow``: a mixed-precision scaler's flag): each
        ``.grad`` holds a :class:`~mltuner.torch._shipped.ShippedGradient`
        until :meth:`clear_grads` (step())."""
        first = self._shipped_grads[0] if self._shipped_grads else None
        if first is None or first.why != why or first.overflow is not overflow:
            self._shipped_grads = [ShippedGradient(slot.param, slot.name, why, overflow) for slot in self.params]
        for param, stand_in in zip(self._params, self._shipped_grads):
            param.grad = stand_in
        self.shipped = True

    def replaced_gradients(self) -> list[str]:
        """The parameters whose ``.grad`` the loop replaced since the update
        left (:meth:`mark_shipped`): a change the servers never see."""
        if not self.shipped:
            return []
        return [slot.name for param, stand_in, slot in zip(self._params, self._shipped_grads, self.params)
                if param.grad is not stand_in]

    def grads(self) -> list[torch.Tensor]:
        """The parameters' gradients, in slot order (all present: checked by
        the gradient hooks)."""
        return [param.grad for param in self._params]  # type: ignore[misc]

    def forget_buffers(self) -> None:
        """Drops the cached buffer views (and with them the engine memory
        they keep alive)."""
        self._cache.clear()


def check_module_types(model: nn.Module) -> None:
    """Refuses the module types the adapter cannot hook (compiled, scripted,
    data-parallel wrappers, sparse embeddings), and lazy modules that have
    not run yet (their parameters have no shape to lay out in a table)."""
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
        if module.__dict__.get("_compiled_call_impl") is not None:  # nn.Module.compile()
            raise UnsupportedModelError(
                f"{where} is compiled with .compile(): wrap the eager module (the adapter needs its forward hooks "
                "and autograd hooks); compile submodules after wrap() instead"
            )
        forward = module.__dict__.get("forward")  # an instance attribute: m.forward = torch.compile(m.forward)
        if forward is not None and hasattr(forward, "_torchdynamo_orig_callable"):
            raise UnsupportedModelError(
                f"the forward of {where} is compiled with torch.compile (m.forward = torch.compile(m.forward)): "
                "the adapter needs the eager forward's hooks; wrap the model without compiling its forward"
            )
        if isinstance(module, torch.jit.ScriptModule):
            raise UnsupportedModelError(f"{where} is a TorchScript module: wrap the eager module")
        if isinstance(module, parallel):
            raise UnsupportedModelError(
                f"{where} is {type(module).__name__}: the parameter server replaces it; wrap the plain module"
            )
        lazy = [name for name, tensor in (*module.named_parameters(recurse=False),
                                          *module.named_buffers(recurse=False)) if is_lazy(tensor)]
        if lazy:
            raise UnsupportedModelError(
                f"{where} ({type(module).__name__}) has uninitialized parameters or buffers ({', '.join(lazy)}): "
                "a lazy module makes them at its first forward pass; run one forward pass before wrap(), e.g. "
                "model(example_input), as PyTorch's docs say to do before making an optimizer"
            )
        if isinstance(module, (nn.Embedding, nn.EmbeddingBag)) and module.sparse:
            raise UnsupportedModelError(
                f"{where} ({type(module).__name__}) has sparse=True: sparse gradients are not supported; "
                "use sparse=False"
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


def _defines_forward(module: nn.Module) -> bool:
    """False for pure containers (``ModuleList``, ``ModuleDict``, ...),
    which are never called: their children run from their parent's forward."""
    return type(module).forward is not nn.Module.forward


_PARAMETER_CONTAINERS = (nn.ParameterList, nn.ParameterDict)


def _held_directly(module: nn.Module) -> list[tuple[str, nn.Parameter]]:
    """A module's own parameters and those of its parameter containers
    (``ParameterList``, ``ParameterDict``), by their names in the module:
    a container is never called, so only the module's forward can use them,
    and they are read with the module."""
    held = list(module.named_parameters(recurse=False))
    for child_name, child in module.named_children():
        if isinstance(child, _PARAMETER_CONTAINERS):
            held += [(f"{child_name}.{name}", param) for name, param in _held_directly(child)]
    return held


def _by_param_group(params: list[tuple[str, nn.Parameter]], group_of: Mapping[int, int]
                    ) -> list[tuple[int, list[tuple[str, nn.Parameter]]]]:
    """``params`` by param group (in the order each group first appears)."""
    parts: dict[int, list[tuple[str, nn.Parameter]]] = {}
    for name, param in params:
        parts.setdefault(group_of[id(param)], []).append((name, param))
    return list(parts.items())


def find_layers(model: nn.Module, row_width: int,
                whole_modules: Sequence[type[nn.Module]] = DEFAULT_WHOLE_MODULES,
                group_bytes: int = DEFAULT_GROUP_BYTES, split: Collection[str] = (),
                by_group: Collection[str] = (), group_of: Mapping[int, int] | None = None) -> list[Layer]:
    """The model's layers in ``named_modules`` order (the same on every
    worker that builds the same model). Only parameters with
    ``requires_grad`` go to the parameter server; frozen ones stay local.

    A proper submodule whose trainable parameters take at most
    ``group_bytes`` (and which defines a forward) is one layer with all of
    them, unless its name is in ``split``; instances of ``whole_modules``
    are one layer whatever their size. Any other module with trainable
    parameters of its own (those of its ParameterLists and ParameterDicts
    included) is a layer of those. A layer named in ``by_group`` becomes
    one layer per param group of its parameters (``group_of``: a
    parameter's id -> its group), all read in the forward of the one module:
    a table has one update rule.

    Raises:
        UnsupportedModelError: see :func:`mltuner.torch.wrap`.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"expected a torch.nn.Module, got {type(model).__name__}")
    check_module_types(model)
    whole = tuple(whole_modules)
    layers: list[Layer] = []
    devices: set[torch.device] = set()
    seen: set[int] = set()
    owner: dict[int, int] = {}  # id of a trainable parameter -> the layer that holds it
    callers: list[tuple[int, str, nn.Module]] = []  # (layer, module name, module) of tied weights

    def qualify(module_name: str, name: str) -> str:
        return f"{module_name}.{name}" if module_name and name else module_name or name

    def add_layer(module_name: str, module: nn.Module, recurse: bool) -> None:
        held = module.named_parameters(recurse=True) if recurse else _held_directly(module)
        every = [(n, p) for n, p in held if p.requires_grad]
        trainable = [(n, p) for n, p in every if id(p) not in owner]
        if len(trainable) < len(every):  # tied to an earlier layer: the modules holding those read it too
            for name, holder in module.named_modules(prefix=module_name) if recurse else [(module_name, module)]:
                for layer in sorted({owner[id(p)] for p in holder.parameters(recurse=False) if id(p) in owner}):
                    callers.append((layer, name, holder))
        if not trainable:
            return
        name = module_name or "<root>"
        parts = _by_param_group(trainable, group_of) if name in by_group and group_of is not None else [(-1, trainable)]
        for group, params in parts:
            layout = TensorLayout(row_width)
            for local_name, param in params:
                _check_param(qualify(module_name, local_name), param)
                layout.add(local_name, tuple(param.shape))
                devices.add(param.device)
            slots = [ParamSlot(qualify(module_name, n), p, layout.slot(n).first_row * row_width, p.shape,
                               memory_strides(p)) for n, p in params]
            owned = {id(p) for _, p in params}
            owner.update((id(p), len(layers)) for _, p in params)
            members = [(module_name, module)]
            if recurse:  # the submodules that own some of the layer's parameters
                members = [(qualify(module_name, n), m) for n, m in module.named_modules()
                           if any(id(p) in owned for p in m.parameters(recurse=False))]
            layers.append(Layer(len(layers), name if group < 0 else f"{name} (param group {group})", module, slots,
                                layout, params[0][1].device, members))

    def visit(module_name: str, module: nn.Module, is_root: bool) -> None:
        if id(module) in seen:
            return
        seen.add(id(module))
        if isinstance(module, whole):
            seen.update(id(m) for m in module.modules())
            add_layer(module_name, module, recurse=True)
            return
        if not is_root and group_bytes > 0 and module_name not in split and _defines_forward(module):
            size = sum(p.numel() * p.element_size() for p in module.parameters() if p.requires_grad)
            if size <= group_bytes:
                seen.update(id(m) for m in module.modules())
                add_layer(module_name, module, recurse=True)
                return
        add_layer(module_name, module, recurse=False)
        for child_name, child in module.named_children():
            if isinstance(child, _PARAMETER_CONTAINERS):  # read with this module (_held_directly)
                seen.update(id(m) for m in child.modules())
                continue
            visit(f"{module_name}.{child_name}" if module_name else child_name, child, is_root=False)

    visit("", model, is_root=True)
    for layer, name, holder in callers:
        layers[layer].callers.append((name, holder))
    if not layers:
        raise UnsupportedModelError("the model has no trainable parameters (requires_grad=True) to train")
    if len(devices) > 1:
        raise UnsupportedModelError(
            f"the model's parameters are on several devices ({', '.join(sorted(map(str, devices)))}): "
            "a worker drives one device; move the whole model to it"
        )
    return layers
