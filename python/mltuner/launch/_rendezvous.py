"""The job's control channel: rendezvous and barriers, through rank 0.

Rank 0 runs a :class:`Coordinator` (a ROUTER socket on the master address, in
its own thread). Every rank, rank 0 included, talks to it through a
:class:`ControlClient` (a DEALER socket used only by the thread that made it):

- ``join`` sends this rank's card (its host and the endpoints of its data
  and control sockets, a JSON object) and a fingerprint of its settings, and
  returns every rank's card once all ranks have joined with the same
  fingerprint;
- ``barrier`` returns once every rank has entered the barrier of that name;
  the job's last one (``final``, at close) marks the coordinator as closing;
- ``allgather`` is a barrier that carries one JSON value per rank and returns
  them all, by rank (the tuner's commands and clock reports travel this way);
- ``request`` asks one of rank 0's services (a function rank 0 registered
  with ``Job.serve``, called on the coordinator's thread) and returns its
  JSON answer, without waiting for the other ranks (the tuning session's
  batch claims travel this way).

One process may open jobs one after another on the same master port. A
rank that leaves a job's final barrier may join the next job before rank 0
has closed the last coordinator; that coordinator answers ``retry``, and the
rank sends its join again until the next coordinator (on the same port, a
new connection) has it.

These sockets use the ZeroMQ I/O thread of the control channel, never
queued behind data. Messages are single JSON frames of at most 1 MiB (ZeroMQ refuses a larger
announced frame before reading it); anything else (a frame nested beyond
the parser's recursion limit too) is dropped, counted and logged at a bounded rate. No single
message stops the coordinator: one whose handling fails is answered with the
error, and a failure of the coordinator itself is sent to every rank (their
current or next wait raises it) rather than leaving them to wait out their
timeouts. A rendezvous that cannot complete (two processes claim a rank, a
rank was started with another world size) fails every rank that joined or
joins, at once, with the reason. Both ends are CURVE sockets of the job
(TCP). Every wait is bounded and polls ``should_stop`` so a lost peer ends it
at once.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Callable, Mapping
from typing import Any, TypeGuard

import zmq
from zmq.utils.monitor import parse_monitor_message

from mltuner.exceptions import InvalidArgumentError, MltunerError, PeerLostError, WaitTimeoutError
from mltuner.transport._control import CONTROL_IO_THREAD
from mltuner.transport._guard import ConnectionGuard, RejectionLog, describe_handshake_failure, limit_input
from mltuner.transport._security import CurveKeys, secure_client, secure_server

__all__ = ["Coordinator", "ControlClient"]

_log = logging.getLogger("mltuner.launch")
_MAX_FRAME = 1 << 20
_POLL_MS = 100
_BUSY_POLL_MS = 2  # a wait with work of its own between polls (allgather's while_waiting)
# How long a rank waits before joining again when the coordinator it reached
# is the previous job's, closing.
_RETRY_S = 0.05
_MISSING_WAIT_S = 0.5  # how long a timed-out wait asks the coordinator who is missing
# Connections the coordinator accepts beyond one per rank (reconnects).
_SPARE_CONNECTIONS = 16
_FAILED_HANDSHAKE = (zmq.EVENT_HANDSHAKE_FAILED_AUTH | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
                     | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL)
_CLIENT_EVENTS = (zmq.EVENT_CONNECTED | zmq.EVENT_CONNECT_RETRIED | zmq.EVENT_DISCONNECTED
                  | zmq.EVENT_HANDSHAKE_SUCCEEDED | _FAILED_HANDSHAKE)
_FAILED_HANDSHAKES_TO_GIVE_UP = 3
# A connection dropped before the handshake that ZeroMQ does not try again
# within this time: the program there answered with something other than
# ZeroMQ's greeting (an HTTP server, a database), and ZeroMQ gives up on it
# without a handshake-failure event.
_DROPPED_GIVE_UP_S = 2.0


def _is_int(value: object) -> TypeGuard[int]:
    """A JSON integer (``true`` is a bool to JSON, not rank 1)."""
    return type(value) is int


def _encode(message: dict[str, Any]) -> bytes:
    return json.dumps(message, separators=(",", ":")).encode()


def _decode(frame: bytes) -> dict[str, Any] | None:
    """The control message in ``frame``, or None for anything that is not
    one: oversized, not UTF-8 or JSON, nested deeper than the parser's
    recursion limit, or not an object with an ``op``. Never raises."""
    if len(frame) > _MAX_FRAME:
        return None
    try:
        message = json.loads(frame.decode())
    except (ValueError, RecursionError, MemoryError):  # UnicodeDecodeError, JSONDecodeError, huge ints
        return None
    return message if isinstance(message, dict) and isinstance(message.get("op"), str) else None


class Coordinator:
    """Rank 0's side of the control channel (a thread serving a ROUTER)."""

    def __init__(self, context: zmq.Context[zmq.Socket[bytes]], bind_host: str, port: int, world_size: int,
                 keys: CurveKeys | None, services: Mapping[str, Callable[[int, Any], Any]] | None = None) -> None:
        self._world_size = world_size
        # Rank 0's handlers by name (Job.serve), read here on every request.
        self._services = services if services is not None else {}
        self._socket = context.socket(zmq.ROUTER)
        self._socket.affinity = CONTROL_IO_THREAD  # never behind data
        self._socket.linger = 0
        limit_input(self._socket, _MAX_FRAME)
        if keys is not None:
            secure_server(self._socket, keys)
        host = f"[{bind_host}]" if ":" in bind_host else bind_host
        try:
            if port == 0:
                self.port = self._socket.bind_to_random_port(f"tcp://{host}")
            else:
                self._socket.bind(f"tcp://{host}:{port}")
                self.port = port
        except zmq.ZMQError as error:
            self._socket.close()
            hint = (": another program holds that port (another job, or a launcher's own store); choose another "
                    "master port" if error.errno == zmq.EADDRINUSE else "")
            raise InvalidArgumentError(f"rank 0 cannot listen on {bind_host}:{port} for the rendezvous: "
                                       f"{error.strerror}{hint}") from None
        self.guard = ConnectionGuard(self._socket, {self.port}, "the rendezvous socket",
                                     world_size + _SPARE_CONNECTIONS, _log)
        self.rejections = RejectionLog(_log, "the rendezvous socket")
        self._members: dict[int, tuple[bytes, Any, str]] = {}  # rank -> (routing id, card, fingerprint)
        self._barriers: dict[str, set[int]] = {}
        self._gathers: dict[str, dict[int, Any]] = {}
        self._welcome: dict[str, Any] | None = None  # the answer to a complete join
        # Why the rendezvous cannot complete (two processes claim a rank, a
        # rank has another world size): every join, before or after, gets it.
        self._refusal: dict[str, Any] | None = None
        self._failure: str | None = None  # why the coordinator itself stopped working
        self._closing = False  # the final barrier was passed: joins are the next job's
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, name="mltuner-coordinator", daemon=True)
        self._thread.start()

    def missing_ranks(self) -> list[int]:
        """Ranks that have not joined yet (for timeout messages)."""
        with self._lock:
            return [r for r in range(self._world_size) if r not in self._members]

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5.0)
        self.guard.close()
        self._socket.close()

    @property
    def failure(self) -> str | None:
        """Why the coordinator stopped serving, or None while it serves."""
        return self._failure

    def _serve(self) -> None:
        try:
            poller = zmq.Poller()
            poller.register(self._socket, zmq.POLLIN)
            poller.register(self.guard.monitor, zmq.POLLIN)
            while not self._stop.is_set():
                ready = dict(poller.poll(_POLL_MS))
                if self.guard.monitor in ready:
                    self.guard.handle_events()
                if self._socket not in ready:
                    continue
                for _ in range(256):  # then look at the guard again
                    try:
                        frames = self._socket.recv_multipart(flags=zmq.NOBLOCK)
                    except zmq.Again:
                        break
                    self._receive(frames)
        except Exception as error:  # the coordinator's own failure: tell every rank, never go silent
            if self._stop.is_set():
                return
            self._fail(f"{type(error).__name__}: {error}")

    def _receive(self, frames: list[bytes]) -> None:
        """One message: no message, however malformed, stops the coordinator."""
        message = _decode(frames[-1]) if len(frames) == 2 else None
        if message is None:
            self.rejections.record(f"a malformed control message ({len(frames)} frames)")
            return
        try:
            self._handle(frames[0], message)
        except Exception as error:  # a bug met by one message: answer it with the error, serve the rest
            _log.error("control channel: rank 0's coordinator failed on a %r message from rank %r",
                       message["op"], message.get("rank"), exc_info=True)
            self._send(frames[0], {"op": "error", "message": (
                f"rank 0's rendezvous coordinator failed on this rank's {message['op']!r} message: "
                f"{type(error).__name__}: {error}")})

    def _fail(self, why: str) -> None:
        """The coordinator cannot go on: every rank's current or next wait
        on it raises with the reason, and it answers every later message so."""
        self._failure = f"rank 0's rendezvous coordinator failed ({why}); the job cannot go on"
        _log.error("control channel: %s", self._failure, exc_info=True)
        reply = {"op": "error", "message": self._failure}
        with self._lock:
            routing_ids = {member[0] for member in self._members.values()}
        for routing_id in routing_ids:
            self._send(routing_id, reply)
        while not self._stop.is_set():
            try:
                if not self._socket.poll(_POLL_MS):
                    continue
                frames = self._socket.recv_multipart(flags=zmq.NOBLOCK)
                if len(frames) == 2:
                    self._send(frames[0], reply)
            except Exception:  # the socket itself is broken: the ranks' timeouts are all that is left
                self._stop.wait(_POLL_MS / 1000)

    def _send(self, routing_id: bytes, message: dict[str, Any]) -> None:
        try:
            self._socket.send_multipart([routing_id, _encode(message)], flags=zmq.NOBLOCK)
        except zmq.ZMQError as error:  # a peer that went away; its own timeout reports it
            _log.warning("control channel: could not answer a peer: %s", error)

    def _handle(self, routing_id: bytes, message: dict[str, Any]) -> None:
        op, rank = message["op"], message.get("rank")
        # A join names its world size too: one of another size is checked there.
        if not _is_int(rank) or rank < 0 or (rank >= self._world_size and op != "join"):
            self._send(routing_id, {"op": "error", "message": f"rank {rank!r} is outside 0..{self._world_size - 1}"})
            return
        if op == "join":
            self._join(routing_id, rank, message)
            return
        name = message.get("name", "")
        if op not in ("barrier", "gather", "request", "missing"):
            self.rejections.record(f"a control message of unknown kind {op[:40]!r} from rank {rank}")
        elif not isinstance(name, str):
            self._send(routing_id, {"op": "error", "message": f"rank {rank} sent a {op} whose name is not a string"})
        elif op == "barrier":
            self._barrier(routing_id, rank, name, message.get("final") is True)
        elif op == "gather":
            self._gather(routing_id, rank, name, message.get("value"))
        elif op == "missing":
            self._missing(routing_id, name, message.get("kind"))
        else:
            self._request(routing_id, rank, name, message.get("value"))

    def _refuse(self, routing_id: bytes, why: str) -> None:
        """The rendezvous cannot complete: every rank that joined, the one
        refused and every later one fail with ``why``. Call with the lock."""
        self._refusal = {"op": "error", "message": (
            f"the rendezvous failed: {why}. Check that every process was started with its own rank and the "
            "same world size")}
        _log.error("control channel: %s", self._refusal["message"])
        for member in {m[0] for m in self._members.values()} | {routing_id}:
            self._send(member, self._refusal)

    def _join(self, routing_id: bytes, rank: int, message: dict[str, Any]) -> None:
        world_size = message.get("world_size")
        if not _is_int(world_size):
            self._send(routing_id, {"op": "error", "message": f"rank {rank} joined without a world size"})
            return
        with self._lock:
            if self._closing:
                # Past the final barrier every join is the next job's (whatever
                # its ranks and size): it joins again until that job's coordinator has it.
                self._send(routing_id, {"op": "retry"})
                return
            if world_size == self._world_size and rank >= world_size:
                self._send(routing_id, {"op": "error", "message": f"rank {rank} is outside 0..{world_size - 1}"})
                return
            if world_size != self._world_size:
                why = f"rank {rank} was started with world size {world_size}, rank 0 with {self._world_size}"
                if self._welcome is None:
                    self._refuse(routing_id, why)
                else:  # the job runs already: only the newcomer is wrong
                    self._send(routing_id, {"op": "error", "message": why})
                return
            if self._refusal is not None:
                self._send(routing_id, self._refusal)
                return
            known = self._members.get(rank)
            if known is not None and known[1] == message.get("card"):
                # The same process (its card names its own sockets) sent its join
                # again, after a reconnect perhaps: answer it where it is now.
                self._members[rank] = (routing_id, known[1], known[2])
                if self._welcome is not None:
                    self._send(routing_id, self._welcome)
                return
            if known is not None:
                if self._welcome is None:
                    self._refuse(routing_id, f"two processes claim rank {rank}")
                else:  # the job runs already: only the newcomer is wrong
                    self._send(routing_id, {"op": "error", "message": f"two processes claim rank {rank}"})
                return
            card = message.get("card")
            if not isinstance(card, dict):
                self._send(routing_id, {"op": "error", "message": f"rank {rank} joined without a card"})
                return
            self._members[rank] = (routing_id, card, str(message.get("fingerprint")))
            if len(self._members) < self._world_size:
                return
            members = [self._members[r] for r in range(self._world_size)]
            fingerprints = {m[2] for m in members}
            if len(fingerprints) > 1:
                self._welcome = {"op": "error", "message": (
                    "the workers were started with different settings: " +
                    "; ".join(f"rank {r}: {m[2]}" for r, m in enumerate(members)))}
            else:
                self._welcome = {"op": "welcome", "cards": [m[1] for m in members]}
        for member in members:
            self._send(member[0], self._welcome)

    def _barrier(self, routing_id: bytes, rank: int, name: str, final: bool) -> None:
        with self._lock:
            if self._members.get(rank, (None,))[0] != routing_id:
                self._send(routing_id, {"op": "error", "message": f"rank {rank} entered a barrier before joining"})
                return
            arrived = self._barriers.setdefault(name, set())
            arrived.add(rank)
            if len(arrived) < self._world_size:
                return
            del self._barriers[name]
            self._closing = self._closing or final
            routing_ids = [self._members[r][0] for r in range(self._world_size)]
        for member in routing_ids:
            self._send(member, {"op": "release", "name": name})


    def _missing(self, routing_id: bytes, name: str, kind: Any) -> None:
        """Which ranks barrier or allgather ``name`` still waits for (asked by
        a rank whose wait timed out, for its message); None when none waits."""
        with self._lock:
            waiting = self._barriers.get(name) if kind == "barrier" else self._gathers.get(name)
            arrived = None if waiting is None else set(waiting)
        ranks = None if arrived is None else [r for r in range(self._world_size) if r not in arrived]
        self._send(routing_id, {"op": "missing", "name": name, "ranks": ranks})

    def _gather(self, routing_id: bytes, rank: int, name: str, value: Any) -> None:
        with self._lock:
            if self._members.get(rank, (None,))[0] != routing_id:
                self._send(routing_id, {"op": "error", "message": f"rank {rank} gathered before joining"})
                return
            values = self._gathers.setdefault(name, {})
            values[rank] = value
            if len(values) < self._world_size:
                return
            del self._gathers[name]
            routing_ids = [self._members[r][0] for r in range(self._world_size)]
        reply = {"op": "gathered", "name": name, "values": [values[r] for r in range(self._world_size)]}
        if len(_encode(reply)) > _MAX_FRAME:
            reply = {"op": "error", "message": f"allgather {name!r}: the values exceed {_MAX_FRAME} bytes"}
        for member in routing_ids:
            self._send(member, reply)


    def _request(self, routing_id: bytes, rank: int, name: str, value: Any) -> None:
        with self._lock:
            joined = self._members.get(rank, (None,))[0] == routing_id
        if not joined:
            self._send(routing_id, {"op": "error", "message": f"rank {rank} sent a request before joining"})
            return
        handler = self._services.get(name)
        if handler is None:
            self._send(routing_id, {"op": "error", "message": f"rank 0 serves no {name!r}"})
            return
        try:
            reply = {"op": "answer", "name": name, "value": handler(rank, value)}
            # An answer JSON cannot hold, or one the rank would refuse, is the handler's fault.
            frame = _encode(reply)
            if len(frame) > _MAX_FRAME:
                raise ValueError(f"the answer is {len(frame)} bytes encoded, more than {_MAX_FRAME}")
        except InvalidArgumentError as error:
            reply = {"op": "error", "message": str(error)}
        except Exception as error:  # a handler's bug must not stop the control channel
            _log.error("rank 0's %r handler failed on rank %d's request: %r", name, rank, error)
            reply = {"op": "error", "message": f"rank 0's {name!r} handler failed: {type(error).__name__}: {error}"}
        self._send(routing_id, reply)


class ControlClient:
    """One rank's side of the control channel. Not thread-safe: use it from
    the thread that made it.

    It watches its own connection (a ZeroMQ monitor), so a rendezvous that
    cannot work fails with the reason instead of waiting out the timeout:
    handshakes refused again and again mean another secret, or a program
    that is not rank 0 on its port (another job, a launcher's store). When
    nothing answers at all, the timeout's message says so."""

    def __init__(self, context: zmq.Context[zmq.Socket[bytes]], host: str, port: int, rank: int,
                 keys: CurveKeys | None, should_stop: Callable[[], str | None]) -> None:
        self._rank = rank
        self._address = f"{host}:{port}"
        self._should_stop = should_stop
        self._socket = context.socket(zmq.DEALER)
        self._socket.affinity = CONTROL_IO_THREAD  # never behind data
        self._socket.linger = 0
        limit_input(self._socket, _MAX_FRAME)
        if keys is not None:
            secure_client(self._socket, keys)
        self._monitor = self._socket.get_monitor_socket(_CLIENT_EVENTS)
        self._connected = False  # a TCP connection was made at least once
        self._handshaken = False  # and completed mltuner's ZeroMQ handshake
        self._reconnects = 0  # handshakes after the first: a message in flight may be lost
        self._failed_handshakes = 0
        self._dropped_at: float | None = None  # when a connection closed before its handshake
        self._retried = False  # the last wait met the previous job's coordinator
        bracketed = f"[{host}]" if ":" in host else host
        self._socket.connect(f"tcp://{bracketed}:{port}")

    def join(self, world_size: int, card: dict[str, Any], fingerprint: str, timeout_s: float,
             missing: Callable[[], list[int]] | None = None) -> list[Any]:
        """Every rank's card, by rank, once all have joined (the caller
        checks each: they came over the network)."""
        join = _encode({"op": "join", "rank": self._rank, "world_size": world_size, "card": card,
                        "fingerprint": fingerprint})

        def timed_out() -> str:
            who = f"ranks {missing()} never joined" if missing else "not every rank joined"
            if self._retried:
                who = "rank 0 there still served the previous job on this port"
            return (f"rendezvous at {self._address} timed out after {timeout_s:g} s: {who}. Check that every "
                    "process was started with the same master address, port and world size (and secret)")

        reply = self._expect("welcome", join, timeout_s, timed_out, resend=True)
        cards = reply.get("cards")
        if not isinstance(cards, list) or len(cards) != world_size:
            raise InvalidArgumentError(f"malformed rendezvous reply from {self._address}")
        return cards

    def barrier(self, name: str, timeout_s: float, *, final: bool = False) -> None:
        """Returns once every rank has called ``barrier(name)``. ``final``:
        the job's last; joins after it are the next job's."""
        barrier = _encode({"op": "barrier", "rank": self._rank, "name": name, "final": final})
        reply = self._expect("release", barrier, timeout_s,
                             lambda: f"barrier {name!r} timed out after {timeout_s:g} s: {self._missing('barrier', name)}")
        if reply.get("name") != name:
            raise InvalidArgumentError(f"barrier {name!r} was answered for {reply.get('name')!r}")

    def allgather(self, name: str, value: Any, timeout_s: float,
                  while_waiting: Callable[[], bool] | None = None) -> list[Any]:
        """Every rank's ``value`` (JSON), by rank, once all have called
        ``allgather(name, ...)``. ``while_waiting`` is called every few
        milliseconds until then; each call that returns True (progress
        elsewhere) starts the timeout again."""
        reply = self._ask("allgather", {"op": "gather", "value": value}, "gathered", name, timeout_s,
                          lambda: self._missing("gather", name), while_waiting)
        values = reply.get("values")
        if not isinstance(values, list):
            raise InvalidArgumentError(f"allgather {name!r} was answered without values")
        return values

    def request(self, name: str, value: Any, timeout_s: float) -> Any:
        """The answer of rank 0's service ``name`` to ``value`` (JSON)."""
        return self._ask("request", {"op": "request", "value": value}, "answer", name, timeout_s,
                         lambda: "rank 0 did not answer").get("value")

    def _ask(self, what: str, message: dict[str, Any], answer: str, name: str, timeout_s: float,
             unanswered: Callable[[], str], while_waiting: Callable[[], bool] | None = None) -> dict[str, Any]:
        """Sends ``message`` named ``name`` and returns the ``answer`` to it."""
        try:
            frame = _encode({**message, "rank": self._rank, "name": name})
        except (TypeError, ValueError, RecursionError) as error:
            raise InvalidArgumentError(f"{what} {name!r}: the value is not JSON: {error}") from None
        if len(frame) > _MAX_FRAME:
            raise InvalidArgumentError(f"{what} {name!r}: the value is {len(frame)} bytes encoded, "
                                       f"more than {_MAX_FRAME}")
        reply = self._expect(answer, frame, timeout_s,
                             lambda: f"{what} {name!r} timed out after {timeout_s:g} s: {unanswered()}",
                             while_waiting=while_waiting)
        if reply.get("name") != name:
            raise InvalidArgumentError(f"{what} {name!r} was answered for {reply.get('name')!r}")
        return reply

    def _missing(self, kind: str, name: str) -> str:
        """Which ranks the coordinator still waits for at barrier or
        allgather ``name``, asked once this rank's wait for it timed out (its
        thread answers even where rank 0's loop is stuck), within half a
        second."""
        unknown = "not every worker reached it"
        try:
            reply = self._expect("missing", _encode({"op": "missing", "rank": self._rank, "name": name, "kind": kind}),
                                 _MISSING_WAIT_S, lambda: unknown)
        except MltunerError:  # no answer in time, a lost peer: the timeout's own message says enough
            return unknown
        ranks = reply.get("ranks")
        if reply.get("name") != name or not isinstance(ranks, list) or not ranks or not all(_is_int(r) for r in ranks):
            return unknown
        return f"rank{'s' if len(ranks) > 1 else ''} {', '.join(str(r) for r in ranks)} did not reach it"

    def close(self) -> None:
        try:
            self._socket.disable_monitor()
        except zmq.ZMQError:
            pass
        self._monitor.close(linger=0)
        self._socket.close()

    def _watch_connection(self) -> None:
        """Reads the monitor's events; raises once the handshake with the
        rendezvous address has failed a few times in a row without ever
        succeeding (one failure may be a rank 0 that is busy or cutting a
        flood; ZeroMQ retries every 0.1 s, or 5 s when nothing answers), or
        once a connection closed before its handshake was not tried again."""
        while True:
            try:
                frames = self._monitor.recv_multipart(flags=zmq.NOBLOCK)
            except zmq.Again:
                break
            message = parse_monitor_message(frames)
            event, value = int(message["event"]), int(message["value"])
            if event == zmq.EVENT_CONNECTED:
                self._connected = True
                self._dropped_at = None
            elif event == zmq.EVENT_CONNECT_RETRIED:
                self._dropped_at = None
            elif event == zmq.EVENT_DISCONNECTED and not self._handshaken:
                self._dropped_at = time.monotonic()
            elif event == zmq.EVENT_HANDSHAKE_SUCCEEDED:
                self._reconnects += self._handshaken
                self._handshaken = True
            elif event & _FAILED_HANDSHAKE and not self._handshaken:
                self._failed_handshakes += 1
                if self._failed_handshakes >= _FAILED_HANDSHAKES_TO_GIVE_UP:
                    raise InvalidArgumentError(
                        f"the rendezvous address {self._address} refused this process's handshake "
                        f"{self._failed_handshakes} times ({describe_handshake_failure(event, value)}): either "
                        "rank 0 there has a different secret (MLTUNER_SECRET, MLTUNER_SECRET_FILE, or another "
                        "user's loopback key), or the program there is not this job's rank 0 (another job, or a "
                        "launcher's own store on that port): check the secret and the master address and port")
        if self._dropped_at is not None and time.monotonic() - self._dropped_at > _DROPPED_GIVE_UP_S:
            raise InvalidArgumentError(
                f"the program at the rendezvous address {self._address} accepted the connection and closed it "
                "without ZeroMQ's handshake, and ZeroMQ does not try it again: it is not this job's rank 0 "
                "(another kind of server on that port?): check the master address and port")

    def _unanswered(self) -> str:
        """Why the rendezvous has not answered yet, for a timeout's message."""
        if not self._connected:
            return (f"nothing accepted a connection at {self._address}: is rank 0 running, and are the master "
                    "address and port the same on every process?")
        if not self._handshaken:
            return f"a connection to {self._address} was made but never completed the handshake"
        return ""

    def _expect(self, op: str, request: bytes, timeout_s: float, timeout_message: Callable[[], str],
                resend: bool = False, while_waiting: Callable[[], bool] | None = None) -> dict[str, Any]:
        """Sends ``request`` and returns the next message of kind ``op``.
        The send never blocks: a DEALER with no connection (none made yet,
        or one ZeroMQ dropped and will not make again) would block in send()
        past every timeout, so the request waits here, within the deadline,
        until it can leave. With ``resend`` (the join), it goes out again
        when the coordinator answers ``retry`` (it is the previous job's,
        closing) and after every reconnect (it may have reached a
        coordinator that closed without answering)."""
        deadline = time.monotonic() + timeout_s
        self._retried = False
        resend_at: float | None = None
        reconnects = self._reconnects
        pending: bytes | None = request  # not handed to ZeroMQ yet
        while True:
            lost = self._should_stop()
            if lost:
                raise PeerLostError(lost)
            now = time.monotonic()
            if while_waiting is not None and while_waiting():
                deadline = now + timeout_s
            remaining = deadline - now
            if remaining <= 0:
                self._watch_connection()
                why = self._unanswered()
                raise WaitTimeoutError(timeout_message() + (f" ({why})" if why else ""))
            self._watch_connection()
            if resend and (self._reconnects != reconnects or (resend_at is not None and now >= resend_at)):
                pending, reconnects, resend_at = request, self._reconnects, None
            if pending is not None:
                try:
                    self._socket.send(pending, flags=zmq.NOBLOCK)
                    pending = None
                except zmq.Again:
                    pass  # no connection to hand it to yet: try again after the poll
            poll_ms = _POLL_MS if while_waiting is None and pending is None else _BUSY_POLL_MS
            if not self._socket.poll(min(poll_ms, int(remaining * 1000) + 1)):
                continue
            message = _decode(self._socket.recv())
            if message is None:  # not from this job's coordinator, which sends none such
                continue
            if message["op"] == "error":
                raise InvalidArgumentError(str(message.get("message")))
            if message["op"] == "retry" and resend:
                self._retried = True
                resend_at = time.monotonic() + _RETRY_S
            if message["op"] == op:
                return message
