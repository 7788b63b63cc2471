"""Limits on what a listening socket takes in, and logs that cannot flood.

- :class:`RejectionLog` logs the first refusal of a kind at once, then at
  most one line per ``interval_s`` with the count since the last line, so a
  flood of bad input costs a bounded number of log lines.
- :class:`ConnectionGuard` watches one bound socket through a ZeroMQ monitor:
  it counts connections that failed the CURVE handshake (wrong or missing
  keys) and cuts connections beyond a cap. Only connections still in their
  handshake can be cut (an authenticated peer's connection is older than any
  over the cap), and ZeroMQ keeps a peer's queued messages until a
  handshake succeeds, so cutting never loses data.
- :class:`Listener` is one bound socket with its guard (a process binds one
  per address kind: ``tcp://`` with CURVE, ``ipc://`` without).
- :func:`limit_input` sets the options every listening socket gets: the
  largest frame it accepts (ZeroMQ refuses a larger announced frame before
  allocating it, and drops the connection) and how long a handshake may take.

The guard's monitor socket must be used by one thread: the one that polls the
guarded socket.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import socket as pysocket
import time
from collections.abc import Collection

import zmq
from zmq.utils.monitor import parse_monitor_message

__all__ = ["RejectionLog", "ConnectionGuard", "Listener", "limit_input", "describe_handshake_failure", "HANDSHAKE_TIMEOUT_MS"]

# A peer that has not finished the CURVE handshake this long after connecting
# is dropped: an honest peer needs milliseconds.
HANDSHAKE_TIMEOUT_MS = 5000
_REPORT_INTERVAL_S = 10.0


class RejectionLog:
    """Counts refusals of one kind; logs the first at once, then at most one
    line per ``interval_s`` saying how many more there were."""

    def __init__(self, logger: logging.Logger, where: str, interval_s: float = _REPORT_INTERVAL_S) -> None:
        self._logger = logger
        self._where = where
        self._interval = interval_s
        self.count = 0
        self._unreported = 0
        self._last_line = -float("inf")
        self.lines = 0  # lines written, for tests

    def record(self, what: str) -> None:
        self.count += 1
        self._unreported += 1
        now = time.monotonic()
        if now - self._last_line < self._interval:
            return
        if self._unreported == 1:
            self._logger.warning("mltuner: %s refused %s", self._where, what)
        else:
            self._logger.warning("mltuner: %s refused %d inputs in the last %.0f s (%d in all), the latest: %s",
                                 self._where, self._unreported, self._interval, self.count, what)
        self.lines += 1
        self._unreported = 0
        self._last_line = now


def limit_input(socket: zmq.Socket[bytes], max_frame_bytes: int) -> None:
    """Bounds what one connection may make this socket hold (call before bind)."""
    socket.setsockopt(zmq.MAXMSGSIZE, int(max_frame_bytes))
    socket.setsockopt(zmq.HANDSHAKE_IVL, HANDSHAKE_TIMEOUT_MS)


def describe_handshake_failure(kind: int, value: int) -> str:
    """Words for a monitor's handshake-failure event (ZeroMQ's own strerror
    knows none of the protocol codes)."""
    if kind == zmq.EVENT_HANDSHAKE_FAILED_AUTH:
        return "unknown key"
    if kind == zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL:
        return _PROTOCOL_ERRORS.get(value, f"protocol error {value:#x}")
    return zmq.strerror(value)


# Protocol errors a handshake between ZeroMQ peers reports.
_PROTOCOL_ERRORS: dict[int, str] = {
    int(zmq.PROTOCOL_ERROR_ZMTP_CRYPTOGRAPHIC): "keys of another secret",
    int(zmq.PROTOCOL_ERROR_ZMTP_MECHANISM_MISMATCH): "one side without CURVE",
}
_FAILED_HANDSHAKE = (zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
                     | zmq.EVENT_HANDSHAKE_FAILED_AUTH)
_EVENTS = zmq.EVENT_ACCEPTED | zmq.EVENT_DISCONNECTED | zmq.EVENT_CLOSED | _FAILED_HANDSHAKE


class ConnectionGuard:
    """Counts refused connections of one bound socket and caps live ones."""

    def __init__(self, socket: zmq.Socket[bytes], bound: Collection[int | str], where: str, max_connections: int,
                 logger: logging.Logger) -> None:
        """``bound``: the socket's TCP ports and ``ipc://`` paths."""
        self._socket = socket
        self._bound = frozenset(bound)
        self._cap = max_connections
        self.monitor = socket.get_monitor_socket(_EVENTS)
        self.refused = RejectionLog(logger, where)
        self._live: list[int] = []  # descriptors of accepted connections, oldest first

    def handle_events(self) -> None:
        """Reads every pending monitor event, then cuts connections over the cap."""
        while True:
            try:
                frames = self.monitor.recv_multipart(flags=zmq.NOBLOCK)
            except zmq.Again:
                break
            event = parse_monitor_message(frames)
            kind, value = int(event["event"]), int(event["value"])
            if kind == zmq.EVENT_ACCEPTED:
                self._live.append(value)
            elif kind in (zmq.EVENT_DISCONNECTED, zmq.EVENT_CLOSED):
                if value in self._live:
                    self._live.remove(value)
            elif kind & _FAILED_HANDSHAKE:
                self.refused.record(f"a connection that failed the CURVE handshake "
                                    f"({describe_handshake_failure(kind, value)})")
        while len(self._live) > self._cap:
            descriptor = self._live.pop()  # the newest: still in its handshake
            self.refused.record(f"a connection beyond the limit of {self._cap} on this port")
            _cut(descriptor, self._bound)

    def close(self) -> None:
        try:
            self._socket.disable_monitor()
        except zmq.ZMQError:
            pass
        self.monitor.close(linger=0)


def _cut(descriptor: int, bound: frozenset[int | str]) -> None:
    # ZeroMQ offers no call to drop one connection; shutting the socket down
    # makes its I/O thread see the peer leave and clean up after itself.
    try:
        copy = pysocket.socket(fileno=os.dup(descriptor))
    except OSError:
        return  # already closed
    try:
        # The number may have been reused since the event: cut it only if it
        # is still a connection accepted on this socket's port or path.
        name = copy.getsockname()
        if (name[1] if isinstance(name, tuple) else name) in bound:
            copy.shutdown(pysocket.SHUT_RDWR)
    except OSError:
        pass
    finally:
        copy.close()


@dataclasses.dataclass
class Listener:
    """A bound socket and its guard, both used by one thread (the one that
    polls them); closed together."""

    socket: zmq.Socket[bytes]
    guard: ConnectionGuard

    def close(self) -> None:
        self.guard.close()
        self.socket.close(linger=0)
