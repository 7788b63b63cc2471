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
counted. The engine checks its plan once more itself, and the shard each
fork of a branch, against ``Config.host_memory_limit`` or the same headroom.
"""

from __future__ import annotations

import dataclasses
import threading

from mltuner import _core
from mltuner.exceptions import ResourceExhaustedError

__all__ = ["HostMemory", "Headroom", "headroom"]

_UNLIMITED = 1 << 62


@dataclasses.dataclass(frozen=True)
class Headroom:
    """Bytes this process may still allocate, and which limit says so."""

    bytes: int
    source: str


def headroom() -> Headroom:
    """The smallest of what the kernel, the cgroups and RLIMIT_AS still
    allow (the engine's own reading, ``mltuner/host_headroom.h``, which its
    plan check and the shard's fork check use too)."""
    room, source = _core.host_memory_headroom()
    if room < 0:
        return Headroom(_UNLIMITED, "no limit found")
    return Headroom(room, source)


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

