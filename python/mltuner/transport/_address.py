"""Which address a process uses to reach each peer: ``ipc://`` on one host,
``tcp://`` between hosts.

Every process binds its sockets on a TCP port and, unless told to use TCP
only, on a Unix-domain socket (``ipc://``) in a private directory of its
own. At the rendezvous it sends a :class:`Card` with both and the identity
of its host; a peer on the same host (same host name, boot id and user) whose
socket file it can see connects through ``ipc://``, anyone else through
``tcp://`` (CURVE on TCP; the private directory authenticates ``ipc://``).

:class:`IpcDirectory` makes the directory (mode 0700, so only this user can
reach the sockets in it) and removes it when the job ends; directories left
by processes that were killed are removed by the next job of this user.
The directory's privacy is what authenticates an ``ipc://`` peer (no CURVE
there, :class:`mltuner.transport._security.SocketSecurity`), so it is
checked before binding (:meth:`IpcDirectory.check_private`) and a peer's
socket is used only in a private directory of this user
(:func:`choose_address`).
"""

from __future__ import annotations

import atexit
import dataclasses
import os
import shutil
import socket
import stat
import tempfile
from pathlib import Path
from typing import Any, Literal

from mltuner.exceptions import InvalidArgumentError

__all__ = ["Card", "MAX_CUDA_IPC_HANDLE_HEX", "IpcDirectory", "host_identity", "choose_address",
           "private_directory_problem", "TransportKind"]

TransportKind = Literal["auto", "tcp", "ipc"]
# sockaddr_un holds 108 bytes with the final NUL; leave room for the names.
_MAX_SOCKET_PATH = 100
# A CUDA IPC handle in hex: a memory handle and DeviceIpc::kCopyEvents (32)
# event handles of 64 bytes each take 2,112 bytes; twice that as the bound.
MAX_CUDA_IPC_HANDLE_HEX = 8192
_PREFIX = "mltuner-"


def host_identity() -> str:
    """Processes that share this string can reach each other's ``ipc://``
    sockets: same host name, same boot (a restarted machine or another
    machine with the same name differs), same user."""
    try:
        boot = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        boot = ""
    return f"{socket.gethostname()}/{boot}/{os.getuid()}"


@dataclasses.dataclass(frozen=True)
class Card:
    """What a process tells its peers at the rendezvous: its host and, for
    each of its sockets (``data``, ``control``), a TCP endpoint and, when it
    binds one, an ``ipc://`` endpoint."""

    host: str
    tcp: dict[str, str]
    ipc: dict[str, str]
    # The CUDA IPC export of a GPU engine (mltuner.transport._cuda_ipc):
    # {"handle": hex, "slice_bytes": n}; None when it offers none.
    cuda_ipc: dict[str, Any] | None = None

    def to_json(self) -> dict[str, Any]:
        card: dict[str, Any] = {"host": self.host, "tcp": self.tcp, "ipc": self.ipc}
        if self.cuda_ipc is not None:
            card["cuda_ipc"] = self.cuda_ipc
        return card

    @staticmethod
    def from_json(value: Any, rank: int) -> Card:
        """Checks a peer's card (it came over the network)."""

        def names(field: Any) -> dict[str, str]:
            if not isinstance(field, dict) or not all(isinstance(k, str) and isinstance(v, str)
                                                      for k, v in field.items()):
                raise InvalidArgumentError(f"rank {rank} sent a malformed rendezvous card: {value!r:.200}")
            return dict(field)

        if not isinstance(value, dict) or not isinstance(value.get("host"), str):
            raise InvalidArgumentError(f"rank {rank} sent a malformed rendezvous card: {value!r:.200}")
        cuda_ipc = value.get("cuda_ipc")
        if cuda_ipc is not None and not (
                isinstance(cuda_ipc, dict) and isinstance(cuda_ipc.get("handle"), str)
                and len(cuda_ipc["handle"]) <= MAX_CUDA_IPC_HANDLE_HEX and isinstance(cuda_ipc.get("slice_bytes"), int)
                and not isinstance(cuda_ipc["slice_bytes"], bool) and 0 < cuda_ipc["slice_bytes"] <= 1 << 50):
            raise InvalidArgumentError(f"rank {rank} sent a malformed CUDA IPC entry in its rendezvous card: "
                                       f"{cuda_ipc!r:.200}")
        return Card(host=value["host"], tcp=names(value.get("tcp")), ipc=names(value.get("ipc")),
                    cuda_ipc=dict(cuda_ipc) if cuda_ipc is not None else None)


def choose_address(kind: TransportKind, mine: Card, theirs: Card, socket_name: str, rank: int) -> str:
    """The endpoint of peer ``rank``'s socket ``socket_name`` to connect to."""
    ipc = theirs.ipc.get(socket_name)
    same_host = theirs.host == mine.host
    if kind == "ipc":
        if not same_host or ipc is None:
            raise InvalidArgumentError(
                f"MLTUNER_TRANSPORT / Job(transport=) is 'ipc' but rank {rank} "
                f"{'runs on another host' if not same_host else 'offers no ipc:// socket'} "
                f"({theirs.host.split('/')[0]}): use 'auto' or 'tcp'")
        problem = _socket_problem(ipc)
        if problem:
            raise InvalidArgumentError(f"MLTUNER_TRANSPORT / Job(transport=) is 'ipc' but rank {rank}'s "
                                       f"{socket_name} socket cannot be used: {problem}; use 'auto' or 'tcp'")
        return ipc
    if kind == "auto" and same_host and ipc is not None and not _socket_problem(ipc):
        return ipc
    try:
        return theirs.tcp[socket_name]
    except KeyError:
        raise InvalidArgumentError(f"rank {rank} offers no TCP endpoint for its {socket_name} socket") from None


def _socket_problem(endpoint: str) -> str:
    """Why this process may not use a peer's ``ipc://`` socket, or "". Same
    host but another mount namespace (a container) cannot see the file; a
    socket outside a private directory of this user would not authenticate
    whoever listens there."""
    path = Path(endpoint.removeprefix("ipc://"))
    try:
        info = os.stat(path)
    except OSError as error:
        return f"{path} is not visible here ({error.strerror or error})"
    if not stat.S_ISSOCK(info.st_mode) or info.st_uid != os.getuid():
        return f"{path} is not a socket of this user"
    return private_directory_problem(path.parent)


def private_directory_problem(path: Path) -> str:
    """Why ``path`` is not a directory that only this user can open, or ""."""
    try:
        info = os.stat(path, follow_symlinks=False)
    except OSError as error:
        return f"cannot look at {path}: {error.strerror or error}"
    if not stat.S_ISDIR(info.st_mode):
        return f"{path} is not a directory"
    if info.st_uid != os.getuid():
        return f"{path} belongs to uid {info.st_uid}, not to this user ({os.getuid()})"
    if info.st_mode & 0o077:
        return f"{path} may be opened by other users (mode {stat.S_IMODE(info.st_mode):o}, not 700)"
    return ""


class IpcDirectory:
    """A directory only this user can open, holding this process's
    ``ipc://`` sockets; removed by :meth:`close` (and at interpreter exit)."""

    def __init__(self) -> None:
        base = _base_directory()
        _remove_stale(base)
        self.path = Path(tempfile.mkdtemp(prefix=f"{_PREFIX}{os.getpid()}-", dir=base))  # mode 0700
        atexit.register(self.close)

    def endpoint(self, name: str) -> str:
        return f"ipc://{self.path / name}"

    def check_private(self) -> None:
        """Raises unless the directory is still this user's alone (the
        authentication of every socket bound in it rests on that)."""
        problem = private_directory_problem(self.path)
        if problem:
            raise InvalidArgumentError(f"the ipc:// socket directory is not private: {problem}")

    def close(self) -> None:
        shutil.rmtree(self.path, ignore_errors=True)
        atexit.unregister(self.close)


def _base_directory() -> str:
    """The user's run-time directory when it is private and its paths short
    enough for a Unix socket, else the system's temporary directory."""
    runtime = os.environ.get("XDG_RUNTIME_DIR", "")
    if runtime and len(runtime) + 40 < _MAX_SOCKET_PATH:
        try:
            info = os.stat(runtime)
            if stat.S_ISDIR(info.st_mode) and info.st_uid == os.getuid() and not info.st_mode & 0o077:
                return runtime
        except OSError:
            pass
    base = tempfile.gettempdir()
    if len(base) + 40 >= _MAX_SOCKET_PATH:
        raise InvalidArgumentError(f"the temporary directory {base} is too long a path for ipc:// sockets: set "
                                   "TMPDIR to a shorter one, or MLTUNER_TRANSPORT=tcp")
    return base


def _remove_stale(base: str) -> None:
    """Removes this user's socket directories whose process is gone."""
    try:
        entries = list(os.scandir(base))
    except OSError:
        return
    for entry in entries:
        if not entry.name.startswith(_PREFIX):
            continue
        pid_text = entry.name[len(_PREFIX):].split("-", 1)[0]
        try:
            if not pid_text.isdigit() or entry.stat(follow_symlinks=False).st_uid != os.getuid() \
                    or not entry.is_dir(follow_symlinks=False):
                continue
            os.kill(int(pid_text), 0)
        except ProcessLookupError:
            shutil.rmtree(entry.path, ignore_errors=True)
        except OSError:
            continue  # alive (or not ours to judge)
