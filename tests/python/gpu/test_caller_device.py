"""Calls into mltuner leave the calling thread's current CUDA device as they
found it. The CUDA backend makes its GPU current on whichever thread calls
it; left so, a LocalCluster made on the main thread moved the script's later
``.cuda()`` tensors to the last worker's GPU, and a worker thread's
``torch.cuda.current_stream()`` flipped between GPUs. Needs two GPUs (one
GPU cannot tell)."""

from __future__ import annotations

import gc
from collections.abc import Callable, Iterator

import pytest

import mltuner as mlt

pytestmark = pytest.mark.gpu

if mlt.cuda_device_count() < 2:
    pytest.skip(f"needs the CUDA backend and two visible GPUs (built with CUDA: {mlt.cuda_built()}, "
                f"devices: {mlt.cuda_device_count()})", allow_module_level=True)
torch = pytest.importorskip("torch")


@pytest.fixture
def restore_current_device() -> Iterator[None]:
    """The main thread's current GPU as it was: later tests' ``.cuda()``
    must not land on the GPU this test chose."""
    saved = torch.cuda.current_device()
    yield
    torch.cuda.set_device(saved)


@pytest.mark.parametrize("main_device", [0, 1])
def test_the_callers_device_stays_current(main_device: int, record_read_update: Callable[..., tuple[int, int]],
                                          restore_current_device: None) -> None:
    torch.cuda.set_device(main_device)
    seen: dict[int, list[int]] = {}

    def train(worker: mlt.Worker) -> None:
        read, update = record_read_update(worker, worker.create_table("t", 8, 4))
        before = torch.cuda.current_device()  # a new thread's: 0
        for _ in range(2):
            rows = torch.from_dlpack(worker.read(read))
            worker.post_read(read)
            torch.from_dlpack(worker.pre_update(update)).copy_(rows + 1)
            worker.update(update)
            worker.clock()
        seen[worker.rank] = [before, torch.cuda.current_device()]

    with mlt.LocalCluster(2, mlt.Config(device="cuda", wait_timeout_s=20)) as cluster:
        assert torch.cuda.current_device() == main_device
        assert [w.device for w in cluster.workers] == ["cuda:0", "cuda:1"]
        cluster.run(train, timeout_s=60)
    assert torch.cuda.current_device() == main_device
    del cluster
    gc.collect()
    assert torch.cuda.current_device() == main_device  # the devices are gone: their destructors too
    assert seen == {0: [0, 0], 1: [0, 0]}
    assert torch.zeros(1, device="cuda").device.index == main_device
