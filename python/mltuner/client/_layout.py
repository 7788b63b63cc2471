"""TensorLayout: named tensors of any shape mapped onto the rows of a table."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterator, Sequence

import numpy as np

from mltuner._validate import INT32_MAX, integer, text
from mltuner.exceptions import ArgumentTypeError, InvalidArgumentError

__all__ = ["TensorLayout", "TensorSlot"]

MAX_VALUES = 2**40  # what one table may hold


@dataclasses.dataclass(frozen=True)
class TensorSlot:
    """Where one tensor lives: rows ``[first_row, first_row + num_rows)``;
    its values fill the rows in C order and the last row may be partly used."""

    name: str
    shape: tuple[int, ...]
    first_row: int
    num_rows: int

    @property
    def size(self) -> int:
        return math.prod(self.shape)

    @property
    def rows(self) -> range:
        return range(self.first_row, self.first_row + self.num_rows)


class TensorLayout:
    """Packs named tensors into rows of ``row_width`` floats, each tensor
    starting on a fresh row, so users never count rows by hand.

    Example:
        >>> layout = TensorLayout(row_width=128)
        >>> layout.add("fc1.weight", (64, 32)).add("fc1.bias", (64,))
        TensorLayout(row_width=128, tensors=2, num_rows=17)
        >>> layout.rows("fc1.bias")
        range(16, 17)
    """

    def __init__(self, row_width: int) -> None:
        self.row_width = integer("TensorLayout: row_width", row_width, 1, INT32_MAX)
        self._slots: dict[str, TensorSlot] = {}
        self._num_rows = 0

    def add(self, name: str, shape: Sequence[int]) -> TensorLayout:
        """Appends a tensor; returns the layout so calls can be chained."""
        text("TensorLayout.add: name", name)
        if name in self._slots:
            raise InvalidArgumentError(f"tensor {name!r} is already in the layout")
        if isinstance(shape, (str, bytes)) or not isinstance(shape, Sequence):
            raise InvalidArgumentError(f"tensor {name!r}: shape must be a sequence of integers, got {shape!r}")
        dims = tuple(integer(f"tensor {name!r}: dimension {i}", d, 0, MAX_VALUES) for i, d in enumerate(shape))
        if math.prod(dims) > MAX_VALUES:
            raise InvalidArgumentError(f"tensor {name!r} of shape {dims} has more than 2**40 values")
        rows = max(1, -(-math.prod(dims) // self.row_width))  # exact: no float rounding
        self._slots[name] = TensorSlot(name, dims, self._num_rows, rows)
        self._num_rows += rows
        return self

    @property
    def num_rows(self) -> int:
        return self._num_rows

    def __len__(self) -> int:
        return len(self._slots)

    def __iter__(self) -> Iterator[TensorSlot]:
        return iter(self._slots.values())

    def __contains__(self, name: object) -> bool:
        return name in self._slots

    def __repr__(self) -> str:
        return f"TensorLayout(row_width={self.row_width}, tensors={len(self)}, num_rows={self.num_rows})"

    def slot(self, name: str) -> TensorSlot:
        try:
            return self._slots[name]
        except KeyError:
            known = ", ".join(self._slots) or "none"
            raise KeyError(f"no tensor {name!r} in the layout (tensors: {known})") from None

    def rows(self, *names: str) -> np.ndarray:
        """The row ids of the named tensors (all tensors when none is named),
        in layout order, for recording an access."""
        slots = [self.slot(n) for n in names] if names else list(self._slots.values())
        if not slots:
            raise InvalidArgumentError("the layout holds no tensors")
        return np.concatenate([np.arange(s.first_row, s.first_row + s.num_rows) for s in slots])

    def view(self, buffer: np.ndarray, name: str, *, names: Sequence[str] | None = None) -> np.ndarray:
        """A zero-copy view of tensor ``name`` inside an access buffer.

        ``buffer`` is what an access returned, shaped (rows, row_width). Its rows
        are those recorded: by default the whole table; pass ``names`` when the
        access was recorded with ``rows(*names)``.
        """
        slot = self.slot(name)
        offset = 0
        for other in ([self.slot(n) for n in names] if names else list(self._slots.values())):
            if other.name == name:
                break
            offset += other.num_rows
        else:
            raise KeyError(f"tensor {name!r} is not among the buffer's tensors {list(names or [])}")
        if buffer.ndim != 2 or buffer.shape[1] != self.row_width:
            raise InvalidArgumentError(f"buffer of shape {buffer.shape} does not hold rows of width {self.row_width}")
        if buffer.shape[0] < offset + slot.num_rows:
            raise InvalidArgumentError(
                f"buffer has {buffer.shape[0]} rows; tensor {name!r} needs rows {offset}..{offset + slot.num_rows - 1}"
            )
        flat = buffer[offset : offset + slot.num_rows].reshape(-1)
        return flat[: slot.size].reshape(slot.shape)

    def pack(self, tensors: dict[str, np.ndarray]) -> np.ndarray:
        """All tensors packed into a fresh (num_rows, row_width) float32 array;
        missing tensors are zero."""
        out = np.zeros((self.num_rows, self.row_width), dtype=np.float32)
        for name, value in tensors.items():
            target = self.view(out, name)
            value = np.asarray(value)
            if value.shape != target.shape:
                raise InvalidArgumentError(f"tensor {name!r} has shape {value.shape}, the layout says {target.shape}")
            if value.dtype.kind not in "biuf":  # complex would lose its imaginary part, objects anything
                raise ArgumentTypeError(f"tensor {name!r} is {value.dtype}: the tables hold real numbers (float32)")
            target[...] = value
        return out
