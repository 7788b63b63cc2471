"""The PyTorch adapter across real processes on 127.0.0.1: a CPU worker
ships its updates at step() unless told otherwise, and under BSP the
servers' parameters are bit for bit those of the same training on an
in-process LocalCluster, whichever way the updates left (at step(), or layer
by layer from the backward pass) and however the transport batched them.
"""

from __future__ import annotations

import numpy as np
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


def test_two_processes_resume_from_a_checkpoint_as_if_never_stopped(start_workers, tmp_path) -> None:  # type: ignore[no-untyped-def]
    """Two ranks save after clock 5 and train on to 12; two new ranks resume
    from the checkpoint and train clocks 5-11: the same parameters, bit for
    bit (the servers' momentum came back with them). One process then
    restores the same checkpoint (its rows re-split over one shard) and
    holds exactly the saved values."""
    root = tmp_path / "checkpoints"
    common = ("--clocks", str(CLOCKS), "--checkpoints", str(root))
    whole = start_workers(WORKERS, *common, "--save-at", "5", program=torch_worker.__file__)
    for rank, (code, output) in enumerate(whole.wait(timeout_s=120)):
        assert code == 0, f"rank {rank} failed:\n{output}"
    assert (root / "latest").read_text().strip() == "clock-00000005"
    resumed = start_workers(WORKERS, *common, "--resume", program=torch_worker.__file__)
    for rank, (code, output) in enumerate(resumed.wait(timeout_s=120)):
        assert code == 0, f"rank {rank} failed:\n{output}"
    want = whole.result(0)
    names = [name for name in want if name not in ("overlap_updates", "plan")]
    for rank in range(WORKERS):
        got = resumed.result(rank)
        for name in names:
            assert torch.equal(torch.from_numpy(got[name]), torch.from_numpy(want[name])), f"rank {rank}: {name}"

    import mltuner.torch as mt
    x, _ = torch_worker.batches(1, 1)
    with mltuner.Job(torch_worker.config()) as job:
        model = mt.wrap(torch_worker.initialized(torch_worker.mnist1d_cnn(torch_worker.LENGTH, torch_worker.CLASSES)),
                        job.worker, example_input=x[0, 0], resume_from=root)
        assert model.resumed is not None and model.resumed.clock == 5 and model.resumed.user_state == {"clock": 5}
        restored = model.state_dict()
    saved = root / "clock-00000005"
    first_layer = np.concatenate([np.load(saved / f"shard-{s}" / "table-0.values.npy").reshape(-1)
                                  for s in range(WORKERS)])
    weight = restored[names[0]].reshape(-1).numpy()
    assert np.array_equal(first_layer[:weight.size], weight)
