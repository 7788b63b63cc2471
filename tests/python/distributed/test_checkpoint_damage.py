"""A damaged checkpoint is refused with an InvalidArgumentError naming the
file and the fault, before restore_checkpoint changes anything in the job:
shards whose row ranges leave a gap, overlap or run outside the table,
metadata of the wrong JSON types, and files whose bytes or rows differ from
their CRC-32. A checkpoint root that is a file is refused before a save
starts."""

from __future__ import annotations

import collections
import json
import os
import threading
import re
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import mltuner
from mltuner.launch import _checkpoint

from test_checkpoint_files import (add_clocks, listing, on_both, prepare, single_job,  # type: ignore[import-not-found]
                                   trained)
from test_wire_security import close, start_pair  # type: ignore[import-not-found]

ROWS, WIDTH = 10, 3  # prepare()'s table "t"


@pytest.fixture
def checkpoint(tmp_path: Path) -> Path:
    """A one-shard checkpoint of table "t" ("add" rule) at clock 2, every value 2."""
    with single_job() as job:
        _, update = prepare(job.worker)
        job.worker.start_iterations()
        add_clocks(job.worker, update, 2, 1.0)
        return Path(job.save_checkpoint(tmp_path / "root"))


def edit_json(path: Path, change: Callable[[Any], object]) -> None:
    content = json.loads(path.read_text())
    change(content)
    path.write_text(json.dumps(content))


def reshard(checkpoint: Path, ranges: list[tuple[int, int]], *, checksums: bool = False) -> None:
    """Rewrites ``checkpoint`` as one shard per (first_row, num_rows) in
    ``ranges``, each saved row holding its row index: consistent files,
    whatever the ranges say; with ``checksums``, their CRC-32s in meta.json
    as a save writes them (else none, as before checkpoints had them)."""
    shutil.rmtree(checkpoint / "shard-0")
    for shard, (first, rows) in enumerate(ranges):
        directory = checkpoint / f"shard-{shard}"
        directory.mkdir()
        values = np.repeat(np.arange(first, first + rows, dtype=np.float32)[:, None], WIDTH, axis=1)
        np.save(directory / "table-0.values.npy", values)
        np.save(directory / "table-0.state.npy", np.zeros(0, np.float32))
        entry = {"first_row": first, "num_rows": rows, "state_arrays": 0}
        if checksums:
            entry.update(values_crc32=_checkpoint._crc32(values, first, rows),
                         state_crc32=_checkpoint._crc32(np.zeros(0, np.float32), first, rows))
        (directory / "meta.json").write_text(json.dumps({"rank": shard, "tables": {"0": entry}}))
    edit_json(checkpoint / "manifest.json", lambda manifest: manifest.update(num_shards=len(ranges)))


def restored(checkpoint: Path) -> tuple[int, np.ndarray]:
    with single_job() as job:
        table, _ = prepare(job.worker)
        clock = job.restore_checkpoint(checkpoint)
        return clock, job.worker.fetch(table)


def assert_refused(checkpoint: Path, match: str) -> None:
    """restore_checkpoint raises InvalidArgumentError matching ``match``, and the job's table keeps its values."""
    with single_job() as job:
        table, _ = prepare(job.worker)
        before = job.worker.fetch(table).copy()
        with pytest.raises(mltuner.InvalidArgumentError, match=match):
            job.restore_checkpoint(checkpoint)
        np.testing.assert_array_equal(job.worker.fetch(table), before)


def test_an_undamaged_checkpoint_restores_exactly_whichever_shards_hold_the_rows(checkpoint: Path) -> None:
    clock, values = restored(checkpoint)
    assert clock == 2
    np.testing.assert_array_equal(values, np.full((ROWS, WIDTH), 2.0, dtype=np.float32))
    reshard(checkpoint, [(4, 6), (0, 4), (10, 0)])  # out of row order, and one shard with no rows
    clock, values = restored(checkpoint)
    np.testing.assert_array_equal(values, np.repeat(np.arange(ROWS, dtype=np.float32)[:, None], WIDTH, axis=1))


@pytest.mark.parametrize("ranges, match", [
    ([(0, 4), (5, 5)], r"shard-1/meta\.json: table 't' rows \[5, 10\) leave rows \[4, 5\) saved by no shard"),
    ([(0, 4), (4, 5)], r"rows \[9, 10\) of table 't' are saved by no shard"),
    ([(0, 5), (4, 6)], r"shard-1/meta\.json: table 't' rows \[4, 10\) overlap rows \[4, 5\) another shard saved"),
    ([(0, 10), (0, 10)], r"shard-\d/meta\.json: table 't' rows \[0, 10\) overlap"),
    ([(2, 10)], r"shard-0/meta\.json: table 't' rows \[2, 12\) lie outside its 10 rows"),
    ([(0, 10), (100, 0)], r"shard-1/meta\.json: table 't' rows \[100, 100\) lie outside"),
    ([(-2, 10)], r"shard-0/meta\.json: 'first_row' is -2, expected an integer >= 0"),
], ids=["gap", "gap-at-end", "overlap", "same-rows-twice", "past-the-end", "empty-out-of-range", "negative"])
def test_shards_that_do_not_tile_the_rows_are_refused(checkpoint: Path, ranges: list[tuple[int, int]],
                                                      match: str) -> None:
    reshard(checkpoint, ranges)
    assert_refused(checkpoint, match)


def test_the_probes_first_row_edit_is_refused(checkpoint: Path) -> None:
    for first_row, match in ((2, r"rows \[2, 12\) lie outside"), (-2, "'first_row' is -2"),
                             (100, r"rows \[100, 110\) lie outside"), (False, "'first_row' is False")):
        edit_json(checkpoint / "shard-0" / "meta.json",
                  lambda meta: meta["tables"]["0"].update(first_row=first_row))
        assert_refused(checkpoint, r"shard-0/meta\.json: .*" + match)


def _set(key: str, value: object) -> Callable[[Any], object]:
    return lambda record: record.update({key: value})


@pytest.mark.parametrize("file, change, match", [
    ("manifest.json", lambda manifest: manifest.pop("tables"), r"manifest\.json has no 'tables'"),
    ("manifest.json", _set("tables", {"0": {}}), r"manifest\.json: 'tables' is .*, expected a JSON array"),
    ("manifest.json", _set("clock", "abc"), r"manifest\.json: 'clock' is 'abc', expected an integer >= 0"),
    ("manifest.json", _set("clock", -5), r"manifest\.json: 'clock' is -5, expected an integer >= 0"),
    ("manifest.json", _set("clock", 2.7), r"manifest\.json: 'clock' is 2\.7, expected an integer"),
    ("manifest.json", _set("clock", True), r"manifest\.json: 'clock' is True, expected an integer"),
    ("manifest.json", _set("num_shards", 0), r"manifest\.json: 'num_shards' is 0, expected an integer >= 1"),
    ("manifest.json", _set("num_shards", "1"), r"manifest\.json: 'num_shards' is '1', expected an integer"),
    ("manifest.json", lambda manifest: manifest["tables"][0].update(id="zero"),
     r"manifest\.json: 'id' is 'zero', expected an integer"),
    ("manifest.json", lambda manifest: manifest["tables"].append(manifest["tables"][0]),
     r"manifest\.json: two tables have the same id"),
    ("shard-0/meta.json", _set("tables", []), r"meta\.json: 'tables' is \[\], expected a JSON object"),
    ("shard-0/meta.json", lambda meta: meta["tables"]["0"].update(num_rows="10"),
     r"meta\.json: 'num_rows' is '10', expected an integer"),
    ("shard-0/meta.json", lambda meta: meta["tables"]["0"].pop("state_arrays"), r"meta\.json has no 'state_arrays'"),
], ids=["no-tables", "tables-object", "clock-text", "clock-negative", "clock-float", "clock-bool", "no-shards",
        "shards-text", "table-id-text", "table-twice", "meta-tables-list", "rows-text", "no-state-arrays"])
def test_metadata_of_the_wrong_type_is_refused_naming_the_file(checkpoint: Path, file: str,
                                                               change: Callable[[Any], object], match: str) -> None:
    edit_json(checkpoint / file, change)
    assert_refused(checkpoint, match)


def test_an_empty_values_file_is_refused_naming_it(checkpoint: Path) -> None:
    (checkpoint / "shard-0" / "table-0.values.npy").write_bytes(b"")
    assert_refused(checkpoint, r"shard-0/table-0\.values\.npy cannot be read")


def _flip_last_byte(path: Path) -> None:
    """Changes one byte of the data (the last), leaving the .npy header readable."""
    content = bytearray(path.read_bytes())
    content[-1] ^= 0x40
    path.write_bytes(bytes(content))


def test_a_changed_byte_in_a_saved_file_is_refused_naming_it(checkpoint: Path) -> None:
    values = checkpoint / "shard-0" / "table-0.values.npy"
    saved = values.read_bytes()
    _flip_last_byte(values)
    assert np.isfinite(np.load(values)).all()  # a plausible value: only the checksum tells
    assert_refused(checkpoint, r"shard-0/table-0\.values\.npy \(table 't', rows \[0, 10\)\) is damaged: its CRC-32")
    values.write_bytes(saved)
    edit_json(checkpoint / "shard-0" / "meta.json", lambda meta: meta["tables"]["0"].update(state_crc32=12345))
    assert_refused(checkpoint, r"table-0\.state\.npy .* is damaged: its CRC-32 is 0x[0-9a-f]{8}, its meta\.json "
                               r"says 0x00003039")


def test_rows_moved_between_shards_are_refused_and_checksummed_shards_restore(checkpoint: Path) -> None:
    reshard(checkpoint, [(0, 5), (5, 5)], checksums=True)
    clock, values = restored(checkpoint)
    np.testing.assert_array_equal(values[:, 0], np.arange(ROWS, dtype=np.float32))
    # Each shard's files are sound, but meta.json now places them at each other's rows.
    edit_json(checkpoint / "shard-0" / "meta.json", lambda meta: meta["tables"]["0"].update(first_row=5))
    edit_json(checkpoint / "shard-1" / "meta.json", lambda meta: meta["tables"]["0"].update(first_row=0))
    assert_refused(checkpoint, r"shard-\d/table-0\.(values|state)\.npy \(table 't', rows \[\d, \d+\)\) is damaged")


def test_a_changed_attachment_is_refused_when_read(tmp_path: Path) -> None:
    with single_job() as job:
        _, update = prepare(job.worker)
        job.worker.start_iterations()
        add_clocks(job.worker, update, 1, 1.0)
        path = Path(job.save_checkpoint(tmp_path / "root", attachments={"notes.txt": b"epoch 3"}))
    assert mltuner.read_attachment(path, "notes.txt") == b"epoch 3"
    (path / "attachments" / "notes.txt").write_bytes(b"epoch 4")
    with pytest.raises(mltuner.InvalidArgumentError, match=r"notes\.txt is damaged: its CRC-32"):
        mltuner.read_attachment(path, "notes.txt")


def test_a_save_to_a_file_or_under_one_is_refused_before_it_starts(tmp_path: Path) -> None:
    file = tmp_path / "file"
    file.write_text("x")
    with single_job() as job:
        _, update = prepare(job.worker)
        job.worker.start_iterations()
        add_clocks(job.worker, update, 1, 1.0)
        with pytest.raises(mltuner.InvalidArgumentError, match=re.escape(f"checkpoint root {file} is a file")):
            job.save_checkpoint(file)
        under = re.escape(f"checkpoint root {file / 'sub'} is under {file}, a file")
        with pytest.raises(mltuner.InvalidArgumentError, match=under):
            job.save_checkpoint(file / "sub")
        assert file.read_text() == "x"
        assert job.save_checkpoint(tmp_path / "root").name == "clock-00000001"  # the job saves on


def test_every_rank_refuses_a_file_only_another_rank_reads(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Shard 1's file damaged: rank 0, which reads only shard 0's rows,
    refuses too, before either rank loads anything (the ranks of a restore
    agree, and may go on to another checkpoint together). Each rank checked
    its share of the files: the checkpoint was read once between them."""
    checked: list[tuple[int, str]] = []
    crc32 = _checkpoint._crc32

    def counted(array: np.ndarray, first: int, rows: int) -> int:
        checked.append((threading.get_ident(), getattr(array, "filename", "")))
        return crc32(array, first, rows)

    monkeypatch.setattr(_checkpoint, "_crc32", counted)
    jobs = start_pair()
    try:
        def train_and_save(job: mltuner.Job) -> None:
            _, update = prepare(job.worker)
            job.worker.start_iterations()
            add_clocks(job.worker, update, 2, 1.0)
            job.save_checkpoint(tmp_path)
            add_clocks(job.worker, update, 1, 1.0)
            job.save_checkpoint(tmp_path)

        on_both(jobs, train_and_save)
    finally:
        close(jobs)
    _flip_last_byte(tmp_path / "clock-00000003" / "shard-1" / "table-0.values.npy")
    jobs = start_pair()
    try:
        def restore(job: mltuner.Job) -> tuple[str, int, np.ndarray]:
            table, _ = prepare(job.worker)
            with pytest.raises(mltuner.InvalidArgumentError, match=r"shard-1/table-0\.values\.npy .* is damaged") as refused:
                job.restore_checkpoint(tmp_path)
            return str(refused.value), job.restore_checkpoint(tmp_path / "clock-00000002"), job.worker.fetch(table)

        for _, clock, values in on_both(jobs, restore):  # type: ignore[misc]
            assert clock == 2  # two clocks of both ranks adding 1
            np.testing.assert_array_equal(values, np.full((ROWS, WIDTH), 4.0, dtype=np.float32))
    finally:
        close(jobs)
    damaged = [(thread, name) for thread, name in checked if "clock-00000003" in str(name)]
    by_thread = collections.Counter(thread for thread, _ in damaged)
    assert sorted(by_thread.values()) == [2, 2] and len({name for _, name in damaged}) == 4


def test_unreadable_metadata_and_a_fifo_are_refused_naming_the_file(checkpoint: Path) -> None:
    manifest = checkpoint / "manifest.json"
    content = manifest.read_bytes()
    manifest.write_bytes(content[:20] + b"\xdd" + content[21:])  # not UTF-8
    assert_refused(checkpoint, r"cannot read .*manifest\.json")
    manifest.write_bytes(content)
    for fifo in ("shard-0/table-0.values.npy", "shard-0/meta.json"):  # an open would wait for a writer for good
        path = checkpoint / fifo
        saved = path.read_bytes()
        path.unlink()
        os.mkfifo(path)
        assert_refused(checkpoint, re.escape(fifo) + " cannot be read: it is not a regular file")
        path.unlink()
        path.write_bytes(saved)


def test_a_full_disk_names_the_file_and_the_job_saves_on(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    with trained() as (job, update):
        def short_write(*args: object, **kwargs: object) -> None:
            raise OSError("32000 requested and 25568 written")  # numpy's message, without errno or file

        with monkeypatch.context() as patch:
            patch.setattr(np, "save", short_write)
            with pytest.raises(OSError, match=r"writing .*table-0\.values\.npy \(120 bytes\) failed: 32000 "
                                              r"requested and 25568 written \(\d+ bytes free on its file system\)"):
                job.save_checkpoint(tmp_path)
        add_clocks(job.worker, update, 1, 1.0)
        assert job.save_checkpoint(tmp_path).name == "clock-00000002"
    assert listing(tmp_path) == ["clock-00000002", "latest"]  # the failed save's staging removed


def test_a_latest_tmp_directory_and_a_read_only_store_do_not_stop_the_job(
        checkpoint: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    root = checkpoint.parent
    (root / "latest.tmp").mkdir()  # left where a file is written next: removed, not fatal
    with single_job() as job:
        _, update = prepare(job.worker)
        job.worker.start_iterations()
        add_clocks(job.worker, update, 3, 1.0)
        job.save_checkpoint(root)
    assert listing(root) == ["clock-00000002", "clock-00000003", "latest"]
    # A store that cannot be written: the checkpoint a cut-off save moved
    # aside keeps its hidden name (with a warning); the restore reads it there.
    (root / "clock-00000003").rename(root / ".clock-00000003.old.tmp")

    def read_only(*args: object) -> None:
        raise OSError(30, "Read-only file system")

    monkeypatch.setattr(_checkpoint.os, "replace", read_only)
    monkeypatch.setattr(_checkpoint, "_remove", lambda path: None)
    clock, values = restored(root)
    assert clock == 3 and "could not give" in caplog.text
    np.testing.assert_array_equal(values, np.full((ROWS, WIDTH), 3.0, dtype=np.float32))


def test_a_restore_checks_the_attachments_the_manifest_lists(tmp_path: Path) -> None:
    with trained() as (job, _):
        path = Path(job.save_checkpoint(tmp_path, attachments={"epoch.json": b'{"epoch": 3}'}))
    attachment = path / "attachments" / "epoch.json"
    attachment.write_bytes(b'{"epoch": 4}')
    assert_refused(path, r"epoch\.json \(attachment epoch\.json\) is damaged: its CRC-32 is 0x[0-9a-f]{8}, the "
                         "manifest says")
    attachment.unlink()  # read_attachment would take it for "no attachment": the manifest lists it
    assert_refused(path, r"epoch\.json \(attachment epoch\.json\) is missing")
    with pytest.raises(mltuner.InvalidArgumentError, match="missing: the manifest lists it"):
        mltuner.read_attachment(path, "epoch.json")


def test_the_ranks_restore_the_checkpoint_rank_0_finds(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A root another job writes into may name different checkpoints to
    different ranks as its latest moves: every rank takes rank 0's."""
    with trained(2) as (job, update):
        job.save_checkpoint(tmp_path)
        add_clocks(job.worker, update, 2, 1.0)
        job.save_checkpoint(tmp_path)
    ranks: dict[int, int] = {}
    resolve = _checkpoint.resolve
    monkeypatch.setattr(_checkpoint, "resolve", lambda path: (
        path / "clock-00000004" if ranks.get(threading.get_ident()) == 1 else resolve(path / "clock-00000002")))
    jobs = start_pair()
    try:
        def restore(job: mltuner.Job) -> int:
            ranks[threading.get_ident()] = job.rank
            prepare(job.worker)
            return job.restore_checkpoint(tmp_path)

        assert on_both(jobs, restore) == [2, 2]
    finally:
        close(jobs)
