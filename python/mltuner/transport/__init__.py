"""Moving a job's messages between processes with ZeroMQ: the sockets and
their send and receive threads (:class:`SocketTransport`), the frames they
carry, CURVE authentication with keys derived from the job's secret, and the
limits on what a listening socket takes in. :mod:`mltuner.launch` sets them
up; docs/distributed.md describes them."""

from __future__ import annotations

from mltuner.transport._guard import ConnectionGuard, RejectionLog, limit_input
from mltuner.transport._security import CurveKeys, derive_keys, secure_client, secure_server
from mltuner.transport._sockets import SocketTransport

__all__ = ["ConnectionGuard", "CurveKeys", "RejectionLog", "SocketTransport", "derive_keys", "limit_input",
           "secure_client", "secure_server"]
