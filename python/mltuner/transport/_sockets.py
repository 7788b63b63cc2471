"""Moves a ProcessNode's messages between processes over ZeroMQ.

Each process binds one PULL socket that every peer sends to, and connects one
PUSH socket to each peer. Two threads, each owning its sockets:

- the send thread takes encoded messages from the node (waiting with the GIL
  released) and sends the header frame and the payload array with no copy
  (ZeroMQ holds the array until the bytes are out, then the buffer returns to
  the node's pool); every ``heartbeat_interval_s`` it also sends each peer a
  heartbeat;
- the receive thread hands data frames to the node, which validates them in
  C++ with the GIL released, and records when each peer was last heard from.
  A peer silent for ``heartbeat_timeout_s`` is declared lost: the node aborts,
  and every engine call on this process raises PeerLostError naming the rank.
  It also reads the inbox's connection guard (failed handshakes, the cap on
  connections).

Every socket is a CURVE socket of the job, so heartbeats and goodbyes are
authenticated like data: a process without the job's secret cannot forge one.

Messages between this process's own engine and shard never come here.
"""

from __future__ import annotations

import logging
import struct
import threading
import time
from typing import Any

import zmq

from mltuner import _core
from mltuner.exceptions import CorruptMessageError
from mltuner.transport._guard import ConnectionGuard, RejectionLog
from mltuner.transport._security import CurveKeys, secure_client

__all__ = ["SocketTransport"]

_log = logging.getLogger("mltuner.transport")
_HEARTBEAT = b"MLTN-HB"
_GOODBYE = b"MLTN-BYE"
_RANK = struct.Struct("<i")
_SENDER_OFFSET = 8  # MessageHeader: magic u32, version u16, type u16, sender i32
_POLL_MS = 50


class SocketTransport:
    """The send and receive threads of one process (see the module doc)."""

    def __init__(self, node: _core.ProcessNode, context: zmq.Context[zmq.Socket[bytes]],
                 inbox: zmq.Socket[bytes], guard: ConnectionGuard, endpoints: list[str], keys: CurveKeys | None, *,
                 heartbeat_interval_s: float, heartbeat_timeout_s: float) -> None:
        self._node = node
        self._rank = int(node.rank)
        self._inbox = inbox
        self.guard = guard
        self._interval = heartbeat_interval_s
        self._timeout = heartbeat_timeout_s
        self._peers: dict[int, zmq.Socket[bytes]] = {}
        for rank, endpoint in enumerate(endpoints):
            if rank == self._rank:
                continue
            socket = context.socket(zmq.PUSH)
            socket.linger = 1000  # at close, give queued bytes a second to leave
            socket.sndhwm = 0  # the engine's pipeline bounds what is in flight
            if keys is not None:
                secure_client(socket, keys)
            socket.connect(endpoint)
            self._peers[rank] = socket
        now = time.monotonic()
        self._last_heard = {rank: now for rank in self._peers}
        self._departed: set[int] = set()
        self.lost: str | None = None  # why the job lost a peer, once it has
        # Messages refused here or by the node (the node also counts its own).
        self._rejected = 0
        self.rejections = RejectionLog(_log, f"rank {self._rank}'s data socket")
        self._stopping = threading.Event()
        self._threads = [
            threading.Thread(target=self._send_loop, name="mltuner-send", daemon=True),
            threading.Thread(target=self._receive_loop, name="mltuner-receive", daemon=True),
        ]
        for thread in self._threads:
            thread.start()

    def stop(self, *, graceful: bool = True) -> None:
        """Says goodbye to the peers and joins both threads. Call after the
        node is shut down (its outbox is then closed and drains). Not
        graceful, or once a peer is lost, nothing waits for unsent bytes."""
        self._stopping.set()
        for thread in self._threads:
            thread.join(10.0)
        linger_ms = 1000 if graceful and self.lost is None else 0
        for socket in self._peers.values():
            try:
                socket.send(_GOODBYE + _RANK.pack(self._rank), flags=zmq.NOBLOCK)
            except zmq.ZMQError:
                pass
            socket.close(linger=linger_ms)
        self.guard.close()
        self._inbox.close(linger=0)

    @property
    def rejected(self) -> int:
        """Frames refused here (the node counts the messages it refuses)."""
        return self._rejected

    # -- sending ------------------------------------------------------------------
    def _send_loop(self) -> None:
        next_beat = 0.0
        while True:
            now = time.monotonic()
            if now >= next_beat:
                self._broadcast(_HEARTBEAT + _RANK.pack(self._rank))
                next_beat = now + self._interval
            item = self._node.next_outgoing(max(1, int((next_beat - now) * 1000)))
            if item is None:
                if self._stopping.is_set():
                    return
                continue
            receiver, header, payload = item
            self._send_frames(self._peers[receiver], [header, payload])

    def _send_frames(self, socket: zmq.Socket[bytes], frames: list[Any]) -> None:
        # Non-blocking with a poll so that a stop or a lost peer ends the wait.
        while not self._node.aborted:
            try:
                socket.send_multipart(frames, flags=zmq.NOBLOCK, copy=False)
                return
            except zmq.Again:
                socket.poll(_POLL_MS, zmq.POLLOUT)

    def _broadcast(self, frame: bytes) -> None:
        for socket in self._peers.values():
            try:
                socket.send(frame, flags=zmq.NOBLOCK)
            except zmq.Again:
                pass  # the peer is backed up with data, which counts as a heartbeat

    # -- receiving ----------------------------------------------------------------
    def _receive_loop(self) -> None:
        poller = zmq.Poller()
        poller.register(self._inbox, zmq.POLLIN)
        poller.register(self.guard.monitor, zmq.POLLIN)
        while not self._stopping.is_set():
            ready = dict(poller.poll(_POLL_MS))
            if self._inbox in ready:
                self._drain()
            if self.guard.monitor in ready:
                self.guard.handle_events()
            self._check_peers()

    def _drain(self) -> None:
        for _ in range(256):  # then check the peers again
            try:
                frames = self._inbox.recv_multipart(flags=zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return
            if len(frames) == 2:
                self._on_data(frames[0], frames[1])
            elif len(frames) == 1:
                self._on_signal(frames[0].bytes)
            else:
                self._reject(f"a message of {len(frames)} frames")

    def _on_data(self, header: zmq.Frame, payload: zmq.Frame) -> None:
        try:
            self._node.deliver(header.buffer, payload.buffer)
        except CorruptMessageError as error:  # counted by the node
            self.rejections.record(str(error))
            return
        sender = _RANK.unpack_from(header.buffer, _SENDER_OFFSET)[0]  # valid: deliver checked it
        self._last_heard[sender] = time.monotonic()

    def _on_signal(self, frame: bytes) -> None:
        kind = frame[:-_RANK.size]
        rank = _RANK.unpack(frame[-_RANK.size:])[0] if len(frame) >= _RANK.size else -1
        if kind not in (_HEARTBEAT, _GOODBYE) or rank not in self._last_heard:
            self._reject(f"an unknown {len(frame)}-byte signal")
            return
        self._last_heard[rank] = time.monotonic()
        if kind == _GOODBYE:
            self._departed.add(rank)

    def _check_peers(self) -> None:
        if self.lost is not None:
            return
        now = time.monotonic()
        for rank, heard in self._last_heard.items():
            if rank not in self._departed and now - heard > self._timeout:
                self.lost = (f"worker rank {rank} stopped answering: nothing received from it for "
                             f"{now - heard:.1f} s (it exited, crashed or hung, or its machine is unreachable)")
                _log.error("mltuner: %s", self.lost)
                self._node.abort(self.lost)
                return

    def _reject(self, what: str) -> None:
        self._rejected += 1
        self.rejections.record(what)
