"""The CUDA backend skips a cross-stream wait that an earlier wait of the
same stream covers (device/wait_ledger.h), and training still reads what it
must: two workers on one GPU (two devices, whose tickets cross between
them) train a model of layers, read in order and updated in reverse as a
backward pass does, and every value read and the final values equal the CPU
backend's bit for bit, while the CUDA run reports skipped waits."""

from __future__ import annotations

import numpy as np
import pytest

import mltuner as mlt

pytestmark = pytest.mark.gpu

if mlt.cuda_device_count() == 0:
    pytest.skip(f"needs the CUDA backend and a visible GPU (built with CUDA: {mlt.cuda_built()})",
                allow_module_level=True)
torch = pytest.importorskip("torch")

TABLES, ROWS, WIDTH, CLOCKS = 8, 64, 32, 12


def _train(device: str) -> tuple[list[np.ndarray], list[np.ndarray], dict[str, float]]:
    config = mlt.Config(device=device, wait_timeout_s=60, update_rule=mlt.UpdateRule("sgd", learning_rate=0.05))
    with mlt.LocalCluster(2, config) as cluster:

        def run(worker: mlt.Worker) -> tuple[list[np.ndarray], list[np.ndarray], dict[str, float]]:
            tables = [worker.create_table(f"layer-{k}", ROWS, WIDTH) for k in range(TABLES)]
            reads = [worker.virtual_read(t, slack=0) for t in tables]
            updates = []
            for t in reversed(tables):
                updates.append(worker.virtual_pre_update(t))
                worker.virtual_update(updates[-1])
            for h in reads:
                worker.virtual_post_read(h)
            worker.virtual_clock()
            worker.finish_virtual_iteration()
            if worker.rank == 0:
                for k, (h, t) in enumerate(zip(updates, reversed(tables))):
                    init = np.random.default_rng(k).normal(size=(ROWS, WIDTH)).astype(np.float32)
                    torch.from_dlpack(worker.pre_update(h)).copy_(torch.from_numpy(init).to(device))
                    worker.update(h)
            worker.start_iterations()
            seen = []
            for clock in range(CLOCKS):
                weights = [torch.from_dlpack(worker.read(h)) for h in reads]
                for i, h in enumerate(updates):  # the last layer first, from what was read
                    source = weights[TABLES - 1 - i]
                    # Rounded alike on both backends (no transcendental functions).
                    torch.from_dlpack(worker.pre_update(h)).copy_((source * 0.5 + (0.1 * clock + worker.rank)) * 0.01)
                    worker.update(h)
                seen.append(weights[0].cpu().numpy().copy())
                for h in reads:
                    worker.post_read(h)
                worker.clock()
            worker.sync()
            return seen, [worker.fetch(t) for t in tables], worker.stats

        results = cluster.run(run)
    return results[0][0] + results[1][0], results[0][1], results[0][2]


def test_covered_waits_are_skipped_and_training_matches_the_cpu_backend() -> None:
    seen_cpu, final_cpu, stats_cpu = _train("cpu")
    seen_gpu, final_gpu, stats_gpu = _train("cuda")
    for got, want in zip(seen_gpu + final_gpu, seen_cpu + final_cpu):
        np.testing.assert_array_equal(got, want)
    assert stats_cpu["stream_waits_queued"] == 0 and stats_cpu["stream_waits_skipped"] == 0
    assert stats_gpu["stream_waits_queued"] > 0
    assert stats_gpu["stream_waits_skipped"] > 0
