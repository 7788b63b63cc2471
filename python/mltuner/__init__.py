"""mltuner: a GPU-specialised parameter server (GeePS design) with in-training
hyperparameter tuning (MLtuner design), driven from Python training loops."""

from __future__ import annotations

try:
    from mltuner import _core
except ImportError as error:  # pragma: no cover - only without a build
    raise ImportError(
        f"mltuner's compiled engine (mltuner._core) could not be imported: {error}. Was the package "
        "installed with `pip install .` (not imported from the source tree's python/ folder)?"
    ) from error

from mltuner._config import Config, UpdateRule
from mltuner._core import DeviceArray, cuda_built, cuda_device_count
from mltuner.client import LocalCluster, PlanPreview, Table, TensorLayout, TensorSlot, Worker
from mltuner.launch import Job, read_attachment
from mltuner.exceptions import (
    ArgumentTypeError,
    CorruptMessageError,
    InternalError,
    InterruptedWaitError,
    InvalidArgumentError,
    MltunerError,
    NotFoundError,
    OutOfOrderError,
    PeerLostError,
    NonFiniteError,
    ResourceExhaustedError,
    ShutdownError,
    WaitTimeoutError,
)

__version__ = "0.1.0"

__all__ = [
    "Config",
    "UpdateRule",
    "DeviceArray",
    "cuda_built",
    "cuda_device_count",
    "LocalCluster",
    "Table",
    "TensorLayout",
    "TensorSlot",
    "Worker",
    "PlanPreview",
    "Job",
    "read_attachment",
    "MltunerError",
    "InvalidArgumentError",
    "ArgumentTypeError",
    "NotFoundError",
    "OutOfOrderError",
    "WaitTimeoutError",
    "ResourceExhaustedError",
    "ShutdownError",
    "CorruptMessageError",
    "InternalError",
    "PeerLostError",
    "NonFiniteError",
    "InterruptedWaitError",
    "__version__",
]
