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

import dataclasses
import json
import logging
import os
import socket
from pathlib import Path
from types import TracebackType
from typing import Any

import zmq

from mltuner import _core
from mltuner._config import MAX_WAIT_S, Config
from mltuner._validate import boolean, integer, real, text
from mltuner.client._worker import Worker
from mltuner.exceptions import ArgumentTypeError, InvalidArgumentError, MltunerError
from mltuner.launch import _checkpoint
from mltuner.launch._env import ProcessEnv, detect_environment, is_loopback
from mltuner.launch._rendezvous import ControlClient, Coordinator
from mltuner.launch._torch_store import lookup_address, publish_address
from mltuner.transport._guard import ConnectionGuard, limit_input
from mltuner.transport._security import CurveKeys, derive_keys, secure_server, start_authenticator, user_loopback_secret
from mltuner.transport._sockets import SocketTransport

__all__ = ["Job", "DEFAULT_MAX_MESSAGE_BYTES"]

# The largest frame a data socket accepts unless Job(max_message_bytes=...)
# says otherwise: a table's slice on one shard must fit (create_table checks).
DEFAULT_MAX_MESSAGE_BYTES = 256 << 20
# Connections a data socket accepts beyond one per peer (reconnects).
_SPARE_CONNECTIONS = 16

_log = logging.getLogger("mltuner.launch")


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
        secure: authenticate and encrypt every socket with ZeroMQ CURVE keys
            derived from the job's secret (``MLTUNER_SECRET``, a file named by
            ``MLTUNER_SECRET_FILE``, or on loopback this user's own key).
            ``None`` or ``True`` (default): always. ``False`` turns it off,
            which is only allowed on loopback addresses and lets any local
            process inject messages: for measurements only.
        max_message_bytes: the largest frame a data socket accepts (ZeroMQ
            refuses a larger announced frame before allocating it). Every
            table's slice on one shard must fit: ``create_table`` refuses a
            table that would need more, naming this setting.

    Attributes:
        worker: the access API (:class:`mltuner.Worker`).
        rank, world_size, local_rank: this process's place in the job.
    """

    def __init__(self, config: Config | None = None, *, env: ProcessEnv | None = None,
                 rendezvous_timeout_s: float = 120.0, heartbeat_interval_s: float = 0.5,
                 heartbeat_timeout_s: float = 5.0, secure: bool | None = None,
                 max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES) -> None:
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
        self._max_message_bytes = max_message_bytes
        self.config = config or Config()
        self.env = env or detect_environment()
        self.rank = self.env.rank
        self.world_size = self.env.world_size
        self.local_rank = self.env.local_rank
        self._timeout_s = self.config.wait_timeout_s
        self._closed = False
        self._first_clock = 0  # the clock training resumed from (restore_checkpoint)
        self._context: zmq.Context[zmq.Socket[bytes]] | None = None
        self._authenticator: object | None = None
        self._coordinator: Coordinator | None = None
        self._control: ControlClient | None = None
        self._transport: SocketTransport | None = None
        self.endpoint = ""  # where peers send to this process (empty when alone)
        self._node = _core.ProcessNode(self.config.to_core(), self.rank, self.world_size, self.config.device,
                                       self.local_rank)
        self.worker = Worker(self._node.engine, owner=self._node, config=self.config,
                             max_message_bytes=self._max_message_bytes if self.world_size > 1 else None)
        if self.world_size > 1:
            try:
                self._connect(self._keys(secure), rendezvous_timeout_s, heartbeat_interval_s, heartbeat_timeout_s)
            except BaseException:
                self.close(graceful=False)
                raise

    # -- the public API -----------------------------------------------------------
    @property
    def rejected_messages(self) -> int:
        """Messages from other processes refused as malformed or misaddressed."""
        dropped = self._transport.rejected if self._transport else 0
        return int(self._node.rejected_messages) + dropped

    @property
    def refused_connections(self) -> int:
        """Connections to this process's sockets that were cut: they failed
        the CURVE handshake (no or wrong keys) or exceeded the cap."""
        total = self._transport.guard.refused.count if self._transport else 0
        if self._coordinator is not None:
            total += self._coordinator.guard.refused.count
        return total

    def barrier(self, name: str = "barrier", timeout_s: float | None = None) -> None:
        """Returns once every rank has called ``barrier`` with this name."""
        text("barrier: name", name)
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
        timeout = self._wait_limit("allgather", timeout_s)
        if self._control is None:
            try:
                json.dumps(value)  # the same check the wire would make
            except (TypeError, ValueError) as error:
                raise InvalidArgumentError(f"allgather {name!r}: the value is not JSON: {error}") from None
            return [value]
        return self._control.allgather(name, value, timeout)

    def save_checkpoint(self, root: str | os.PathLike[str], *, keep: int = 2) -> Path:
        """Saves every shard's parameters and optimizer state at this clock.

        Call it on every rank at the same clock (after ``start_iterations``).
        It waits until every worker's updates up to this clock are applied,
        writes each shard's slice, and makes the checkpoint visible atomically
        as ``root/clock-NNNNNNNN`` (``root/latest`` names the newest); only the
        newest ``keep`` are kept. ``root`` must be on a file system every rank
        can see. Returns the checkpoint's directory.
        """
        keep = integer("save_checkpoint: keep", keep, 1, 10**6)
        return _checkpoint.save(self._node, self.worker, Path(root), self.barrier, keep=keep,
                                first_clock=self._first_clock)

    def restore_checkpoint(self, path: str | os.PathLike[str]) -> int:
        """Loads a checkpoint into this rank's shard and returns its clock.

        Call it on every rank after ``finish_virtual_iteration`` and before
        ``start_iterations``, with the tables created as when it was saved;
        the number of processes may differ. ``path`` is a checkpoint
        directory or a root written by :meth:`save_checkpoint` (its newest
        checkpoint is used). Training clocks restart at 0; the returned clock
        tells the application where its data stream was, and later
        checkpoints are named from it on. It ends with a barrier, so every
        read after it, on any rank, sees the restored values.
        """
        self._first_clock = _checkpoint.restore(self._node, self.worker, Path(path), self.config.update_rule.kind,
                                                self.barrier)
        return self._first_clock

    def close(self, *, graceful: bool = True) -> None:
        """Leaves the job. Graceful: hands over this worker's last updates and
        waits (bounded) for every rank to reach close, so no peer mistakes the
        exit for a crash. Idempotent."""
        if self._closed:
            return
        self._closed = True
        lost = self._transport.lost if self._transport else None
        if graceful and self._control is not None and lost is None:
            try:
                self.worker.flush()
                self._control.barrier("close", self._timeout_s)
            except MltunerError:
                pass  # a lost peer was reported by the calls that met it
        self._node.shutdown()
        if self._transport is not None:
            self._transport.stop(graceful=graceful)
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

    def __enter__(self) -> Job:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close(graceful=exc is None)

    def __del__(self) -> None:
        if not getattr(self, "_closed", True):
            self.close(graceful=False)

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

    def _connect(self, keys: CurveKeys | None, rendezvous_timeout_s: float, heartbeat_interval_s: float,
                 heartbeat_timeout_s: float) -> None:
        self._context = zmq.Context()
        if keys is not None:
            self._authenticator = start_authenticator(self._context, keys)
        inbox = self._context.socket(zmq.PULL)
        inbox.rcvhwm = 0
        limit_input(inbox, self._max_message_bytes)
        if keys is not None:
            secure_server(inbox, keys)
        try:
            port = inbox.bind_to_random_port(f"tcp://{_bracketed(self.env.bind_host)}")
        except zmq.ZMQError:
            inbox.close(linger=0)
            raise
        guard = ConnectionGuard(inbox, port, f"rank {self.rank}'s data socket",
                                self.world_size - 1 + _SPARE_CONNECTIONS, _log)
        endpoint = self.endpoint = f"tcp://{_bracketed(_advertised_host(self.env))}:{port}"
        try:
            host, port = self._rendezvous_address(keys, rendezvous_timeout_s)
            self._control = ControlClient(self._context, host, port, self.rank, keys, self._lost_peer)
            missing = self._coordinator.missing_ranks if self._coordinator else None
            endpoints = self._control.join(self.world_size, endpoint, _fingerprint(self.config),
                                           rendezvous_timeout_s, missing)
        except BaseException:
            guard.close()
            inbox.close(linger=0)
            raise
        self._transport = SocketTransport(self._node, self._context, inbox, guard, endpoints, keys,
                                          heartbeat_interval_s=heartbeat_interval_s,
                                          heartbeat_timeout_s=heartbeat_timeout_s)

    def _rendezvous_address(self, keys: CurveKeys | None, timeout_s: float) -> tuple[str, int]:
        """Starts rank 0's coordinator; returns where every rank finds it.

        Under torchrun the master port is torchrun's own store: rank 0 binds
        a free port and publishes it there, and the others read it."""
        env = self.env
        assert self._context is not None
        if self.rank == 0:
            self._coordinator = Coordinator(self._context, env.bind_host, 0 if env.torch_store_key else env.master_port,
                                            self.world_size, keys)
            if env.torch_store_key:
                address = f"{_bracketed(_advertised_host(env))}:{self._coordinator.port}"
                publish_address(env.master_addr, env.master_port, env.torch_store_key, address, timeout_s)
        if env.torch_store_key:
            return lookup_address(env.master_addr, env.master_port, env.torch_store_key, timeout_s)
        return env.master_addr, env.master_port

    def _lost_peer(self) -> str | None:
        return self._transport.lost if self._transport else None


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


def _fingerprint(config: Config) -> str:
    """The settings every rank must share (the device and budget may differ)."""
    shared = {"update_rule": dataclasses.asdict(config.update_rule), "prefetch_clocks": config.prefetch_clocks,
              "wait_timeout_s": config.wait_timeout_s}
    return json.dumps(shared, sort_keys=True)

