"""Where this process sits in a job: rank, world size and the master's address.

:func:`detect_environment` reads the variables that a launcher exported and
returns a :class:`ProcessEnv`. The launchers are tried in a fixed order and the
first whose variables are present wins:

1. ``mltuner launch`` (``MLTUNER_*``),
2. torchrun (``RANK``, ``WORLD_SIZE``, ...),
3. Slurm's srun (``SLURM_PROCID``, ...),
4. Open MPI's mpirun (``OMPI_COMM_WORLD_*``),
5. none of them: a single process.

This is the only module that reads these variables; docs/launching.md lists
them all.
"""

from __future__ import annotations

import dataclasses
import ipaddress
import os
import random
import socket
from collections.abc import Iterator, Mapping
from typing import Literal, Union

from mltuner.exceptions import InvalidArgumentError
from mltuner.transport._address import TransportKind
from mltuner.transport._security import MIN_SECRET_CHARS, read_secret_file

__all__ = [
    "ProcessEnv",
    "Source",
    "TransportKind",
    "TRANSPORTS",
    "detect_environment",
    "is_loopback",
    "free_port",
    "iter_slurm_hosts",
    "first_slurm_host",
]

Source = Literal["mltuner", "torchrun", "slurm", "openmpi", "single"]
TRANSPORTS: tuple[TransportKind, ...] = ("auto", "tcp", "ipc")

# Slurm gives no port, so every job derives one from its id: tasks of one job
# agree without talking, and concurrent jobs on a node rarely collide.
SLURM_BASE_PORT = 20000
SLURM_PORT_SPAN = 20000
# Processes of one job: each connects to every other (and a typo in a
# launcher's variables should not allocate per-rank state without bound).
MAX_WORLD_SIZE = 4096

_SECRET_HINT = (
    "set MLTUNER_SECRET to the same random string on every process, e.g. the output of "
    '`python -c "import secrets; print(secrets.token_hex(32))"`, or set MLTUNER_SECRET_FILE to '
    "a file holding it that only you can read"
)


@dataclasses.dataclass(frozen=True)
class ProcessEnv:
    """This process's place in the job.

    Attributes:
        rank: this process's index in the job, in ``[0, world_size)``.
        world_size: number of processes in the job.
        local_rank: index of this process among those on its machine.
        master_addr: host name or address of rank 0, which peers connect to.
        master_port: rank 0's port; 0 means "not fixed" and only occurs when
            ``world_size`` is 1.
        bind_host: the address this process's sockets bind to.
        secret: the job's shared secret (``MLTUNER_SECRET`` or the contents of
            ``MLTUNER_SECRET_FILE``), or None. Left out
            of ``repr`` so that logs never show it.
        source: the launcher whose variables were read.
        torch_store_key: under torchrun, the key in torchrun's own TCPStore
            (which already serves ``master_addr:master_port``) where rank 0
            publishes the rendezvous address it bound; None when rank 0
            binds ``master_port`` itself.
        transport: how processes on one host reach each other: ``"auto"``
            (``ipc://`` between processes of one host, ``tcp://`` between
            hosts), ``"tcp"`` (always TCP) or ``"ipc"`` (every rank must be
            on this host). From ``MLTUNER_TRANSPORT``; ``Job(transport=...)``
            overrides it.
    """

    rank: int
    world_size: int
    local_rank: int
    master_addr: str
    master_port: int
    bind_host: str
    secret: str | None = dataclasses.field(repr=False)
    source: Source
    torch_store_key: str | None = None
    transport: TransportKind = "auto"


def is_loopback(host: str) -> bool:
    """True for addresses only this machine can reach: 127.0.0.0/8, ``::1``
    (with or without brackets, or IPv4-mapped) and ``localhost``."""
    name = host.strip().strip("[]").lower()
    if name in ("localhost", "localhost.") or name.endswith(".localhost"):
        return True
    try:
        address = ipaddress.ip_address(name)
    except ValueError:
        return False  # a host name: it may resolve to any machine
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        return address.ipv4_mapped.is_loopback
    return address.is_loopback


# Ports below the kernel's ephemeral range from this one up: the kernel never
# hands them to a socket bound to port 0 or to an outgoing connection.
_LOWEST_CHOSEN_PORT = 10000
_PORT_TRIES = 64


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port on ``host`` that was free a moment ago, below the kernel's
    ephemeral range where the system has one (Linux).

    The port is only reserved while this call holds it, so callers should
    fail clearly on "address in use" rather than assume the port is theirs.
    A port from the ephemeral range could be taken in that moment by any
    socket of the job itself: a worker's own sockets bound to port 0, or its
    connections to rank 0 while rank 0 is still starting (one of them could
    even reach itself: TCP's self-connect). Below that range only another
    program choosing the same number can take it.
    """
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    address = host.strip("[]")
    ephemeral_low = _ephemeral_low()
    if ephemeral_low is not None and ephemeral_low - _LOWEST_CHOSEN_PORT >= _PORT_TRIES:
        rng = random.SystemRandom()
        for _ in range(_PORT_TRIES):
            port = rng.randrange(_LOWEST_CHOSEN_PORT, ephemeral_low)
            with socket.socket(family, socket.SOCK_STREAM) as probe:
                try:
                    probe.bind((address, port))
                except OSError:
                    continue
                return port
    with socket.socket(family, socket.SOCK_STREAM) as probe:
        probe.bind((address, 0))
        return int(probe.getsockname()[1])


def _ephemeral_low() -> int | None:
    """The lowest port of the kernel's ephemeral range, where it says."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range", encoding="ascii") as ports:
            return int(ports.read().split()[0])
    except (OSError, ValueError, IndexError):
        return None


def detect_environment(env: Mapping[str, str] | None = None) -> ProcessEnv:
    """Reads this process's rank, world size and master address from ``env``
    (default: ``os.environ``).

    Whatever the launcher, ``MLTUNER_BIND_HOST`` overrides the bind address
    and ``MLTUNER_SECRET`` (or a file named by ``MLTUNER_SECRET_FILE``) gives
    the shared secret. Without either, a job on loopback addresses uses this
    user's own key (see :mod:`mltuner.transport._security`).

    Raises:
        InvalidArgumentError (a ValueError): a variable is not an integer or out of range, a variable a
            launcher always sets is missing, or the job would listen beyond
            this machine without ``MLTUNER_SECRET``. The message names the
            variable.
    """
    env = os.environ if env is None else env
    for reader in (_from_mltuner, _from_torchrun, _from_slurm, _from_openmpi):
        found = reader(env)
        if found is not None:
            return _finish(env, *found)
    return _finish(env, "single", 0, 1, 0, "127.0.0.1", 0)


def _torch_store_key(env: Mapping[str, str]) -> str | None:
    """Where rank 0 publishes its rendezvous address in torchrun's store.

    torchrun's agent already listens on MASTER_PORT (its TCPStore), so rank 0
    cannot bind it; the key is unique to the run and to the restart, so a
    restarted job never reads its predecessor's address.
    """
    if env.get(_TORCH_AGENT_STORE, "").strip().lower() not in ("true", "1"):
        return None
    run = env.get("TORCHELASTIC_RUN_ID", "").strip() or "none"
    restart = env.get("TORCHELASTIC_RESTART_COUNT", "").strip() or "0"
    return f"mltuner/{run}/{restart}/rendezvous"


# A reader returns (source, rank, world_size, local_rank, master_addr,
# master_port), or None when its launcher's variables are absent.
# torchrun's agent serves its own TCPStore on MASTER_PORT when it sets this.
_TORCH_AGENT_STORE = "TORCHELASTIC_USE_AGENT_STORE"
_Found = tuple[Source, int, int, int, str, int]


def _from_mltuner(env: Mapping[str, str]) -> _Found | None:
    names = ("MLTUNER_RANK", "MLTUNER_WORLD_SIZE", "MLTUNER_LOCAL_RANK",
             "MLTUNER_MASTER_ADDR", "MLTUNER_MASTER_PORT")
    if not any(name in env for name in names):
        return None
    _require_all(env, names, "`mltuner launch` sets all of them")
    return ("mltuner", _int(env, names[0]), _int(env, names[1]), _int(env, names[2]),
            env[names[3]], _int(env, names[4]))


def _from_torchrun(env: Mapping[str, str]) -> _Found | None:
    if "RANK" not in env and "WORLD_SIZE" not in env:
        return None
    names = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")
    _require_all(env, names, "these are torchrun's variables, and torchrun sets all of them")
    return ("torchrun", _int(env, "RANK"), _int(env, "WORLD_SIZE"), _int(env, "LOCAL_RANK"),
            env["MASTER_ADDR"], _int(env, "MASTER_PORT"))


def _from_slurm(env: Mapping[str, str]) -> _Found | None:
    if "SLURM_PROCID" not in env:
        return None
    names = ("SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID")
    _require_all(env, names, "srun sets all of them")
    rank, world_size, local_rank = (_int(env, name) for name in names)
    addr = env.get("MASTER_ADDR", "")
    if not addr:
        for name in ("SLURM_STEP_NODELIST", "SLURM_JOB_NODELIST"):
            if env.get(name):
                try:
                    addr = first_slurm_host(env[name])
                except ValueError as error:
                    raise InvalidArgumentError(f"{name}={env[name]!r} is not a Slurm host list: {error}") from None
                break
    if "MASTER_PORT" in env:
        port = _int(env, "MASTER_PORT")
    elif "SLURM_JOB_ID" in env:
        port = SLURM_BASE_PORT + _int(env, "SLURM_JOB_ID") % SLURM_PORT_SPAN
    elif world_size > 1:
        raise InvalidArgumentError("under Slurm, set MASTER_PORT or SLURM_JOB_ID (srun sets SLURM_JOB_ID)")
    else:
        port = 0
    return ("slurm", rank, world_size, local_rank, addr, port)


def _from_openmpi(env: Mapping[str, str]) -> _Found | None:
    if "OMPI_COMM_WORLD_RANK" not in env:
        return None
    names = ("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK")
    _require_all(env, names, "mpirun sets all of them")
    rank, world_size, local_rank = (_int(env, name) for name in names)
    if world_size > 1:
        # mpirun exports no rendezvous address; the user must forward one.
        missing = [name for name in ("MASTER_ADDR", "MASTER_PORT") if not env.get(name)]
        if missing:
            raise InvalidArgumentError(
                f"under Open MPI with {world_size} processes, {' and '.join(missing)} must be set: "
                "export them to every process with `mpirun -x MASTER_ADDR=<rank 0's host> "
                "-x MASTER_PORT=<free port> ...`"
            )
    addr = env.get("MASTER_ADDR") or "127.0.0.1"
    port = _int(env, "MASTER_PORT") if env.get("MASTER_PORT") else 0
    return ("openmpi", rank, world_size, local_rank, addr, port)


def _finish(env: Mapping[str, str], source: Source, rank: int, world_size: int, local_rank: int,
            master_addr: str, master_port: int) -> ProcessEnv:
    """Validates what a reader found and applies the overrides every source shares."""
    if not 1 <= world_size <= MAX_WORLD_SIZE:
        raise InvalidArgumentError(f"{_var(source, 'world_size')} must be in 1..{MAX_WORLD_SIZE} (each process "
                                   f"connects to every other), got {world_size}")
    if not 0 <= rank < world_size:
        raise InvalidArgumentError(f"{_var(source, 'rank')}={rank} is outside [0, {world_size}) "
                         f"(world size from {_var(source, 'world_size')})")
    if not 0 <= local_rank < world_size:
        raise InvalidArgumentError(f"{_var(source, 'local_rank')}={local_rank} is outside [0, {world_size})")
    master_addr = master_addr.strip()
    if world_size > 1 and not master_addr:
        raise InvalidArgumentError(f"{_var(source, 'master_addr')} must name rank 0's host when the world "
                         f"size is {world_size}")
    low_port = 1 if world_size > 1 else 0
    if not low_port <= master_port <= 65535:
        raise InvalidArgumentError(f"{_var(source, 'master_port')}={master_port} is not a port in "
                         f"{low_port}..65535")
    bind_host = env.get("MLTUNER_BIND_HOST", "").strip() or _default_bind_host(master_addr)
    secret = env.get("MLTUNER_SECRET") or None
    if secret is None and env.get("MLTUNER_SECRET_FILE"):
        secret = read_secret_file(env["MLTUNER_SECRET_FILE"])
    reachable = not (is_loopback(master_addr) and is_loopback(bind_host))
    if secret is not None and reachable and len(secret) < MIN_SECRET_CHARS:
        # The keys derive from it: a short one is guessed, and a guess joins the job.
        raise InvalidArgumentError(f"MLTUNER_SECRET holds {len(secret)} characters; a job that other machines "
                                   f"can reach needs at least {MIN_SECRET_CHARS}: {_SECRET_HINT}")
    if secret is None:
        # Sockets that other machines can reach must authenticate their peers.
        if not is_loopback(master_addr):
            raise InvalidArgumentError(f"the master address {master_addr!r} ({_var(source, 'master_addr')}) "
                             f"is not a loopback address, so peers on other machines must "
                             f"authenticate: {_SECRET_HINT}")
        if not is_loopback(bind_host):
            raise InvalidArgumentError(f"MLTUNER_BIND_HOST={bind_host!r} is not a loopback address, so peers "
                             f"on other machines must authenticate: {_SECRET_HINT}")
    transport = env.get("MLTUNER_TRANSPORT", "").strip().lower() or "auto"
    if transport not in TRANSPORTS:
        raise InvalidArgumentError(f"MLTUNER_TRANSPORT={env['MLTUNER_TRANSPORT']!r} is not one of "
                                   f"{', '.join(TRANSPORTS)}")
    return ProcessEnv(rank=rank, world_size=world_size, local_rank=local_rank,
                      master_addr=master_addr, master_port=master_port, bind_host=bind_host,
                      secret=secret, source=source,
                      torch_store_key=_torch_store_key(env) if source == "torchrun" else None,
                      transport=transport)


def _default_bind_host(master_addr: str) -> str:
    # Only a loopback job stays private to this machine; any other master
    # address means peers elsewhere, so listen on every interface.
    if not is_loopback(master_addr):
        return "0.0.0.0"
    return "::1" if ":" in master_addr else "127.0.0.1"


# The variable each field came from, for error messages.
_VARIABLES: dict[Source, dict[str, str]] = {
    "mltuner": {"rank": "MLTUNER_RANK", "world_size": "MLTUNER_WORLD_SIZE",
                "local_rank": "MLTUNER_LOCAL_RANK", "master_addr": "MLTUNER_MASTER_ADDR",
                "master_port": "MLTUNER_MASTER_PORT"},
    "torchrun": {"rank": "RANK", "world_size": "WORLD_SIZE", "local_rank": "LOCAL_RANK",
                 "master_addr": "MASTER_ADDR", "master_port": "MASTER_PORT"},
    "slurm": {"rank": "SLURM_PROCID", "world_size": "SLURM_NTASKS", "local_rank": "SLURM_LOCALID",
              "master_addr": "MASTER_ADDR or SLURM_STEP_NODELIST/SLURM_JOB_NODELIST",
              "master_port": "MASTER_PORT or 20000 + SLURM_JOB_ID % 20000"},
    "openmpi": {"rank": "OMPI_COMM_WORLD_RANK", "world_size": "OMPI_COMM_WORLD_SIZE",
                "local_rank": "OMPI_COMM_WORLD_LOCAL_RANK", "master_addr": "MASTER_ADDR",
                "master_port": "MASTER_PORT"},
    "single": {"rank": "rank", "world_size": "world size", "local_rank": "local rank",
               "master_addr": "master address", "master_port": "master port"},
}


def _var(source: Source, field: str) -> str:
    return _VARIABLES[source][field]


def _int(env: Mapping[str, str], name: str) -> int:
    text = env[name].strip()
    try:
        return int(text)
    except ValueError:
        raise InvalidArgumentError(f"{name}={env[name]!r} is not an integer") from None


def _require_all(env: Mapping[str, str], names: tuple[str, ...], why: str) -> None:
    missing = [name for name in names if name not in env]
    if missing:
        present = [name for name in names if name in env]
        raise InvalidArgumentError(f"{', '.join(present)} set but {', '.join(missing)} missing ({why}): "
                         f"set every one of {', '.join(names)}")


def first_slurm_host(hostlist: str) -> str:
    """The first host of a Slurm host list: ``"node[01-03,07],gpu5"`` gives
    ``"node01"``.

    Raises:
        ValueError: ``hostlist`` is empty or malformed.
    """
    return next(iter_slurm_hosts(hostlist))


def iter_slurm_hosts(hostlist: str) -> Iterator[str]:
    """Expands a Slurm compact host list lazily, in Slurm's order.

    ``"node[01-03,07],gpu5"`` yields node01, node02, node03, node07, gpu5.
    Zero padding is kept (the width of a range is that of its first number),
    text may follow a bracket (``"n[1-2]-ib"``), and several brackets in one
    name expand left to right, the last varying fastest (``"r[1-2]n[1-2]"``).

    Raises:
        ValueError: the list is empty, a bracket is unbalanced or nested, or a
            range is not ``low-high`` with ``low <= high`` (raised when the
            before the first host is yielded).
    """
    items = _split_top_level(hostlist)
    parsed = [_parse_host_pattern(item) for item in items]  # fail before yielding anything
    for parts in parsed:
        yield from _expand(parts)


def _split_top_level(hostlist: str) -> list[str]:
    """Splits at commas outside brackets."""
    items: list[str] = []
    depth = 0
    start = 0
    for index, char in enumerate(hostlist):
        if char == "[":
            if depth:
                raise InvalidArgumentError("nested '[' is not valid")
            depth = 1
        elif char == "]":
            if not depth:
                raise InvalidArgumentError("']' without a matching '['")
            depth = 0
        elif char == "," and not depth:
            items.append(hostlist[start:index])
            start = index + 1
    if depth:
        raise InvalidArgumentError("'[' without a matching ']'")
    items.append(hostlist[start:])
    items = [item.strip() for item in items]
    if not any(items) or not all(items):
        raise InvalidArgumentError("empty host name")
    return items


# A host pattern is a list of parts: literal text, or one bracket's ranges as
# (low, high, width) so that a huge range is never materialised.
_Part = Union[str, list[tuple[int, int, int]]]


def _parse_host_pattern(item: str) -> list[_Part]:
    parts: list[_Part] = []
    rest = item
    while rest:
        open_at = rest.find("[")
        if open_at < 0:
            parts.append(rest)
            break
        if open_at:
            parts.append(rest[:open_at])
        close_at = rest.index("]", open_at)
        parts.append(_bracket_ranges(rest[open_at + 1:close_at]))
        rest = rest[close_at + 1:]
    return parts


def _bracket_ranges(body: str) -> list[tuple[int, int, int]]:
    ranges: list[tuple[int, int, int]] = []
    for chunk in body.split(","):
        chunk = chunk.strip()
        low, dash, high = chunk.partition("-")
        if not low.isdigit() or (dash and not high.isdigit()):
            raise InvalidArgumentError(f"range {chunk!r} is not a number or low-high")
        last = int(high) if dash else int(low)
        if last < int(low):
            raise InvalidArgumentError(f"range {chunk!r} runs backwards")
        ranges.append((int(low), last, len(low)))  # Slurm pads to the width of the low end
    return ranges


def _choices(part: _Part) -> Iterator[str]:
    if isinstance(part, str):
        yield part
        return
    for low, high, width in part:
        for number in range(low, high + 1):
            yield str(number).zfill(width)


def _expand(parts: list[_Part]) -> Iterator[str]:
    if not parts:
        yield ""
        return
    for head in _choices(parts[0]):
        for tail in _expand(parts[1:]):
            yield head + tail
