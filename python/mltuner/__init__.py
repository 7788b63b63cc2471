"""mltuner: a GPU-specialised parameter server (GeePS design) with in-training
hyperparameter tuning (MLtuner design), driven from Python training loops."""

from __future__ import annotations

try:
    from mltuner import _core
except ImportError as error:  # pragma: no cover - only without a build
    raise ImportError(
        "mltuner's compiled engine (mltuner._core) is missing: install the package with "
        "`pip install .` from the source tree rather than importing it from python/."
    ) from error

from mltuner._config import Config, UpdateRule
from mltuner.client import LocalCluster, Table, TensorLayout, TensorSlot, Worker
from mltuner.exceptions import (
    CorruptMessageError,
    InternalError,
    InvalidArgumentError,
    MltunerError,
    NotFoundError,
    OutOfOrderError,
    ResourceExhaustedError,
    ShutdownError,
    WaitTimeoutError,
)

__version__ = "0.1.0"

__all__ = [
    "Config",
    "UpdateRule",
    "LocalCluster",
    "Table",
    "TensorLayout",
    "TensorSlot",
    "Worker",
    "MltunerError",
    "InvalidArgumentError",
    "NotFoundError",
    "OutOfOrderError",
    "WaitTimeoutError",
    "ResourceExhaustedError",
    "ShutdownError",
    "CorruptMessageError",
    "InternalError",
    "__version__",
]
