"""Host memory is predicted and refused before it is allocated: a table or a
plan that needs more than this process may have raises
ResourceExhaustedError with both sizes, instead of the kernel killing the
process; the prediction matches what the engine reports holding."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

import mltuner
from mltuner.client._host_memory import headroom

GIB = 2**30


def test_a_2_31_value_table_under_a_2_gib_limit_is_refused() -> None:
    config = mltuner.Config(host_memory_limit=2 * GIB)
    with mltuner.LocalCluster(1, config) as cluster:
        worker = cluster.worker(0)
        with pytest.raises(mltuner.ResourceExhaustedError,
                           match=r"create_table\('t'\) of 1 x 2147483648 needs 8589934592 bytes .* "
                                 r"may use only 2147483648 bytes .*Config\(host_memory_limit=2147483648\)"):
            worker.create_table("t", 1, 2**31)
        assert worker.tables == []
        worker.create_table("t", 1, 1024)  # the refusal held nothing back


def test_a_plan_over_the_limit_is_refused_before_the_engine_allocates() -> None:
    config = mltuner.Config(host_memory_limit=100 * 2**20, update_rule=mltuner.UpdateRule("sgd", 0.1))
    with mltuner.LocalCluster(1, config) as cluster:
        worker = cluster.worker(0)
        table = worker.create_table("t", 1024, 16 * 1024)  # 64 MiB: the shard's slice fits
        read = worker.virtual_read(table)
        worker.virtual_post_read(read)
        worker.virtual_clock()
        with pytest.raises(mltuner.ResourceExhaustedError, match=r"finish_virtual_iteration needs \d+ bytes"):
            worker.finish_virtual_iteration()
        assert worker.stats["pool_bytes"] == 0  # nothing was planned or allocated


def test_the_limit_counts_every_worker_of_the_process() -> None:
    config = mltuner.Config(host_memory_limit=3 * 2**20)
    with mltuner.LocalCluster(2, config) as cluster:
        cluster.worker(0).create_table("a", 2 * 1024, 256)  # 1 MiB on each shard
        cluster.worker(1).create_table("a", 2 * 1024, 256)
        with pytest.raises(mltuner.ResourceExhaustedError, match="minus the 2097152 bytes"):
            cluster.worker(0).create_table("b", 2 * 4096, 256)


@pytest.mark.parametrize("budget", [0, 12 * 2**20])
def test_the_prediction_covers_what_the_engine_holds(budget: int) -> None:
    config = mltuner.Config(device_memory_budget=budget, update_rule=mltuner.UpdateRule("momentum", 0.1))
    with mltuner.LocalCluster(1, config) as cluster:
        worker = cluster.worker(0)
        params = worker.create_table("params", 4096, 256)
        local = worker.create_table("acts", 512, 256, local=True)
        read = worker.virtual_read(params)
        worker.virtual_post_read(read)
        access = worker.virtual_local_access(local)
        worker.virtual_post_local_access(access)
        update = worker.virtual_pre_update(params)
        worker.virtual_update(update)
        worker.virtual_clock()
        predicted = worker.planned_host_bytes()
        worker.finish_virtual_iteration()
        stats = worker.stats
        held = stats["pool_bytes"] + stats["device_store_bytes"] + stats["host_store_bytes"]
        # Counted: the engine's buffers plus the staging buffer and indexes.
        assert held <= predicted <= 1.3 * held, (held, predicted)


def test_rlimit_as_is_honoured_in_a_fresh_process() -> None:
    room = headroom().bytes
    script = textwrap.dedent("""
        import resource, sys
        import mltuner
        resource.setrlimit(resource.RLIMIT_AS, (2 * 2**30, resource.RLIM_INFINITY))
        with mltuner.LocalCluster(1) as cluster:
            try:
                cluster.worker(0).create_table("t", 1, 2**31)
            except mltuner.ResourceExhaustedError as error:
                print("REFUSED", error)
    """)
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert "REFUSED" in out.stdout and "RLIMIT_AS of 2147483648 bytes" in out.stdout, (out.stdout, out.stderr, room)
