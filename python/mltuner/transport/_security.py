"""The job's secret, the ZeroMQ CURVE keys derived from it, and which
sockets use them.

Which sockets authenticate how (:class:`SocketSecurity`, the one place that
decides):

- ``tcp://``, loopback included: CURVE. Any local user can connect to a
  127.0.0.1 port and TCP tells the receiver nothing about who connected, so
  only the keys keep other users' processes out.
- ``ipc://``: no CURVE by default. The socket file lives in a directory that
  only the job's user can open (mode 0700, checked before binding and before
  connecting, :mod:`mltuner.transport._address`), so the kernel refuses any
  other user's connect: the operating system authenticates the peer, and the
  bytes never leave the machine's memory, so there is nothing to encrypt
  against. A process of the same user can connect, as it could ptrace the
  job anyway (the same trust as the per-user loopback key below). CURVE
  costs about 4x the throughput on one host (docs/transport_benchmarks.md).
  ``Job(secure=True)`` keeps CURVE on ``ipc://`` too.
- The rendezvous is TCP, so CURVE; ``Job(secure=False)`` turns CURVE off
  everywhere, on loopback addresses only, for measurements.

Every process of the job knows one secret and derives the keys from it: one
key pair for the sockets that bind (servers) and one for the sockets that
connect (clients). A server accepts a connection only when the client proves
it holds the client secret key (the ZAP handler checks the client's public
key), so a process without the secret cannot complete the handshake and none
of its bytes reach the engine. CURVE also encrypts the traffic.

Where the secret comes from (first found wins):

1. ``MLTUNER_SECRET`` (``mltuner launch`` makes a fresh one for every job);
2. ``MLTUNER_SECRET_FILE``, a file only its owner can read (for torchrun,
   Slurm or MPI: write it once on a shared file system);
3. for a job on one machine (loopback addresses only), a per-user key file
   (``$XDG_RUNTIME_DIR/mltuner/loopback.key``, else ``~/.mltuner/loopback.key``)
   made on first use, readable by this user only. Any process of this user
   can join such a job, which is no weaker than what the user could do with
   ptrace; processes of other users cannot.
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
import secrets
import stat
from pathlib import Path

import zmq
import zmq.auth.thread

from mltuner.exceptions import InvalidArgumentError

__all__ = ["CurveKeys", "SocketSecurity", "derive_keys", "secure_server", "secure_client", "start_authenticator",
           "read_secret_file", "user_loopback_secret", "user_key_directory"]

MIN_SECRET_CHARS = 16
_KEY_FILE = "loopback.key"


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


@dataclasses.dataclass(frozen=True)
class SocketSecurity:
    """Which of a job's sockets use CURVE (see the module doc).

    Attributes:
        keys: the job's keys; None turns CURVE off everywhere
            (``Job(secure=False)``, loopback only).
        curve_on_ipc: CURVE on ``ipc://`` sockets as well
            (``Job(secure=True)``); by default the private directory
            authenticates them.
    """

    keys: CurveKeys | None
    curve_on_ipc: bool = False

    def keys_for(self, endpoint: str) -> CurveKeys | None:
        """The keys a socket bound or connected at ``endpoint`` uses, or None
        for a plain socket."""
        if self.keys is None:
            return None
        if endpoint.startswith("ipc://") and not self.curve_on_ipc:
            return None
        if endpoint.startswith(("ipc://", "tcp://")):
            return self.keys
        raise InvalidArgumentError(f"no security rule for the endpoint {endpoint!r}: expected tcp:// or ipc://")


def derive_keys(secret: str) -> CurveKeys:
    """The job's key pairs; the same secret gives the same keys everywhere."""
    if not secret:
        raise InvalidArgumentError("the shared secret (MLTUNER_SECRET) is empty")
    if not zmq.has("curve"):
        raise InvalidArgumentError("this pyzmq's libzmq was built without CURVE; install a pyzmq wheel from PyPI")
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


# -- where the secret comes from ---------------------------------------------------
def _check_private(path: Path, what: str, *, directory: bool) -> None:
    """Refuses a file or directory that another user owns or may open."""
    info = path.lstat()
    kind_ok = stat.S_ISDIR(info.st_mode) if directory else stat.S_ISREG(info.st_mode)
    if not kind_ok:
        raise InvalidArgumentError(f"{what} {path} is not a {'directory' if directory else 'regular file'}")
    if info.st_uid != os.getuid():
        raise InvalidArgumentError(f"{what} {path} belongs to uid {info.st_uid}, not to this user ({os.getuid()})")
    if info.st_mode & 0o077:
        raise InvalidArgumentError(f"{what} {path} may be opened by other users (mode {stat.S_IMODE(info.st_mode):o}): "
                                   f"chmod {'700' if directory else '600'} it")


def read_secret_file(path: str | os.PathLike[str]) -> str:
    """The secret stored in ``path`` (``MLTUNER_SECRET_FILE``), which must be
    a regular file of this user that no one else may read, holding at least
    16 characters."""
    path = Path(path)
    try:
        _check_private(path, "MLTUNER_SECRET_FILE", directory=False)
        secret = path.read_text().strip()
    except OSError as error:
        raise InvalidArgumentError(f"cannot read MLTUNER_SECRET_FILE {path}: {error.strerror or error}") from None
    if len(secret) < MIN_SECRET_CHARS:
        raise InvalidArgumentError(f"MLTUNER_SECRET_FILE {path} holds {len(secret)} characters; "
                                   f"a secret needs at least {MIN_SECRET_CHARS}")
    return secret


def user_key_directory() -> Path:
    """Where the per-user loopback key lives: a private run-time directory
    when the system gives one, else ``~/.mltuner``."""
    runtime = os.environ.get("XDG_RUNTIME_DIR", "")
    if runtime and Path(runtime).is_dir():
        return Path(runtime) / "mltuner"
    return Path.home() / ".mltuner"


def user_loopback_secret(directory: Path | None = None) -> str:
    """This user's secret for jobs on one machine, made on first use.

    Several processes may call this at once: each writes a candidate into a
    private file and links it into place; the link fails for all but the
    first, and everyone then reads the winner, so all agree.
    """
    directory = directory or user_key_directory()
    try:
        directory.mkdir(mode=0o700, parents=True, exist_ok=True)
        _check_private(directory, "the mltuner key directory", directory=True)
        final = directory / _KEY_FILE
        if not final.exists():
            candidate = directory / f".{_KEY_FILE}.{os.getpid()}.{secrets.token_hex(4)}"
            descriptor = os.open(candidate, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            try:
                with os.fdopen(descriptor, "w") as file:
                    file.write(secrets.token_hex(32) + "\n")
                    file.flush()
                    os.fsync(file.fileno())
                try:
                    os.link(candidate, final)
                except FileExistsError:
                    pass  # another process was first: use its key
            finally:
                candidate.unlink(missing_ok=True)
        _check_private(final, "the mltuner loopback key", directory=False)
        secret = final.read_text().strip()
    except OSError as error:
        raise InvalidArgumentError(f"cannot make or read this user's mltuner key in {directory}: "
                                   f"{error.strerror or error}; set MLTUNER_SECRET instead") from None
    if len(secret) < MIN_SECRET_CHARS:
        raise InvalidArgumentError(f"the mltuner loopback key {final} is damaged: delete it and start again")
    return secret
