"""The claim board in a file that every rank of one host locks and updates
itself (``steal_batches`` when the whole job runs on one host).

Through :meth:`mltuner.Job.request` every claim is a round trip to rank 0,
whose Python thread that answers it must first get rank 0's interpreter
lock from its training loop: measured at 2.5 ms a clock with rank 0
computing in Python (a CPU loop of 4 ms a clock, two workers), where the
claims are for every clock of every rank. Here a rank takes the file's lock
(``flock``), reads the board's state, makes its claim and writes the state
back, all in its own process (tens of microseconds), and rank 0's loop is
left alone. The file lives in ``/dev/shm`` (memory), readable by its owner
only, and is unlinked as soon as every rank has it open, so nothing is left
behind however the job ends. A rank that dies while holding the lock
releases it (the kernel drops a dead process's locks); one that hangs holds
it, and the others fail after the timeout.
"""

from __future__ import annotations

import fcntl
import json
import os
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

from mltuner.exceptions import WaitTimeoutError
from mltuner.tune._errors import TuningError
from mltuner.tune.session._steal import LATE_AFTER, Claim, ClaimBoard, Wait

__all__ = ["SharedClaimBoard", "new_board_file"]

_SHM = "/dev/shm"


def new_board_file() -> str:
    """A new empty board file, readable and writable by this user only."""
    directory = _SHM if os.path.isdir(_SHM) and os.access(_SHM, os.W_OK) else tempfile.gettempdir()
    fd, path = tempfile.mkstemp(prefix="mltuner-claims-", dir=directory)
    os.close(fd)
    return path


class SharedClaimBoard:
    """A :class:`ClaimBoard` whose state lives in the file at ``path``.

    Args:
        path: the board file (:func:`new_board_file` on one rank, the same
            path on the others).
        world_size: the job's ranks.
        timeout_s: the longest a claim waits for the file's lock.
        late_after: :class:`ClaimBoard`'s.
        now: the clock of the claims' times: every rank's must be the same
            (``time.monotonic``, one per host).
    """

    def __init__(self, path: str, world_size: int, timeout_s: float, late_after: float = LATE_AFTER,
                 now: Callable[[], float] = time.monotonic) -> None:
        self._fd = os.open(path, os.O_RDWR)
        self._path = path
        self._world = world_size
        self._timeout_s = timeout_s
        self._now = now
        self._late_after = late_after

    def claim(self, rank: int, run: int, clock: int, slack: int | None = None,
              samples: int | None = None) -> Claim | Wait:
        """:meth:`ClaimBoard.claim`, made under the file's lock."""
        with self._locked():
            board = ClaimBoard(self._world, self._late_after, self._now)
            raw = os.pread(self._fd, os.fstat(self._fd).st_size, 0)
            if raw:
                try:
                    board.load(json.loads(raw))
                except (ValueError, KeyError, TypeError) as error:
                    raise TuningError(f"the batch claim board {self._path} is corrupt ({error}): a rank died "
                                      f"while writing it?") from error
            claim = board.claim(rank, run, clock, slack, samples)
            if isinstance(claim, Wait):
                return claim  # the board is as it was
            data = json.dumps(board.state(), separators=(",", ":")).encode()
            os.pwrite(self._fd, data, 0)
            os.ftruncate(self._fd, len(data))
            return claim

    def unlink(self) -> None:
        """Removes the file's name (the ranks that opened it keep it)."""
        try:
            os.unlink(self._path)
        except FileNotFoundError:
            pass

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1

    @contextmanager
    def _locked(self) -> Iterator[None]:
        deadline = time.monotonic() + self._timeout_s
        while True:
            try:
                fcntl.flock(self._fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() > deadline:
                    raise WaitTimeoutError(f"waited {self._timeout_s:g} s for the batch claim board's lock "
                                           f"({self._path}): another rank holds it") from None
                time.sleep(20e-6)
        try:
            yield
        finally:
            fcntl.flock(self._fd, fcntl.LOCK_UN)
