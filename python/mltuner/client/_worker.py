"""Worker: one worker's client of the parameter server (the GeePS access API)."""

from __future__ import annotations

import contextlib
import dataclasses
import os
import weakref
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any, Protocol, Union

import numpy as np

from mltuner import _core
from mltuner._config import MAX_LEARNING_RATE, Config, UpdateRule
from mltuner._validate import INT32_MAX, INT64_MAX, boolean, integer, real, text
from mltuner.client._host_memory import HostMemory
from mltuner.client._layout import TensorLayout
from mltuner.exceptions import ArgumentTypeError, InvalidArgumentError, NonFiniteError, NotFoundError, OutOfOrderError

__all__ = ["Worker", "Table", "Rows", "Buffer", "PlanPreview", "Checkpoints"]

# The engine's limits: row ids and sizes are int64, a table holds at most
# 2**40 values, handles, slack and branches are int32, streams are pointers.
MAX_TABLE_VALUES = 2**40
UINTPTR_MAX = 2**64 - 1

Rows = Union[Sequence[int], np.ndarray, range, None]
# What an access returns: a numpy array on the CPU backend, a DeviceArray
# (DLPack, zero copy) on an accelerator.
Buffer = Union[np.ndarray, _core.DeviceArray]


class Checkpoints(Protocol):
    """What the job of a worker offers for checkpoints (``mltuner.Job``),
    to code that is given only the worker (``mltuner.torch``)."""

    def save_checkpoint(self, root: str | os.PathLike[str], *, keep: int = 2,
                        attachments: Mapping[str, bytes] | None = None) -> Path: ...

    def restore_checkpoint(self, path: str | os.PathLike[str], *,
                           sources: Mapping[str, Sequence[tuple[int, str, int, int]]] | None = None) -> int: ...

    def allgather(self, name: str, value: Any, timeout_s: float | None = None) -> list[Any]: ...


@dataclasses.dataclass(frozen=True)
class Table:
    """A table of ``num_rows`` rows of ``row_width`` float32 values.

    A local table holds per-worker data (activations, optimizer history) that
    is never communicated, only stored and swapped by the engine.
    """

    id: int
    name: str
    num_rows: int
    row_width: int
    local: bool = False
    layout: TensorLayout | None = None
    update_rule: UpdateRule | None = None  # its own rule; None: the Config's


@dataclasses.dataclass(frozen=True)
class PlanPreview:
    """What the plan of a recorded virtual iteration needs, from the engine's
    dry run (:meth:`Worker.preview_plan`), before
    ``finish_virtual_iteration`` commits to it. Sizes in bytes.

    ``pool_min_bytes`` is the least access-buffer pool of the recording (one
    region per clock in flight, each one clock's buffers packed by
    lifetime): the smallest ``Config.device_memory_budget`` it accepts. With
    ``Config.prefetch_clocks`` None that is one region's under a budget (the
    plan then falls back to one), two regions' without one. ``fits`` says
    whether the budget holds it; ``prefetch_clocks`` is then the plan's
    (Config's, or its choice), else that of the least pool. The other sizes
    are those of the plan the engine will make, and are 0 when it does not
    fit.
    ``budget_bytes`` is the budget the plan is made under: Config's, or,
    with none set, the automatic one (``automatic_budget``) when the device
    cannot hold the plan (0: no budget, everything on the device).
    """

    pool_min_bytes: int
    fits: bool
    pool_bytes: int
    device_store_bytes: int
    host_store_bytes: int
    # The host memory the plan needs (what finish_virtual_iteration checks),
    # and its parts: parameter_stores (host-resident parameter rows with
    # their update logs), local_data, device_memory (the pool and the
    # device-resident stores, on the CPU backend), staging, payloads (update
    # payloads of the clocks in flight in host memory, an upper estimate),
    # shard_per_branch (this rank's shard's state, per branch: in the sum
    # when shard_in_host_memory, i.e. on the CPU backend or when the device
    # has no room for it after the plan).
    host_memory_bytes: int
    host_memory: dict[str, int]
    host_memory_detail: str  # the same in words
    description: str  # the plan as Worker.plan will give it
    budget_bytes: int = 0
    automatic_budget: bool = False
    prefetch_clocks: int = 1
    # The bytes the plan predicts it moves over the host link per clock,
    # each way (the swaps of host-resident rows: Worker.plan's "predicted
    # per clock").
    host_to_device_bytes: int = 0
    device_to_host_bytes: int = 0
    # The handles of local accesses (virtual_local_access) whose rows all
    # stay on the device: no swap ever moves them.
    device_local_accesses: frozenset[int] = frozenset()

    @classmethod
    def from_core(cls, core: _core.PlanPreview) -> PlanPreview:
        host = core.host
        parts = {name: int(getattr(host, name)) for name in
                 ("parameter_stores", "local_data", "device_memory", "staging", "payloads", "shard_per_branch",
                  "shard_in_host_memory")}
        return cls(int(core.pool_min_bytes), bool(core.fits), int(core.pool_bytes), int(core.device_store_bytes),
                   int(core.host_store_bytes), int(host.total()), parts, str(host.describe()),
                   str(core.description), int(core.budget_bytes), bool(core.automatic_budget),
                   int(core.prefetch_clocks), int(core.host_to_device_bytes), int(core.device_to_host_bytes),
                   frozenset(int(h) for h in core.device_local_accesses))


class Worker:
    """The access API of one worker, in four phases.

    1. ``create_table`` for every table (same tables, same order on every worker).
    2. The virtual iteration: ``virtual_read`` / ``virtual_post_read``,
       ``virtual_pre_update`` / ``virtual_update``, ``virtual_local_access`` /
       ``virtual_post_local_access`` replay one iteration and return handles;
       ``virtual_clock`` ends it and ``finish_virtual_iteration`` builds the plan.
    3. Initialisation: the real calls with those handles run synchronously and in
       any order; ``read`` shows the servers' values, ``pre_update`` +
       ``update`` add to them directly (no update rule).
    4. ``start_iterations``; then the real calls must follow the recorded order,
       and ``clock`` ends each iteration.

    Buffers have shape (rows, row_width) and live in engine memory, with no
    copy: numpy arrays on the CPU backend (read buffers are read-only),
    :class:`DeviceArray` objects on CUDA (``torch.from_dlpack(buffer)``). A
    buffer is valid until its post call (``post_read``, ``update``,
    ``post_local_access``); after it the engine reads or reuses its memory
    (an update is shipped from it, the next clock's rows are gathered into
    it), so a later write would change what is sent and a later read would see
    another clock's data. The numpy array handed out is made read-only at its
    post call, so such a write raises; views made from it before (``layout.view``)
    and tensors made with DLPack share the memory but cannot be revoked: drop
    them at the post call too. On CUDA, give each post call the stream
    your kernels used on the buffer (``stream=torch.cuda.current_stream().cuda_stream``;
    the default 0 is the legacy default stream, which torch and cupy use unless
    told otherwise): the engine waits for that work before it touches the buffer.
    Buffers may be used on different streams: a post on another stream than the
    previous post's makes its stream wait for the previous post's work first.
    Blocking calls release the GIL, so several workers can run on threads.
    """

    def __init__(self, engine: _core.Engine, owner: object = None, *, config: Config | None = None,
                 host_memory: HostMemory | None = None, max_message_bytes: int | None = None,
                 data_paths: Mapping[int, str] | None = None, checkpoints: Checkpoints | None = None) -> None:
        self._engine = engine
        self._owner = owner  # keeps the cluster alive while the worker is used
        # The job's checkpoints; weak, since the job holds the worker.
        self._checkpoints = None if checkpoints is None else weakref.ref(checkpoints)
        self._config = config or Config()
        # What this process's engines hold (shared by a LocalCluster's workers).
        self._host_memory = host_memory or HostMemory(self._config.host_memory_limit)
        self._started = False  # start_iterations ran
        self._shard_bytes_reserved = 0  # the shard's state, reserved by create_table
        self._shard_bytes_of: dict[int, int] = {}  # the same, by table (drop_tables gives it back)
        self._host_freed_during_init = 0  # release_host_memory_during_init
        # The largest frame the job's data sockets accept (None: in memory).
        self._max_message_bytes = max_message_bytes
        self._data_paths = data_paths if data_paths is not None else {}  # the Job's, filled at its rendezvous
        # Writable numpy buffers handed out, by handle, made read-only at their
        # post. Weak references: the engine reuses a buffer's memory only once
        # Python holds none to it, so the worker must not extend its life.
        self._handed_out: dict[int, weakref.ref[np.ndarray]] = {}
        self._tables: dict[int, Table] = {}
        self._read_slack: int | None = None  # the least slack of the recorded reads
        self._update_shapes: dict[int, tuple[int, int]] = {}  # recorded update -> its (rows, row width)
        self._trained_branch: int | None = None  # a tuning session's final branch (trained_branch)
        self._trained_tunables: dict[str, Any] | None = None  # the setting it trained with
        self._trained_listeners: list[weakref.WeakMethod[Callable[[], None]]] = []
        self._branch_listeners: list[weakref.WeakMethod[Callable[[int, int | None], None]]] = []
        self._session_checks: list[weakref.WeakMethod[Callable[[frozenset[str]], None]]] = []
        # The settings a tuning session running on this worker sets on its
        # branches ("lr", "momentum"), which the application must not change.
        self.tuned_settings: frozenset[str] = frozenset()
        self._last_data_age = -2

    # -- tables ---------------------------------------------------------------
    @property
    def rank(self) -> int:
        return int(self._engine.rank)

    @property
    def num_workers(self) -> int:
        return int(self._engine.num_workers)

    @property
    def device(self) -> str:
        """Where the engine's buffers live, as torch names devices: ``"cpu"``
        or ``"cuda:N"`` (worker r uses GPU r mod the visible count)."""
        return str(self._engine.device)

    @property
    def shards_in_process(self) -> bool:
        """Whether every shard of the job lives in this process (a
        ``LocalCluster``, or a job of one process): updates then never
        cross a socket."""
        return self._max_message_bytes is None

    @property
    def peers_by_cuda_ipc(self) -> bool:
        """Whether this worker's payloads reach every shard in another
        process device to device (CUDA IPC between processes of one host,
        ``Job.data_paths``); False where some peer takes host frames, and in
        a job of one process."""
        paths = self._data_paths
        return bool(paths) and all(path == "cuda-ipc" for path in paths.values())

    @property
    def config(self) -> Config:
        """The settings of this worker's engine."""
        return self._config

    def create_table(self, name: str, num_rows: int, row_width: int, *, local: bool = False,
                     update_rule: UpdateRule | None = None) -> Table:
        """Creates a table; every worker must create the same tables in the same order.

        A communicated table's updates go through ``update_rule`` on the
        servers, or through ``Config.update_rule`` when it is None; every
        worker must give the same rule (checked when the virtual iteration
        is finished)."""
        text("create_table: name", name)
        num_rows = integer(f"create_table({name!r}): num_rows", num_rows, 1, MAX_TABLE_VALUES)
        row_width = integer(f"create_table({name!r}): row_width", row_width, 1, MAX_TABLE_VALUES)
        local = boolean(f"create_table({name!r}): local", local)
        if update_rule is not None and not isinstance(update_rule, UpdateRule):
            raise ArgumentTypeError(f"create_table({name!r}): update_rule must be an UpdateRule, got "
                                    f"{type(update_rule).__name__}")
        if update_rule is not None and local:
            raise InvalidArgumentError(f"create_table({name!r}): a local table has no update rule")
        if num_rows * row_width > MAX_TABLE_VALUES:
            raise InvalidArgumentError(f"create_table({name!r}): {num_rows} x {row_width} values is more than "
                                       f"the 2**40 a table may hold")
        if not local and self._max_message_bytes is not None:
            _check_frames_fit(name, num_rows, row_width, self.num_workers, self._max_message_bytes)
        shard_bytes = 0
        rule = update_rule or self._config.update_rule
        if not local:
            # The shard allocates its slice and the rule's state once every
            # worker is ready, in host memory when the device has no room:
            # counted now, settled by finish_virtual_iteration's plan.
            base, extra = divmod(num_rows, self.num_workers)
            slice_rows = base + (1 if self.rank < extra else 0)
            arrays = 1 + rule.state_arrays
            shard_bytes = slice_rows * row_width * 4 * arrays
            self._host_memory.reserve(f"create_table({name!r}) of {num_rows} x {row_width}", shard_bytes,
                                      f"this shard's {slice_rows} rows x {arrays} arrays "
                                      f"({rule.kind!r} rule)")
        try:
            table_id = self._engine.create_table(name, num_rows, row_width, local,
                                                 None if update_rule is None else update_rule.to_core())
        except BaseException:
            self._host_memory.release(shard_bytes)
            raise
        self._shard_bytes_reserved += shard_bytes
        self._shard_bytes_of[table_id] = shard_bytes
        table = Table(table_id, name, num_rows, row_width, local, update_rule=update_rule)
        self._tables[table_id] = table
        return table

    def update_rule_of(self, table: Table) -> UpdateRule | None:
        """The rule the servers apply to a table's updates (None for local data)."""
        self._table_id(table)
        return None if table.local else table.update_rule or self._config.update_rule

    def set_learning_rate(self, table: Table, learning_rate: float) -> None:
        """Sets a table's learning rate from the first clock whose updates
        of the table this worker has not posted (in the middle of a clock
        before the table's update: from this clock, as torch applies a rate
        set before ``optimizer.step()``; after it: from the next one; before
        ``start_iterations``: from clock 0). That clock's updates carry the
        rate to the servers, which use it from that clock on, on the clock's
        branch. Every worker must set the same rate at the same point of the
        same clock; the servers fail the clock otherwise. Not for local
        tables or the ``add`` rule, which has no learning rate."""
        table_id = self._table_id(table)
        rate = real(f"set_learning_rate({table.name!r})", learning_rate, 0, MAX_LEARNING_RATE)
        self._engine.set_learning_rate(table_id, rate)

    def skip_step(self, *, if_set: int = 0, stream: int = 0) -> None:
        """Makes the current clock a skipped step on the servers, as torch
        skips ``optimizer.step()`` when a mixed-precision scaler finds an inf
        or NaN gradient: the clock's updates carry the mark, and a server
        that gets it from any worker applies no rule to any table for that
        clock, so values and optimizer state (momentum, Adam's moments and
        step count) stay as they were; the clock still ends as usual. With
        ``if_set`` (the address of a float32 in the worker's device memory
        that the application writes on ``stream``), only if that float is
        nonzero once the work queued on ``stream`` so far is done: the
        engine reads it before the clock's first update leaves, so the
        caller does not wait for the device. Call it before the clock's
        first update (``OutOfOrderError`` after: some may have left
        unmarked)."""
        self._engine.skip_step(integer("skip_step: if_set", if_set, 0, UINTPTR_MAX), _stream(stream))

    @property
    def tables(self) -> list[Table]:
        """This worker's tables, in creation order."""
        return [self._tables[table_id] for table_id in sorted(self._tables)]

    def create_tensor_table(self, name: str, layout: TensorLayout, *, local: bool = False,
                            update_rule: UpdateRule | None = None) -> Table:
        """Creates a table holding the tensors of ``layout``; use ``layout.rows``
        and ``layout.view`` to address them. ``update_rule`` as for
        :meth:`create_table`."""
        if not isinstance(layout, TensorLayout):
            raise ArgumentTypeError(f"create_tensor_table({name!r}): layout must be a TensorLayout, "
                                       f"got {type(layout).__name__}")
        if layout.num_rows == 0:
            raise InvalidArgumentError(f"layout for table {name!r} holds no tensors")
        table = self.create_table(name, layout.num_rows, layout.row_width, local=local, update_rule=update_rule)
        table = dataclasses.replace(table, layout=layout)
        self._tables[table.id] = table
        return table

    def _table_id(self, table: Table) -> int:
        if not isinstance(table, Table):
            raise ArgumentTypeError(f"expected a Table, got {type(table).__name__}")
        mine = self._tables.get(table.id)
        if mine is None or mine.name != table.name:
            raise NotFoundError(f"table {table.name!r} does not belong to worker {self.rank}")
        if mine is not table and (mine.num_rows, mine.row_width, mine.local) != (table.num_rows, table.row_width,
                                                                                 table.local):
            # A Table of a table dropped since, whose id and name came back (or one made by hand).
            raise NotFoundError(f"this Table {table.name!r} ({table.num_rows} x {table.row_width}) is not the worker's "
                                f"table of that name now ({mine.num_rows} x {mine.row_width}): was it dropped and "
                                "created again?")
        return table.id

    def _rows(self, table: Table, rows: Rows) -> np.ndarray:
        self._table_id(table)
        if rows is None:
            return np.arange(table.num_rows, dtype=np.int64)
        try:
            array = np.asarray(rows)
        except (ValueError, TypeError, OverflowError) as error:
            raise InvalidArgumentError(f"row ids for table {table.name!r} are not an array of integers: "
                                       f"{error}") from None
        if array.size == 0:
            array = array.astype(np.int64)  # [] is float64 to numpy; let the engine name the error
        if array.dtype.kind not in "iu":
            raise ArgumentTypeError(f"row ids for table {table.name!r} must be integers, got dtype {array.dtype}")
        if array.ndim != 1:
            raise InvalidArgumentError(f"row ids for table {table.name!r} must be 1-D, got shape {array.shape}")
        if array.size and array.dtype.kind == "u" and int(array.max()) >= table.num_rows:
            # uint64 values past 2**63 would wrap to negative ids in int64.
            raise InvalidArgumentError(f"row id {int(array.max())} is outside table {table.name!r} "
                                       f"(0..{table.num_rows - 1})")
        return array.astype(np.int64, copy=False)

    # -- the virtual iteration -------------------------------------------------
    def virtual_read(self, table: Table, rows: Rows = None, *, slack: int = 0) -> int:
        """Records a read of ``rows`` (all rows by default) that may be ``slack``
        clocks stale (0 = BSP); returns its handle."""
        row_ids = self._rows(table, rows)
        slack = integer("slack", slack, 0, INT32_MAX)
        handle = int(self._engine.virtual_read(table.id, row_ids, slack))
        self._read_slack = slack if self._read_slack is None else min(self._read_slack, slack)
        return handle

    def virtual_post_read(self, handle: int) -> None:
        self._engine.virtual_post_read(_handle(handle))

    def virtual_pre_update(self, table: Table, rows: Rows = None) -> int:
        """Records an update of ``rows``; returns its handle."""
        row_ids = self._rows(table, rows)
        handle = int(self._engine.virtual_pre_update(table.id, row_ids))
        self._update_shapes[handle] = (len(row_ids), table.row_width)
        return handle

    def virtual_update(self, handle: int) -> None:
        self._engine.virtual_update(_handle(handle))

    def virtual_local_access(self, table: Table, rows: Rows = None, *, fetch: bool = True) -> int:
        """Records an access to local data; ``fetch`` loads the old contents."""
        row_ids = self._rows(table, rows)
        return int(self._engine.virtual_local_access(table.id, row_ids, boolean("fetch", fetch)))

    def virtual_post_local_access(self, handle: int, *, keep: bool = True) -> None:
        """Closes a local access; ``keep`` writes the buffer back to the store."""
        self._engine.virtual_post_local_access(_handle(handle), boolean("keep", keep))

    def virtual_clock(self) -> None:
        self._engine.virtual_clock()

    def preview_plan(self) -> PlanPreview:
        """A dry run of :meth:`finish_virtual_iteration`'s plan for the
        iteration recorded so far (after ``virtual_clock``): the least
        ``Config.device_memory_budget`` it accepts and, when the budget holds
        that, the plan's sizes and the host memory it needs. Allocates
        nothing, and the plan is kept for ``finish_virtual_iteration``; when
        it does not fit, :meth:`reset_virtual_iteration` lets another
        iteration be recorded instead.

        Raises:
            OutOfOrderError: before ``virtual_clock``, or after
                ``finish_virtual_iteration``.
        """
        return PlanPreview.from_core(self._engine.preview_plan())

    def reset_virtual_iteration(self) -> None:
        """Drops the recorded virtual iteration (the tables stay), so that
        another can be recorded; its handles are no longer valid and new
        ones count from 0 again.

        Raises:
            OutOfOrderError: after ``finish_virtual_iteration``.
        """
        self._engine.reset_virtual_iteration()
        self._update_shapes.clear()

    def drop_tables(self, first: Table) -> None:
        """Drops ``first`` and every table created after it: their names,
        ids and host memory are free again, for a caller whose plan did not
        fit and who records with other tables. Every worker must drop the
        same tables, but for local ones (``local=True``), which are each
        worker's own.

        Raises:
            OutOfOrderError: after ``finish_virtual_iteration``, or while the
                virtual iteration has recorded calls
                (:meth:`reset_virtual_iteration` first).
            NotFoundError: ``first`` is not this worker's table.
        """
        first_id = self._table_id(first)
        self._engine.drop_tables(first_id)
        for table_id in [t for t in self._tables if t >= first_id]:
            del self._tables[table_id]
            reserved = self._shard_bytes_of.pop(table_id, 0)
            self._host_memory.release(reserved)
            self._shard_bytes_reserved -= reserved

    def reserve_device_memory(self, nbytes: int) -> None:
        """Declares the device memory the application will hold beside the
        engine during each clock (say, saved activations autograd keeps
        rather than local data): plans made from now on leave it out of the
        budget, ``Config.device_memory_budget`` or the automatic one. 0
        until set; a later call replaces it.

        Raises:
            InvalidArgumentError: ``nbytes`` is negative.
            OutOfOrderError: after ``finish_virtual_iteration``.
        """
        self._engine.reserve_device_memory(integer("nbytes", nbytes, 0, INT64_MAX))

    def release_host_memory_during_init(self, nbytes: int) -> None:
        """Declares host memory the application holds now and frees while it
        writes initial values between ``finish_virtual_iteration`` and
        ``start_iterations`` (worker 0's copy of a model, freed table by
        table as written). A server shard whose state lives in host memory
        allocates each table's state as those writes arrive, so the host
        checks of ``finish_virtual_iteration`` let that state take up to
        ``nbytes`` beyond the memory available now; everything else the plan
        allocates must fit now. 0 until set; a later call replaces it.

        Raises:
            InvalidArgumentError: ``nbytes`` is negative.
            OutOfOrderError: after ``finish_virtual_iteration``.
        """
        nbytes = integer("nbytes", nbytes, 0, INT64_MAX)
        self._engine.release_host_memory_during_init(nbytes)
        self._host_freed_during_init = nbytes

    def planned_host_bytes(self) -> int:
        """The host memory ``finish_virtual_iteration`` will hold, as the
        engine's plan counts it (``PlanPreview.host_memory_bytes``; the
        shards' memory is counted at ``create_table``): host-resident
        parameter caches with their update logs and local data, the staging
        buffer, the update payloads in flight, and on the CPU backend the
        access-buffer pool and the device-resident stores. 0 when the
        budget cannot hold the plan (``finish_virtual_iteration`` refuses it)."""
        preview = self.preview_plan()
        return preview.host_memory_bytes if preview.fits else 0

    def finish_virtual_iteration(self) -> None:
        """Lays rows out, places them under the memory budget, builds indexes.

        Raises:
            ResourceExhaustedError: ``Config.device_memory_budget`` cannot
                hold the least access-buffer pool (the message gives it), or
                the plan needs more host memory than this process may have
                (see :class:`~mltuner.Config`'s ``host_memory_limit``; the
                message gives the need, part by part, and the limit);
                nothing was allocated.
        """
        try:
            preview: PlanPreview | None = self.preview_plan()  # the engine keeps this plan: planned once
        except OutOfOrderError:
            preview = None  # no clock yet, or finished: the engine's finish says which
        needed = preview.host_memory_bytes if preview is not None and preview.fits else 0
        # The plan counts the shard's state where it will live; create_table
        # reserved it as host memory already.
        shard = self._shard_bytes_reserved if needed else 0
        in_host = bool(preview.host_memory["shard_in_host_memory"]) if needed and preview is not None else False
        if needed:
            assert preview is not None
            # A shard's state in host memory is allocated as worker 0 writes
            # initial values, while the application frees its copies of them.
            later = min(shard, self._host_freed_during_init) if in_host else 0
            self._host_memory.reserve("finish_virtual_iteration", needed, preview.host_memory_detail,
                                      in_place_of=shard if in_host else 0, freed_meanwhile=later)
        try:
            self._engine.finish_virtual_iteration()
        except BaseException:
            self._host_memory.release(needed - (shard if in_host else 0))
            raise
        if shard and not in_host:
            self._host_memory.release(shard)  # the state goes to the device
        self._shard_bytes_reserved -= shard

    def write_initial(self, handle: int, values: np.ndarray) -> None:
        """Initialisation phase only (after :meth:`finish_virtual_iteration`,
        before :meth:`start_iterations`): adds ``values``, float32 host
        memory holding the recorded update's rows in its row order (of its
        shape, rows x row width, or flat), to the servers' values, as
        :meth:`pre_update`, writing the buffer and :meth:`update` would, with
        no device buffer in between: how worker 0 writes a model's initial
        values. With ``Config.check_finite`` a NaN or infinity among them is
        refused (:class:`~mltuner.NonFiniteError`)."""
        if not isinstance(values, np.ndarray) or values.dtype != np.float32:
            what = f"an array of {values.dtype}" if isinstance(values, np.ndarray) else type(values).__name__
            raise ArgumentTypeError(f"write_initial: values must be a float32 numpy array, got {what}")
        handle = _handle(handle)
        shape = self._update_shapes.get(handle)
        if shape is not None and values.ndim != 1 and values.shape != shape:
            raise InvalidArgumentError(f"write_initial: values of shape {values.shape} for update {handle}, whose "
                                       f"rows are {shape} (rows x row width; a flat array of their values works too)")
        if self._config.check_finite and not np.isfinite(values).all():
            raise NonFiniteError(f"write_initial: the initial values of update {handle} hold a NaN or an infinity "
                                 "(Config.check_finite)")
        self._engine.write_initial(handle, values)  # the binding takes them made contiguous

    def start_iterations(self) -> None:
        """Ends initialisation and starts the background threads."""
        self._engine.start_iterations()
        self._started = True

    @property
    def checkpoints(self) -> Checkpoints | None:
        """Saving and restoring checkpoints of this worker's job (its
        ``mltuner.Job``); None for a worker outside a Job (a ``LocalCluster``'s)."""
        return None if self._checkpoints is None else self._checkpoints()

    @property
    def iterations_started(self) -> bool:
        """Whether :meth:`start_iterations` ran (``mltuner.torch.wrap`` runs it)."""
        return self._started

    # -- real accesses -----------------------------------------------------------
    def read(self, handle: int, *, stream: int = 0) -> Buffer:
        """The rows of a recorded read, fresh within its slack (read-only).

        On CUDA the buffer's contents are still being written by the engine
        when it is returned: ``stream`` (the stream your kernels will read it
        on; 0 = the legacy default stream) is made to wait for them, without
        blocking this thread."""
        buffer, age = self._engine.read(_handle(handle), _stream(stream))
        self._last_data_age = int(age)
        return buffer

    def post_read(self, handle: int, *, stream: int = 0) -> None:
        """Hands a read buffer back once ``stream``'s work on it is done."""
        self._engine.post_read(_handle(handle), _stream(stream))

    def pre_update(self, handle: int, *, stream: int = 0) -> Buffer:
        """A zeroed buffer to write this clock's update of the recorded rows
        into (``stream`` as for :meth:`read`)."""
        buffer, _ = self._engine.pre_update(_handle(handle), _stream(stream))
        return self._hand_out(int(handle), buffer)

    def update(self, handle: int, *, stream: int = 0) -> None:
        """Hands the update buffer to the engine, which adds it and ships it
        once ``stream``'s work on it is done."""
        handle, stream = _handle(handle), _stream(stream)
        with self._taken_back(handle):
            self._engine.update(handle, stream)

    def local_access(self, handle: int, *, stream: int = 0) -> Buffer:
        """The rows of a recorded local access (``stream`` as for :meth:`read`)."""
        buffer, _ = self._engine.local_access(_handle(handle), _stream(stream))
        return self._hand_out(int(handle), buffer)

    def post_local_access(self, handle: int, *, stream: int = 0) -> None:
        handle, stream = _handle(handle), _stream(stream)
        with self._taken_back(handle):
            self._engine.post_local_access(handle, stream)

    def _run_ops(self, ops: list[tuple[Any, ...]], stream: int) -> list[Buffer]:
        """:meth:`run` for the PyTorch adapter, without the per-op checks
        (its handles and kinds come from its own recording): ``ops`` hold
        OpKind numbers, and an update or post_local_access may carry a third
        item, pieces ``(address, offset, count)`` of float32 memory on the
        worker's device that the engine copies into the buffer on ``stream``
        before the post; a post_local_access a fourth, pieces it copies out
        of the buffer (a stored activation read back); an update a fifth,
        the address of a float32 on that device whose value when the copy
        runs, if nonzero, makes it write zeros instead (a mixed-precision
        scaler's overflow flag; 0: none). The addresses are
        trusted: the adapter takes them from tensors it checked (dtype,
        device, contiguity) or made."""
        return list(self._engine.run(ops, stream))

    def _hand_out(self, handle: int, buffer: Buffer) -> Buffer:
        if isinstance(buffer, np.ndarray):
            self._handed_out[handle] = weakref.ref(buffer)
        return buffer

    @contextlib.contextmanager
    def _taken_back(self, handle: int) -> Iterator[None]:
        """Makes the buffer handed out for ``handle``, if the application still
        holds it, read-only for the engine's post call (a write after the post
        would change what the engine ships); a failed post makes it writable
        again."""
        reference = self._handed_out.pop(handle, None)
        buffer = reference() if reference is not None else None
        if buffer is None:
            yield
            return
        buffer.flags.writeable = False
        del buffer  # hold no reference while the engine takes the memory back
        try:
            yield
        except BaseException:
            again = reference() if reference is not None else None
            if again is not None:
                with contextlib.suppress(ValueError):  # numpy may refuse; the post's own error matters
                    again.flags.writeable = True
            raise

    def clock(self) -> None:
        """Ends the current iteration."""
        self._engine.clock()

    def finish_clock(self, *, stream: int = 0) -> int:
        """Ends a clock the loop left in the middle (a Ctrl-C, an exception):
        runs the rest of its recorded ops with nothing done in between, so
        its reads are given back, its updates send what their buffers hold
        (zeros where nothing was written: a step of zero gradient, through
        which momentum still moves the parameters), its local accesses keep
        theirs, and the clock ends; the loop goes on from the next clock. At
        a clock boundary it does nothing. Returns the ops it ran; interrupted
        itself, it may be called again and goes on where it stopped."""
        with contextlib.ExitStack() as taken_back:
            for handle in list(self._handed_out):
                taken_back.enter_context(self._taken_back(handle))
            return int(self._engine.finish_clock(_stream(stream)))

    def run(self, ops: Sequence[tuple[str, int]], *, stream: int = 0) -> list[Buffer]:
        """Several consecutive recorded ops in one engine call, exactly as if
        each were called in order: ``ops`` are ``(kind, handle)`` pairs, the
        kind one of ``"read"``, ``"post_read"``, ``"pre_update"``,
        ``"update"``, ``"local_access"``, ``"post_local_access"`` or
        ``"clock"`` (handle ignored). Returns the buffers of the open ops, in
        order.

        On CUDA it costs two driver calls in all instead of one per op: the
        posts share one ticket of ``stream``'s work so far, and ``stream``
        waits once for every buffer opened. A failed op raises as its own
        call would; the ops before it took effect."""
        calls = []
        for op in ops:
            if not isinstance(op, (tuple, list)) or len(op) != 2:
                raise InvalidArgumentError(f"run: each op is a (kind, handle) pair, got {op!r}")
            kind, handle = op
            number = OP_KINDS.get(kind)
            if number is None:
                raise InvalidArgumentError(f"run: unknown op kind {kind!r}; one of {', '.join(OP_KINDS)}")
            calls.append((number, -1 if number == _CLOCK else _handle(handle)))
        posted = [h for n, h in calls if n in _POSTS_OF_WRITABLE]
        with contextlib.ExitStack() as taken_back:
            for handle in posted:
                taken_back.enter_context(self._taken_back(handle))
            buffers = self._engine.run(calls, _stream(stream))
        opens = [(n, h) for n, h in calls if n in _OPENS]
        for (number, handle), buffer in zip(opens, buffers):
            if number in _WRITABLE_OPENS:
                self._hand_out(handle, buffer)
        return list(buffers)

    # -- branches (Config.branches) ---------------------------------------------
    def fork_branch(self, child: int, parent: int, *, learning_rate: float | None = None,
                    momentum: float | None = None, training: bool = True, slack: int | None = None,
                    keep_rate_ratios: bool = False) -> None:
        """Copies ``parent``'s parameters and optimizer state into a new branch
        ``child`` on every shard, with its own learning rate and momentum for
        every table's rule (``None``: each table keeps the parent's; momentum
        is read by the sgd and damped_momentum rules), training flag (only
        training branches apply updates) and staleness (``None``: each read's
        own slack). With ``keep_rate_ratios``, ``learning_rate`` is the rate
        of the parent's fastest table and every table keeps its ratio to it
        (tables of param groups with different rates; one at 0 stays at 0;
        ``add`` tables, which have no rate, aside), the ratios of a parent
        forked so while no rate changed (a chain of forks rounds once);
        where the parent's rates are all 0, every table takes it. Every
        worker calls it at the same clock boundary; it
        returns once the fork is done everywhere. A shard that cannot hold
        the copy (where its state lives in host memory: more than the host
        has available) refuses it with the sizes, every worker raises
        ResourceExhaustedError, and the fork is undone on every shard."""
        keep = -1.0  # the engine's BranchSettings::kKeepParent
        self._engine.fork_branch(
            integer("fork_branch: child", child, 0, INT32_MAX), integer("fork_branch: parent", parent, 0, INT32_MAX),
            keep if learning_rate is None else real("fork_branch: learning_rate", learning_rate, 0, MAX_LEARNING_RATE),
            keep if momentum is None else real("fork_branch: momentum", momentum, 0, 1, high_open=True),
            boolean("fork_branch: training", training),
            -1 if slack is None else integer("fork_branch: slack", slack, 0, INT32_MAX),
            boolean("fork_branch: keep_rate_ratios", keep_rate_ratios))
        _call_live(self._branch_listeners, child, parent)

    def free_branch(self, branch: int) -> None:
        """Releases a branch on every shard (every worker, same clock boundary)."""
        self._engine.free_branch(integer("free_branch: branch", branch, 0, INT32_MAX))
        _call_live(self._branch_listeners, branch, None)

    def add_branch_listener(self, callback: Callable[[int, int | None], None]) -> None:
        """Calls ``callback(child, parent)`` (a bound method, held weakly)
        after each :meth:`fork_branch`, and ``callback(branch, None)`` after
        each :meth:`free_branch`: ``mltuner.torch`` gives each branch the
        GradScaler state of its parent at the fork."""
        self._branch_listeners.append(weakref.WeakMethod(callback))

    def schedule_branch(self, branch: int, clocks: int) -> None:
        """Runs the next ``clocks`` clocks on ``branch``. Each branch counts its
        own clocks; switching reloads the cache with that branch's rows."""
        self._engine.schedule_branch(integer("schedule_branch: branch", branch, 0, INT32_MAX),
                                     integer("schedule_branch: clocks", clocks, 1, 2**62))

    def declare_empty_clock(self, worker: int, branch: int, clock: int) -> None:
        """Tells every shard that ``worker``'s ``clock`` of ``branch`` computes
        nothing: its samples went to the other workers (batch stealing,
        ``TuningSession(steal_batches=True)``). The shards count that clock
        at once instead of waiting for the worker, and drop the update it
        still sends for it, which must be zero (a shard refuses any other,
        and the job stops). Any worker may declare it once the clock is
        scheduled; one that reaches a shard after the worker's own update
        changes nothing there. Returns without waiting for the shards."""
        self._engine.declare_empty_clock(integer("declare_empty_clock: worker", worker, 0, INT32_MAX),
                                         integer("declare_empty_clock: branch", branch, 0, INT32_MAX),
                                         integer("declare_empty_clock: clock", clock, 0, 2**62))

    @property
    def branch(self) -> int:
        """The branch of the last finished clock (0 before any)."""
        return int(self._engine.stats().branch)

    @property
    def trained_branch(self) -> int | None:
        """The branch that holds the trained model where that is not the
        branch of the last finished clock: a tuning session's final branch,
        set when the session ends (its last clocks ran on a validation
        branch, which it freed). None otherwise. ``mltuner.torch`` reads a
        model's values from it by default, and clocks that nobody scheduled
        run on it (the loop trains on after the session), one at a time:
        ``schedule_branch`` still decides the clocks it is given."""
        return self._trained_branch

    @trained_branch.setter
    def trained_branch(self, branch: int | None) -> None:
        self.set_trained(branch, None)

    @property
    def scheduled_ahead(self) -> int:
        """Clocks scheduled on branches from the next one on (0 without
        ``Config.branches``)."""
        return int(self._engine.stats().scheduled_ahead)

    @property
    def next_branch(self) -> int | None:
        """The branch the next clock runs on: the one scheduled, else the
        trained branch that unscheduled clocks go on from; None when there
        is neither (the clock is refused) or without ``Config.branches``."""
        if not self._config.branches:
            return None
        branch = int(self._engine.stats().next_branch)
        return None if branch < 0 else branch

    def add_trained_listener(self, callback: Callable[[], None]) -> None:
        """Calls ``callback`` (a bound method, held weakly) after each
        :meth:`set_trained`: ``mltuner.torch`` shows the trained setting in
        the model's param groups at once."""
        self._trained_listeners.append(weakref.WeakMethod(callback))

    def add_session_check(self, check: Callable[[frozenset[str]], None]) -> None:
        """Calls ``check(settings)`` (a bound method, held weakly) when a
        tuning session that sets ``settings`` (``"lr"``, ``"momentum"``) on
        its branches starts on this worker, before it forks anything; what
        it raises refuses the session: ``mltuner.torch`` refuses a rate
        written since the last clock, which the servers have not seen."""
        self._session_checks.append(weakref.WeakMethod(check))

    def check_session_start(self, settings: frozenset[str]) -> None:
        """Runs the :meth:`add_session_check` checks (a tuning session
        calls it as it starts)."""
        _call_live(self._session_checks, settings)

    @property
    def trained_tunables(self) -> dict[str, Any] | None:
        """The setting :attr:`trained_branch` trained with (a tuning
        session's ``final_tunables``); None when not known."""
        return None if self._trained_tunables is None else dict(self._trained_tunables)

    def set_trained(self, branch: int | None, tunables: Mapping[str, Any] | None) -> None:
        """Sets :attr:`trained_branch` and :attr:`trained_tunables` (every
        worker, at the same clock boundary: a tuning session does at its end)."""
        branch = None if branch is None else integer("trained_branch", branch, 0, INT32_MAX)
        self._engine.continue_on_branch(-1 if branch is None else branch)
        self._trained_branch = branch
        self._trained_tunables = None if tunables is None else dict(tunables)
        _call_live(self._trained_listeners)

    @property
    def last_read_data_age(self) -> int:
        """Data age of the last read: every worker's updates through this clock
        are in its rows."""
        return self._last_data_age

    # -- inspection and lifetime -------------------------------------------------
    def fetch(self, table: Table, rows: Rows = None, *, branch: int | None = None) -> np.ndarray:
        """A copy of the servers' current values of ``rows`` (any phase), from
        ``branch`` (default: the branch of the last finished clock)."""
        row_ids = self._rows(table, rows)
        return self._engine.fetch(table.id, row_ids, table.row_width,
                                  -1 if branch is None else integer("fetch: branch", branch, 0, INT32_MAX))

    def data_age(self, table: Table) -> int:
        """The clock through which every worker's updates are in this worker's
        cache (-1 before any). A local table has none: InvalidArgumentError."""
        table_id = self._table_id(table)
        if table.local:
            raise InvalidArgumentError(f"table {table.name!r} is local: it has no data age")
        return int(self._engine.data_age(table_id))

    def flush(self) -> None:
        """Waits until the updates of every clock this worker finished have
        been handed to the transport."""
        self._engine.flush()

    def sync(self) -> None:
        """Waits until every worker's updates of the clocks this worker has
        finished are applied and visible in its cache (a barrier on clocks)."""
        self._engine.flush()
        finished = int(self._engine.stats().branch_clock)  # clocks of the current branch
        for table in self._tables.values():
            if not table.local:
                self._engine.wait_for_data_age(table.id, finished - 1)

    @property
    def read_slack(self) -> int | None:
        """The least slack of the recorded reads (the one that binds the
        clocks), None before any; a branch forked with its own slack
        overrides it for that branch."""
        return self._read_slack

    @property
    def stall_seconds(self) -> float:
        """Seconds this worker's application has waited for buffers so far
        (``stats["stall_seconds"]``, without building the whole dict: cheap
        enough to read every clock)."""
        return float(self._engine.stats().stall_seconds)

    @property
    def stats(self) -> dict[str, float]:
        """Counters: clock, stall seconds, bytes gathered, swapped and scattered, ...;
        and the plan's sizes, budget and ``prefetch_clocks`` (Config's, or
        the plan's choice when Config leaves it None)."""
        core = self._engine.stats()
        names = [n for n in dir(core) if not n.startswith("_")]
        return {n: getattr(core, n) for n in names}

    @property
    def plan(self) -> str:
        """A description of the placement made by finish_virtual_iteration:
        the budget, ``prefetch_clocks`` and why (``prefetch_clocks 0 (chosen:
        ...)``), the pool, the stores, the host memory, what went where (entries of
        parameters and local data on the device and in host memory), the
        predicted bytes moved per clock host->device and device->host, and
        which tables' clocks move in parts (``Config.clock_part_bytes``)."""
        return str(self._engine.describe_plan())

    def shutdown(self) -> None:
        """Stops this worker's threads; later calls raise ShutdownError."""
        self._engine.shutdown()


# Engine::Run's op kinds (OpKind's numbers in cpp/include/mltuner/types.h).
OP_KINDS = {"read": 0, "post_read": 1, "pre_update": 2, "update": 3, "local_access": 4, "post_local_access": 5,
            "clock": 6}
_CLOCK = 6
_OPENS = frozenset({0, 2, 4})
_WRITABLE_OPENS = frozenset({2, 4})  # their numpy buffers become read-only at the post
_POSTS_OF_WRITABLE = frozenset({3, 5})


def _handle(handle: object) -> int:
    # Any int32: the engine names an unknown handle and its op.
    return integer("handle", handle, -INT32_MAX - 1, INT32_MAX)


def _stream(stream: object) -> int:
    return integer("stream", stream, 0, UINTPTR_MAX)


# Frame 0 of a message: the 64-byte header, 16 bytes per row span, and text
# (the table schema of kReady grows with the tables: this bounds it).
_HEADER_BYTES = 64
_SPAN_BYTES = 16
_TEXT_BYTES = 64 << 10


def largest_frame_bytes(num_rows: int, row_width: int, num_shards: int) -> int:
    """The largest frame a table's messages can have: a shard's whole slice
    of rows as payload, or as spans of one row each in frame 0."""
    rows = -(-num_rows // num_shards)
    return max(rows * row_width * 4, _HEADER_BYTES + _SPAN_BYTES * rows + _TEXT_BYTES)


def _check_frames_fit(name: str, num_rows: int, row_width: int, num_shards: int, limit: int) -> None:
    needed = largest_frame_bytes(num_rows, row_width, num_shards)
    if needed > limit:
        raise InvalidArgumentError(
            f"table {name!r} ({num_rows} x {row_width}) needs messages of up to {needed} bytes between "
            f"{num_shards} processes, more than the data sockets accept ({limit} bytes): raise "
            f"Job(max_message_bytes=...) to at least {needed}, or split the table")


def _call_live(callbacks: list[weakref.WeakMethod[Callable[..., None]]], *args: Any) -> None:
    """Calls each weakly held bound method whose object is alive with
    ``args``, in order, and forgets the dead ones."""
    for reference in list(callbacks):
        callback = reference()
        if callback is None:
            callbacks.remove(reference)
        else:
            callback(*args)
