"""Moving a job's messages between processes with ZeroMQ: the data sockets
and their send and receive threads (:class:`SocketTransport`), heartbeats and
goodbyes on sockets of their own (:class:`ControlChannel`), which address
reaches each peer (``ipc://`` on one host, ``tcp://`` between hosts:
:class:`Card`, :class:`IpcDirectory`), which sockets authenticate how
(:class:`SocketSecurity`: CURVE with keys derived from the job's secret on
TCP, the private directory on ``ipc://``), and the limits on what a socket takes in and holds.
:mod:`mltuner.launch` sets them up; docs/distributed.md describes them."""

from __future__ import annotations

from mltuner.transport._address import Card, IpcDirectory, choose_address, host_identity
from mltuner.transport._control import ControlChannel
from mltuner.transport._guard import ConnectionGuard, RejectionLog, limit_input
from mltuner.transport._security import CurveKeys, SocketSecurity, derive_keys, secure_client, secure_server
from mltuner.transport._sockets import SocketTransport

__all__ = ["Card", "ConnectionGuard", "ControlChannel", "CurveKeys", "IpcDirectory", "RejectionLog",
           "SocketSecurity", "SocketTransport", "choose_address", "derive_keys", "host_identity", "limit_input", "secure_client",
           "secure_server"]
