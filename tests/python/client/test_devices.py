"""Choosing the device backend: clear errors where a backend is unusable."""

from __future__ import annotations

import pytest

import mltuner as mlt


def test_unknown_device_is_refused_by_the_config() -> None:
    with pytest.raises(ValueError, match="Config.device must be one of 'cpu', 'cuda', got 'tpu'"):
        mlt.Config(device="tpu")  # type: ignore[arg-type]


@pytest.mark.skipif(mlt.cuda_device_count() > 0, reason="a GPU is visible here")
def test_cuda_without_a_usable_gpu_is_a_clear_error() -> None:
    expected = "no CUDA device is visible" if mlt.cuda_built() else "built without the CUDA backend"
    with pytest.raises(mlt.InvalidArgumentError, match=expected):
        mlt.LocalCluster(1, mlt.Config(device="cuda"))


def test_cpu_buffers_are_numpy_views() -> None:
    with mlt.LocalCluster(1) as cluster:
        worker = cluster.worker(0)
        table = worker.create_table("t", 3, 4)
        h = worker.virtual_pre_update(table)
        worker.virtual_update(h)
        worker.virtual_clock()
        worker.finish_virtual_iteration()
        buffer = worker.pre_update(h)
        assert not isinstance(buffer, mlt.DeviceArray)
        assert buffer.shape == (3, 4) and buffer.flags.writeable
