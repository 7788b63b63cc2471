"""What a forward call's tensors are: their shapes and memory layouts,
which every clock with stored activations must keep
(``ClockChecks._check_inputs``), and the tensors nested in a call's
arguments or a model's output."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from typing import Any

import torch

from mltuner.torch._recording import Slot

__all__ = ["input_layouts", "input_shapes", "same_layouts", "tensors_in"]


def input_shapes(args: tuple[Any, ...], kwargs: dict[str, Any]) -> list[tuple[int, ...]]:
    """The shapes of a forward call's tensors: the positional arguments',
    then the keyword arguments' by name."""
    return [tuple(t.shape) for t in tensors_in((args, [kwargs[name] for name in sorted(kwargs)]))]


def input_layouts(args: tuple[Any, ...], kwargs: dict[str, Any]) -> list[tuple[bool, tuple[int, ...]]]:
    """The memory layouts of a forward call's tensors (as input_shapes
    orders them): whether each covers its memory exactly once, and its
    dimensions of more than one element from the densest stride up
    (same_layouts compares them)."""
    layouts = []
    for tensor in tensors_in((args, [kwargs[name] for name in sorted(kwargs)])):
        slot = Slot(tuple(tensor.shape), tensor.dtype, tuple(tensor.stride()))
        order = tuple(sorted((d for d, size in enumerate(tensor.shape) if size != 1), key=lambda d: tensor.stride(d)))
        layouts.append((slot.exact_layout, order))
    return layouts


def same_layouts(now: list[tuple[bool, tuple[int, ...]]], recorded: list[tuple[bool, tuple[int, ...]]]) -> int:
    """The first input whose layout differs from the recorded one (-1: none
    does): the same coverage, and its dimensions in the recorded order (a
    dimension of one element, as a batch of 1, has no place in it)."""
    for number, ((exact, order), (then_exact, then_order)) in enumerate(zip(now, recorded)):
        if exact != then_exact or order != tuple(d for d in then_order if d in order):
            return number
    return -1


def tensors_in(value: Any) -> Iterator[torch.Tensor]:
    """The tensors in a (nested) tuple, list, dict or dataclass instance (a
    model's output type)."""
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, (list, tuple)):
        for item in value:
            yield from tensors_in(item)
    elif isinstance(value, dict):
        for item in value.values():
            yield from tensors_in(item)
    elif dataclasses.is_dataclass(value) and not isinstance(value, type):
        for field in dataclasses.fields(value):
            yield from tensors_in(getattr(value, field.name))
