"""When updates leave (mltuner/torch/_shipping.py): wrap() ships them at
step() unless the worker is on a GPU with a shard in another process that
some payloads reach through host frames, says
so in ``model.overlap_updates`` and ``model.plan``, and takes an explicit
choice as given. The processes' side is in
tests/python/distributed/test_torch_processes.py.
"""

from __future__ import annotations

import types

import pytest

torch = pytest.importorskip("torch")

from torch import nn  # noqa: E402

import mltuner.torch as mt  # noqa: E402
from mltuner import ArgumentTypeError, Config, LocalCluster, UpdateRule, Worker  # noqa: E402
from mltuner.torch._shipping import choose_overlap  # noqa: E402


def wrapped(cluster: LocalCluster, **options: object) -> mt.PSModule:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    return mt.wrap(model, cluster.worker(0), example_input=torch.randn(3, 4), **options)  # type: ignore[arg-type]


def config() -> Config:
    return Config(update_rule=UpdateRule("sgd", learning_rate=0.1))


def test_within_one_process_updates_ship_at_step() -> None:
    with LocalCluster(1, config()) as cluster:
        model = wrapped(cluster)
        assert model.overlap_updates is False
        assert "overlap_updates=False (every shard is in this process" in model.plan


@pytest.mark.parametrize("given", [True, False])
def test_a_given_choice_is_kept_and_named(given: bool) -> None:
    with LocalCluster(1, config()) as cluster:
        model = wrapped(cluster, overlap_updates=given)
        assert model.overlap_updates is given
        assert f"overlap_updates={given} (given to wrap()" in model.plan


def test_a_choice_that_is_not_a_bool_is_refused() -> None:
    with LocalCluster(1, config()) as cluster:
        with pytest.raises(ArgumentTypeError, match="overlap_updates must be True, False or None"):
            wrapped(cluster, overlap_updates=1)
        assert not cluster.worker(0).tables  # refused before anything reached the engine


@pytest.mark.parametrize("in_process,device,by_cuda_ipc,expected,why", [
    (True, "cpu", False, False, "every shard is in this process"),
    (True, "cuda", False, False, "every shard is in this process"),
    (False, "cpu", False, False, "a CPU worker"),
    (False, "cuda", True, False, "a GPU worker whose peers all take CUDA IPC"),
    (False, "cuda", False, True, "a GPU worker with a shard in another process reached through host frames"),
])
def test_the_rule(in_process: bool, device: str, by_cuda_ipc: bool, expected: bool, why: str) -> None:
    # The worker's three facts the rule reads; the real processes are in the distributed tests.
    worker = types.SimpleNamespace(shards_in_process=in_process, config=Config(device=device),  # type: ignore[arg-type]
                                   peers_by_cuda_ipc=by_cuda_ipc)
    chosen, reason = choose_overlap(worker, None)  # type: ignore[arg-type]
    assert chosen is expected
    assert why in reason


def test_peers_by_cuda_ipc_follows_the_jobs_data_paths() -> None:
    # The Job hands its (still empty) data paths to the worker and fills them
    # at the rendezvous; the worker reads them when wrap() asks.
    paths: dict[int, str] = {}
    with LocalCluster(1, config()) as cluster:
        worker = Worker(cluster.worker(0)._engine, owner=cluster, config=config(), data_paths=paths)
        assert not worker.peers_by_cuda_ipc  # one process: no peers at all
        paths.update({1: "cuda-ipc", 2: "cuda-ipc"})
        assert worker.peers_by_cuda_ipc
        paths[2] = "host-frames (another host)"
        assert not worker.peers_by_cuda_ipc
