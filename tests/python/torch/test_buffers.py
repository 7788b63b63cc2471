"""Engine buffers become torch tensors over the same memory, or an error:
never a silent copy."""

from __future__ import annotations

import gc
from typing import Any

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from torch import nn  # noqa: E402

import mltuner  # noqa: E402
import mltuner.torch as mt  # noqa: E402
from mltuner.client._worker import OP_KINDS  # noqa: E402
from mltuner import Config, LocalCluster  # noqa: E402
from mltuner.torch._buffers import app_stream, as_tensor  # noqa: E402

CPU = torch.device("cpu")


OP_NAMES = {number: name for name, number in OP_KINDS.items()}


def test_numpy_buffers_are_shared_not_copied() -> None:
    buffer = np.arange(12, dtype=np.float32).reshape(3, 4)
    tensor = as_tensor(buffer, CPU)
    assert tensor.data_ptr() == buffer.ctypes.data and tensor.shape == (3, 4)
    tensor[0, 0] = 42.0
    assert buffer[0, 0] == 42.0


def test_read_only_buffers_are_shared_without_a_warning() -> None:
    """Read buffers come read-only from the engine; torch.from_numpy would
    warn (an error under this suite's filterwarnings)."""
    buffer = np.ones((2, 4), dtype=np.float32)
    buffer.flags.writeable = False
    tensor = as_tensor(buffer, CPU)
    assert tensor.data_ptr() == buffer.ctypes.data
    address = buffer.ctypes.data
    del buffer
    gc.collect()
    assert tensor.data_ptr() == address and float(tensor.sum()) == 8.0  # the tensor keeps it alive


@pytest.mark.parametrize(
    ("buffer", "message"),
    [
        ([[1.0, 2.0]], "buffer of type list"),
        (np.zeros((2, 2), dtype=np.float64), "dtype float64"),
    ],
)
def test_unknown_buffers_are_an_error(buffer: Any, message: str) -> None:
    with pytest.raises(mltuner.InternalError, match=message):
        as_tensor(buffer, CPU)


def test_a_model_on_another_device_than_the_engine_is_an_error() -> None:
    buffer = np.zeros((2, 2), dtype=np.float32)
    with pytest.raises(mltuner.InvalidArgumentError, match=r"on cpu but the model's parameters are on cuda:0.*"
                                                          r"Config\(device='cuda'\)"):
        as_tensor(buffer, torch.device("cuda", 0))


def test_cpu_posts_use_stream_zero() -> None:
    assert app_stream(CPU) == 0


def test_parameters_point_into_the_engines_read_buffer() -> None:
    """End to end: during a layer's forward its weight lives in the very
    buffer Worker.read returned."""
    model = nn.Sequential(nn.Linear(4, 3))
    with LocalCluster(1, Config(wait_timeout_s=20)) as cluster:
        worker = cluster.worker(0)
        ps_model = mt.wrap(model, worker, example_input=torch.randn(2, 4))
        reads: list[int] = []
        real_run = worker._run_ops

        def spy_run(ops: Any, stream: int) -> Any:  # the light clock opens its reads in one batch
            buffers = real_run(ops, stream)
            opens = [OP_NAMES[op[0]] for op in ops if OP_NAMES[op[0]] in ("read", "pre_update", "local_access")]
            reads.extend(int(b.ctypes.data) for kind, b in zip(opens, buffers) if kind == "read")
            return buffers

        worker._run_ops = spy_run  # type: ignore[method-assign]
        seen: list[int] = []
        # Pre-hooks run in registration order: this one after the adapter's read.
        model[0].register_forward_pre_hook(lambda m, a: seen.append(m.weight.untyped_storage().data_ptr()))
        ps_model(torch.randn(2, 4)).sum().backward()
        ps_model.step()
        assert len(reads) == 1 and seen == reads  # no copy between the engine and the module
