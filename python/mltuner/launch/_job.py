"""Job: this process's part of a distributed training job.

A job is N worker processes; each runs one engine and one server shard
(the GeePS layout). Creating a :class:`Job` reads where this process sits
(``mltuner launch``, torchrun, Slurm or Open MPI variables), meets the other
ranks at rank 0's address, and connects every pair of processes. The same
script runs unchanged under any of those launchers, or alone.

Example::

    with mltuner.Job(mltuner.Config(update_rule=mltuner.UpdateRule("sgd", 0.1))) as job:
        worker = job.worker
        ...  # create tables, record the virtual iteration, train
        job.save_checkpoint("ckpt")
"""

from __future__ import annotations

import atexit
import contextlib
import dataclasses
import json
import logging
import os
import socket
import sys
import threading
import time
import warnings
import weakref
from collections.abc import Callable, Mapping
from pathlib import Path
from types import TracebackType
from typing import Any

import zmq

from mltuner import _core
from mltuner._config import MAX_WAIT_S, MOST_AUTO_PREFETCH_CLOCKS, Config
from mltuner._validate import boolean, integer, real, text
from mltuner.client._worker import Worker, largest_frame_bytes
from mltuner.exceptions import ArgumentTypeError, InvalidArgumentError, MltunerError, OutOfOrderError, ShutdownError
from mltuner.launch import _checkpoint
from mltuner.launch._env import TRANSPORTS, ProcessEnv, detect_environment, is_loopback
from mltuner.launch._rendezvous import ControlClient, Coordinator
from mltuner.launch._root_lock import RootLocks
from mltuner.launch._torch_store import job_key, lookup_address, publish_address
from mltuner.launch._uneven import ClockLender
from mltuner.transport._address import Card, IpcDirectory, TransportKind, choose_address, host_identity
from mltuner.transport import _cuda_ipc
from mltuner.transport._control import (CONTROL_IO_THREAD, CONTROL_RECEIVE_QUEUE, DATA_IO_THREAD, MAX_SIGNAL_BYTES,
                                        ControlChannel, refused_connections)
from mltuner.transport._guard import ConnectionGuard, Listener, limit_input
from mltuner.transport._security import (CurveKeys, SocketSecurity, derive_keys, secure_server, start_authenticator,
                                         user_loopback_secret)
from mltuner.transport._sockets import RECEIVE_QUEUE_MESSAGES, SocketTransport

__all__ = ["Job", "DEFAULT_MAX_MESSAGE_BYTES"]

# The largest frame a data socket accepts unless Job(max_message_bytes=...)
# says otherwise: a table's slice on one shard must fit (create_table checks).
DEFAULT_MAX_MESSAGE_BYTES = 256 << 20
# Connections a data or control socket accepts beyond one per peer (reconnects).
_SPARE_CONNECTIONS = 16
# How long after a peer said it is closing a collective call of this rank
# still waits: one that peer completed before closing may be answered late.
_CLOSING_GRACE_S = 1.0
# How long an engine call of a tuning session may wait while a peer has
# closed the job before it is ended as hopeless (_watch_engine_wait): long
# enough for the closed peer's last updates to arrive.
_CLOSED_PEER_WAIT_S = 3.0
# The least max_queued_bytes the plan gives (tiny models send many small messages).
_MIN_QUEUE_BYTES = 4 << 20

_log = logging.getLogger("mltuner.launch")
# Jobs still open when the interpreter exits are closed (not gracefully)
# before Python tears down, while their threads can still be joined: left to
# the engine's destructors at teardown, joinable threads ended the process
# with std::terminate.
_open_jobs: weakref.WeakSet[Job] = weakref.WeakSet()


def _warn_uneven_end(clocks: list[Any], lent: bool) -> None:
    """Ranks that close at different clocks (uneven data splits, a loop
    bound off by one): the trained values differ from an even run's, so
    every rank says so."""
    if len(set(clocks)) <= 1:
        return
    ends = ", ".join(f"rank {rank} at clock {clock}" for rank, clock in enumerate(clocks))
    if lent:  # _uneven.py: the ranks that closed early lent their later clocks
        warnings.warn(f"the ranks closed the job at different clocks ({ends}): the clocks a rank did not run "
                      "counted its update as zero (as PyTorch DDP's Join)", stacklevel=3)
    else:
        warnings.warn(f"the ranks closed the job at different clocks ({ends}): every rank must run the same number "
                      "of clocks (the clocks past the fewest have updates that no shard completed; check the "
                      "ranks' loop bounds and data lengths, e.g. DistributedSampler's padding)", stacklevel=3)


def _rendezvous_place(env: ProcessEnv) -> tuple[Any, ...]:
    """Where a Job of this thread meets its peers, as rank ``env.rank``."""
    return env.master_addr, env.master_port, env.torch_store_key, env.rank, threading.get_ident()


def _refuse_a_second_rendezvous(env: ProcessEnv, place: tuple[Any, ...]) -> None:
    """A second Job of a script on the rendezvous of its open one (one Job
    per model, a GAN's two networks, under one launcher) would meet the
    first one's peers: rank 0 failed to bind the port, the others claimed
    ranks twice. Refused before anything binds, with the way out. (Jobs of
    one rank on other threads are left to the rendezvous, which refuses a
    rank claimed twice: tests play processes so.)"""
    for other in list(_open_jobs):
        if not other._closed and other.world_size > 1 and other._place == place:
            own = ("torch_store_key=first_job.env.torch_store_key + '/2'" if env.torch_store_key else
                   "master_port=<another port free on rank 0's host>")
            raise InvalidArgumentError(
                f"this process already has an open Job on the rendezvous {env.master_addr}:{env.master_port} "
                f"(rank {other.rank} of {other.world_size}): a second Job (one per model, as a GAN's two networks "
                "need: a worker holds one wrapped model) needs a rendezvous of its own, the same on every rank: "
                f"mltuner.Job(env=dataclasses.replace(first_job.env, {own}))")


@atexit.register
def _close_open_jobs() -> None:
    # A script that ends normally leaves gracefully (its last updates, the
    # close barrier, a goodbye); one ending on an uncaught exception, which
    # the interpreter keeps in sys.last_value, does not, so its peers see it
    # fail within their heartbeat timeout instead of waiting for it. A
    # SystemExit leaves no trace here (Python hands atexit no exit status):
    # sys.exit(1) ends as gracefully as the script's end, docs/distributed.md.
    failed = getattr(sys, "last_value", None) is not None
    unanswered: MltunerError | None = None
    for job in list(_open_jobs):
        try:
            job.close(graceful=not failed)
        except MltunerError as error:  # every job is closed first
            unanswered = unanswered or error
    if unanswered is not None:
        # An exception here would be printed and ignored, and the process
        # exit 0 as if the job had finished: the launcher must see it fail.
        _log.error("mltuner: closing the job at exit: %s", unanswered)
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(Exception):
                stream.flush()
        os._exit(1)


class Job:
    """This process's worker in a job of ``world_size`` processes.

    Args:
        config: engine settings; every rank must use the same update rule,
            wait timeout and prefetch depth (checked at the rendezvous).
        env: where this process sits; by default read from the environment
            (see :func:`mltuner.launch.detect_environment`).
        rendezvous_timeout_s: how long to wait for every rank to arrive.
        heartbeat_interval_s: how often each process tells every peer it is alive.
        heartbeat_timeout_s: a peer silent this long is declared lost: every
            engine call on this process then raises
            :class:`~mltuner.PeerLostError` naming its rank.
        secure: how sockets authenticate their peers. ``None`` (default):
            every ``tcp://`` socket (loopback included) is a ZeroMQ CURVE
            socket with keys derived from the job's secret
            (``MLTUNER_SECRET``, a file named by ``MLTUNER_SECRET_FILE``, or
            on loopback this user's own key); ``ipc://`` sockets are plain,
            authenticated by their directory that only this user can open.
            ``True``: CURVE on ``ipc://`` sockets too. ``False``: no CURVE,
            only allowed on loopback addresses; any local process may then
            inject messages: for measurements only (docs/distributed.md,
            Security).
        max_message_bytes: the largest frame a data socket accepts (ZeroMQ
            refuses a larger announced frame before allocating it). Every
            table's slice on one shard must fit: ``create_table`` refuses a
            table that would need more, naming this setting.
        transport: how this process reaches its peers: ``"auto"`` (``ipc://``
            to processes of this host, ``tcp://`` to others), ``"tcp"`` or
            ``"ipc"`` (every peer must be on this host). ``None``: the
            ``MLTUNER_TRANSPORT`` variable's choice, by default ``"auto"``.
        max_queued_bytes: the payload bytes that may wait in ZeroMQ to be
            sent to one peer (and, times the peers, in the node's outbox
            before that); a send beyond it waits for the peer
            (back-pressure), for at most ``config.wait_timeout_s``, then the
            job fails naming it. ``None`` (default): from the plan,
            ``prefetch_clocks + 2`` clocks of this process's traffic to one
            peer (with ``prefetch_clocks`` None, the most the plan chooses:
            1), and at least twice the largest message and 4 MiB.
        cuda_ipc: whether engines of processes on one host move updates
            and fresh rows directly (a small notice on the socket) instead
            of through host frames: CUDA engines device -> device by CUDA
            IPC, CPU engines through shared memory (a memory file their
            peers map). Used per pair of processes where both can;
            elsewhere host frames. ``None``: ``MLTUNER_CUDA_IPC`` (``0``
            turns it off), by default on.
        cuda_ipc_slice_bytes: device memory each process sets aside per peer
            for payloads landing by CUDA IPC (outside the engine's budget);
            a payload that does not fit beside those in flight goes by host
            frames. ``None``: ``MLTUNER_CUDA_IPC_SLICE_BYTES``, by default
            2 GiB or a sixteenth of the GPU's memory, whichever is less,
            shared by the peers, at least 256 MiB each (2 GiB holds a clock
            of a model up to about 1 GiB on two processes). On a CPU the
            region is shared memory that takes RAM only where written.

    Attributes:
        worker: the access API (:class:`mltuner.Worker`).
        rank, world_size, local_rank: this process's place in the job.
    """

    def __init__(self, config: Config | None = None, *, env: ProcessEnv | None = None,
                 rendezvous_timeout_s: float = 120.0, heartbeat_interval_s: float = 0.5,
                 heartbeat_timeout_s: float = 5.0, secure: bool | None = None,
                 max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES, transport: TransportKind | None = None,
                 max_queued_bytes: int | None = None, cuda_ipc: bool | None = None,
                 cuda_ipc_slice_bytes: int | None = None) -> None:
        if config is not None and not isinstance(config, Config):
            raise ArgumentTypeError(f"Job: config must be a Config, got {type(config).__name__}")
        rendezvous_timeout_s = real("Job: rendezvous_timeout_s", rendezvous_timeout_s, 0, MAX_WAIT_S, low_open=True)
        heartbeat_timeout_s = real("Job: heartbeat_timeout_s", heartbeat_timeout_s, 0, MAX_WAIT_S, low_open=True)
        heartbeat_interval_s = real("Job: heartbeat_interval_s", heartbeat_interval_s, 0, heartbeat_timeout_s,
                                    low_open=True, high_open=True)
        if secure is not None:
            boolean("Job: secure", secure)
        if isinstance(max_message_bytes, bool) or not isinstance(max_message_bytes, int) \
                or not 1 << 20 <= max_message_bytes <= 1 << 62:
            raise InvalidArgumentError(f"max_message_bytes must be an integer in [2**20, 2**62], "
                                       f"got {max_message_bytes!r}")
        if transport is not None and transport not in TRANSPORTS:
            raise InvalidArgumentError(f"Job: transport must be one of {', '.join(TRANSPORTS)}, got {transport!r}")
        if max_queued_bytes is not None:
            max_queued_bytes = integer("Job: max_queued_bytes", max_queued_bytes, 1, 1 << 62)
        if cuda_ipc is not None:
            boolean("Job: cuda_ipc", cuda_ipc)
        self._cuda_ipc = _cuda_ipc.cuda_ipc_wanted(cuda_ipc)
        self._cuda_ipc_slice_asked = _cuda_ipc.slice_bytes_setting(cuda_ipc_slice_bytes)
        self._cuda_ipc_slice = 0  # chosen at the rendezvous
        self._max_message_bytes = max_message_bytes
        self._max_queued_bytes = max_queued_bytes
        self.config = config or Config()
        self.env = env or detect_environment()
        self.transport: TransportKind = transport or self.env.transport
        self.rank = self.env.rank
        self.world_size = self.env.world_size
        self.local_rank = self.env.local_rank
        self._timeout_s = self.config.wait_timeout_s
        self._closed = True  # until the node below exists: nothing to close before it
        self._first_clock = 0  # the clock training resumed from (restore_checkpoint)
        self._root_locks = RootLocks()  # the checkpoint roots this job (rank 0) writes into
        self._context: zmq.Context[zmq.Socket[bytes]] | None = None
        self._authenticator: object | None = None
        self._coordinator: Coordinator | None = None
        self._control: ControlClient | None = None
        self._services: dict[str, Callable[[int, Any], Any]] = {}  # rank 0's handlers (serve)
        self._transport: SocketTransport | None = None
        self._liveness: ControlChannel | None = None
        self._ipc: IpcDirectory | None = None
        self._queue_plan: tuple[int, int] = (-1, 0)  # (tables seen, the limit for them)
        self.endpoint = ""  # where peers on other hosts send to this process (empty when alone)
        self.peer_endpoints: dict[int, str] = {}  # where this process sends each peer's data
        # How device payloads reach each peer: "cuda-ipc" or "host-frames (why)".
        self.data_paths: dict[int, str] = {}
        self._place = _rendezvous_place(self.env)  # with the thread that opened it
        if self.world_size > 1:
            _refuse_a_second_rendezvous(self.env, self._place)
        self._node = _core.ProcessNode(self.config.to_core(), self.rank, self.world_size, self.config.device,
                                       self.local_rank)
        self._closed = False
        self.worker = Worker(self._node.engine, owner=self._node, config=self.config,
                             max_message_bytes=self._max_message_bytes if self.world_size > 1 else None,
                             data_paths=self.data_paths, checkpoints=self)
        _open_jobs.add(self)
        if self.world_size > 1:
            try:
                self._connect(SocketSecurity(self._keys(secure), curve_on_ipc=secure is True), rendezvous_timeout_s,
                              heartbeat_interval_s, heartbeat_timeout_s)
            except BaseException:
                self.close(graceful=False)
                raise
            job = weakref.ref(self)  # the engine's watcher must not keep the job alive
            self._node.engine.set_wait_watcher(lambda blocked_s: _watch_engine_wait(job(), blocked_s))

    # -- the public API -----------------------------------------------------------
    @property
    def rejected_messages(self) -> int:
        """Messages from other processes refused as malformed or misaddressed."""
        dropped = self._transport.rejected if self._transport else 0
        dropped += self._liveness.rejections.count if self._liveness else 0
        return int(self._node.rejected_messages) + dropped

    @property
    def refused_connections(self) -> int:
        """Connections to this process's sockets that were cut: they failed
        the CURVE handshake (no or wrong keys) or exceeded the cap."""
        total = refused_connections(self._transport.listeners) if self._transport else 0
        total += refused_connections(self._liveness.listeners) if self._liveness else 0
        if self._coordinator is not None:
            total += self._coordinator.guard.refused.count
        return total

    @property
    def transport_stats(self) -> dict[str, int]:
        """Payload traffic to and from the peers so far: ``socket_payload_bytes``
        (sent through the socket), ``device_payload_bytes_by_host`` (of those,
        device payloads copied to host frames first) and the CUDA IPC
        counters (``cuda_ipc_sent_bytes``, ``cuda_ipc_received_bytes``,
        ``cuda_ipc_fallbacks``, ...: see ``ProcessNode.cuda_ipc_stats``)."""
        stats = {"socket_payload_bytes": int(self._node.socket_payload_bytes),
                 "device_payload_bytes_by_host": int(self._node.device_payload_bytes_by_host)}
        stats.update({f"cuda_ipc_{name}": int(value) for name, value in self._node.cuda_ipc_stats.items()})
        return stats

    def barrier(self, name: str = "barrier", timeout_s: float | None = None) -> None:
        """Returns once every rank has called ``barrier`` with this name."""
        text("barrier: name", name)
        self._check_open("barrier")
        timeout = self._wait_limit("barrier", timeout_s)
        if self._control is not None:
            self._control.barrier(name, timeout)

    def allgather(self, name: str, value: Any, timeout_s: float | None = None) -> list[Any]:
        """Every rank's ``value``, by rank, once every rank has called
        ``allgather`` with this name. Values travel as JSON (no pickle): use
        numbers, strings, lists, dicts and None; at most 1 MiB in all. For
        small control data (the tuner's commands and loss reports), not
        tensors."""
        text("allgather: name", name)
        self._check_open("allgather")
        timeout = self._wait_limit("allgather", timeout_s)
        if self._control is None:
            try:
                json.dumps(value)  # the same check the wire would make
            except (TypeError, ValueError) as error:
                raise InvalidArgumentError(f"allgather {name!r}: the value is not JSON: {error}") from None
            return [value]
        return self._control.allgather(name, value, timeout)

    def serve(self, name: str, handler: Callable[[int, Any], Any] | None) -> None:
        """Rank 0 only: answers every rank's :meth:`request` of ``name``
        with ``handler(rank, value)``, a JSON value; None stops serving it.
        Other ranks' requests run the handler on the control channel's
        thread, rank 0's own on its caller's: the handler must be
        thread-safe and quick (it delays every control message behind it).
        Raising :class:`~mltuner.InvalidArgumentError` answers the asking
        rank with that error."""
        text("serve: name", name)
        if self.rank != 0:
            raise InvalidArgumentError(f"serve({name!r}): only rank 0 serves requests; this is rank {self.rank}")
        if handler is not None and not callable(handler):
            raise ArgumentTypeError(f"serve({name!r}): handler must be callable, got {type(handler).__name__}")
        if handler is None:
            self._services.pop(name, None)
        else:
            self._services[name] = handler

    def request(self, name: str, value: Any, timeout_s: float | None = None) -> Any:
        """Rank 0's answer to ``value`` from the handler it serves as
        ``name`` (:meth:`serve`), without waiting for the other ranks.
        Values travel as JSON (no pickle), at most 1 MiB. Raises
        InvalidArgumentError when rank 0 serves no ``name`` or its handler
        refuses the value, WaitTimeoutError when no answer comes in time."""
        text("request: name", name)
        self._check_open("request")
        timeout = self._wait_limit("request", timeout_s)
        try:
            json.dumps(value)  # the check the wire makes, for rank 0's own requests too
        except (TypeError, ValueError) as error:
            raise InvalidArgumentError(f"request {name!r}: the value is not JSON: {error}") from None
        if self.rank != 0 and self._control is not None:
            return self._control.request(name, value, timeout)
        handler = self._services.get(name)
        if handler is None:
            raise InvalidArgumentError(f"rank 0 serves no {name!r}")
        return handler(0, value)

    def save_checkpoint(self, root: str | os.PathLike[str], *, keep: int = 2,
                        attachments: Mapping[str, bytes] | None = None) -> Path:
        """Saves every shard's parameters and optimizer state at this clock.

        Call it on every rank at the same clock (after ``start_iterations``).
        It waits until every worker's updates up to this clock are applied,
        writes each shard's slice, and makes the checkpoint visible atomically
        as ``root/clock-NNNNNNNN`` (``root/latest`` names the newest); only the
        newest ``keep`` are kept. ``root`` must be on a file system every rank
        can see. Rank 0 adds ``attachments`` (file name -> bytes: the
        application's own state, such as its epoch) to the checkpoint before
        it becomes visible; :func:`mltuner.read_attachment` reads them back.
        Returns the checkpoint's directory.
        """
        keep = integer("save_checkpoint: keep", keep, 1, 10**6)
        self._check_open("save_checkpoint")
        return _checkpoint.save(self._node, self.worker, Path(root), self.allgather, self._root_locks,
                                keep=keep, first_clock=self._first_clock, attachments=attachments)

    def restore_checkpoint(self, path: str | os.PathLike[str], *, sources: _checkpoint.Sources | None = None) -> int:
        """Loads a checkpoint into this rank's shard and returns its clock.

        Call it on every rank after ``finish_virtual_iteration`` and before
        ``start_iterations``, with the tables created as when it was saved
        or, where they group the values otherwise, ``sources`` saying for
        each table's name where its flat values (rows one after another)
        come from: pieces ``(offset, saved table's name, offset there,
        count)``, each with its optimizer state (the rest is zero). The
        number of processes may differ. ``path`` is a checkpoint
        directory or a root written by :meth:`save_checkpoint` (its newest
        checkpoint is used). Training clocks restart at 0; the returned clock
        tells the application where its data stream was, and later
        checkpoints are named from it on. It ends with a barrier, so every
        read after it, on any rank, sees the restored values.
        """
        self._check_open("restore_checkpoint")
        self._first_clock = _checkpoint.restore(self._node, self.worker, Path(path), self.barrier, self.allgather,
                                                sources)
        return self._first_clock

    def close(self, *, graceful: bool = True) -> None:
        """Leaves the job. Graceful: hands over this worker's last updates and
        waits for every rank to reach close, so no peer mistakes the exit for
        a crash. A rank that trains on meanwhile (its data split is longer)
        gets this rank's later clocks as empty ones, zero updates, as with
        PyTorch DDP's ``Join``; the wait ends ``Config.wait_timeout_s`` after
        the last clock any rank finished. Idempotent.

        Raises:
            mltuner.MltunerError: graceful, what the close's wait met (a
                WaitTimeoutError: a peer alive but stuck never reached close;
                a PeerLostError: a peer lost while this rank waited for it
                here), once the rank has shut down, so that it does not end
                as if its job had finished (a job still open at interpreter
                exit then exits with status 1); such a close says no goodbye,
                so the peers report this rank lost rather than wait for it. A
                peer lost before close() was reported by the calls that met
                it, and is not raised again.
        """
        if self._closed:
            return
        self._closed = True
        self._root_locks.release()
        self._node.engine.set_wait_watcher(None)
        unanswered: MltunerError | None = None
        if graceful and self._control is not None and self._lost_peer() is None:
            try:
                if self._liveness is not None:
                    self._liveness.announce_closing()
                self.worker.flush()
                lender = ClockLender.for_worker(self.worker)
                clocks = self._control.allgather("close-clocks", int(self.worker.stats["clock"]), self._timeout_s,
                                                 while_waiting=None if lender is None else
                                                 lambda: not self._every_peer_closing() and lender.step())
                _warn_uneven_end(clocks, lender is not None)
                self._control.barrier("close", self._timeout_s, final=True)
            except MltunerError as error:
                unanswered = error
        self._node.shutdown()
        if self._transport is not None:
            self._transport.stop(graceful=graceful)
        if self._liveness is not None:  # the goodbye leaves after the data, and only after a close that succeeded
            self._liveness.stop(graceful=graceful and unanswered is None)
        if self._control is not None:
            self._control.close()
        if self._coordinator is not None:
            self._coordinator.close()
        if self._authenticator is not None:
            self._authenticator.stop()  # type: ignore[attr-defined]
        if self._context is not None:
            # Closes what a failed start left open too; the sockets above
            # already lingered as long as they were allowed to.
            self._context.destroy(linger=0)
        if self._ipc is not None:
            self._ipc.close()
        if unanswered is not None:
            raise unanswered

    def _every_peer_closing(self) -> bool:
        """Whether every other rank said it is in close(): then no rank trains
        on, so lending clocks would only make progress of the lenders' own,
        which must not hold the close's wait open without end."""
        return self._liveness is not None and len(self._liveness.closing) >= self.world_size - 1

    def __enter__(self) -> Job:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        # sys.exit(0) inside the block ends the rank as cleanly as the block's end does.
        self.close(graceful=exc is None or (isinstance(exc, SystemExit) and exc.code in (0, None)))

    def __del__(self) -> None:
        if not getattr(self, "_closed", True):
            self.close(graceful=False)

    def _check_open(self, what: str) -> None:
        if self._closed:
            raise ShutdownError(f"{what}: the job is closed")

    def _wait_limit(self, what: str, timeout_s: float | None) -> float:
        if timeout_s is None:
            return self._timeout_s
        return real(f"{what}: timeout_s", timeout_s, 0, MAX_WAIT_S, low_open=True)

    # -- setting up ---------------------------------------------------------------
    def _keys(self, secure: bool | None) -> CurveKeys | None:
        loopback = is_loopback(self.env.bind_host) and is_loopback(self.env.master_addr)
        if secure is False:
            if not loopback:
                raise InvalidArgumentError(f"secure=False is only allowed on loopback addresses; this job binds "
                                           f"{self.env.bind_host} with rank 0 at {self.env.master_addr}")
            return None
        if self.env.secret:
            return derive_keys(self.env.secret)
        if not loopback:
            raise InvalidArgumentError(
                f"binding to {self.env.bind_host} needs peers to authenticate: set MLTUNER_SECRET to the same "
                "random string on every process, or MLTUNER_SECRET_FILE to a file holding it "
                "(mltuner launch does this for you)")
        return derive_keys(user_loopback_secret())

    def _connect(self, security: SocketSecurity, rendezvous_timeout_s: float, heartbeat_interval_s: float,
                 heartbeat_timeout_s: float) -> None:
        if self.world_size > 1:
            _check_resolves(self.env.master_addr)
        # Two I/O threads: data on the first, heartbeats and the rendezvous on
        # the second, so no backlog of data delays a heartbeat.
        self._context = zmq.Context(io_threads=2)
        keys = security.keys
        if keys is not None:
            self._authenticator = start_authenticator(self._context, keys)
        if self.transport != "tcp":
            self._ipc = IpcDirectory()
        data, card_data = self._bind("data", self._max_message_bytes, DATA_IO_THREAD, RECEIVE_QUEUE_MESSAGES,
                                     security)
        control, card_control = self._bind("control", MAX_SIGNAL_BYTES, CONTROL_IO_THREAD, CONTROL_RECEIVE_QUEUE,
                                           security)
        self._cuda_ipc_slice = _cuda_ipc.slice_bytes_for(self._cuda_ipc_slice_asked, self.world_size - 1,
                                                         int(self._node.device_total_bytes))
        cuda_ipc, no_cuda_ipc = _cuda_ipc.export(self._node, self.config.device, self._cuda_ipc, self._cuda_ipc_slice)
        card = Card(host=host_identity(), tcp={"data": card_data[0], "control": card_control[0]},
                    ipc={name: ipc for name, ipc in (("data", card_data[1]), ("control", card_control[1])) if ipc},
                    cuda_ipc=cuda_ipc)
        self.endpoint = card.tcp["data"]
        host, port = self._rendezvous_address(keys, rendezvous_timeout_s)
        self._control = ControlClient(self._context, host, port, self.rank, keys, self._wait_check)
        missing = self._coordinator.missing_ranks if self._coordinator else None
        cards = [Card.from_json(c, r) for r, c in enumerate(
            self._control.join(self.world_size, card.to_json(), _fingerprint(self.config), rendezvous_timeout_s,
                               missing))]
        peers = [r for r in range(self.world_size) if r != self.rank]
        # Heartbeats from the join on: a rank that dies in the exchanges after
        # it is named within the heartbeat timeout (it left the others waiting
        # in the CUDA IPC allgather until the rendezvous timeout).
        self._liveness = ControlChannel(
            self.rank, self._context, control,
            {r: choose_address(self.transport, card, cards[r], "control", r) for r in peers}, security,
            heartbeat_interval_s=heartbeat_interval_s, heartbeat_timeout_s=heartbeat_timeout_s,
            on_lost=self._node.abort)
        control_client = self._control
        self.data_paths.update(_cuda_ipc.connect(
            self._node, self.config.device, card, cards, no_cuda_ipc,
            lambda name, value: control_client.allgather(name, value, rendezvous_timeout_s)))
        self.peer_endpoints = {r: choose_address(self.transport, card, cards[r], "data", r) for r in peers}
        self._transport = SocketTransport(self._node, self._context, data, self.peer_endpoints, security,
                                          queue_limit=self._queue_limit, wait_timeout_s=self._timeout_s)

    def _bind(self, name: str, max_frame: int, io_thread: int, queue: int, security: SocketSecurity
              ) -> tuple[list[Listener], tuple[str, str | None]]:
        """A PULL socket bound on a free TCP port and, unless the job uses TCP
        only, one bound on ``ipc://`` in this process's private directory
        (apart, since each has its own authentication: ``security``); their
        guards; and their (tcp, ipc) endpoints for the peers."""
        tcp, port = self._listen(f"tcp://{_bracketed(self.env.bind_host)}", name, max_frame, io_thread, queue,
                                 security)
        listeners = [tcp]
        ipc = None
        if self._ipc is not None:
            self._ipc.check_private()  # what authenticates the peers of a plain ipc:// socket
            ipc = self._ipc.endpoint(name)
            listeners.append(self._listen(ipc, name, max_frame, io_thread, queue, security)[0])
        return listeners, (f"tcp://{_bracketed(_advertised_host(self.env))}:{port}", ipc)

    def _listen(self, address: str, name: str, max_frame: int, io_thread: int, queue: int,
                security: SocketSecurity) -> tuple[Listener, int | str]:
        """A PULL socket bound at ``address`` (a TCP host: on a free port),
        and its port or path."""
        assert self._context is not None
        socket = self._context.socket(zmq.PULL)
        try:
            socket.affinity = io_thread
            socket.rcvhwm = queue
            limit_input(socket, max_frame)
            keys = security.keys_for(address)
            if keys is not None:
                secure_server(socket, keys)
            if address.startswith("tcp://"):
                bound: int | str = socket.bind_to_random_port(address)
                kind = "tcp"
            else:
                socket.bind(address)
                bound = address.removeprefix("ipc://")
                kind = "ipc"
            guard = ConnectionGuard(socket, {bound}, f"rank {self.rank}'s {name} socket ({kind})",
                                    self.world_size - 1 + _SPARE_CONNECTIONS, _log)
        except BaseException:
            socket.close(linger=0)
            raise
        return Listener(socket, guard), bound

    def _queue_limit(self) -> int:
        """The bytes that may wait for one peer, from the plan (see
        ``max_queued_bytes``); recomputed when the tables change."""
        if self._max_queued_bytes is not None:
            if self._queue_plan[0] < 0:
                self._queue_plan = (0, self._max_queued_bytes)
                self._set_node_limits(self._max_queued_bytes)
            return self._max_queued_bytes
        tables = [t for t in self.worker.tables if not t.local]
        if self._queue_plan[0] != len(tables):
            shards = self.world_size
            # Per clock, one peer gets at most this process's update of its
            # shard's slice of every table, and this shard's rows of it.
            per_clock = sum(2 * -(-t.num_rows // shards) * t.row_width * 4 for t in tables)
            largest = max((largest_frame_bytes(t.num_rows, t.row_width, shards) for t in tables), default=0)
            # prefetch_clocks None: the plan chooses, at most MOST_AUTO_PREFETCH_CLOCKS.
            ahead = MOST_AUTO_PREFETCH_CLOCKS if self.config.prefetch_clocks is None else self.config.prefetch_clocks
            limit = max((ahead + 2) * per_clock, 2 * largest, _MIN_QUEUE_BYTES)
            self._queue_plan = (len(tables), limit)
            advice = _cuda_ipc.slice_advice(per_clock, self._cuda_ipc_slice)
            if advice and any(path in _cuda_ipc.DIRECT_PATHS.values() for path in self.data_paths.values()):
                _log.warning(advice)
            self._set_node_limits(limit)
        return self._queue_plan[1]

    def _set_node_limits(self, per_peer: int) -> None:
        """The node's outbox (where messages wait while the send thread waits
        for a peer) and each of its inboxes (where the peers' messages wait
        for the shard or the installer) hold as much as ``per_peer`` for all
        peers together: traffic is symmetric, one clock's worth each way."""
        together = per_peer * (self.world_size - 1)
        self._node.set_outbox_limit(together)
        self._node.set_inbox_limit(together)

    def _rendezvous_address(self, keys: CurveKeys | None, timeout_s: float) -> tuple[str, int]:
        """Starts rank 0's coordinator; returns where every rank finds it.

        Under torchrun the master port is torchrun's own store: rank 0 binds
        a free port and publishes it there, and the others read it."""
        env = self.env
        assert self._context is not None
        store_key = job_key(env.torch_store_key) if env.torch_store_key else None
        if self.rank == 0:
            self._coordinator = Coordinator(self._context, env.bind_host, 0 if store_key else env.master_port,
                                            self.world_size, keys, services=self._services)
            if store_key:
                address = f"{_bracketed(_advertised_host(env))}:{self._coordinator.port}"
                publish_address(env.master_addr, env.master_port, store_key, address, timeout_s)
        if store_key:
            return lookup_address(env.master_addr, env.master_port, store_key, timeout_s)
        return env.master_addr, env.master_port

    def _lost_peer(self) -> str | None:
        lost = self._liveness.lost if self._liveness else None
        return lost or (self._transport.stuck if self._transport else None)

    def _wait_check(self) -> str | None:
        """What ends a wait on the control channel: a lost peer (returned),
        or, outside close(), a peer that closed the job a moment ago
        (OutOfOrderError: it joins no barrier or allgather any more). The
        moment lets a collective that peer completed before closing return."""
        closed = self._closed_peers(_CLOSING_GRACE_S)
        if closed:
            raise OutOfOrderError(
                f"rank {closed[0]} has closed the job (its loop ended, e.g. its data ran out), so a barrier, "
                "allgather or checkpoint waiting for every rank cannot complete: every rank must make the same "
                "collective calls before closing")
        return self._lost_peer()

    def _closed_peers(self, for_s: float) -> list[int]:
        """The ranks that said they are closing the job more than ``for_s``
        ago, in order (none once this rank closed it too)."""
        closing = self._liveness.closing if self._liveness is not None and not self._closed else {}
        now = time.monotonic()
        return sorted(rank for rank, heard in closing.items() if now - heard > for_s)


def _watch_engine_wait(job: Job | None, blocked_s: float) -> None:
    """Ends an engine call (raising) that waits for a rank which closed the
    job during a tuning session: the session's clocks are on branches, which
    a closing rank cannot lend (launch/_uneven.py), so the wait would last
    until Config.wait_timeout_s and then blame a slow worker."""
    if job is None or blocked_s < _CLOSED_PEER_WAIT_S or not job.config.branches:
        return
    closed = job._closed_peers(_CLOSED_PEER_WAIT_S)
    if closed:
        raise OutOfOrderError(
            f"rank {closed[0]} closed the job (its loop ended: a break, or its data ran out) while this rank waits "
            f"for its clocks ({blocked_s:.0f} s in an engine call): clocks on branches (a tuning session's) cannot "
            "be lent by a closing rank, so every rank must run the same clocks; iterate the session to its end on "
            "every rank")


def _bracketed(host: str) -> str:
    return f"[{host}]" if ":" in host else host


def _advertised_host(env: ProcessEnv) -> str:
    """The address peers should use to reach this process's sockets."""
    if is_loopback(env.bind_host):
        return env.bind_host
    if env.bind_host not in ("0.0.0.0", "::"):
        return env.bind_host
    # Bound to every interface: pick the one that routes to rank 0 (a UDP
    # "connect" sends nothing; it only asks the kernel for the route).
    family = socket.AF_INET6 if ":" in env.master_addr else socket.AF_INET
    with socket.socket(family, socket.SOCK_DGRAM) as probe:
        try:
            probe.connect((env.master_addr, env.master_port or 9))
            return str(probe.getsockname()[0])
        except OSError:
            return socket.gethostbyname(socket.gethostname())


def _check_resolves(host: str) -> None:
    """Refuses a master address that does not resolve: ZeroMQ would retry
    it in silence until the rendezvous timed out, saying only that nothing
    answered."""
    try:
        socket.getaddrinfo(host, None)
    except (socket.gaierror, UnicodeError) as error:
        raise InvalidArgumentError(f"the master address {host!r} does not resolve ({error}): check MASTER_ADDR "
                                   "(or MLTUNER_MASTER_ADDR) on every process") from None


def _fingerprint(config: Config) -> str:
    """The settings every rank must share (the device and budget may differ):
    the shards' rule and checks, and whether clocks run on branches (a
    branch request to a shard without them fails mid-run). Numbers as
    floats: ``wait_timeout_s=60`` on one rank is the default 60.0 of another."""
    shared = {"update_rule": dataclasses.asdict(config.update_rule), "prefetch_clocks": config.prefetch_clocks,
              "wait_timeout_s": config.wait_timeout_s, "branches": config.branches,
              "check_finite": config.check_finite}
    return json.dumps(_numbers_as_floats(shared), sort_keys=True)


def _numbers_as_floats(value: Any) -> Any:
    if isinstance(value, dict):
        return {key: _numbers_as_floats(item) for key, item in value.items()}
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value)
    return value

