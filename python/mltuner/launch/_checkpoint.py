"""Checkpoints of the parameter server: every shard's slice of every table.

Layout of one checkpoint (``root/clock-NNNNNNNN``)::

    manifest.json                  written last: the checkpoint is complete
    shard-R/table-T.values.npy     rows [first_row, first_row + num_rows) of table T
    shard-R/table-T.state.npy      the update rule's state: state_arrays arrays
                                   of len(values) floats, then scalars
    shard-R/meta.json              what shard R wrote, with each file's CRC-32
    attachments/NAME               bytes rank 0 attached (save's ``attachments``),
                                   e.g. the PyTorch adapter's buffers and param groups

The root also holds ``latest`` (the newest checkpoint's name) and
``.writer.lock``, which rank 0 of the job that saves there holds
(_root_lock.py). Shards write into a hidden ``.clock-NNNNNNNN.TOKEN.tmp``
directory (the token rank 0 drew for the save, once it held the root);
once every rank wrote, rank 0 adds the manifest and renames the directory into place, then
points ``root/latest`` at it (os.replace), so a reader sees a whole
checkpoint or none. Rank 0 removes what an interrupted save left behind
(hidden ``.clock-*.tmp`` directories, ``*.tmp`` files) at the next save and
when a job restores from the root, and keeps exactly the newest ``keep``
checkpoints. Clocks in names and manifests count from the start of training,
across restores. Every array file's CRC-32 (seeded with the rows it holds,
so that a shard's rows cannot be placed elsewhere) is in its shard's
meta.json, every attachment's in the manifest; before any rank loads
anything, each rank of a restore checks its share of the files and the
ranks agree on the verdict (an allgather), so all refuse a damaged
checkpoint together, having read it once between them; a file that differs
is refused by name (checkpoints written before the checksums restore
unchecked). Restoring re-splits rows and state over however many shards
the new job has, and ends with a barrier, so every read after it, on any
rank, sees restored values. Files are plain .npy arrays read without pickle.

A job whose tables group the values otherwise than the saved ones (the
PyTorch adapter's layers under another budget) restores from ``sources``:
each of its tables assembled from pieces of the saved tables' flat values,
with their optimizer state.
"""

from __future__ import annotations

import json
import logging
import math
import os
import re
import secrets
import shutil
import time
import zlib
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np

from mltuner import _core
from mltuner._config import UpdateRule
from mltuner.client._worker import Table, Worker
from mltuner.exceptions import ArgumentTypeError, InvalidArgumentError, MltunerError, NotFoundError, OutOfOrderError
from mltuner.launch._root_lock import RootLocks, held_elsewhere

__all__ = ["Piece", "Sources", "save", "restore", "shard_range", "resolve", "resolve_together", "read_attachment",
           "check_tables", "remove_leftovers"]

FORMAT = "mltuner-checkpoint"
VERSION = 1
LATEST = "latest"
_CHECKPOINT_NAME = re.compile(r"clock-(\d{8,})")
_ASIDE_NAME = re.compile(r"\.(clock-\d{8,})\.old\.tmp")  # a checkpoint a second save of its clock moved aside
_ATTACHMENT_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")
ATTACHMENTS = "attachments"
_log = logging.getLogger("mltuner.launch")

# A run of a table's flat values (its rows one after another): (offset in
# it, saved table's name, offset in that table, count).
Piece = tuple[int, str, int, int]
# Each of a job's table names -> the pieces of saved tables it is made of.
Sources = Mapping[str, Sequence[Piece]]


def shard_range(num_rows: int, shard: int, num_shards: int) -> tuple[int, int]:
    """(first row, row count) of a shard: the engine's ShardRange split."""
    base, extra = divmod(num_rows, num_shards)
    return shard * base + min(shard, extra), base + (1 if shard < extra else 0)


def save(node: _core.ProcessNode, worker: Worker, root: Path, allgather: Callable[[str, Any], list[Any]],
         locks: RootLocks, *, keep: int, first_clock: int = 0,
         attachments: Mapping[str, bytes] | None = None) -> Path:
    """Saves this shard's part; ``first_clock`` is the clock training
    resumed from (the engine's own clocks restart at 0 after a restore).
    Rank 0 holds ``root`` in ``locks`` against other jobs and writes
    ``attachments`` (file name -> bytes) into the checkpoint before it
    becomes visible; other ranks' are ignored. What fails on one rank
    (a full disk, bad attachments, a root another job holds) fails the save
    on every rank, saying so, rather than leaving the others at a barrier."""
    # A file at or above root would fail only midway, creating a shard's directory.
    existing = next(entry for entry in (root, *root.parents) if entry.exists())
    if not existing.is_dir():
        raise InvalidArgumentError(f"save_checkpoint: the checkpoint root {root} is a file" if existing == root else
                                   f"save_checkpoint: the checkpoint root {root} is under {existing}, a file")
    engine_clock = int(worker.stats["clock"])
    if engine_clock == 0:
        raise OutOfOrderError("save_checkpoint needs at least one finished clock after start_iterations")
    # Branch 0's, or after a tuning session its final branch (what the model
    # is then, whatever branch its last validation ran on); a restore loads
    # it as branch 0.
    branch = worker.trained_branch
    if branch is None and worker.branch != 0:
        raise OutOfOrderError(f"save_checkpoint saves branch 0 or, after a tuning session, its final branch, and "
                              f"the last clock ran on branch {worker.branch} (a session's trials run on branches of "
                              "their own: save before or after the session)")
    branch = branch or 0
    worker.sync()  # every worker's updates through this clock are applied on every shard
    # The shards' clock of the branch, where its last clock is the worker's last
    # (a finished branch's were all applied before the branches after it forked).
    expected = int(worker.stats["branch_clock"]) - 1 if branch == worker.branch else None
    clock = first_clock + engine_clock
    name = f"clock-{clock:08d}"
    # Rank 0 holds the root and names this save's staging directory before
    # any rank writes: a second job saving there is refused on every rank.
    attached: dict[str, bytes] = {}
    token = ""

    def open_save() -> None:
        nonlocal attached, token
        attached = check_attachments(attachments)
        root.mkdir(parents=True, exist_ok=True)
        locks.hold(root)
        token = secrets.token_hex(4)
        remove_temporaries(root, keep=f".{name}.{token}.tmp")

    token = _together(allgather, f"checkpoint-{name}-start", open_save if node.rank == 0 else None,
                      lambda: token)[0]
    staging = root / f".{name}.{token}.tmp"

    def write_shard() -> None:
        shard_dir = staging / f"shard-{node.rank}"
        shard_dir.mkdir(parents=True)
        written: dict[str, Any] = {"rank": int(node.rank), "tables": {}}
        for table in _communicated(worker):
            piece = node.export_shard_table(table.id, branch)
            if expected is not None and int(piece["global_clock"]) != expected:
                raise OutOfOrderError(f"table {table.name!r} is at clock {piece['global_clock']} of branch {branch} "
                                      f"on shard {node.rank}, expected {expected}: call save_checkpoint on every rank "
                                      "at the same clock")
            first_row, num_rows = int(piece["first_row"]), int(piece["num_rows"])
            values = np.asarray(piece["values"]).reshape(num_rows, table.row_width)
            entry = {"first_row": first_row, "num_rows": num_rows, "state_arrays": int(piece["state_arrays"])}
            for kind, array in (("values", values), ("state", np.asarray(piece["state"]))):
                written_array = _save_array(shard_dir / f"table-{table.id}.{kind}.npy", array)
                entry[f"{kind}_crc32"] = _crc32(written_array, first_row, num_rows)
            written["tables"][str(table.id)] = entry
        _write_json(shard_dir / "meta.json", written)

    _together(allgather, f"checkpoint-{name}-written", write_shard, lambda: None)
    final = root / name

    def publish() -> None:
        manifest = {
            "format": FORMAT, "version": VERSION, "clock": clock, "num_shards": int(node.num_workers),
            "tables": [{"id": t.id, "name": t.name, "num_rows": t.num_rows, "row_width": t.row_width}
                       for t in _communicated(worker)],
        }
        if attached:
            (staging / ATTACHMENTS).mkdir(exist_ok=True)
            for file_name, content in attached.items():
                _write_bytes(staging / ATTACHMENTS / file_name, content)
            manifest["attachments_crc32"] = {file_name: zlib.crc32(content) for file_name, content in attached.items()}
        _write_json(staging / "manifest.json", manifest)
        # Saved again (a run resumed from an older one reached this clock): the
        # old one moves aside first, so that a crash leaves a complete one in
        # place or leaves `latest` naming nothing (resolve then takes the newest).
        aside = root / f".{name}.old.tmp"
        if final.exists():
            if aside.exists():
                _remove(aside)
            os.replace(final, aside)
        os.replace(staging, final)
        _write_text(root / LATEST, name + "\n")
        if aside.exists():
            _remove(aside)
        _keep_newest(root, keep, clock)

    _together(allgather, f"checkpoint-{name}-done", publish if node.rank == 0 else None, lambda: None)
    return final


def _together(allgather: Callable[[str, Any], list[Any]], name: str, step: Callable[[], None] | None,
              result: Callable[[], Any], what: str = "save_checkpoint") -> list[Any]:
    """Runs ``step`` (where given) on this rank, then an allgather of each
    rank's outcome: every rank's ``result()``, by rank, when every step
    succeeded. A step's exception is raised on its own rank; the other ranks
    raise what it said (an OSError where it was one, else an
    InvalidArgumentError), so no rank waits for one that gave up."""
    failure: BaseException | None = None
    if step is not None:
        try:
            step()
        except (MltunerError, OSError, TypeError, ValueError) as error:
            failure = error
    outcome = ({"ok": result()} if failure is None else
               {"error": f"{type(failure).__name__}: {failure}", "os": isinstance(failure, OSError)})
    outcomes = allgather(name, outcome)
    if failure is not None:
        raise failure
    for rank, other in enumerate(outcomes):
        if "error" in other:
            text = f"{what} failed on rank {rank}: {other['error']}"
            raise OSError(text) if other["os"] else InvalidArgumentError(text)
    return [other["ok"] for other in outcomes]


def check_attachments(attachments: Mapping[str, bytes] | None) -> dict[str, bytes]:
    """``attachments`` as a dict, each name a plain file name and each value bytes."""
    checked: dict[str, bytes] = {}
    for name, content in (attachments or {}).items():
        if not isinstance(name, str) or not _ATTACHMENT_NAME.fullmatch(name):
            raise InvalidArgumentError(f"attachment name {name!r}: use 1-128 letters, digits, '.', '_' or '-', "
                                       "starting with a letter or digit")
        if not isinstance(content, (bytes, bytearray, memoryview)):
            raise ArgumentTypeError(f"attachment {name!r}: expected bytes, got {type(content).__name__}")
        checked[name] = bytes(content)
    return checked


def read_attachment(path: str | os.PathLike[str], name: str) -> bytes | None:
    """The bytes rank 0 attached as ``name`` to a checkpoint
    (``Job.save_checkpoint(..., attachments=...)``), None when it has none.
    ``path`` is a checkpoint directory, or a root (its newest checkpoint).

    Raises:
        mltuner.NotFoundError: no complete checkpoint at ``path``.
        mltuner.InvalidArgumentError: the attachment differs from what was saved (its CRC-32).
    """
    check_attachments({name: b""})
    directory = resolve(Path(path))
    expected = _read_manifest(directory).get("attachments_crc32", {}).get(name)
    try:
        content = _read_regular(directory / ATTACHMENTS / name)
    except FileNotFoundError:
        if expected is not None:
            raise InvalidArgumentError(f"checkpoint file {directory / ATTACHMENTS / name} is missing: the manifest "
                                       "lists it") from None
        return None
    if expected is not None and zlib.crc32(content) != expected:
        raise InvalidArgumentError(f"checkpoint file {directory / ATTACHMENTS / name} is damaged: its CRC-32 is "
                                   f"{zlib.crc32(content):#010x}, the manifest says {expected:#010x}")
    return content


def _keep_newest(root: Path, keep: int, saved: int) -> None:
    """Removes every checkpoint up to clock ``saved``, the one just saved,
    but the newest ``keep``. Those of later clocks are an earlier run's that
    was resumed from an older checkpoint: left alone, neither counted nor
    taken for the newest (they took the place of the one just saved)."""
    found = [entry for number, entry in _numbered(root) if entry.is_dir() and number <= saved]
    for old in found[:-keep]:
        _remove(old)


def _numbered(root: Path) -> list[tuple[int, Path]]:
    """The ``clock-*`` entries of ``root`` (none if it is no directory), by clock."""
    entries = root.iterdir() if root.is_dir() else ()
    return sorted((int(match.group(1)), entry) for entry in entries
                  if (match := _CHECKPOINT_NAME.fullmatch(entry.name)))


def remove_temporaries(root: Path, keep: str = "") -> None:
    """Removes what interrupted saves left in ``root``: hidden staging
    directories and half-written ``*.tmp`` files (but not ``keep``). A
    complete checkpoint a second save of its clock moved aside, cut off
    before the new one took its name, gets its name back."""
    for entry in root.iterdir():
        aside = _ASIDE_NAME.fullmatch(entry.name)
        if aside and not (root / aside.group(1)).exists() and (entry / "manifest.json").is_file():
            try:
                os.replace(entry, root / aside.group(1))
            except OSError as error:  # a read-only store: restores still read what is complete
                _log.warning("mltuner: could not give %s its name back: %s", entry, error)
    for entry in root.iterdir():
        if entry.name != keep and entry.name.endswith(".tmp") and (
                entry.name.startswith(".clock-") or entry.name == f"{LATEST}.tmp" or entry.is_file()):
            _remove(entry)


def remove_leftovers(root: Path) -> None:
    """:func:`remove_temporaries` before a restore from ``root``, unless a
    job writes there now (its half-written saves are not leftovers)."""
    if not held_elsewhere(root):
        remove_temporaries(root)


def _remove(path: Path) -> None:
    try:
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path)
        else:
            path.unlink()
    except OSError as error:  # the checkpoint itself is safe; say what is left
        _log.warning("mltuner: could not remove %s: %s", path, error)


def restore(node: _core.ProcessNode, worker: Worker, path: Path,
            barrier: Callable[[str], None], agree: Callable[[str, Any], list[Any]],
            sources: Sources | None = None) -> int:
    if worker.iterations_started:
        # The worker may hold clock-0 reads of the old values already, and
        # its clocks would not restart: the loaded values would mix with them.
        raise OutOfOrderError(
            "restore_checkpoint after start_iterations: restore between finish_virtual_iteration and "
            "start_iterations. mltuner.torch.wrap() runs both: a PyTorch model resumes from a checkpoint with "
            "wrap(..., resume_from=path)"
        )
    directory = resolve_together(path, int(node.rank), agree)
    manifest, metas = _check_checkpoint(directory, worker, sources, agree=agree)
    saved = _saved_tables(manifest)
    for table in _communicated(worker):
        first, count = shard_range(table.num_rows, int(node.rank), int(node.num_workers))
        if sources is None:
            values, state = _gather_slice(directory, metas, table, first, count)
        else:
            values, state = _assemble_slice(directory, metas, saved, table, sources[table.name], first, count)
        try:
            node.import_shard_table(table.id, values, state)
        except InvalidArgumentError as error:
            rule = worker.update_rule_of(table)
            raise InvalidArgumentError(f"checkpoint {directory} does not fit the update rule of table "
                                       f"{table.name!r} ({rule.kind if rule else None!r}): {error}") from error
    # Every shard holds its rows before any rank reads (a fetch right after
    # the restore would otherwise see another shard's rows not yet loaded).
    barrier(f"checkpoint-{directory.name}-restored")
    return int(manifest["clock"])


def _communicated(worker: Worker) -> list[Table]:
    return [t for t in worker.tables if not t.local]


def resolve_together(path: Path, rank: int, agree: Callable[[str, Any], list[Any]] | None) -> Path:
    """:func:`resolve` on rank 0, its answer on every rank (``agree``: the
    job's allgather; every rank calls this): resolved on each rank, a root
    another job writes into could name different checkpoints to different
    ranks. A root's leftovers go first (:func:`remove_leftovers`), so that a
    checkpoint a cut-off save moved aside has its name back when the newest
    is chosen (and is not saved over later as if it were gone)."""
    found = ""

    def on_rank_0() -> None:
        nonlocal found
        if (path / LATEST).is_file():
            remove_leftovers(path)
        found = str(resolve(path))

    if agree is None:
        on_rank_0()
        return Path(found)

    return Path(_together(agree, f"checkpoint-resolve-{path.name}", on_rank_0 if rank == 0 else None, lambda: found,
                          what="resolving the checkpoint")[0])


def resolve(path: Path) -> Path:
    """The checkpoint directory ``path`` names: itself, or a root's newest:
    the one ``latest`` names (where a save of its clock again was cut off
    after moving it aside: under that hidden name, which a restore gives
    back first), else (a ``latest`` edited by hand) the complete ``clock-*``
    of the highest clock. Changes nothing on disk."""
    if (path / "manifest.json").is_file():
        return path
    latest = path / LATEST
    named = ""
    if latest.is_file():
        named = latest.read_text(errors="replace").strip()
        if _CHECKPOINT_NAME.fullmatch(named):
            for candidate in (path / named, path / f".{named}.old.tmp"):  # a cut-off save moved it aside
                if (candidate / "manifest.json").is_file():
                    return candidate
    complete = [entry for _, entry in _numbered(path) if (entry / "manifest.json").is_file()]
    said = (f"{latest} names {named!r}, which holds no complete checkpoint" if latest.is_file()
            else f"no {LATEST} file")
    if complete:
        _log.warning("mltuner: %s; resuming from %s, the newest complete one", said, complete[-1].name)
        return complete[-1]
    raise NotFoundError(f"no complete checkpoint at {path}: no manifest.json there, {said}, and no clock-* "
                        "directory with one")


def check_tables(directory: Path, worker: Worker, sources: Sources | None = None, *,
                 mismatch_hint: str = "", agree: Callable[[str, Any], list[Any]] | None = None) -> dict[str, Any]:
    """The manifest of the checkpoint ``directory``, once it is known to
    hold exactly ``worker``'s communicated tables (or, with ``sources``, the
    saved tables their pieces name) and every file a restore reads is sound,
    its checksum too (InvalidArgumentError naming the file and the fault
    otherwise; where the tables differ, followed by ``mismatch_hint``).
    ``agree``: the job's allgather, with which every rank checks its share
    of the checksums (every rank must call this then)."""
    return _check_checkpoint(directory, worker, sources, mismatch_hint, agree)[0]


class _Entry(NamedTuple):
    """What one shard saved of a table (its meta.json entry)."""

    first_row: int
    num_rows: int
    state_arrays: int
    crc32: dict[str, int]  # "values" / "state" -> the file's checksum; empty in checkpoints from before them


def _saved_tables(manifest: dict[str, Any]) -> dict[str, Table]:
    """The checkpoint's tables by name."""
    return {entry["name"]: Table(entry["id"], entry["name"], entry["num_rows"], entry["row_width"])
            for entry in manifest["tables"]}


def _check_checkpoint(directory: Path, worker: Worker, sources: Sources | None = None,
                      mismatch_hint: str = "", agree: Callable[[str, Any], list[Any]] | None = None,
                      ) -> tuple[dict[str, Any], list[dict[int, _Entry]]]:
    """The manifest and every shard's entries (saved table id -> _Entry),
    once every file a restore reads is known to be sound, its checksum
    too (:func:`_verify_share`, with ``agree``), and to fit ``worker``: all
    of it is checked before a restore changes anything."""
    manifest = _read_manifest(directory)
    metas, checksummed = (_check_sources(directory, manifest, worker, sources) if sources is not None
                          else _check_same_tables(directory, manifest, worker, mismatch_hint))
    checksummed += [(str(directory / ATTACHMENTS / name), f"attachment {name}", -1, 0, expected)
                    for name, expected in manifest.get("attachments_crc32", {}).items()]
    _verify_share(directory, checksummed, worker, agree)
    return manifest, metas


def _check_same_tables(directory: Path, manifest: dict[str, Any], worker: Worker,
                       mismatch_hint: str) -> tuple[list[dict[int, _Entry]], list[_Checksummed]]:
    """Every shard's entries, and the files to check against their
    checksums, once the checkpoint holds exactly ``worker``'s communicated
    tables in files of the sizes they should have."""
    saved = {entry["id"]: entry for entry in manifest["tables"]}
    mine = _communicated(worker)
    problems = []
    for table in mine:
        entry = saved.get(table.id)
        if entry is None:
            problems.append(f"table {table.name!r} (id {table.id}) is not in it")
        elif (entry["name"], entry["num_rows"], entry["row_width"]) != (table.name, table.num_rows, table.row_width):
            problems.append(f"table id {table.id} is {entry['name']!r} {entry['num_rows']}x{entry['row_width']} "
                            f"there, {table.name!r} {table.num_rows}x{table.row_width} here")
    if len(saved) != len(mine):
        problems.append(f"it has {len(saved)} communicated tables, this job {len(mine)}")
    if problems:
        raise InvalidArgumentError(f"checkpoint {directory} does not match this job's tables: " + "; ".join(problems)
                                   + mismatch_hint)
    metas = [_read_meta(directory, shard, mine) for shard in range(manifest["num_shards"])]
    return metas, [file for table in mine
                   for file in _check_saved_table(directory, metas, table, worker.update_rule_of(table), table.name)]


def _check_saved_table(directory: Path, metas: list[dict[int, _Entry]], saved: Table, rule: UpdateRule | None,
                       into: str) -> list[_Checksummed]:
    """A saved table's shard files are sound and hold the optimizer state
    ``rule`` (the rule of the job's table ``into``) keeps; returns those to
    check against their checksums."""
    _check_shards(directory, saved, [meta[saved.id] for meta in metas])
    if rule is not None and metas[0][saved.id][2] != rule.state_arrays:
        raise InvalidArgumentError(
            f"checkpoint {directory} does not fit this job's update rules: table {saved.name!r} has "
            f"{metas[0][saved.id][2]} arrays of optimizer state per value there, and the rule of "
            f"{into!r} ({rule.kind}) keeps {rule.state_arrays} here")
    return [file for shard, meta in enumerate(metas)
            for file in _check_arrays(directory / f"shard-{shard}", saved, meta[saved.id])]


def _check_sources(directory: Path, manifest: dict[str, Any], worker: Worker,
                   sources: Sources) -> tuple[list[dict[int, _Entry]], list[_Checksummed]]:
    """restore(sources=): every piece lies inside its saved table and the
    job's table, the saved tables it names are sound and keep the optimizer
    state of the rule of each table they go into, and the pieces of a table
    come from tables of one optimizer step count (the state's scalars)."""
    saved = _saved_tables(manifest)
    problems = []
    uses: list[tuple[str, str, UpdateRule | None]] = []  # (saved table, the job's table it goes into, its rule)
    for table in _communicated(worker):
        pieces = sources.get(table.name)
        if not pieces:
            problems.append(f"nothing says where table {table.name!r} comes from")
            continue
        for piece in pieces:
            if len(piece) != 4 or not all(type(v) is int for v in (piece[0], piece[2], piece[3])):
                problems.append(f"a piece of {table.name!r} is {piece!r}, not (offset, table, offset, count) "
                                "with integer offsets and count")
                continue
            offset, name, source_offset, count = piece
            source = saved.get(name)
            if source is None:
                problems.append(f"table {name!r} (a source of {table.name!r}) is not in it")
            elif (min(offset, source_offset, count) < 0 or offset + count > table.num_rows * table.row_width
                  or source_offset + count > source.num_rows * source.row_width):
                problems.append(f"values [{source_offset}, {source_offset + count}) of {name!r} "
                                f"({source.num_rows}x{source.row_width}) cannot go to [{offset}, {offset + count}) "
                                f"of {table.name!r} ({table.num_rows}x{table.row_width})")
            else:
                uses.append((name, table.name, worker.update_rule_of(table)))
    if problems:
        raise InvalidArgumentError(f"checkpoint {directory} does not match this job's tables: " + "; ".join(problems))
    tables = [saved[name] for name in dict.fromkeys(name for name, _, _ in uses)]
    metas = [_read_meta(directory, shard, tables) for shard in range(manifest["num_shards"])]
    checksummed = [file for name, into, rule in dict.fromkeys(uses)  # every (saved table, job's table) pair:
                   for file in _check_saved_table(directory, metas, saved[name], rule, into)]  # their rules may differ
    for table in _communicated(worker):
        names = dict.fromkeys(name for _, name, _, _ in sources[table.name])
        steps = {name: _scalars(directory, metas, saved[name]).tolist() for name in names}
        if len({tuple(values) for values in steps.values()}) > 1:
            raise InvalidArgumentError(f"checkpoint {directory}: table {table.name!r} would join tables whose "
                                       f"optimizer step counts differ ({steps})")
    return metas, checksummed


def _field(path: Path, record: Mapping[str, Any], key: str, kind: type, least: int = 0) -> Any:
    """``record[key]``, when it is a ``kind`` (an int: at least ``least``)."""
    if key not in record:
        raise InvalidArgumentError(f"checkpoint file {path} has no {key!r}")
    value: Any = record[key]
    # type(), not isinstance: JSON's true and false are bools, which isinstance counts as ints.
    wrong_type = type(value) is not kind
    if wrong_type or (kind is int and value < least):
        expected = {int: f"an integer >= {least}", str: "a string", list: "a JSON array", dict: "a JSON object"}[kind]
        raise InvalidArgumentError(f"checkpoint file {path}: {key!r} is {value!r}, expected {expected}")
    return value


def _read_manifest(directory: Path) -> dict[str, Any]:
    """manifest.json, its fields and every table's of the types a restore uses."""
    path = directory / "manifest.json"
    manifest = _read_json(path)
    if manifest.get("format") != FORMAT or _field(path, manifest, "version", int) != VERSION:
        raise InvalidArgumentError(f"{directory} is not an mltuner checkpoint of version {VERSION}")
    _field(path, manifest, "clock", int)
    _field(path, manifest, "num_shards", int, least=1)
    ids = set()
    for table in _field(path, manifest, "tables", list):
        if not isinstance(table, dict):
            raise InvalidArgumentError(f"checkpoint file {path}: a table is {table!r}, expected a JSON object")
        ids.add(_field(path, table, "id", int))
        _field(path, table, "name", str)
        _field(path, table, "num_rows", int)
        _field(path, table, "row_width", int, least=1)
    if len(ids) != len(manifest["tables"]):
        raise InvalidArgumentError(f"checkpoint file {path}: two tables have the same id")
    if "attachments_crc32" in manifest:
        checksums = _field(path, manifest, "attachments_crc32", dict)
        for name in checksums:
            check_attachments({name: b""})
            _field(path, checksums, name, int)
    return manifest


def _read_meta(directory: Path, shard: int, tables: list[Table]) -> dict[int, _Entry]:
    """What shard-``shard``/meta.json says the shard saved of each of ``tables``."""
    path = directory / f"shard-{shard}" / "meta.json"
    written = _field(path, _read_json(path), "tables", dict)
    entries = {}
    for table in tables:
        entry = written.get(str(table.id))
        if not isinstance(entry, dict):
            raise InvalidArgumentError(f"checkpoint file {path} has no table {table.name!r} (id {table.id})")
        crc32 = {kind: _field(path, entry, f"{kind}_crc32", int) for kind in ("values", "state")
                 if f"{kind}_crc32" in entry}
        entries[table.id] = _Entry(_field(path, entry, "first_row", int), _field(path, entry, "num_rows", int),
                                   _field(path, entry, "state_arrays", int), crc32)
    return entries


def _check_shards(directory: Path, table: Table, entries: list[_Entry]) -> None:
    """The shards' row ranges of a table cover its rows [0, num_rows) once
    each (a gap would restore uninitialised memory, an overlap is a damaged
    checkpoint), and agree on the number of state arrays."""
    end = 0
    for shard, (first, rows, state_arrays, _) in sorted(enumerate(entries), key=lambda item: item[1][:2]):
        where = f"checkpoint file {directory / f'shard-{shard}' / 'meta.json'}: table {table.name!r}"
        if state_arrays != entries[0][2]:
            raise InvalidArgumentError(f"{where} has {state_arrays} state arrays, shard 0 {entries[0][2]}")
        if first + rows > table.num_rows:
            raise InvalidArgumentError(f"{where} rows [{first}, {first + rows}) lie outside its {table.num_rows} rows")
        if rows == 0:
            continue  # more shards than rows: an empty range covers nothing wherever it starts
        if first > end:
            raise InvalidArgumentError(f"{where} rows [{first}, {first + rows}) leave rows [{end}, {first}) "
                                       "saved by no shard")
        if first < end:
            raise InvalidArgumentError(f"{where} rows [{first}, {first + rows}) overlap rows "
                                       f"[{first}, {min(end, first + rows)}) another shard saved")
        end = first + rows
    if end != table.num_rows:
        raise InvalidArgumentError(f"checkpoint {directory}: rows [{end}, {table.num_rows}) of table "
                                   f"{table.name!r} are saved by no shard")


# A file to check against its checksum: (path, table name, first row, rows, the CRC-32 meta.json gives);
# an attachment: (path, "attachment NAME", -1, 0, the CRC-32 the manifest gives).
_Checksummed = tuple[str, str, int, int, int]


def _check_arrays(shard_dir: Path, table: Table, entry: _Entry) -> list[_Checksummed]:
    """A shard's two files of a table: readable .npy arrays of the sizes its
    meta.json gives; returns those it gives a CRC-32 for (_verify_share)."""
    first, rows, state_arrays, checksums = entry
    checksummed = []
    for kind, least in (("values", rows * table.row_width), ("state", state_arrays * rows * table.row_width)):
        path = shard_dir / f"table-{table.id}.{kind}.npy"
        if path.exists() and not path.is_file():  # (a FIFO would block np.load's open for good)
            raise InvalidArgumentError(f"checkpoint file {path} cannot be read: it is not a regular file")
        try:
            array = np.load(path, mmap_mode="r", allow_pickle=False)
        except (OSError, ValueError, EOFError) as error:  # EOFError: an empty file
            raise InvalidArgumentError(f"checkpoint file {path} cannot be read: {error}") from None
        if kind == "values" and (array.dtype != np.float32 or array.shape != (rows, table.row_width)):
            raise InvalidArgumentError(f"checkpoint file {path} holds a {array.dtype} array of shape {array.shape}, "
                                       f"float32 ({rows}, {table.row_width}) expected")
        if kind == "state" and (array.dtype != np.float32 or array.ndim != 1 or array.size < least):
            raise InvalidArgumentError(f"checkpoint file {path} holds a {array.dtype} array of shape {array.shape}, "
                                       f"a row of at least {least} float32 expected")
        if kind in checksums:
            checksummed.append((str(path), table.name, first, rows, checksums[kind]))
    return checksummed


def _verify_share(directory: Path, files: list[_Checksummed], worker: Worker,
                  agree: Callable[[str, Any], list[Any]] | None) -> None:
    """Checks ``files`` against their checksums before a restore loads
    anything. With ``agree`` (the job's allgather) each rank checks its
    share of them and the ranks agree on the verdict, so all refuse a
    damaged checkpoint together, having read it once between them; without,
    this rank checks them all."""
    files = sorted(set(files))
    mine = files[worker.rank::worker.num_workers] if agree is not None else files
    problem = None
    for file in mine:
        try:
            _verify(*file)
        except InvalidArgumentError as error:
            problem = str(error)
            break
    if agree is not None:
        problem = next((verdict for verdict in agree(f"checkpoint-{directory.name}-checked", problem) if verdict),
                       None)
    if problem is not None:
        raise InvalidArgumentError(problem)


def _verify(name: str, what: str, first: int, rows: int, expected: int) -> None:
    """Checks one file against its checksum: an array file's values seeded
    with its rows, or (``first`` < 0) an attachment's bytes."""
    path = Path(name)
    try:
        status = path.stat()
    except FileNotFoundError:
        raise InvalidArgumentError(f"checkpoint file {path} ({what}) is missing") from None
    seen = (name, status.st_size, status.st_mtime_ns, expected, first, rows)
    if time.monotonic() - _VERIFIED.get(seen, -math.inf) < _VERIFIED_FOR_S:
        return  # checked a moment ago, unchanged since (wrap(resume_from=) checks, then restores)
    if first < 0:
        actual = zlib.crc32(_read_regular(path))
        where, by = f"({what})", "the manifest"
    else:
        actual = _crc32(np.load(path, mmap_mode="r", allow_pickle=False), first, rows)
        where, by = f"(table {what!r}, rows [{first}, {first + rows}))", "its meta.json"
    if actual != expected:
        raise InvalidArgumentError(
            f"checkpoint file {path} {where} is damaged: its CRC-32 is {actual:#010x}, {by} says "
            f"{expected:#010x}; restore from another checkpoint (save_checkpoint's keep= keeps older ones)")
    if len(_VERIFIED) > 100_000:
        _VERIFIED.clear()
    _VERIFIED[seen] = time.monotonic()


def _gather_slice(directory: Path, metas: list[dict[int, _Entry]], table: Table, first: int,
                  count: int) -> tuple[np.ndarray, np.ndarray]:
    """This shard's rows [first, first+count) of a table and their optimizer
    state, assembled from the old shards that held them (_check_checkpoint
    has made sure they tile the table's rows and have the sizes used here)."""
    width = table.row_width
    values = np.empty((count, width), dtype=np.float32)
    state_arrays = metas[0][table.id][2]
    state_rows = np.empty((state_arrays, count, width), dtype=np.float32)
    for shard, meta in enumerate(metas):
        old_first, old_count, _, _ = meta[table.id]
        lo, hi = max(first, old_first), min(first + count, old_first + old_count)
        if lo >= hi:
            continue
        files = directory / f"shard-{shard}" / f"table-{table.id}"
        old_state = np.load(f"{files}.state.npy", mmap_mode="r", allow_pickle=False)
        per_array = old_count * width
        old_values = np.load(f"{files}.values.npy", mmap_mode="r", allow_pickle=False)
        values[lo - first:hi - first] = old_values[lo - old_first:hi - old_first]
        arrays = old_state[:state_arrays * per_array].reshape(state_arrays, old_count, width)
        state_rows[:, lo - first:hi - first] = arrays[:, lo - old_first:hi - old_first]
    scalars = _scalars(directory, metas, table)
    return values, np.concatenate([state_rows.reshape(-1), scalars]).astype(np.float32, copy=False)


def _scalars(directory: Path, metas: list[dict[int, _Entry]], table: Table) -> np.ndarray:
    """A saved table's update-rule scalars (Adam's step count), after its state arrays."""
    _, count, state_arrays, _ = metas[0][table.id]
    state = np.load(directory / "shard-0" / f"table-{table.id}.state.npy", mmap_mode="r", allow_pickle=False)
    return np.array(state[state_arrays * count * table.row_width:], dtype=np.float32)


def _merged(pieces: Sequence[Piece]) -> list[Piece]:
    """``pieces`` with each run that continues the one before it in both
    tables joined to it (a layer's parameters, one after another)."""
    merged: list[Piece] = []
    for offset, name, source_offset, count in sorted(pieces):
        if merged:
            last = merged[-1]
            if last[1] == name and last[0] + last[3] == offset and last[2] + last[3] == source_offset:
                merged[-1] = (last[0], name, last[2], last[3] + count)
                continue
        merged.append((offset, name, source_offset, count))
    return merged


def _assemble_slice(directory: Path, metas: list[dict[int, _Entry]], saved: Mapping[str, Table], table: Table,
                    pieces: Sequence[Piece], first: int, count: int) -> tuple[np.ndarray, np.ndarray]:
    """This shard's rows [first, first+count) of ``table`` and their
    optimizer state, made of ``pieces`` of the saved tables (what no piece
    covers, a layer's padding, is zero)."""
    width = table.row_width
    low, high = first * width, (first + count) * width
    pieces = _merged(pieces)
    state_arrays = metas[0][saved[pieces[0][1]].id][2] if pieces else 0
    values = np.zeros(count * width, dtype=np.float32)
    state = np.zeros((state_arrays, count * width), dtype=np.float32)
    for offset, name, source_offset, length in pieces:
        begin, end = max(offset, low), min(offset + length, high)
        if begin >= end:
            continue
        source = saved[name]
        start = source_offset + begin - offset  # the first value taken, in the source's flat values
        rows = range(start // source.row_width, -(-(start + end - begin) // source.row_width))
        old_values, old_state = _gather_slice(directory, metas, source, rows.start, len(rows))
        skip = start - rows.start * source.row_width
        values[begin - low:end - low] = old_values.reshape(-1)[skip:skip + end - begin]
        per_array = len(rows) * source.row_width
        arrays = old_state[:state_arrays * per_array].reshape(state_arrays, per_array)
        state[:, begin - low:end - low] = arrays[:, skip:skip + end - begin]
    scalars = _scalars(directory, metas, saved[pieces[0][1]]) if pieces else np.empty(0, np.float32)
    return values.reshape(count, width), np.concatenate([state.reshape(-1), scalars])


# Array files whose checksum matched, as (path, size, mtime, checksum, the
# rows it was seeded with) -> when; trusted for a while, not for good.
_VERIFIED: dict[tuple[str, int, int, int, int, int], float] = {}
_VERIFIED_FOR_S = 300.0


def _crc32(array: np.ndarray, first_row: int, num_rows: int) -> int:
    """The CRC-32 of an array file's values, seeded with the rows they are."""
    seed = zlib.crc32(f"rows {first_row} {num_rows}".encode())
    return zlib.crc32(np.ascontiguousarray(array).reshape(-1).view(np.uint8).data, seed)


def _save_array(path: Path, array: np.ndarray) -> np.ndarray:
    """Writes ``array`` as float32 .npy and syncs it; returns what it wrote."""
    written = np.ascontiguousarray(array, dtype=np.float32)
    try:
        with open(path, "wb") as file:
            np.save(file, written, allow_pickle=False)
            file.flush()
            os.fsync(file.fileno())
    except OSError as error:  # numpy's short write names neither the file nor the cause
        try:
            free = f" ({shutil.disk_usage(path.parent).free} bytes free on its file system)"
        except OSError:
            free = ""
        message = f"save_checkpoint: writing {path} ({written.nbytes} bytes) failed: {error.strerror or error}{free}"
        raise (OSError(error.errno, message) if error.errno else OSError(message)) from error
    return written


def _write_json(path: Path, content: dict[str, Any]) -> None:
    _write_text(path, json.dumps(content, indent=1))


def _write_text(path: Path, text: str) -> None:
    _write_bytes(path, text.encode())


def _write_bytes(path: Path, content: bytes) -> None:
    temporary = path.with_name(path.name + ".tmp")
    with open(temporary, "wb") as file:
        file.write(content)
        file.flush()
        os.fsync(file.fileno())
    os.replace(temporary, path)


def _read_regular(path: Path) -> bytes:
    """A checkpoint file's bytes; one that is not a regular file is refused
    (a FIFO would block the read for good)."""
    if path.exists() and not path.is_file():
        raise InvalidArgumentError(f"checkpoint file {path} cannot be read: it is not a regular file")
    return path.read_bytes()


def _read_json(path: Path) -> dict[str, Any]:
    try:
        content = json.loads(_read_regular(path).decode())
    except (OSError, ValueError) as error:  # ValueError: bad JSON, or bytes that are not UTF-8
        raise InvalidArgumentError(f"cannot read {path}: {error}") from error
    if not isinstance(content, dict):
        raise InvalidArgumentError(f"{path} is not a JSON object")
    return content
