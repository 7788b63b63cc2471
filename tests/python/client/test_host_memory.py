"""Host memory is predicted and refused before it is allocated: a table or a
plan that needs more than this process may have raises
ResourceExhaustedError with both sizes, instead of the kernel killing the
process; the prediction matches what the engine reports holding."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import numpy as np
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
def test_the_prediction_is_what_the_engine_holds(budget: int) -> None:
    """The need is the engine's own plan, part by part: on the CPU backend
    the pool and every store (device- or host-resident) are host memory,
    plus the staging buffer (the largest access buffer), the update
    payloads of two clocks (slack 0: the one being sent, the one not yet
    applied) and the shard's state (values and momentum: the CPU's memory is
    host memory)."""
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
        preview = worker.preview_plan()
        predicted = worker.planned_host_bytes()
        worker.finish_virtual_iteration()
        stats = worker.stats
        held = stats["pool_bytes"] + stats["device_store_bytes"] + stats["host_store_bytes"]
        table_bytes = 4096 * 256 * 4
        assert preview.host_memory["staging"] == table_bytes
        assert preview.host_memory["payloads"] == 2 * table_bytes
        assert predicted == held + 3 * table_bytes + 2 * table_bytes == stats["host_memory_bytes"], (held, predicted)
        assert preview.pool_bytes == stats["pool_bytes"]
        assert (budget == 0) == (stats["host_store_bytes"] == 0)
        assert preview.host_memory["shard_per_branch"] == 2 * table_bytes  # values and momentum
        assert f"host memory {predicted} B" in worker.plan


def test_the_engine_refuses_a_plan_over_its_limit_with_the_sizes() -> None:
    """The engine's own check at finish (plan/host_memory.h), against
    Config.host_memory_limit, with the need broken down; the plan, refused,
    leaves the recording in place."""
    config = mltuner.Config(host_memory_limit=2**20)
    with mltuner.LocalCluster(1, config) as cluster:
        worker = cluster.worker(0)
        table = worker.create_table("t", 256, 256)  # 256 KiB: the shard's slice fits
        read = worker.virtual_read(table)
        worker.virtual_post_read(read)
        update = worker.virtual_pre_update(table)
        worker.virtual_update(update)
        worker.virtual_clock()
        need = worker.planned_host_bytes()
        assert need > 2**20
        with pytest.raises(mltuner.ResourceExhaustedError,
                           match=rf"finish_virtual_iteration needs {need} bytes .*parameter stores and update "
                                 r"logs 0 B.*staging 262144 B, update payloads in flight 524288 B.* may use only "
                                 r"\d+ bytes .*Config\(host_memory_limit=1048576\)"):
            worker.finish_virtual_iteration()
        assert worker.stats["pool_bytes"] == 0
        # The engine's own check, the same numbers (a C++ caller has only this one).
        with pytest.raises(mltuner.ResourceExhaustedError,
                           match=rf"the plan needs {need} B .*staging 262144 B.* more than the 1048576 B "
                                 r"\(1.0 MiB\) of Config.host_memory_limit"):
            worker._engine.finish_virtual_iteration()
        worker.reset_virtual_iteration()  # the recording was not consumed: another may be tried
        read = worker.virtual_read(table, range(16))
        worker.virtual_post_read(read)
        worker.virtual_clock()
        assert worker.planned_host_bytes() < 2**20
        worker.finish_virtual_iteration()


def test_a_table_created_after_a_preview_is_planned_too() -> None:
    """The preview's plan is kept for finish_virtual_iteration, unless a
    table was created since (allowed until the iteration is finished). A
    local table no access touches takes no memory: only recorded accesses
    reach local data."""
    with mltuner.LocalCluster(1) as cluster:
        worker = cluster.worker(0)
        table = worker.create_table("t", 64, 16)
        read = worker.virtual_read(table)
        worker.virtual_post_read(read)
        worker.virtual_clock()
        before = worker.preview_plan()
        assert before.fits and before.host_store_bytes == 0
        worker.create_table("untouched local", 32, 16, local=True)
        assert worker.preview_plan().device_store_bytes == before.device_store_bytes
        worker.create_table("late", 32, 16)
        after = worker.preview_plan()
        assert after.device_store_bytes == before.device_store_bytes + 32 * 16 * 4
        worker.finish_virtual_iteration()
        assert worker.stats["device_store_bytes"] == after.device_store_bytes


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


def test_the_plan_takes_little_host_memory_beyond_what_it_keeps() -> None:
    """Issue 17: peak host memory during finish_virtual_iteration at most 1.5x
    the tables' size (it was 6x: zero-filled caches and update logs, and 8 to
    25 bytes of bookkeeping per row). The caches and logs are now mapped
    zero pages that take RAM as rows are first written, and the layout,
    placement and indexes of rows in runs are a few entries per access, so the
    plan's own peak is a small fraction of the tables: measured, about 1%.
    The bound asserted, 0.25x, catches a store or a per-row array creeping
    back. A fresh process, so the peak (VmHWM, reset just before the call) is
    this plan's alone."""
    script = textwrap.dedent("""
        import numpy as np
        import mltuner

        def status(key):
            for line in open("/proc/self/status"):
                if line.startswith(key):
                    return int(line.split()[1]) * 1024
            raise KeyError(key)

        MIB = 2**20
        with mltuner.LocalCluster(1, mltuner.Config(update_rule=mltuner.UpdateRule("momentum", 0.1))) as cluster:
            worker = cluster.worker(0)
            wide = worker.create_table("wide", 32 * 1024, 1024)        # 128 MiB, 4 KiB rows
            narrow = worker.create_table("narrow", 2 * 2**20, 16)      # 128 MiB, 64-byte rows
            local = worker.create_table("local", 1024, 1024, local=True)  # 4 MiB
            table_bytes = (32 * 1024 * 1024 + 2 * 2**20 * 16 + 1024 * 1024) * 4
            first = worker.virtual_read(wide, np.arange(0, 1024))     # a first layer's block
            worker.virtual_post_read(first)
            for table in (wide, narrow):
                read = worker.virtual_read(table)
                worker.virtual_post_read(read)
                update = worker.virtual_pre_update(table)
                worker.virtual_update(update)
            access = worker.virtual_local_access(local)
            worker.virtual_post_local_access(access)
            worker.virtual_clock()
            try:
                with open("/proc/self/clear_refs", "w") as refs:
                    refs.write("5")  # VmHWM := VmRSS
            except OSError as error:
                print("NO-RESET", error)
                raise SystemExit(0)
            before = status("VmRSS")
            worker.finish_virtual_iteration()
            growth = status("VmHWM") - before
            print(f"GROWTH {growth} {table_bytes} {growth / table_bytes:.4f}")
    """)
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, (out.stdout, out.stderr)
    if "NO-RESET" in out.stdout:
        pytest.skip(f"this kernel does not let a process reset its peak RSS: {out.stdout}")
    growth, table_bytes = (int(field) for field in out.stdout.split("GROWTH")[1].split()[:2])
    assert growth <= 0.25 * table_bytes, out.stdout


def test_memory_freed_while_initial_values_are_written_is_room_for_a_host_shard_state(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """An application that frees its copies of the initial values as it
    writes them (release_host_memory_during_init) lets a shard whose state
    lives in host memory take up to those bytes beyond the memory available
    now: the state is allocated table by table as the writes arrive. The
    rest of the plan must fit now, and the values written are the values
    trained from. (The kernel's headroom is patched to sit between the two.)"""
    import mltuner.client._host_memory as host_memory

    rule = mltuner.UpdateRule("momentum", learning_rate=0.5, momentum=0.9)
    config = mltuner.Config(update_rule=rule, cpu_device_capacity=4 * 2**20, device_memory_reserve=2**20)
    with mltuner.LocalCluster(1, config) as cluster:
        worker = cluster.worker(0)
        tables = [worker.create_table(f"t{k}", 512, 256) for k in range(4)]  # 2 MiB of state each
        updates = []
        for table in tables:
            read = worker.virtual_read(table)
            worker.virtual_post_read(read)
            updates.append(worker.virtual_pre_update(table))
            worker.virtual_update(updates[-1])
        worker.virtual_clock()
        preview = worker.preview_plan()
        shard = preview.host_memory["shard_per_branch"]
        assert preview.host_memory["shard_in_host_memory"] and shard == 4 * 512 * 256 * 4 * 2
        rest = preview.host_memory_bytes - shard
        now = rest + shard // 2  # the plan's own memory fits, the shard's state only half
        monkeypatch.setattr(host_memory, "headroom", lambda: host_memory.Headroom(now, "a patched headroom"))
        with pytest.raises(mltuner.ResourceExhaustedError, match=rf"may use only {now} bytes .*a patched headroom"):
            worker.finish_virtual_iteration()
        with pytest.raises(mltuner.InvalidArgumentError, match="nbytes"):
            worker.release_host_memory_during_init(-1)
        worker.release_host_memory_during_init(shard // 2 - 1)
        with pytest.raises(mltuner.ResourceExhaustedError, match=rf"the {shard // 2 - 1} bytes the application frees"):
            worker.finish_virtual_iteration()
        worker.release_host_memory_during_init(shard // 2)
        worker.finish_virtual_iteration()
        with pytest.raises(mltuner.OutOfOrderError):
            worker.release_host_memory_during_init(0)
        initial = [np.random.default_rng(k).standard_normal((512, 256)).astype(np.float32) for k in range(4)]
        for update, values in zip(updates, initial):
            worker.pre_update(update)[...] = values
            worker.update(update)
        worker.start_iterations()
        for k, table in enumerate(tables):
            assert np.array_equal(worker.fetch(table, range(512)), initial[k])
