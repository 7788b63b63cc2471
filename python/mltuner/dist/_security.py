"""ZeroMQ CURVE keys derived from the job's shared secret.

Every process of a job knows the secret (``MLTUNER_SECRET``) and nothing else,
so the keys are derived from it: one key pair for the sockets that bind
(servers) and one for the sockets that connect (clients). A server accepts a
connection only when the client proves it holds the client secret key (the
ZAP handler checks the client's public key), so a process without the secret
cannot complete the handshake, and its bytes never reach the engine. CURVE
also encrypts the traffic.
"""

from __future__ import annotations

import dataclasses
import hashlib

import zmq
import zmq.auth.thread

__all__ = ["CurveKeys", "derive_keys", "secure_server", "secure_client", "start_authenticator"]


@dataclasses.dataclass(frozen=True)
class CurveKeys:
    """Z85-encoded CURVE keys of a job (secret halves never printed)."""

    server_public: bytes
    server_secret: bytes = dataclasses.field(repr=False)
    client_public: bytes
    client_secret: bytes = dataclasses.field(repr=False)


def _secret_key(secret: str, role: str) -> bytes:
    # A CURVE secret key is any 32 bytes; a keyed hash per role keeps the
    # server and client pairs independent.
    digest = hashlib.blake2b(secret.encode(), key=b"mltuner-curve-v1", person=role.encode()[:16], digest_size=32)
    return zmq.utils.z85.encode(digest.digest())


def derive_keys(secret: str) -> CurveKeys:
    """The job's key pairs; the same secret gives the same keys everywhere."""
    if not secret:
        raise ValueError("the shared secret (MLTUNER_SECRET) is empty")
    if not zmq.has("curve"):
        raise RuntimeError("this pyzmq's libzmq was built without CURVE; install a pyzmq wheel from PyPI")
    server_secret = _secret_key(secret, "server")
    client_secret = _secret_key(secret, "client")
    return CurveKeys(
        server_public=zmq.curve_public(server_secret),
        server_secret=server_secret,
        client_public=zmq.curve_public(client_secret),
        client_secret=client_secret,
    )


def secure_server(socket: zmq.Socket[bytes], keys: CurveKeys) -> None:
    """Makes a socket that binds a CURVE server (call before bind)."""
    socket.curve_secretkey = keys.server_secret
    socket.curve_publickey = keys.server_public
    socket.curve_server = True


def secure_client(socket: zmq.Socket[bytes], keys: CurveKeys) -> None:
    """Makes a socket that connects a CURVE client of the job's servers."""
    socket.curve_serverkey = keys.server_public
    socket.curve_publickey = keys.client_public
    socket.curve_secretkey = keys.client_secret


class _JobMembers:
    """ZAP credentials check: only the job's client key is let in."""

    def __init__(self, client_public: bytes) -> None:
        self._client_public = client_public

    def callback(self, domain: str, key: bytes) -> bool:
        return key == self._client_public


def start_authenticator(context: zmq.Context[zmq.Socket[bytes]], keys: CurveKeys) -> zmq.auth.thread.ThreadAuthenticator:
    """Starts the ZAP handler of ``context``; stop it when the context ends."""
    authenticator = zmq.auth.thread.ThreadAuthenticator(context)
    authenticator.start()
    authenticator.configure_curve_callback(domain="*", credentials_provider=_JobMembers(keys.client_public))
    return authenticator
