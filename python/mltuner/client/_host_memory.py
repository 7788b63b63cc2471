"""Host memory the engine will hold, predicted and checked before it is allocated.

The engine allocates host memory at two moments: ``create_table`` (the
server shard's slice of the table and the update rule's state) and
``finish_virtual_iteration`` (what the engine's plan counts: host-resident
caches with their update logs and local data, the staging buffer, the update
payloads in flight, and on the CPU backend the access-buffer pool and the
device-resident stores; ``cpp/src/plan/host_memory.h``). Before each,
:class:`HostMemory` compares what the call will take with what this process
may still have, the smallest of:

- the memory the kernel reports available (``MemAvailable``),
- the cgroup's memory limit minus its usage (v2 ``memory.max``, or v1),
- ``RLIMIT_AS`` minus this process's address space,
- ``Config(host_memory_limit=...)`` minus what the engines of this process
  already hold,

and refuses with :class:`~mltuner.ResourceExhaustedError`, giving both sizes,
instead of letting the kernel kill the process. The prediction counts the
buffers the engine keeps; short-lived copies while the plan is built are not
counted. The engine checks its plan once more itself, against
``Config.host_memory_limit`` or ``MemAvailable`` alone.
"""

from __future__ import annotations

import dataclasses
import resource
import threading
from pathlib import Path

from mltuner.exceptions import ResourceExhaustedError

__all__ = ["HostMemory", "Headroom", "headroom"]

_UNLIMITED = 1 << 62


@dataclasses.dataclass(frozen=True)
class Headroom:
    """Bytes this process may still allocate, and which limit says so."""

    bytes: int
    source: str


def _meminfo_available() -> Headroom | None:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return Headroom(int(line.split()[1]) * 1024, "the memory the kernel reports available")
    except (OSError, ValueError, IndexError):
        pass
    return None


def _read_int(path: Path) -> int | None:
    try:
        text = path.read_text().strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None


def _cgroup_headroom() -> Headroom | None:
    try:
        lines = Path("/proc/self/cgroup").read_text().splitlines()
    except OSError:
        return None
    best: Headroom | None = None
    for line in lines:
        _, controllers, path = line.split(":", 2)
        if controllers == "":  # v2: every level up to the root may set a limit
            directory = Path("/sys/fs/cgroup") / path.lstrip("/")
            while True:
                limit, usage = _read_int(directory / "memory.max"), _read_int(directory / "memory.current")
                if limit is not None and usage is not None:
                    room = Headroom(limit - usage, f"the cgroup's memory.max of {limit} bytes minus its usage "
                                                   f"of {usage} bytes ({directory})")
                    best = room if best is None or room.bytes < best.bytes else best
                if directory == Path("/sys/fs/cgroup") or directory.parent == directory:
                    break
                directory = directory.parent
        elif "memory" in controllers.split(","):
            directory = Path("/sys/fs/cgroup/memory") / path.lstrip("/")
            limit = _read_int(directory / "memory.limit_in_bytes")
            usage = _read_int(directory / "memory.usage_in_bytes")
            if limit is not None and usage is not None and limit < _UNLIMITED:
                room = Headroom(limit - usage, f"the cgroup's memory limit of {limit} bytes minus its usage "
                                               f"of {usage} bytes")
                best = room if best is None or room.bytes < best.bytes else best
    return best


def _address_space_headroom() -> Headroom | None:
    soft, _ = resource.getrlimit(resource.RLIMIT_AS)
    if soft == resource.RLIM_INFINITY:
        return None
    used = 0
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmSize:"):
                used = int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return Headroom(soft - used, f"RLIMIT_AS of {soft} bytes minus this process's address space of {used} bytes")


def headroom() -> Headroom:
    """The smallest of what the kernel, the cgroup and RLIMIT_AS still allow."""
    found = [room for room in (_meminfo_available(), _cgroup_headroom(), _address_space_headroom()) if room]
    if not found:
        return Headroom(_UNLIMITED, "no limit found")
    return min(found, key=lambda room: room.bytes)


class HostMemory:
    """What the engines of one process hold, and the check before each
    allocation. Shared by the workers of a LocalCluster; thread-safe."""

    def __init__(self, limit: int | None = None) -> None:
        self.limit = limit or None  # 0: no limit of its own, as None
        self.held = 0
        self._lock = threading.Lock()

    def reserve(self, what: str, needed: int, detail: str, *, in_place_of: int = 0, freed_meanwhile: int = 0) -> None:
        """Counts ``needed`` bytes as held, or raises ResourceExhaustedError
        (naming ``what`` and the sizes) when this process may not have them.
        ``in_place_of``: bytes reserved earlier that ``needed`` includes
        (given back with it; kept when refused). ``freed_meanwhile``: bytes
        the application frees before the last of ``needed`` is allocated
        (room beyond what the kernel, the cgroup and RLIMIT_AS allow now; not
        beyond ``Config.host_memory_limit``, which counts the engines alone)."""
        with self._lock:
            held = max(0, self.held - in_place_of)
            room = headroom()
            if freed_meanwhile > 0:
                room = Headroom(room.bytes + freed_meanwhile, f"{room.source}, and the {freed_meanwhile} bytes the "
                                                              "application frees while it writes initial values")
            if self.limit is not None and self.limit - held < room.bytes:
                room = Headroom(self.limit - held, f"Config(host_memory_limit={self.limit}) minus the "
                                                   f"{held} bytes this process's engines already hold")
            if needed > room.bytes:
                raise ResourceExhaustedError(
                    f"{what} needs {needed} bytes ({_mib(needed)}) of host memory ({detail}), but this process may "
                    f"use only {max(room.bytes, 0)} bytes ({_mib(max(room.bytes, 0))}) more: {room.source}")
            self.held = held + needed

    def release(self, amount: int) -> None:
        with self._lock:
            self.held = max(0, self.held - amount)


def _mib(amount: int) -> str:
    return f"{amount / 2**20:.1f} MiB"

