"""A job's hold on its checkpoint roots: rank 0 takes an exclusive lock on
``root/.writer.lock`` at its first save into a root and keeps it until the
job closes. A second job saving into the same root (a script started
twice) is refused at its first save, naming the holder, instead of
overwriting the first one's checkpoints or mixing its files with theirs.
The lock is the kernel's (``flock``), so a job that crashed leaves none
behind, and processes forked from the job (data loader workers) close
their copy at once, so they do not keep it after the job. On a file system
without locks saves go on unguarded, with a warning. (On NFS, where flock
is a POSIX lock, closing any descriptor of the file in the holding process
drops its lock: a restore probing the root from the job that writes there
would end its hold.)"""

from __future__ import annotations

import fcntl
import logging
import os
import socket
import time
import weakref
from pathlib import Path

from mltuner.exceptions import InvalidArgumentError

__all__ = ["RootLocks", "held_elsewhere", "LOCK_NAME"]

LOCK_NAME = ".writer.lock"
_TRIES, _RETRY_S = 10, 0.1  # a probe of another job's restore holds the lock for an instant
_log = logging.getLogger("mltuner.launch")
_ALL: weakref.WeakSet[RootLocks] = weakref.WeakSet()


class RootLocks:
    """The checkpoint roots one job writes into, each locked once."""

    def __init__(self) -> None:
        self._held: dict[Path, int] = {}  # root -> the lock file's descriptor (-1: not lockable)
        _ALL.add(self)

    def hold(self, root: Path) -> None:
        """Locks ``root`` (an existing directory) for this job, unless it does already.

        Raises:
            mltuner.InvalidArgumentError: another job holds it.
        """
        root = root.resolve()
        if root in self._held:
            return
        path = root / LOCK_NAME
        descriptor = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            for attempt in range(_TRIES):
                try:
                    fcntl.flock(descriptor, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    break
                except BlockingIOError:
                    if attempt + 1 == _TRIES:
                        raise
                    time.sleep(_RETRY_S)
        except BlockingIOError:
            holder = os.pread(descriptor, 200, 0).decode(errors="replace").strip() or "a process"
            os.close(descriptor)
            raise InvalidArgumentError(
                f"save_checkpoint: another job saves checkpoints into {root} ({holder}); its saves and this job's "
                "would replace each other's: give each run a root of its own") from None
        except OSError as error:
            os.close(descriptor)
            _log.warning("mltuner: cannot lock %s (%s); saves into it are not guarded against another job",
                         path, error)
            self._held[root] = -1
            return
        self._held[root] = descriptor
        try:  # who holds it, for the refusal of another job; the lock holds without it
            os.ftruncate(descriptor, 0)
            os.pwrite(descriptor, f"pid {os.getpid()} on {socket.gethostname()}\n".encode(), 0)
        except OSError:
            pass

    def release(self) -> None:
        """Lets every root go (closing a lock file's descriptor unlocks it)."""
        for descriptor in self._held.values():
            if descriptor >= 0:
                os.close(descriptor)
        self._held.clear()


def held_elsewhere(root: Path) -> bool:
    """Whether a job holds ``root`` now (a restore then leaves its
    half-written saves alone): a shared lock for an instant, which a writer's
    exclusive one refuses."""
    try:
        descriptor = os.open(root / LOCK_NAME, os.O_RDONLY)
    except OSError:
        return False  # no lock file: no job ever saved there with one
    try:
        fcntl.flock(descriptor, fcntl.LOCK_SH | fcntl.LOCK_NB)
        return False
    except BlockingIOError:
        return True
    except OSError:
        return False
    finally:
        os.close(descriptor)


def _close_in_child() -> None:
    """After fork(): the child closes its copies of the held descriptors (a
    lock lasts while any copy is open), leaving the parent's hold intact."""
    for locks in list(_ALL):
        for descriptor in locks._held.values():
            if descriptor >= 0:
                try:
                    os.close(descriptor)
                except OSError:
                    pass
        locks._held.clear()


os.register_at_fork(after_in_child=_close_in_child)
