"""The PyTorch adapter across real processes on 127.0.0.1: a CPU worker
ships its updates at step() unless told otherwise, and under BSP the
servers' parameters are bit for bit those of the same training on an
in-process LocalCluster, whichever way the updates left (at step(), or layer
by layer from the backward pass) and however the transport batched them.
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

import mltuner  # noqa: E402
import torch_worker  # type: ignore[import-not-found]  # noqa: E402

CLOCKS = 12
WORKERS = 2


def in_process() -> list[dict[str, object]]:
    with mltuner.LocalCluster(WORKERS, torch_worker.config()) as cluster:
        return cluster.run(lambda worker: torch_worker.train(worker, worker.rank, WORKERS, CLOCKS))


@pytest.mark.parametrize("overlap", ["auto", "true"], ids=["default", "from-backward"])
def test_bsp_processes_equal_the_in_process_cluster_bit_for_bit(start_workers, overlap: str) -> None:  # type: ignore[no-untyped-def]
    workers = start_workers(WORKERS, "--clocks", str(CLOCKS), "--overlap", overlap, program=torch_worker.__file__)
    for rank, (code, output) in enumerate(workers.wait(timeout_s=120)):
        assert code == 0, f"rank {rank} failed:\n{output}"
    want = in_process()
    assert not bool(want[0]["overlap_updates"])  # one process: shipped at step()
    names = [name for name in want[0] if name not in ("overlap_updates", "plan")]
    assert names, "the CNN has parameters"
    for rank in range(WORKERS):
        got = workers.result(rank)
        for name in names:
            assert torch.equal(torch.from_numpy(got[name]), torch.from_numpy(want[0][name])), f"rank {rank}: {name}"
        if overlap == "auto":  # the rule: a CPU worker with a shard in another process ships at step()
            assert not bool(got["overlap_updates"])
            assert "a CPU worker" in str(got["plan"])
        else:
            assert bool(got["overlap_updates"])
            assert "given to wrap()" in str(got["plan"])
