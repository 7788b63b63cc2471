"""Engine access buffers as torch tensors, without a copy.

On the CPU backend the engine hands out numpy arrays over its own memory;
on CUDA, :class:`mltuner.DeviceArray` objects that speak DLPack. Both become
torch tensors over the same memory here. Any other buffer type, or a buffer
on another device than the model, is an error: a silent copy would make the
"zero-copy" promise (and the engine's memory budget) a lie.
"""

from __future__ import annotations

import threading
from typing import Any

import numpy as np
import torch
import torch.utils.dlpack

from mltuner._core import DeviceArray
from mltuner.exceptions import InternalError, InvalidArgumentError

__all__ = ["as_tensor", "autocast_state", "buffer_key", "app_stream", "placeholder", "storage_ptr"]


class _WritableAlias:
    """Presents a read-only numpy array as writable through
    ``__array_interface__``, and keeps the original (which keeps the engine
    memory alive) referenced.

    Why: ``torch.from_numpy`` warns on read-only arrays, and torch has no
    read-only tensors anyway. Read buffers are the engine's private copy of
    the rows (gathered from the cache), so a stray write can only spoil the
    reader's own view, never the cache.
    """

    def __init__(self, array: np.ndarray) -> None:
        self.array = array
        interface = dict(array.__array_interface__)
        interface["data"] = (interface["data"][0], False)
        self.__array_interface__ = interface


def check_same_device(engine: torch.device, model: torch.device) -> None:
    """Refuses a model whose parameters are on another device than the
    engine's buffers.

    Raises:
        InvalidArgumentError: the two differ; the message says how to match them.
    """
    if engine == model:
        return
    hint = ""
    if model.type == "cuda" and engine.type == "cpu":
        hint = ": use mltuner.Config(device='cuda')"
    elif model.type == "cpu" and engine.type == "cuda":
        hint = ": move the model to the worker's GPU before wrap(), or use Config(device='cpu')"
    elif model.type == "cuda":
        hint = f": move the model to {engine} before wrap() (worker r uses GPU r mod count)"
    raise InvalidArgumentError(f"the engine's buffers are on {engine} but the model's parameters are on {model}{hint}")


def as_tensor(buffer: Any, device: torch.device) -> torch.Tensor:
    """The torch tensor over an engine buffer's memory, shaped (rows, width).

    Raises:
        InvalidArgumentError: the buffer lives on another device than the
            model (e.g. a CUDA model with a CPU engine).
        InternalError: an unknown buffer type, or the conversion copied.
    """
    if isinstance(buffer, np.ndarray):
        if buffer.dtype != np.float32:
            raise InternalError(f"engine buffer has dtype {buffer.dtype}, expected float32")
        array = buffer if buffer.flags.writeable else np.asarray(_WritableAlias(buffer))
        tensor = torch.from_numpy(array)
        address = int(buffer.ctypes.data)
    elif isinstance(buffer, DeviceArray):
        try:  # copy=False: torch must refuse rather than copy
            tensor = torch.utils.dlpack.from_dlpack(buffer, copy=False)
        except TypeError:  # torch before 2.8 has no copy argument; the address check below still holds
            tensor = torch.utils.dlpack.from_dlpack(buffer)
        address = int(buffer.data_ptr)
    else:
        raise InternalError(
            f"the engine returned a buffer of type {type(buffer).__name__}; the torch adapter knows numpy "
            "arrays (CPU backend) and mltuner.DeviceArray (CUDA backend)"
        )
    check_same_device(tensor.device, device)
    if tensor.data_ptr() != address or tensor.dtype != torch.float32:
        raise InternalError("converting an engine buffer to a torch tensor copied it")
    return tensor


def buffer_key(buffer: Any) -> tuple[int, tuple[int, ...]]:
    """What identifies an engine buffer's memory: its address and shape.

    The engine hands out buffers from a fixed pool, so the same key recurs
    clock after clock; a tensor made by :func:`as_tensor` for one buffer
    serves every later buffer with the same key. That is safe because the
    tensor keeps the engine memory it was made for alive (the buffer's
    keepalive): while it exists, no other allocation can take its address,
    so a buffer with the same address is the same memory.
    """
    if isinstance(buffer, np.ndarray):
        return buffer.ctypes.data, buffer.shape
    if isinstance(buffer, DeviceArray):
        return int(buffer.data_ptr), tuple(buffer.shape)
    as_tensor(buffer, torch.device("cpu"))  # raises the error that names the type
    raise AssertionError("unreachable")


def app_stream(device: torch.device) -> int:
    """The stream handle to give the engine's post calls: torch's current
    CUDA stream on ``device`` (its kernels use the buffer), 0 on the CPU."""
    if device.type == "cuda":
        return int(torch.cuda.current_stream(device).cuda_stream)
    return 0


def storage_ptr(tensor: torch.Tensor) -> int | None:
    """The address of a dense tensor's storage; None for tensors without one
    (sparse, nested, wrapper subclasses), which are left to torch."""
    if tensor.layout != torch.strided:
        return None
    try:
        return int(tensor.untyped_storage().data_ptr())
    except (RuntimeError, NotImplementedError):
        return None


_PLACEHOLDERS: dict[torch.device, torch.Tensor] = {}
_DENSE_PLACEHOLDERS: dict[torch.device, torch.Tensor] = {}
_PLACEHOLDER_PTRS: set[int] = set()  # every placeholder's storage, ever made (views of old ones live on)
# Replaced dense placeholders, kept alive: their addresses stay in
# _PLACEHOLDER_PTRS, so a freed one's memory, handed to another tensor,
# would make that tensor look like a parameter between its accesses.
_RETIRED_PLACEHOLDERS: list[torch.Tensor] = []
_PLACEHOLDER_LOCK = threading.Lock()  # workers wrap on threads of their own


def placeholder(device: torch.device) -> torch.Tensor:
    """A one-element NaN tensor on ``device``; parameters point at an
    expanded view of it between their accesses, so a use outside the
    module's forward gives NaN (and, when autograd saves it, an error)
    rather than values from a buffer the engine has taken back."""
    with _PLACEHOLDER_LOCK:
        value = _PLACEHOLDERS.get(device)
        if value is None:
            value = _PLACEHOLDERS[device] = torch.full((), float("nan"), dtype=torch.float32, device=device)
            _PLACEHOLDER_PTRS.add(int(value.untyped_storage().data_ptr()))
        return value


def dense_placeholder(device: torch.device, numel: int) -> torch.Tensor:
    """A NaN tensor of at least ``numel`` elements on ``device``, shared: the
    placeholder of parameters kept in a memory order of their own, which
    must be dense (an expanded one has no order, and autograd would then lay
    their gradients out contiguously)."""
    with _PLACEHOLDER_LOCK:
        value = _DENSE_PLACEHOLDERS.get(device)
        if value is None or value.numel() < numel:
            if value is not None:  # at least doubled: the retired ones hold less than the live one
                _RETIRED_PLACEHOLDERS.append(value)
                numel = max(numel, 2 * value.numel())
            value = _DENSE_PLACEHOLDERS[device] = torch.full((numel,), float("nan"), dtype=torch.float32,
                                                             device=device)
            _PLACEHOLDER_PTRS.add(int(value.untyped_storage().data_ptr()))
        return value


def is_placeholder(address: int | None) -> bool:
    """Whether a storage address is a placeholder's (a parameter between
    its accesses)."""
    return address in _PLACEHOLDER_PTRS


def autocast_state(device: torch.device) -> tuple[bool, torch.dtype | None]:
    """Whether autocast is on for ``device``'s type on this thread, and its
    dtype when it is."""
    kind = device.type
    try:
        enabled = torch.is_autocast_enabled(kind)
        dtype = torch.get_autocast_dtype(kind) if enabled else None
    except (TypeError, AttributeError):  # torch before 2.4: one function per device type
        enabled = torch.is_autocast_cpu_enabled() if kind == "cpu" else torch.is_autocast_enabled()
        dtype = ((torch.get_autocast_cpu_dtype() if kind == "cpu" else torch.get_autocast_gpu_dtype())
                 if enabled else None)
    return enabled, dtype
