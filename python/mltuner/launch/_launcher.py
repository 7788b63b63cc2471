"""``mltuner launch``: runs N copies of a training command on this machine.

Each worker gets the ``MLTUNER_*`` variables that
:func:`~mltuner.launch.detect_environment` reads, runs in its own process group
(so that a signal reaches the worker and everything it started), and has its
output printed line by line with a ``[rank k]`` prefix.

When a worker fails, the others get ``grace_seconds`` to notice the lost peer
and exit by themselves; then their groups get SIGTERM, and SIGKILL 5 s later.
SIGINT or SIGTERM to the launcher stops every worker the same way, without the
grace period. Every wait is bounded, and no worker group outlives the launcher.

Threads: the calling thread starts and watches the workers; one reader thread
per worker copies its output. Signal handlers are installed only when
:func:`launch` runs on the main thread (Python allows no other).
"""

from __future__ import annotations

import ctypes
import errno
import os
import secrets
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from types import FrameType
from typing import Callable, Optional, TextIO, Union

from mltuner.launch._env import free_port

__all__ = ["launch", "KILL_AFTER_SECONDS"]

_PR_SET_PDEATHSIG = 1  # linux/prctl.h
# How long workers get between SIGTERM and SIGKILL.
KILL_AFTER_SECONDS = 5.0
# How often the workers' states are checked: short enough that a failure is
# acted on at once, long enough to cost nothing.
_POLL_SECONDS = 0.05
# How long the readers may take to drain what the workers wrote before exiting.
_READER_JOIN_SECONDS = 5.0
# Exit codes a shell would give.
_NOT_EXECUTABLE = 126
_NOT_FOUND = 127

_SignalHandler = Union[Callable[[int, Optional[FrameType]], object], int, signal.Handlers, None]


class _Output:
    """Writes whole lines to one stream, one writer at a time, flushing each."""

    def __init__(self, stream: TextIO) -> None:
        self._stream = stream
        self._lock = threading.Lock()

    def line(self, text: str) -> None:
        with self._lock:
            try:
                self._stream.write(text + "\n")
                self._stream.flush()
            except (OSError, ValueError):
                pass  # a closed or broken stream must not stop the job or the draining


class _Worker:
    """One worker process and the thread that copies its output."""

    def __init__(self, rank: int, process: subprocess.Popen[bytes], output: _Output) -> None:
        self.rank = rank
        self.process = process
        # Exit code as the launcher reports it (128 + S when killed by signal
        # S); None while running. Set without reaping, see _exit_code.
        self.code: int | None = None
        self.reader = threading.Thread(target=self._copy_output, args=(output,),
                                       name=f"mltuner-launch-rank-{rank}", daemon=True)
        self.reader.start()

    def _copy_output(self, output: _Output) -> None:
        pipe = self.process.stdout
        assert pipe is not None
        prefix = f"[rank {self.rank}] "
        try:
            for raw in pipe:  # ends when every process holding the pipe has exited
                output.line(prefix + raw.decode("utf-8", errors="replace").rstrip("\r\n"))
        finally:
            pipe.close()

    def check(self) -> int | None:
        """The exit code if the worker has exited, else None."""
        if self.code is None:
            self.code = _exit_code(self.process)
        return self.code

    def described(self) -> str:
        """``"rank R"``, with " (stopped)" where the process is stopped
        (SIGSTOP, a debugger): it cannot act on SIGTERM, nor answer peers."""
        try:
            stat = Path(f"/proc/{self.process.pid}/stat").read_text()
            stopped = stat[stat.rindex(")") + 2] in "Tt"
        except (OSError, ValueError, IndexError):  # no /proc (macOS), or gone
            stopped = False
        return f"rank {self.rank}" + (" (stopped)" if stopped else "")

    def signal_group(self, signum: signal.Signals) -> None:
        # The group id is the worker's pid. The worker is not reaped before
        # its group is killed for the last time, so the id cannot have been
        # reused by an unrelated process.
        try:
            os.killpg(self.process.pid, signum)
        except (ProcessLookupError, PermissionError):
            pass  # the group is already empty


def _die_with_launcher() -> Callable[[], None] | None:
    """What a worker runs between fork and exec so that it gets SIGTERM when
    the launcher dies, even by SIGKILL (the OOM killer, a CI runner's
    timeout), which no handler of the launcher's sees: Linux's
    PR_SET_PDEATHSIG. None elsewhere. prctl is resolved here, in the
    launcher, so the child only makes the call."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        prctl = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None
    launcher = os.getpid()

    def arm() -> None:
        prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
        if os.getppid() != launcher:  # the launcher died before the call: nothing will send the signal
            os.kill(os.getpid(), signal.SIGTERM)

    return arm


def _exit_code(process: subprocess.Popen[bytes]) -> int | None:
    """The exit code of ``process`` if it has exited, else None.

    WNOWAIT leaves the exited process a zombie: its pid, which is also its
    process group's id, stays reserved until :func:`_stop_and_reap`, so a later
    killpg cannot hit a stranger that reused the pid.
    """
    try:
        status = os.waitid(os.P_PID, process.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT)
    except ChildProcessError:  # reaped elsewhere (SIGCHLD ignored): fall back to Popen
        code = process.poll()
        return None if code is None else (128 - code if code < 0 else code)
    if status is None or status.si_pid == 0:
        return None
    if status.si_code == os.CLD_EXITED:
        return int(status.si_status)
    return 128 + int(status.si_status)  # killed or dumped by signal si_status


# Workers one launcher starts: each is a process with its engine's threads and
# a connection to every other, so a mistyped count would fork without bound.
MAX_LOCAL_WORKERS = 1024


def launch(
    command: Sequence[str],
    num_workers: int,
    *,
    master_port: int = 0,
    grace_seconds: float = 15.0,
    env: Mapping[str, str] | None = None,
    stdout: TextIO | None = None,
) -> int:
    """Runs ``num_workers`` copies of ``command`` on this machine and returns
    the job's exit code.

    Each worker gets ``env`` (default: this process's environment) plus
    ``MLTUNER_RANK``, ``MLTUNER_WORLD_SIZE``, ``MLTUNER_LOCAL_RANK`` (the rank),
    ``MLTUNER_MASTER_ADDR=127.0.0.1``, ``MLTUNER_MASTER_PORT``,
    ``MLTUNER_SECRET`` (``env``'s, or a fresh random one) and
    ``PYTHONUNBUFFERED=1``, and ``OMP_NUM_THREADS`` = cores / workers unless
    ``env`` sets it (numpy's BLAS and torch size their thread pools by it).
    ``command`` is run directly, without a shell.

    Args:
        command: the program and its arguments, e.g.
            ``["python", "train.py", "--lr", "0.1"]``.
        num_workers: how many workers to start (ranks 0 .. num_workers - 1).
        master_port: rank 0's port; 0 picks a port that is free now.
        grace_seconds: after a worker fails, how long the others may take to
            exit by themselves before they get SIGTERM.
        env: the workers' base environment; None means ``os.environ``.
        stdout: where the workers' prefixed lines and the launcher's own
            messages go; None means ``sys.stdout`` at call time.

    Returns:
        0 when every worker exited with 0; else the code of the first worker
        that failed (128 + S for a worker killed by signal S); 130 or 143 when
        the launcher got SIGINT or SIGTERM; 127 when the command was not found
        and 126 when it is not executable.

    Raises:
        ValueError: ``num_workers`` outside 1..:data:`MAX_LOCAL_WORKERS`, an empty ``command``, a negative
            ``grace_seconds`` or ``master_port`` outside 0..65535.
    """
    if not 1 <= num_workers <= MAX_LOCAL_WORKERS:
        raise ValueError(f"the number of workers must be in 1..{MAX_LOCAL_WORKERS} (each is a process connected "
                         f"to every other), got {num_workers}")
    if not command:
        raise ValueError("no command to launch: put it after `--`, e.g. "
                         "`mltuner launch -n 2 -- python train.py`")
    if not grace_seconds >= 0:
        raise ValueError(f"grace_seconds must be >= 0, got {grace_seconds}")
    if not 0 <= master_port <= 65535:
        raise ValueError(f"master_port must be in 0..65535, got {master_port}")
    output = _Output(sys.stdout if stdout is None else stdout)
    base_env = dict(os.environ if env is None else env)
    shared = {
        "MLTUNER_WORLD_SIZE": str(num_workers),
        "MLTUNER_MASTER_ADDR": "127.0.0.1",
        "MLTUNER_MASTER_PORT": str(master_port or free_port("127.0.0.1")),
        "MLTUNER_SECRET": base_env.get("MLTUNER_SECRET") or secrets.token_hex(32),
        "PYTHONUNBUFFERED": "1",
    }
    # The machine's cores divided among the workers: BLAS and OpenMP pools
    # sized for the whole machine in every worker oversubscribe the cores,
    # and their spinning threads slowed a 2-worker numpy job 20x.
    if "OMP_NUM_THREADS" not in base_env:
        shared["OMP_NUM_THREADS"] = str(max(1, (os.cpu_count() or 1) // num_workers))

    received: list[int] = []  # signals that arrived, in order

    def on_signal(signum: int, _frame: FrameType | None) -> None:
        received.append(signum)  # acted on by the watch loop, outside the handler

    previous = _install_handlers(on_signal)
    workers: list[_Worker] = []
    try:
        for rank in range(num_workers):
            worker_env = {**base_env, **shared,
                          "MLTUNER_RANK": str(rank), "MLTUNER_LOCAL_RANK": str(rank)}
            try:
                process = subprocess.Popen(
                    list(command), env=worker_env, stdin=subprocess.DEVNULL,
                    stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                    start_new_session=True,  # its own group: signals reach its children too
                    preexec_fn=_die_with_launcher(),
                )
            except OSError as error:  # 127 not found, 126 found but not runnable (a shell's codes), else 1
                output.line(f"mltuner launch: cannot run {command[0]!r}: {error.strerror or error}")
                if isinstance(error, FileNotFoundError):
                    return _NOT_FOUND
                return _NOT_EXECUTABLE if isinstance(error, PermissionError) or error.errno == errno.ENOEXEC else 1
            workers.append(_Worker(rank, process, output))
            if received:
                break
        return _watch(workers, received, grace_seconds, output)
    finally:
        _stop_and_reap(workers, output)
        _restore_handlers(previous)


def _watch(workers: list[_Worker], received: list[int], grace_seconds: float,
           output: _Output) -> int:
    """Waits for the job to end and returns its exit code; leaves survivors
    (after a failure or a signal) to :func:`_stop_and_reap`."""
    failed: tuple[int, int] | None = None  # (rank, code) of the first failure
    deadline = float("inf")
    while True:
        if received:
            name = signal.Signals(received[0]).name
            output.line(f"mltuner launch: received {name}; stopping the job")
            return 128 + received[0]
        running = [worker for worker in workers if worker.check() is None]
        if failed is None:
            for worker in workers:
                if worker.code:
                    failed = (worker.rank, worker.code)
                    output.line(f"mltuner launch: rank {worker.rank} exited with code "
                                f"{worker.code}; stopping the job")
                    # The others notice the lost peer by its missing heartbeats.
                    deadline = time.monotonic() + grace_seconds
                    break
        if not running:
            return 0 if failed is None else failed[1]
        if time.monotonic() >= deadline:
            assert failed is not None
            ranks = ", ".join(worker.described() for worker in running)
            output.line(f"mltuner launch: {ranks} still running {grace_seconds:g} s after "
                        f"rank {failed[0]} failed; sending SIGTERM")
            return failed[1]
        time.sleep(_POLL_SECONDS)


def _stop_and_reap(workers: list[_Worker], output: _Output) -> None:
    """Ends every worker group and reaps every worker; bounded by
    KILL_AFTER_SECONDS plus a few seconds."""
    running = [worker for worker in workers if worker.check() is None]
    for worker in running:
        worker.signal_group(signal.SIGTERM)
    deadline = time.monotonic() + KILL_AFTER_SECONDS
    while running and time.monotonic() < deadline:
        time.sleep(_POLL_SECONDS)
        running = [worker for worker in running if worker.check() is None]
    if running:
        ranks = ", ".join(worker.described() for worker in running)
        output.line(f"mltuner launch: {ranks} did not end within {KILL_AFTER_SECONDS:g} s of SIGTERM; "
                    "sending SIGKILL")
    # Also kills what an exited worker left behind in its group (a process
    # started in the background), which would otherwise outlive the job.
    for worker in workers:
        worker.signal_group(signal.SIGKILL)
    for worker in workers:
        try:
            worker.process.wait(timeout=KILL_AFTER_SECONDS)
        except subprocess.TimeoutExpired:  # pragma: no cover - SIGKILL cannot be ignored
            output.line(f"mltuner launch: rank {worker.rank} (pid {worker.process.pid}) "
                        "did not exit after SIGKILL")
    for worker in workers:
        worker.reader.join(timeout=_READER_JOIN_SECONDS)
        if worker.reader.is_alive():
            # A process that left the worker's group still holds its output
            # pipe; the daemon reader closes it when that process exits.
            output.line(f"mltuner launch: output of rank {worker.rank} is still open "
                        "(a process left its group); not waiting for it")


def _install_handlers(handler: Callable[[int, FrameType | None], None]
                      ) -> dict[signal.Signals, _SignalHandler]:
    if threading.current_thread() is not threading.main_thread():
        return {}
    previous: dict[signal.Signals, _SignalHandler] = {}
    for signum in (signal.SIGINT, signal.SIGTERM):
        previous[signum] = signal.signal(signum, handler)
    return previous


def _restore_handlers(previous: Mapping[signal.Signals, _SignalHandler]) -> None:
    for signum, handler in previous.items():
        signal.signal(signum, handler if handler is not None else signal.SIG_DFL)

