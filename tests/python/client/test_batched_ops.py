"""Worker.run: several recorded ops in one engine call behave exactly like
the same ops called one by one (the PyTorch adapter's light clock uses it).

Reference: two workers train the same small model on the same data with the
same rule, one calling each op on its own, the other in batches that cross
op boundaries (a post, an update and the next open in one call); every read
and the final parameters must be bit for bit equal.
"""

from __future__ import annotations

import numpy as np
import pytest

from mltuner import Config, LocalCluster, Table, TensorLayout, UpdateRule, Worker
from mltuner.exceptions import InvalidArgumentError, OutOfOrderError

CLOCKS = 12


def layout() -> TensorLayout:
    return TensorLayout(row_width=8).add("w", (5, 3)).add("b", (3,))


def train(batched: bool) -> tuple[list[np.ndarray], np.ndarray]:
    config = Config(update_rule=UpdateRule("momentum", learning_rate=0.1, momentum=0.5), wait_timeout_s=20)
    seen: list[np.ndarray] = []
    final: list[np.ndarray] = []

    def body(worker: Worker) -> None:
        a = worker.create_tensor_table("a", layout())
        b = worker.create_tensor_table("b", layout())
        read_a, read_b = worker.virtual_read(a, slack=0), worker.virtual_read(b, slack=0)
        up_b = worker.virtual_pre_update(b)
        worker.virtual_post_read(read_b)
        worker.virtual_update(up_b)
        up_a = worker.virtual_pre_update(a)
        worker.virtual_post_read(read_a)
        worker.virtual_update(up_a)
        worker.virtual_clock()
        worker.finish_virtual_iteration()
        rng = np.random.default_rng(0)
        for handle in (up_a, up_b):
            worker.pre_update(handle)[...] = rng.normal(size=(3, 8)).astype(np.float32)
            worker.update(handle)
        worker.start_iterations()
        for clock in range(CLOCKS):
            if batched:
                values_a, values_b, out_b = worker.run([("read", read_a), ("read", read_b), ("pre_update", up_b)])
            else:
                values_a, values_b = worker.read(read_a), worker.read(read_b)
                out_b = worker.pre_update(up_b)
            seen.extend([values_a.copy(), values_b.copy()])
            out_b[...] = 0.5 * values_b + 0.01 * clock
            if batched:
                (out_a,) = worker.run([("post_read", read_b), ("update", up_b), ("pre_update", up_a)])
            else:
                worker.post_read(read_b)
                worker.update(up_b)
                out_a = worker.pre_update(up_a)
            out_a[...] = values_a * values_a
            if batched:
                assert worker.run([("post_read", read_a), ("update", up_a), ("clock", -1)]) == []
                assert not out_a.flags.writeable  # posted through run: read-only like after update()
            else:
                worker.post_read(read_a)
                worker.update(up_a)
                worker.clock()
        worker.sync()
        final.append(worker.fetch(a))

    with LocalCluster(1, config) as cluster:
        cluster.run(body)
    return seen, final[0]


def test_batches_equal_single_calls() -> None:
    seen_single, final_single = train(batched=False)
    seen_batched, final_batched = train(batched=True)
    assert len(seen_single) == len(seen_batched) == 2 * CLOCKS
    for single, batched in zip(seen_single, seen_batched):
        np.testing.assert_array_equal(single, batched)
    np.testing.assert_array_equal(final_single, final_batched)


@pytest.mark.parametrize("ops, error, match", [
    ([("write", 0)], InvalidArgumentError, "unknown op kind 'write'"),
    ([("update", 0)], InvalidArgumentError, "update of handle 0, which was recorded as a read"),
    ([("post_read", 0)], OutOfOrderError, "expects read"),
    ([("read", 0), ("read", 0)], OutOfOrderError, "called read\\(handle 0\\)"),
])
def test_bad_batches_raise_the_single_calls_errors(ops: list[tuple[str, int]], error: type[Exception],
                                                    match: str) -> None:
    with LocalCluster(1, Config(wait_timeout_s=10)) as cluster:
        def body(worker: Worker) -> None:
            table = worker.create_table("t", 4, 2)
            read = worker.virtual_read(table, slack=0)
            worker.virtual_post_read(read)
            worker.virtual_clock()
            worker.finish_virtual_iteration()
            worker.start_iterations()
            with pytest.raises(error, match=match):
                worker.run(ops)

        cluster.run(body)


def start_one_update(worker: Worker) -> tuple[Table, int]:
    """A table of layout() whose clock is one whole update; iterations started."""
    table = worker.create_tensor_table("t", layout())
    update = worker.virtual_pre_update(table)
    worker.virtual_update(update)
    worker.virtual_clock()
    worker.finish_virtual_iteration()
    worker.start_iterations()
    return table, update


def test_an_update_takes_pieces_copied_in_before_its_post() -> None:
    """Worker._run_ops (the PyTorch adapter's path): an update may carry
    pieces of float32 memory that the engine copies into its buffer; the
    servers receive exactly them, and a piece outside the buffer is refused
    before anything is copied."""
    config = Config(update_rule=UpdateRule("add"), wait_timeout_s=20)
    pieces_src = [np.arange(1, 16, dtype=np.float32), np.full(3, -2.0, dtype=np.float32)]
    got: list[np.ndarray] = []

    def body(worker: Worker) -> None:
        table, update = start_one_update(worker)
        worker.pre_update(update)
        with pytest.raises(InvalidArgumentError, match="does not fit the 24 floats"):
            worker._run_ops([(3, update, [(pieces_src[0].ctypes.data, 20, 5)])], 0)
        pieces = [(pieces_src[0].ctypes.data, 0, 15), (pieces_src[1].ctypes.data, 16, 3)]
        worker._run_ops([(3, update, pieces), (6, -1)], 0)
        worker.sync()
        got.append(worker.fetch(table))

    with LocalCluster(1, config) as cluster:
        cluster.run(body)
    expected = np.zeros(24, dtype=np.float32)
    expected[:15] = pieces_src[0]
    expected[16:19] = pieces_src[1]
    np.testing.assert_array_equal(got[0].reshape(-1), expected)


def test_an_update_flag_set_when_the_copy_runs_sends_zeros() -> None:
    """Worker._run_ops: an update's fifth item, the address of a float32,
    makes the engine's copy of the pieces write zeros when that float is
    nonzero as the copy runs (a scaler's overflow flag): two clocks, the
    flag clear then set, add the pieces once."""
    config = Config(update_rule=UpdateRule("add"), wait_timeout_s=20)
    source = np.arange(1, 25, dtype=np.float32)
    flag = np.zeros(1, dtype=np.float32)
    got: list[np.ndarray] = []

    def body(worker: Worker) -> None:
        table, update = start_one_update(worker)
        for value in (0.0, float("inf")):
            flag[0] = value
            worker.pre_update(update)
            with pytest.raises(ValueError, match="only an update takes a zero-if flag"):
                worker._run_ops([(6, -1, [], [], flag.ctypes.data)], 0)
            worker._run_ops([(3, update, [(source.ctypes.data, 0, 24)], [], flag.ctypes.data), (6, -1)], 0)
        worker.sync()
        got.append(worker.fetch(table))

    with LocalCluster(1, config) as cluster:
        cluster.run(body)
    np.testing.assert_array_equal(got[0].reshape(-1), source)


def test_a_local_post_takes_pieces_copied_out_before_it() -> None:
    """Worker._run_ops: a post_local_access may carry pieces that the engine
    copies out of its buffer before the post (the PyTorch adapter reads a
    stored activation back this way); they hold exactly what the clock
    wrote, in the same call that opens the rows. A piece outside the buffer,
    or pieces to copy out of an update, are refused."""
    config = Config(update_rule=UpdateRule("add"), wait_timeout_s=20)
    out = [np.full(10, np.nan, dtype=np.float32) for _ in range(2)]
    written = np.arange(24, dtype=np.float32).reshape(3, 8) * 0.5

    def start_clock(worker: Worker) -> tuple[int, int]:
        table = worker.create_tensor_table("t", layout())
        local = worker.create_table("acts", 3, 8, local=True)
        write = worker.virtual_local_access(local, fetch=False)
        worker.virtual_post_local_access(write, keep=True)
        update = worker.virtual_pre_update(table)
        worker.virtual_update(update)
        back = worker.virtual_local_access(local, fetch=True)
        worker.virtual_post_local_access(back, keep=False)
        worker.virtual_clock()
        worker.finish_virtual_iteration()
        worker.start_iterations()
        worker.local_access(write)[...] = written
        worker.post_local_access(write)
        worker.pre_update(update)
        return update, back

    def refused(worker: Worker) -> None:
        update, back = start_clock(worker)
        with pytest.raises(InvalidArgumentError, match="pieces to copy out come with a post_local_access"):
            worker._run_ops([(3, update, [], [(out[0].ctypes.data, 0, 4)])], 0)
        worker.update(update)
        with pytest.raises(InvalidArgumentError, match="does not fit the 24 floats"):
            worker._run_ops([(4, back), (5, back, [], [(out[0].ctypes.data, 20, 5)])], 0)

    def copied_out(worker: Worker) -> None:
        update, back = start_clock(worker)
        pieces = [(out[0].ctypes.data, 0, 10), (out[1].ctypes.data, 14, 10)]
        worker._run_ops([(3, update), (4, back), (5, back, [], pieces), (6, -1)], 0)

    for body in (refused, copied_out):  # a fresh cluster each: a refused op leaves its clock half done
        with LocalCluster(1, config) as cluster:
            cluster.run(body)
    np.testing.assert_array_equal(out[0], written.reshape(-1)[:10])
    np.testing.assert_array_equal(out[1], written.reshape(-1)[14:24])
