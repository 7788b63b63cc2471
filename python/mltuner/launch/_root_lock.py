"""A job's hold on its checkpoint roots: rank 0 takes an exclusive lock on
``root/.writer.lock`` at its first save into a root and keeps it until the
job closes. A second job saving into the same root (a script started
twice) is refused at its first save, naming the holder, instead of
overwriting the first one's checkpoints or mixing its files with theirs.
The lock is the kernel's (``flock``), so a job that crashed leaves none
behind; on a file system without locks saves go on unguarded, with a
warning."""

from __future__ import annotations

import fcntl
import logging
import os
import socket
from pathlib import Path

from mltuner.exceptions import InvalidArgumentError

__all__ = ["RootLocks", "LOCK_NAME"]

LOCK_NAME = ".writer.lock"
_log = logging.getLogger("mltuner.launch")


class RootLocks:
    """The checkpoint roots one job writes into, each locked once."""

    def __init__(self) -> None:
        self._held: dict[Path, int] = {}  # root -> the lock file's descriptor (-1: not lockable)

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
            fcntl.flock(descriptor, fcntl.LOCK_EX | fcntl.LOCK_NB)
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
        os.ftruncate(descriptor, 0)
        os.pwrite(descriptor, f"pid {os.getpid()} on {socket.gethostname()}\n".encode(), 0)
        self._held[root] = descriptor

    def held_elsewhere(self, root: Path) -> bool:
        """Whether another job holds ``root`` now (a restore then leaves its
        half-written saves alone)."""
        root = root.resolve()
        if root in self._held or not (root / LOCK_NAME).is_file():
            return False
        try:
            descriptor = os.open(root / LOCK_NAME, os.O_RDONLY)
        except OSError:
            return False
        try:
            fcntl.flock(descriptor, fcntl.LOCK_EX | fcntl.LOCK_NB)  # released by the close below
            return False
        except BlockingIOError:
            return True
        except OSError:
            return False
        finally:
            os.close(descriptor)

    def release(self) -> None:
        """Lets every root go (closing a lock file's descriptor unlocks it)."""
        for descriptor in self._held.values():
            if descriptor >= 0:
                os.close(descriptor)
        self._held.clear()
