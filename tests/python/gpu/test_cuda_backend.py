"""The CUDA backend against the CPU backend: same training, same numbers.

These tests run where mltuner was built with nvcc and a GPU is visible (the
lent device); elsewhere they are skipped with the reason. Buffers reach the
GPU code through DLPack (torch), with no copy.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import pytest

import mltuner as mlt

pytestmark = pytest.mark.gpu

if mlt.cuda_device_count() == 0:
    pytest.skip(
        f"needs the CUDA backend and a visible GPU (built with CUDA: {mlt.cuda_built()}, "
        f"devices: {mlt.cuda_device_count()})",
        allow_module_level=True,
    )
torch = pytest.importorskip("torch")

ROWS, WIDTH, CLOCKS = 37, 24, 12


def _gradient(weights: np.ndarray, rank: int, clock: int) -> np.ndarray:
    """A deterministic 'gradient' that depends on what was read."""
    rng = np.random.default_rng(100 * rank + clock)
    return (0.5 * weights + rng.normal(size=weights.shape)).astype(np.float32)


RULES = {
    "sgd": mlt.UpdateRule("sgd", learning_rate=0.05),
    "momentum": mlt.UpdateRule("damped_momentum", learning_rate=0.05, momentum=0.9),
    "adam": mlt.UpdateRule("adam", learning_rate=0.01),
    # torch's SGD and AdamW with every option the kernel branches on
    "sgd_nesterov": mlt.UpdateRule("sgd", learning_rate=0.05, momentum=0.9, nesterov=True, weight_decay=1e-3),
    "sgd_dampening": mlt.UpdateRule("sgd", learning_rate=0.05, momentum=0.9, dampening=0.1, weight_decay=1e-2),
    "adamw_amsgrad": mlt.UpdateRule("adamw", learning_rate=0.01, weight_decay=0.1, amsgrad=True),
}


def _train(device: str, num_workers: int, budget: int, stream_kind: str = "default",
           rule: str = "momentum", debug_buffers: bool = False, part_bytes: int = 0) -> list[np.ndarray]:
    config = mlt.Config(
        device=device,
        device_memory_budget=budget,
        wait_timeout_s=30,
        update_rule=RULES[rule],
        debug_buffers=debug_buffers,
        clock_part_bytes=part_bytes,
    )
    tables: dict[int, mlt.Table] = {}
    reads: dict[int, list[np.ndarray]] = {}

    def body(worker: mlt.Worker) -> None:
        layers = [worker.create_table(f"layer{i}", ROWS, WIDTH) for i in range(3)]
        tables[worker.rank] = layers[0]
        reads_h = [worker.virtual_read(t, slack=0) for t in layers]
        grads_h = []
        for t in reversed(layers):  # backward: top layer first, each shipped at once
            grads_h.append(worker.virtual_pre_update(t))
            worker.virtual_update(grads_h[-1])
        for h in reads_h:
            worker.virtual_post_read(h)
        worker.virtual_clock()
        worker.finish_virtual_iteration()
        if worker.rank == 0:
            for i, h in enumerate(grads_h):
                init = np.random.default_rng(7 + i).normal(size=(ROWS, WIDTH)).astype(np.float32)
                _write(worker.pre_update(h), init, device, "default")
                worker.update(h)
        worker.start_iterations()
        seen = []
        for clock in range(CLOCKS):
            weights = [_to_numpy(worker.read(h), device) for h in reads_h]
            seen.append(weights[0])
            for i, h in enumerate(grads_h):
                buffer = worker.pre_update(h)
                stream = _write(buffer, _gradient(weights[len(layers) - 1 - i], worker.rank, clock), device, stream_kind)
                worker.update(h, stream=stream)
            for h in reads_h:
                worker.post_read(h)
            worker.clock()
        worker.sync()
        reads[worker.rank] = seen

    with mlt.LocalCluster(num_workers, config) as cluster:
        cluster.run(body, timeout_s=120)
        final = cluster.worker(0).fetch(tables[0])
    return [final] + reads[0]


def _to_numpy(buffer: object, device: str) -> np.ndarray:
    if device == "cpu":
        return np.array(buffer)
    tensor = torch.from_dlpack(buffer)
    assert tensor.is_cuda and tensor.data_ptr() == buffer.data_ptr  # zero copy
    return tensor.cpu().numpy()


def _write(buffer: object, values: np.ndarray, device: str, stream_kind: str) -> int:
    """Writes values into an update buffer; returns the stream used."""
    if device == "cpu":
        buffer[...] = values
        return 0
    target = torch.from_dlpack(buffer)
    if stream_kind == "default":
        target.copy_(torch.from_numpy(values))
        return 0
    # A side stream with a long kernel queued first: the engine must wait for it.
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        big = torch.randn(4096, 4096, device="cuda")
        for _ in range(4):
            big = big @ big / 64.0
        target.copy_(torch.from_numpy(values).cuda(non_blocking=False) + 0.0 * big[0, 0])
    return int(side.cuda_stream)


@pytest.mark.parametrize("rule", sorted(RULES))
@pytest.mark.parametrize("num_workers", [1, 2, 4])
def test_cuda_training_equals_cpu_training(num_workers: int, rule: str) -> None:
    """BSP on N workers: the shards apply the rule on the GPU on CUDA and on
    the CPU otherwise; every value read and the final values agree bit for bit."""
    cpu = _train("cpu", num_workers, budget=0, rule=rule)
    gpu = _train("cuda", num_workers, budget=0, rule=rule)
    for want, got in zip(cpu, gpu):
        np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("rule", ["adam", "sgd_nesterov"])
@pytest.mark.parametrize("num_workers", [1, 2])
def test_cuda_training_in_parts_equals_cpu_training_whole(num_workers: int, rule: str) -> None:
    """Each shard's rows in parts of 5 rows (Config.clock_part_bytes): on the
    GPU each part is packed, applied and installed on its own, with the
    rule's state read at an offset; the same bits as whole on the CPU."""
    cpu = _train("cpu", num_workers, budget=0, rule=rule)
    gpu = _train("cuda", num_workers, budget=0, rule=rule, part_bytes=5 * WIDTH * 4)
    for want, got in zip(cpu, gpu):
        np.testing.assert_array_equal(got, want)


def test_cuda_under_a_small_budget_in_parts_equals_unlimited() -> None:
    """Host-resident rows (update log, cache) moved part by part."""
    row_bytes = WIDTH * 4
    peak = 3 * ((ROWS * row_bytes + 255) // 256 * 256) + ((ROWS * row_bytes + 255) // 256 * 256)
    budget = 2 * peak + 2 * ROWS * row_bytes
    np.testing.assert_array_equal(_train("cuda", 2, budget=budget, part_bytes=5 * row_bytes)[0],
                                  _train("cuda", 2, budget=0)[0])


def test_cuda_under_a_small_budget_equals_unlimited() -> None:
    row_bytes = WIDTH * 4
    peak = 3 * ((ROWS * row_bytes + 255) // 256 * 256) + ((ROWS * row_bytes + 255) // 256 * 256)
    budget = 2 * peak + 2 * ROWS * row_bytes  # the pool and about one layer
    np.testing.assert_array_equal(_train("cuda", 2, budget=budget)[0], _train("cuda", 2, budget=0)[0])


def test_update_waits_for_work_on_the_application_stream() -> None:
    np.testing.assert_array_equal(_train("cuda", 1, budget=0, stream_kind="side")[0], _train("cpu", 1, budget=0)[0])


def test_device_array_is_dlpack_and_copyable() -> None:
    config = mlt.Config(device="cuda", wait_timeout_s=30)
    with mlt.LocalCluster(1, config) as cluster:
        worker = cluster.worker(0)
        assert worker.device == "cuda:0"
        table = worker.create_table("t", 5, 8)
        h = worker.virtual_pre_update(table)
        worker.virtual_update(h)
        worker.virtual_clock()
        worker.finish_virtual_iteration()
        buffer = worker.pre_update(h)
        assert isinstance(buffer, mlt.DeviceArray)
        assert buffer.shape == (5, 8) and buffer.dtype == "float32" and buffer.writable
        assert buffer.__dlpack_device__()[0] == 2  # kDLCUDA
        values = np.arange(40, dtype=np.float32).reshape(5, 8) + 1
        torch.from_dlpack(buffer).copy_(torch.from_numpy(values))
        np.testing.assert_array_equal(buffer.numpy(), values)
        worker.update(h)
        np.testing.assert_array_equal(worker.fetch(table), values)


def test_cuda_debug_buffers_poison_without_changing_training(
        record_read_update: Callable[[mlt.Worker, mlt.Table], tuple[int, int]]) -> None:
    """Config(debug_buffers=True) on the GPU: the same numbers as without, and
    a tensor read on the application's stream after its post sees NaN."""
    np.testing.assert_array_equal(_train("cuda", 2, budget=0, debug_buffers=True)[0],
                                  _train("cpu", 2, budget=0)[0])
    config = mlt.Config(device="cuda", wait_timeout_s=30, debug_buffers=True)
    with mlt.LocalCluster(1, config) as cluster:
        worker = cluster.worker(0)
        read, update = record_read_update(worker, worker.create_table("t", 5, 8))
        params = torch.from_dlpack(worker.read(read))
        assert torch.isfinite(params).all()
        worker.post_read(read)
        assert torch.isnan(params).all()  # queued on the default stream after the engine's fill
        gradient = torch.from_dlpack(worker.pre_update(update))
        gradient.fill_(1.0)
        worker.update(update)
        worker.clock()
        worker.flush()
        torch.cuda.synchronize()
        assert torch.isnan(gradient).all()


def test_cuda_check_finite_refuses_a_nan_gradient() -> None:
    """The shards' count runs on the GPU (a device payload from a worker of
    the same process): both workers fail naming the table and the sender."""
    config = mlt.Config(device="cuda", wait_timeout_s=20, check_finite=True,
                        update_rule=mlt.UpdateRule("sgd", learning_rate=0.1))
    errors: dict[int, BaseException] = {}

    def body(worker: mlt.Worker) -> None:
        table = worker.create_table("weights", 8, 4)
        update = worker.virtual_pre_update(table)
        worker.virtual_update(update)
        read = worker.virtual_read(table)
        worker.virtual_post_read(read)
        worker.virtual_clock()
        worker.finish_virtual_iteration()
        worker.start_iterations()
        try:
            for clock in range(4):
                gradient = torch.from_dlpack(worker.pre_update(update))
                gradient.fill_(0.5)
                if worker.rank == 1 and clock == 1:
                    gradient[2, 3] = float("nan")
                worker.update(update)
                worker.read(read)
                worker.post_read(read)
                worker.clock()
            worker.sync()
        except mlt.MltunerError as error:
            errors[worker.rank] = error

    with mlt.LocalCluster(2, config) as cluster:
        cluster.run(body, timeout_s=60)
    assert sorted(errors) == [0, 1]
    for error in errors.values():
        assert isinstance(error, mlt.NonFiniteError), repr(error)
        assert "table 'weights' (id 0) on branch 0, clock 1: worker 1's update holds 1 of" in str(error)
