"""Liveness between the processes of a job, on sockets of its own.

Each process binds a control socket (PULL) and connects one PUSH to every
peer's. One thread, ``mltuner-control``, sends every peer a heartbeat every
``heartbeat_interval_s``, reads the peers' heartbeats and goodbyes, and
declares a peer lost when nothing came from it on this channel for
``heartbeat_timeout_s``. Nothing else travels here and nothing here waits
for data: the control sockets have their own connections and their own
ZeroMQ I/O thread (the context's second; data uses the first), so a backlog
of data (a large model, a slow receiver, CURVE on a slow link) never delays
a heartbeat, and only a peer that is really silent (dead, stopped, hung or
unreachable) is declared lost.

A signal is one frame: ``MLTN-HB``, ``MLTN-END`` (closing) or ``MLTN-BYE``
and the sender's rank
(int32, little-endian). Like everything else it arrives only through an
authenticated connection: CURVE over ``tcp://``, a private directory for
``ipc://`` (:class:`mltuner.transport._security.SocketSecurity`).
"""

from __future__ import annotations

import logging
import struct
import threading
import time
from collections.abc import Callable

import zmq

from mltuner.transport._guard import Listener, RejectionLog
from mltuner.transport._security import SocketSecurity, secure_client

__all__ = ["ControlChannel", "refused_connections", "push_sockets", "CONTROL_IO_THREAD", "CONTROL_RECEIVE_QUEUE", "DATA_IO_THREAD", "MAX_SIGNAL_BYTES"]

_log = logging.getLogger("mltuner.transport")
HEARTBEAT = b"MLTN-HB"
GOODBYE = b"MLTN-BYE"
CLOSING = b"MLTN-END"  # the sender is in close(): it joins no collective but close's own
_RANK = struct.Struct("<i")
# The largest frame a control socket accepts: a signal is 12 bytes, but the
# limit also applies to the CURVE handshake's commands (HELLO is 200 bytes,
# INITIATE about 300 with its metadata).
MAX_SIGNAL_BYTES = 4096
# ZMQ_AFFINITY bit masks: which of the context's two I/O threads serves a socket.
DATA_IO_THREAD = 1
CONTROL_IO_THREAD = 2
# Heartbeats a peer has not read yet are worthless: keep only a few.
_SEND_QUEUE = 16
CONTROL_RECEIVE_QUEUE = 1024
_POLL_MS = 50



def push_sockets(context: zmq.Context[zmq.Socket[bytes]], peers: dict[int, str], security: SocketSecurity, *,
                 io_thread: int, send_queue: int) -> dict[int, zmq.Socket[bytes]]:
    """A PUSH socket connected to each peer's endpoint, on ZeroMQ I/O thread
    ``io_thread``, queueing at most ``send_queue`` messages, with CURVE where
    ``security`` says so for its endpoint."""
    sockets: dict[int, zmq.Socket[bytes]] = {}
    for peer, endpoint in peers.items():
        socket = context.socket(zmq.PUSH)
        socket.affinity = io_thread
        socket.sndhwm = send_queue
        keys = security.keys_for(endpoint)
        if keys is not None:
            secure_client(socket, keys)
        socket.connect(endpoint)
        sockets[peer] = socket
    return sockets


def refused_connections(listeners: list[Listener]) -> int:
    """Connections the listeners' guards cut or saw fail their handshake."""
    return sum(listener.guard.refused.count for listener in listeners)

class ControlChannel:
    """Heartbeats and goodbyes of one process (see the module doc).

    Args:
        rank: this process's rank.
        context: the job's ZeroMQ context (two I/O threads).
        listeners: the bound control sockets (one per address kind) with
            their guards; the channel owns them from here on.
        peers: each peer's control endpoint, by rank.
        security: which endpoints use CURVE.
        on_lost: called once, from the control thread, with the reason when
            a peer is lost (the job aborts its engine there).
    """

    def __init__(self, rank: int, context: zmq.Context[zmq.Socket[bytes]], listeners: list[Listener],
                 peers: dict[int, str], security: SocketSecurity, *,
                 heartbeat_interval_s: float, heartbeat_timeout_s: float,
                 on_lost: Callable[[str], None]) -> None:
        self._rank = rank
        self.listeners = listeners
        self._interval = heartbeat_interval_s
        self._timeout = heartbeat_timeout_s
        self._on_lost = on_lost
        self._peers = push_sockets(context, peers, security, io_thread=CONTROL_IO_THREAD, send_queue=_SEND_QUEUE)
        now = time.monotonic()
        self._last_heard = {peer: now for peer in self._peers}
        self._departed: set[int] = set()
        self._closing: dict[int, float] = {}  # peers in close(), and when that was heard
        self.lost: str | None = None  # why the job lost a peer, once it has
        self.rejections = RejectionLog(_log, f"rank {rank}'s control socket")
        self._stopping = threading.Event()
        self._thread = threading.Thread(target=self._run, name="mltuner-control", daemon=True)
        self._thread.start()

    @property
    def departed(self) -> set[int]:
        """Peers that said goodbye."""
        return set(self._departed)

    @property
    def closing(self) -> dict[int, float]:
        """Peers that said they are closing the job, and when that was
        heard (time.monotonic)."""
        return dict(self._closing)

    def announce_closing(self) -> None:
        """Tells every peer that this process is in close(): a barrier or
        allgather of theirs other than close's own will not be joined."""
        self._broadcast(CLOSING + _RANK.pack(self._rank))

    def stop(self, *, graceful: bool = True) -> None:
        """Says goodbye to every peer, joins the thread, closes the sockets.
        Not graceful, or once a peer is lost, there is no goodbye: the peers
        notice the silence within their heartbeat timeout instead."""
        self._stopping.set()
        self._thread.join(10.0)
        farewell = graceful and self.lost is None
        for socket in self._peers.values():
            if farewell:  # else none: a peer that heard one would take a failed rank for one that finished
                try:
                    socket.send(GOODBYE + _RANK.pack(self._rank), flags=zmq.NOBLOCK)
                except zmq.ZMQError:
                    pass
            socket.close(linger=1000 if farewell else 0)
        for listener in self.listeners:
            listener.close()

    def _run(self) -> None:
        poller = zmq.Poller()
        for listener in self.listeners:
            poller.register(listener.socket, zmq.POLLIN)
            poller.register(listener.guard.monitor, zmq.POLLIN)
        next_beat = 0.0
        last_judged = time.monotonic()
        while not self._stopping.is_set():
            now = time.monotonic()
            if now >= next_beat:
                self._broadcast(HEARTBEAT + _RANK.pack(self._rank))
                next_beat = now + self._interval
            ready = dict(poller.poll(min(_POLL_MS, max(1, int((next_beat - now) * 1000)))))
            if time.monotonic() - last_judged > self._timeout / 2:
                self._catch_up(poller, time.monotonic() - last_judged)
            # As of a moment before the reading, which reads whatever the poll
            # said (its answer may be from before a pause of this thread).
            judged_at = time.monotonic()
            self._read(ready)
            self._check_peers(judged_at)
            last_judged = judged_at

    def _read(self, ready: dict[object, int]) -> None:
        """Every signal that came, and the connection events the poll saw."""
        for listener in self.listeners:
            self._drain(listener.socket)
            if listener.guard.monitor in ready:
                listener.guard.handle_events()

    def _catch_up(self, poller: zmq.Poller, paused: float) -> None:
        """This thread did not run for ``paused`` seconds: a call that held the
        interpreter lock, or a stopped process. The peers' heartbeats of that
        time may still wait in ZeroMQ's queues, whose thread a stop stopped
        too: before the peers are judged, this process says it is alive and
        reads what comes for two heartbeat intervals, with the lock released
        (their silence then still counts in full: a peer that died meanwhile
        is named as soon as the timeout says). Past the timeout the peers may
        have taken this process for lost, and it says so."""
        if paused > self._timeout:
            _log.warning("mltuner: rank %d's control thread did not run for %.1f s (a call that held the interpreter "
                         "lock, or a stopped process), longer than the heartbeat timeout: its peers may take it for "
                         "lost; Job(heartbeat_timeout_s=...) bounds such pauses", self._rank, paused)
        self._broadcast(HEARTBEAT + _RANK.pack(self._rank))
        until = time.monotonic() + 2 * self._interval
        while (left := until - time.monotonic()) > 0 and not self._stopping.is_set():
            self._read(dict(poller.poll(max(1, int(left * 1000)))))

    def _broadcast(self, frame: bytes) -> None:
        for socket in self._peers.values():
            try:
                socket.send(frame, flags=zmq.NOBLOCK)
            except zmq.Again:
                pass  # the peer has not read the last few: it is silent, and its own silence will tell

    def _drain(self, inbox: zmq.Socket[bytes]) -> None:
        for _ in range(256):  # then look at the clock again
            try:
                frames = inbox.recv_multipart(flags=zmq.NOBLOCK)
            except zmq.Again:
                return
            frame = frames[0] if len(frames) == 1 else b""
            kind = frame[:-_RANK.size]
            rank = _RANK.unpack(frame[-_RANK.size:])[0] if len(frame) > _RANK.size else -1
            if kind not in (HEARTBEAT, GOODBYE, CLOSING) or rank not in self._last_heard:
                self.rejections.record(f"an unknown control message ({len(frames)} frames, {len(frame)} bytes)")
                continue
            self._last_heard[rank] = time.monotonic()
            if kind == GOODBYE:
                self._departed.add(rank)
            elif kind == CLOSING:
                self._closing.setdefault(rank, time.monotonic())

    def _check_peers(self, now: float) -> None:
        if self.lost is not None:
            return
        for rank, heard in self._last_heard.items():
            if rank not in self._departed and now - heard > self._timeout:
                self.lost = (f"worker rank {rank} stopped answering: no heartbeat from it for {now - heard:.1f} s "
                             "(it exited, crashed, was stopped or hung, or its machine is unreachable)")
                _log.error("mltuner: %s", self.lost)
                self._on_lost(self.lost)
                return
