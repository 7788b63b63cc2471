"""TensorLayout: rows, views and packing of named tensors, and a round trip
through the engine."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import pytest

from mltuner import Config, LocalCluster, TensorLayout, TensorSlot


def make_layout() -> TensorLayout:
    # 20*7 = 140 values = 8 full rows of 16 + a partial row of 12;
    # 7 values = one partial row; 2*3*5 = 30 values = 1 full row + 14.
    return TensorLayout(row_width=16).add("weight", (20, 7)).add("bias", (7,)).add("cube", (2, 3, 5))


def random_tensors(layout: TensorLayout, seed: int, nonzero_uniform: Callable[..., np.ndarray]) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {slot.name: nonzero_uniform(rng, slot.shape) for slot in layout}


def test_rows_are_contiguous_and_each_tensor_starts_a_row() -> None:
    layout = make_layout()
    assert layout.num_rows == 9 + 1 + 2
    assert len(layout) == 3
    assert "bias" in layout and "nothing" not in layout
    assert [s.name for s in layout] == ["weight", "bias", "cube"]
    assert layout.slot("weight") == TensorSlot("weight", (20, 7), 0, 9)
    assert layout.slot("bias") == TensorSlot("bias", (7,), 9, 1)
    assert layout.slot("cube") == TensorSlot("cube", (2, 3, 5), 10, 2)
    assert layout.slot("cube").size == 30
    assert layout.slot("bias").rows == range(9, 10)
    np.testing.assert_array_equal(layout.rows(), np.arange(12))
    np.testing.assert_array_equal(layout.rows("bias"), [9])
    np.testing.assert_array_equal(layout.rows("cube", "bias"), [10, 11, 9])
    assert repr(layout) == "TensorLayout(row_width=16, tensors=3, num_rows=12)"


def test_exact_fit_and_scalar_and_empty_tensors_take_rows() -> None:
    layout = TensorLayout(row_width=4).add("exact", (2, 4)).add("scalar", ()).add("empty", (0,))
    assert layout.slot("exact").num_rows == 2
    assert layout.slot("scalar").num_rows == 1  # one value still needs a row
    assert layout.slot("empty").num_rows == 1  # every tensor owns at least one row
    assert layout.num_rows == 4


def test_pack_then_view_round_trips(nonzero_uniform: Callable[..., np.ndarray]) -> None:
    layout = make_layout()
    tensors = random_tensors(layout, 1, nonzero_uniform)
    packed = layout.pack(tensors)
    assert packed.shape == (layout.num_rows, 16) and packed.dtype == np.float32
    for name, value in tensors.items():
        view = layout.view(packed, name)
        assert view.shape == value.shape
        np.testing.assert_array_equal(view, value)
    # The values fill the rows in C order; the tails of partial rows are zero.
    flat = packed[0:9].reshape(-1)
    np.testing.assert_array_equal(flat[:140], tensors["weight"].reshape(-1))
    assert np.all(flat[140:] == 0)
    np.testing.assert_array_equal(packed[9, :7], tensors["bias"])
    assert np.all(packed[9, 7:] == 0)
    assert np.all(packed[11, 14:] == 0)


def test_view_is_zero_copy() -> None:
    layout = make_layout()
    buffer = np.zeros((layout.num_rows, 16), dtype=np.float32)
    layout.view(buffer, "bias")[...] = 3.5
    np.testing.assert_array_equal(buffer[9, :7], np.full(7, 3.5, dtype=np.float32))
    assert np.shares_memory(layout.view(buffer, "weight"), buffer)


def test_view_of_a_buffer_holding_some_tensors(nonzero_uniform: Callable[..., np.ndarray]) -> None:
    layout = make_layout()
    tensors = random_tensors(layout, 2, nonzero_uniform)
    packed = layout.pack(tensors)
    rows = layout.rows("cube", "bias")
    partial = packed[rows]  # what an access recorded with those rows returns
    np.testing.assert_array_equal(layout.view(partial, "cube", names=["cube", "bias"]), tensors["cube"])
    np.testing.assert_array_equal(layout.view(partial, "bias", names=["cube", "bias"]), tensors["bias"])
    with pytest.raises(KeyError, match="weight"):
        layout.view(partial, "weight", names=["cube", "bias"])


def test_missing_tensors_pack_as_zero(nonzero_uniform: Callable[..., np.ndarray]) -> None:
    layout = make_layout()
    bias = nonzero_uniform(np.random.default_rng(3), (7,))
    packed = layout.pack({"bias": bias})
    np.testing.assert_array_equal(layout.view(packed, "bias"), bias)
    assert np.all(layout.view(packed, "weight") == 0)
    assert np.all(layout.view(packed, "cube") == 0)


def test_errors() -> None:
    layout = make_layout()
    with pytest.raises(ValueError, match="'bias' is already in the layout"):
        layout.add("bias", (3,))
    with pytest.raises(ValueError, match=r"dimension 1 must be in \[0, 2\*\*40\], got -1"):
        layout.add("bad", (3, -1))
    with pytest.raises(ValueError, match="row_width"):
        TensorLayout(row_width=0)
    with pytest.raises(KeyError, match="'nope'"):
        layout.slot("nope")
    with pytest.raises(KeyError, match="'nope'"):
        layout.rows("bias", "nope")
    with pytest.raises(KeyError, match="'nope'"):
        layout.view(np.zeros((layout.num_rows, 16), np.float32), "nope")
    with pytest.raises(KeyError, match="'nope'"):
        layout.pack({"nope": np.zeros(3)})
    with pytest.raises(ValueError, match=r"'weight' has shape \(7, 20\)"):
        layout.pack({"weight": np.ones((7, 20))})
    with pytest.raises(ValueError, match="width 16"):
        layout.view(np.zeros((layout.num_rows, 8), np.float32), "bias")
    with pytest.raises(ValueError, match="rows"):
        layout.view(np.zeros((5, 16), np.float32), "cube")
    with pytest.raises(ValueError, match="no tensors"):
        TensorLayout(row_width=4).rows()


def test_engine_round_trip(nonzero_uniform: Callable[..., np.ndarray]) -> None:
    """create_tensor_table, an init-phase write of layout.pack(...), and reads
    (init phase, first clock, fetch) viewed back through the layout."""
    layout = make_layout()
    tensors = random_tensors(layout, 4, nonzero_uniform)
    with LocalCluster(1, Config(wait_timeout_s=20)) as cluster:
        worker = cluster.workers[0]
        table = worker.create_tensor_table("params", layout)
        assert (table.num_rows, table.row_width, table.layout) == (layout.num_rows, 16, layout)
        read = worker.virtual_read(table)
        worker.virtual_post_read(read)
        read_some = worker.virtual_read(table, layout.rows("cube", "bias"))
        worker.virtual_post_read(read_some)
        update = worker.virtual_pre_update(table)
        worker.virtual_update(update)
        worker.virtual_clock()
        worker.finish_virtual_iteration()

        buffer = worker.pre_update(update)
        buffer[...] = layout.pack(tensors)
        worker.update(update)

        init_view = worker.read(read)
        for name, value in tensors.items():
            np.testing.assert_array_equal(layout.view(init_view, name), value)
        worker.post_read(read)

        worker.start_iterations()
        values = worker.read(read)
        for name, value in tensors.items():
            np.testing.assert_array_equal(layout.view(values, name), value)
        worker.post_read(read)
        some = worker.read(read_some)
        assert some.shape == (3, 16)
        np.testing.assert_array_equal(layout.view(some, "cube", names=["cube", "bias"]), tensors["cube"])
        np.testing.assert_array_equal(layout.view(some, "bias", names=["cube", "bias"]), tensors["bias"])
        worker.post_read(read_some)
        worker.pre_update(update)
        worker.update(update)
        worker.clock()
        worker.sync()
        np.testing.assert_array_equal(worker.fetch(table), layout.pack(tensors))


def test_empty_layout_cannot_make_a_table() -> None:
    with LocalCluster(1, Config(wait_timeout_s=20)) as cluster:
        with pytest.raises(ValueError, match="'empty' holds no tensors"):
            cluster.workers[0].create_tensor_table("empty", TensorLayout(row_width=8))
