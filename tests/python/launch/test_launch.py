"""mltuner.launch._launcher: the local launcher behind `mltuner launch`, run on real
subprocesses (small `python -c` scripts)."""

from __future__ import annotations

import io
import os
import re
import signal
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Mapping
from pathlib import Path

import pytest

from mltuner.cli import main
from mltuner.launch import launch
from mltuner.launch._launcher import KILL_AFTER_SECONDS

# Every script starts with this: T_DIR is a per-test folder, RANK this worker's rank.
PRELUDE = textwrap.dedent("""\
    import os, pathlib, signal, subprocess, sys, time
    T_DIR = pathlib.Path(os.environ["T_DIR"])
    RANK = int(os.environ["MLTUNER_RANK"])
    SIZE = int(os.environ["MLTUNER_WORLD_SIZE"])

    def write_pid(name=None, pid=None):
        (T_DIR / (name or f"pid{RANK}")).write_text(str(pid or os.getpid()))

    def wait_for_pids(count, timeout=10.0):
        deadline = time.monotonic() + timeout
        while len(list(T_DIR.glob("pid*"))) < count and time.monotonic() < deadline:
            time.sleep(0.02)
""")


def python(script: str) -> list[str]:
    return [sys.executable, "-c", PRELUDE + textwrap.dedent(script)]


def worker_env(tmp_path: Path, **extra: str) -> dict[str, str]:
    env = {name: value for name, value in os.environ.items() if name != "MLTUNER_SECRET"}
    return {**env, "T_DIR": str(tmp_path), **extra}


def run(command: list[str], num_workers: int, env: Mapping[str, str], grace_seconds: float = 15.0
        ) -> tuple[int, str, float]:
    """Runs a job and returns its exit code, its output and how long it took."""
    out = io.StringIO()
    start = time.monotonic()
    code = launch(command, num_workers, env=env, stdout=out, grace_seconds=grace_seconds)
    return code, out.getvalue(), time.monotonic() - start


def is_gone(pid: int) -> bool:
    """True when ``pid`` has exited (a zombie waiting for a reaper counts as gone)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return True
    return stat.rsplit(")", 1)[1].split()[0] == "Z"


def assert_all_gone(pids: list[int], timeout: float = 3.0) -> None:
    # An orphaned grandchild is reaped by init a moment after it dies.
    deadline = time.monotonic() + timeout
    while not all(is_gone(pid) for pid in pids) and time.monotonic() < deadline:
        time.sleep(0.02)
    alive = [pid for pid in pids if not is_gone(pid)]
    for pid in alive:  # do not leave them behind even when the test fails
        os.kill(pid, signal.SIGKILL)
    assert not alive, f"processes {alive} outlived the launcher"


def read_pids(tmp_path: Path) -> list[int]:
    return [int(path.read_text()) for path in sorted(tmp_path.glob("pid*"))]


# ---- a job that succeeds -----------------------------------------------------------------------

def test_workers_get_distinct_ranks_and_shared_port_and_secret(tmp_path: Path) -> None:
    script = """\
        names = ["MLTUNER_RANK", "MLTUNER_WORLD_SIZE", "MLTUNER_LOCAL_RANK", "MLTUNER_MASTER_ADDR",
                 "MLTUNER_MASTER_PORT", "MLTUNER_SECRET", "PYTHONUNBUFFERED"]
        print("vars", *[os.environ[name] for name in names])
    """
    code, out, _ = run(python(script), 3, worker_env(tmp_path))
    assert code == 0, out
    found = re.findall(r"^\[rank (\d)\] vars (\d) (\d) (\d) (\S+) (\d+) ([0-9a-f]+) (\S+)$", out, re.M)
    assert len(found) == 3, out
    assert sorted(row[0] for row in found) == ["0", "1", "2"]
    for prefix, rank, world, local, addr, port, secret, unbuffered in found:
        assert (rank, local, world, addr, unbuffered) == (prefix, prefix, "3", "127.0.0.1", "1")
        assert 1 <= int(port) <= 65535
        assert len(secret) == 64
    assert len({row[5] for row in found}) == 1, "ranks disagree on the port"
    assert len({row[6] for row in found}) == 1, "ranks disagree on the secret"


def test_given_port_and_parent_secret_are_passed_on(tmp_path: Path) -> None:
    script = 'print(os.environ["MLTUNER_MASTER_PORT"], os.environ["MLTUNER_SECRET"])'
    out = io.StringIO()
    code = launch(python(script), 2, master_port=31337, env=worker_env(tmp_path, MLTUNER_SECRET="abc"),
                  stdout=out)
    assert code == 0
    assert sorted(re.findall(r"^\[rank \d\] .*$", out.getvalue(), re.M)) == [
        "[rank 0] 31337 abc", "[rank 1] 31337 abc"]


def test_output_is_merged_and_prefixed_whole_lines(tmp_path: Path) -> None:
    script = """\
        for i in range(300):
            stream = sys.stdout if i % 2 else sys.stderr
            print(f"r{RANK}-{i}-" + "x" * 300, file=stream)
        sys.stdout.buffer.write(b"bad \\xff byte\\n")
        sys.stdout.write("no newline at the end")
    """
    code, out, _ = run(python(script), 2, worker_env(tmp_path))
    assert code == 0
    lines = out.splitlines()
    for rank in (0, 1):
        mine = [line for line in lines if line.startswith(f"[rank {rank}] ")]
        body = [line[len(f"[rank {rank}] "):] for line in mine]
        assert sorted(body[:300], key=lambda b: int(b.split("-")[1])) == [
            f"r{rank}-{i}-" + "x" * 300 for i in range(300)]
        assert body[300:] == ["bad \ufffd byte", "no newline at the end"]
    assert all(line.startswith(("[rank 0] ", "[rank 1] ")) for line in lines)


def test_background_processes_of_a_finished_worker_are_killed(tmp_path: Path) -> None:
    script = """\
        child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
        write_pid("pid-child", child.pid)
        write_pid()
    """
    code, out, elapsed = run(python(script), 1, worker_env(tmp_path))
    assert code == 0, out
    assert elapsed < 10
    assert_all_gone(read_pids(tmp_path))


# ---- a worker fails ----------------------------------------------------------------------------

def test_a_failing_worker_stops_the_job_with_its_code(tmp_path: Path) -> None:
    script = """\
        write_pid()
        if RANK == 1:
            wait_for_pids(SIZE)
            sys.exit(3)
        time.sleep(60)
    """
    grace = 1.0
    code, out, elapsed = run(python(script), 3, worker_env(tmp_path), grace_seconds=grace)
    assert code == 3
    assert "mltuner launch: rank 1 exited with code 3; stopping the job" in out.splitlines()
    assert "sending SIGTERM" in out
    assert elapsed < grace + 6
    pids = read_pids(tmp_path)
    assert len(pids) == 3
    assert_all_gone(pids)


def test_the_others_may_exit_by_themselves_within_the_grace_period(tmp_path: Path) -> None:
    script = """\
        write_pid()
        if RANK == 0:
            wait_for_pids(SIZE)
            sys.exit(5)
        time.sleep(0.5)  # as if it noticed the lost peer
        print("peer lost")
        sys.exit(1)
    """
    code, out, elapsed = run(python(script), 3, worker_env(tmp_path), grace_seconds=15.0)
    assert code == 5, out
    assert elapsed < 8, "the launcher waited out the grace period although every worker had exited"
    assert "SIGTERM" not in out
    assert out.count("peer lost") == 2
    assert out.count("stopping the job") == 1
    assert_all_gone(read_pids(tmp_path))


def test_a_stopped_worker_is_said_to_be_stopped_and_killed(tmp_path: Path) -> None:
    # SIGSTOP (a debugger, a job-control mistake): it cannot act on SIGTERM,
    # which the launcher said it "ignored", and rank 0 seemed to be the culprit.
    script = """\
        write_pid()
        if RANK == 0:
            wait_for_pids(SIZE)
            sys.exit(2)
        os.kill(os.getpid(), signal.SIGSTOP)
    """
    code, out, elapsed = run(python(script), 2, worker_env(tmp_path), grace_seconds=0.2)
    assert code == 2
    assert "rank 1 (stopped) still running" in out, out
    assert "rank 1 (stopped) did not end within" in out and "sending SIGKILL" in out, out
    assert_all_gone(read_pids(tmp_path))


def test_workers_that_ignore_sigterm_are_killed(tmp_path: Path) -> None:
    script = """\
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        write_pid()
        if RANK == 0:
            wait_for_pids(SIZE)
            sys.exit(2)
        time.sleep(60)
    """
    code, out, elapsed = run(python(script), 2, worker_env(tmp_path), grace_seconds=0.2)
    assert code == 2
    assert "sending SIGKILL" in out
    assert KILL_AFTER_SECONDS <= elapsed < KILL_AFTER_SECONDS + 5
    assert_all_gone(read_pids(tmp_path))


def test_a_worker_killed_by_a_signal_counts_as_128_plus_the_signal(tmp_path: Path) -> None:
    script = """\
        if RANK == 1:
            os.kill(os.getpid(), signal.SIGKILL)
        time.sleep(60)
    """
    code, out, elapsed = run(python(script), 2, worker_env(tmp_path), grace_seconds=0.5)
    assert code == 128 + signal.SIGKILL
    assert "rank 1 exited with code 137" in out
    assert elapsed < 7


# ---- signals to the launcher ------------------------------------------------------------------

@pytest.mark.parametrize("signum, expected", [(signal.SIGTERM, 143), (signal.SIGINT, 130)])
def test_a_signal_to_the_launcher_stops_every_worker(tmp_path: Path, signum: signal.Signals,
                                                      expected: int) -> None:
    script = """\
        write_pid()
        time.sleep(60)
    """
    handler_before = signal.getsignal(signum)

    def send_when_started() -> None:
        deadline = time.monotonic() + 15
        while len(list(tmp_path.glob("pid*"))) < 2 and time.monotonic() < deadline:
            time.sleep(0.02)
        os.kill(os.getpid(), signum)  # launch's handler is in place: the workers are running

    sender = threading.Thread(target=send_when_started, daemon=True)
    sender.start()
    code, out, elapsed = run(python(script), 2, worker_env(tmp_path))
    sender.join(timeout=5)
    assert code == expected
    assert f"received {signum.name}" in out
    assert elapsed < 15
    assert signal.getsignal(signum) is handler_before
    assert_all_gone(read_pids(tmp_path))


# ---- bad input --------------------------------------------------------------------------------

def test_a_missing_command_exits_127(tmp_path: Path) -> None:
    code, out, _ = run(["mltuner-no-such-command-xyz", "--flag"], 2, worker_env(tmp_path))
    assert code == 127
    assert "cannot run 'mltuner-no-such-command-xyz'" in out


@pytest.mark.parametrize("mode", [0o644, 0o755], ids=["not executable", "not a format the kernel runs"])
def test_a_command_that_cannot_be_run_exits_126(tmp_path: Path, mode: int) -> None:
    script = tmp_path / "script"
    script.write_text("garbage\n")  # no #! line: executable, it fails with ENOEXEC (exited 1)
    script.chmod(mode)
    code, out, _ = run([str(script)], 1, worker_env(tmp_path))
    assert code == 126
    assert "cannot run" in out


@pytest.mark.parametrize("kwargs, message", [
    ({"num_workers": 0}, "number of workers must be in 1..1024"),
    ({"num_workers": 1025}, "number of workers must be in 1..1024"),
    ({"command": []}, "no command to launch"),
    ({"grace_seconds": -1.0}, "grace_seconds must be >= 0"),
    ({"master_port": 70000}, "master_port must be in 0..65535"),
])
def test_bad_arguments_raise_value_error(kwargs: dict[str, object], message: str) -> None:
    arguments: dict[str, object] = {"command": ["true"], "num_workers": 1, **kwargs}
    with pytest.raises(ValueError, match=re.escape(message)):
        launch(**arguments)  # type: ignore[arg-type]


# ---- the command line -------------------------------------------------------------------------

def test_cli_launch(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                    monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("MLTUNER_SECRET", raising=False)
    code = main(["launch", "-n", "2", "--grace", "3", "--", sys.executable, "-c",
                 "import os; print('hello from', os.environ['MLTUNER_RANK'])"])
    assert code == 0
    out = capsys.readouterr().out
    assert "[rank 0] hello from 0" in out
    assert "[rank 1] hello from 1" in out


def test_cli_launch_returns_the_failed_workers_code(capsys: pytest.CaptureFixture[str]) -> None:
    code = main(["launch", "-n", "2", "--", sys.executable, "-c",
                 "import os, sys; sys.exit(7 if os.environ['MLTUNER_RANK'] == '0' else 0)"])
    assert code == 7
    assert "rank 0 exited with code 7" in capsys.readouterr().out


@pytest.mark.parametrize("argv, message", [
    (["launch", "-n", "2", "--"], "no command to launch"),
    (["launch", "-n", "2"], "no command to launch"),
])
def test_cli_bad_input_returns_2(argv: list[str], message: str,
                                 capsys: pytest.CaptureFixture[str]) -> None:
    assert main(argv) == 2
    assert message in capsys.readouterr().err


def test_cli_missing_command_returns_127(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["launch", "-n", "1", "--", "mltuner-no-such-command-xyz"]) == 127
    captured = capsys.readouterr()
    assert "Traceback" not in captured.out + captured.err


def test_cli_requires_the_number_of_workers() -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["launch", "--", "true"])
    assert exit_info.value.code == 2


def test_workers_do_not_outlive_a_launcher_killed_by_sigkill(tmp_path: Path) -> None:
    """SIGKILL (the OOM killer, a CI runner's timeout) leaves the launcher no
    handler to run: the workers learn of it from the kernel (their parent's
    death) and end too."""
    script = """\
        write_pid()
        time.sleep(60)
    """
    launcher = subprocess.Popen(
        [sys.executable, "-c", "import sys; from mltuner.cli import main; sys.exit(main(sys.argv[1:]))",
         "launch", "-n", "2", "--", *python(script)],
        env=worker_env(tmp_path), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 30
        while len(read_pids(tmp_path)) < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        pids = read_pids(tmp_path)
        assert len(pids) == 2, "the workers did not start"
    finally:
        launcher.kill()
        launcher.wait(10)
    assert_all_gone(pids, timeout=5.0)
