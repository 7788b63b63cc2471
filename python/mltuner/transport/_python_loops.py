"""The data plane's send and receive threads in Python: the fallback where
the C++ socket pump (``_core.SocketPump``, ``cpp/include/mltuner/socket_pump.h``)
cannot be used, because no shared libzmq is loaded (a pyzmq built with a
static one) or ``MLTUNER_SOCKET_THREADS=python`` asks for it. Both do the same
(see :mod:`mltuner.transport._sockets`); these threads hold the GIL for every
message, which a clock of many small messages pays for.

- the send thread takes encoded messages from the node (waiting with the GIL
  released) and sends the header frame and the payload array with no copy
  (ZeroMQ holds the array until the bytes are out; the array views a pinned,
  recycled host frame, which then returns to its pool);
- the receive thread hands data frames to the node, which validates them in
  C++ with the GIL released and, on the CPU backend, uses the payload where
  ZeroMQ received it (no copy): the thread keeps each payload frame, by
  token, until the node hands the token back (``take_released_payloads``);
  it also reads the data sockets' connection guards.
"""

from __future__ import annotations

import logging
import threading
import time
import weakref
from collections.abc import Callable
from typing import Any

import numpy as np
import zmq

from mltuner import _core
from mltuner.exceptions import CorruptMessageError, WaitTimeoutError
from mltuner.transport._guard import Listener, RejectionLog

__all__ = ["PythonLoops"]

_log = logging.getLogger("mltuner.transport")
_POLL_S = 0.05
# Payloads below this share ZeroMQ's receive buffer (its in_batch_size) at
# any byte offset, which a float array may not have: the node copies them
# anyway, so they go without a token (no bookkeeping per small message).
_LEND_MIN_BYTES = 8192
# One wake-up of the send thread takes at most this many messages, and past
# the first at most this many payload bytes (the node batches the small ones).
_TAKE_MESSAGES = 256
_TAKE_BYTES = 1 << 20


class PythonLoops:
    """The data send and receive threads of one process, in Python (see
    :class:`mltuner.transport.SocketTransport` for the arguments)."""

    def __init__(self, node: _core.ProcessNode, listeners: list[Listener], peers: dict[int, zmq.Socket[bytes]],
                 rejections: RejectionLog, *, queue_limit: Callable[[], int], wait_timeout_s: float) -> None:
        self._node = node
        self.listeners = listeners
        self._queue_limit = queue_limit
        self._wait_timeout = wait_timeout_s
        self._peers = peers
        # Payload bytes handed to ZeroMQ per peer and not yet released by it.
        self._queued = {rank: 0 for rank in self._peers}
        self.peak_queued = {rank: 0 for rank in self._peers}
        self._room = threading.Condition()
        self.stuck: str | None = None  # why a peer was declared stuck, once it is
        # Messages refused here (the node counts the messages it refuses).
        self.rejected = 0
        self.rejections = rejections
        # Received payload frames the node may still read, by token (the
        # receive thread's alone).
        self._lent: dict[int, zmq.Frame] = {}
        self._next_token = 0
        self._lends = bool(node.lends_payloads)
        self._stopping = threading.Event()
        self._threads = [
            threading.Thread(target=self._send_loop, name="mltuner-send", daemon=True),
            threading.Thread(target=self._receive_loop, name="mltuner-receive", daemon=True),
        ]
        for thread in self._threads:
            thread.start()

    def stop(self) -> None:
        """Joins both threads (the sockets stay open)."""
        self._stopping.set()
        with self._room:
            self._room.notify_all()
        for thread in self._threads:
            thread.join(10.0)

    def queued_bytes(self, rank: int) -> int:
        """Payload bytes waiting in ZeroMQ for peer ``rank``."""
        with self._room:
            return self._queued[rank]

    # -- sending ------------------------------------------------------------------
    def _send_loop(self) -> None:
        while True:
            taken = self._node.next_outgoing_batch(int(_POLL_S * 1000), _TAKE_MESSAGES, _TAKE_BYTES)
            if not taken:
                if self._stopping.is_set():
                    return
                continue
            for receiver, header, payload in taken:
                self._send(receiver, header, payload)

    def _send(self, receiver: int, header: bytes, payload: Any) -> None:
        size = payload.nbytes if isinstance(payload, np.ndarray) else len(payload)
        if not self._wait_for_room(receiver, size):
            return  # aborted or stopping: the message is dropped with the job
        if self._send_frames(receiver, [header, payload]) and isinstance(payload, np.ndarray) and size:
            with self._room:
                self._queued[receiver] += size
                self.peak_queued[receiver] = max(self.peak_queued[receiver], self._queued[receiver])
            # ZeroMQ drops its reference once the bytes are out; then the
            # array dies and its bytes leave the count.
            weakref.finalize(payload, self._release, receiver, size)

    def _release(self, receiver: int, size: int) -> None:
        with self._room:
            self._queued[receiver] -= size
            self._room.notify_all()

    def _wait_for_room(self, receiver: int, size: int) -> bool:
        """Waits until peer ``receiver``'s queue can take ``size`` more bytes
        (or is empty). False when the job stops or aborts first."""
        deadline = time.monotonic() + self._wait_timeout
        limit = self._queue_limit()
        with self._room:
            while self._queued[receiver] and self._queued[receiver] + size > limit:
                if self._node.aborted or self._stopping.is_set():
                    return False
                if time.monotonic() >= deadline:
                    self._declare_stuck(receiver)
                    return False
                self._room.wait(_POLL_S)
        return True

    def _send_frames(self, receiver: int, frames: list[Any]) -> bool:
        # Non-blocking with a poll so that a stop or an abort ends the wait.
        socket = self._peers[receiver]
        deadline = time.monotonic() + self._wait_timeout
        while not self._node.aborted:
            try:
                socket.send_multipart(frames, flags=zmq.NOBLOCK, copy=False)
                return True
            except zmq.Again:
                if time.monotonic() >= deadline:
                    self._declare_stuck(receiver)
                    return False
                socket.poll(int(_POLL_S * 1000), zmq.POLLOUT)
        return False

    def _declare_stuck(self, receiver: int) -> None:
        self.stuck = (f"worker rank {receiver} stopped taking data: {self._queued[receiver]} bytes have waited "
                      f"for it for {self._wait_timeout:g} s (Config.wait_timeout_s) although its heartbeats still "
                      "arrive: it is stuck, or far slower than this process")
        _log.error("mltuner: %s", self.stuck)
        self._node.abort(self.stuck)

    # -- receiving ----------------------------------------------------------------
    def _receive_loop(self) -> None:
        poller = zmq.Poller()
        for listener in self.listeners:
            poller.register(listener.socket, zmq.POLLIN)
            poller.register(listener.guard.monitor, zmq.POLLIN)
        while not self._stopping.is_set():
            ready = dict(poller.poll(int(_POLL_S * 1000)))
            for listener in self.listeners:
                if listener.socket in ready:
                    self._drain(listener.socket)
                if listener.guard.monitor in ready:
                    listener.guard.handle_events()
            if self._lent:
                self._free_released()

    def _free_released(self) -> None:
        """Drops the payload frames the node no longer reads."""
        for token in self._node.take_released_payloads():
            self._lent.pop(token, None)

    @property
    def lent_payloads(self) -> int:
        """Received payload frames kept for the node (used in place)."""
        return len(self._lent)

    def _drain(self, inbox: zmq.Socket[bytes]) -> None:
        for _ in range(256):  # then look at the guards again
            try:
                frames = inbox.recv_multipart(flags=zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return
            if len(frames) == 2:
                self._on_data(frames[0], frames[1])
            else:
                self._reject(f"a message of {len(frames)} frames")

    def _on_data(self, header: zmq.Frame, payload: zmq.Frame) -> None:
        token = -1  # copied by the node before deliver returns
        if self._lends and len(payload) >= _LEND_MIN_BYTES:
            # Kept before the node sees it: the token may come back at once.
            token = self._next_token
            self._next_token += 1
            self._lent[token] = payload
        try:
            self._node.deliver(header.buffer, payload.buffer, token)
        except CorruptMessageError as error:  # counted by the node
            self.rejections.record(str(error))
        except WaitTimeoutError as error:  # an inbox stayed full: the node is aborted with why
            if self.stuck is None:
                self.stuck = str(error)
                _log.error("mltuner: %s", error)

    def _reject(self, what: str) -> None:
        self.rejected += 1
        self.rejections.record(what)
