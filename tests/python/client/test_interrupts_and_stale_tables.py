"""Two robustness guarantees at the boundary between Python and the engine.

A stale Table (kept across drop_tables while a table of the same name and id
but other dimensions was made) must not make fetch write past the array it
returns: the engine checks the caller's row width against the table's and
raises InvalidArgumentError naming both (it once overran the heap, rc 134).

Ctrl-C must interrupt a call blocked in an engine wait (a read waiting for a
peer's clock, sync, finish_virtual_iteration waiting for the other workers)
at once, not after wait_timeout_s: the waits ask Python for pending signals
while they block. The engine must still work, and close, afterwards.

Each case runs in a fresh interpreter, so a crash or a hang fails the test
instead of taking pytest down, and SIGINT reaches that process's main thread.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

# Far above the latency expected (one poll, 50 ms) and far below the wait
# timeout the scripts set (a wait that ignores the signal ends only there).
MAX_LATENCY_S = 2.0
WAIT_TIMEOUT_S = 15


def _run(*parts: str, timeout_s: float = 60) -> str:
    script = "\n".join(textwrap.dedent(part) for part in parts)
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=timeout_s)
    assert out.returncode == 0, f"rc {out.returncode}\nstdout:\n{out.stdout}\nstderr:\n{out.stderr}"
    assert "DONE" in out.stdout, (out.stdout, out.stderr)
    return out.stdout


def _value(stdout: str, key: str) -> float:
    for line in stdout.splitlines():
        if line.startswith(key + " "):
            return float(line.split()[1])
    raise AssertionError(f"no {key} in {stdout!r}")


def test_fetch_with_a_stale_table_raises_instead_of_overrunning() -> None:
    _run("""
        import dataclasses
        import numpy as np
        import mltuner as mlt

        config = mlt.Config(update_rule=mlt.UpdateRule("add"), wait_timeout_s=10)
        with mlt.LocalCluster(1, config) as cluster:
            w = cluster.workers[0]
            old = w.create_table("t", 64, 1)
            w.drop_tables(old)
            new = w.create_table("t", 64, 65536)
            assert new.id == old.id
            for _ in range(5):  # an overrun shows as heap corruption, maybe only later
                try:
                    w.fetch(old)
                except mlt.NotFoundError as e:  # the worker knows its tables' sizes
                    text = str(e)
                    assert "'t' (64 x 1)" in text and "(64 x 65536)" in text, text
                else:
                    raise AssertionError("fetch with a stale Table returned")
                junk = [np.ones(1000) for _ in range(100)]
            # Wider than the table: it used to return uninitialised memory.
            wider = dataclasses.replace(new, row_width=70000)
            try:
                w.fetch(wider, [0, 1])
            except mlt.NotFoundError as e:
                assert "(64 x 70000)" in str(e) and "(64 x 65536)" in str(e), str(e)
            else:
                raise AssertionError("fetch wider than the table returned")
            # Below the worker, the engine checks the binding's own argument:
            # any width but the table's is refused.
            for width in (1, 0, -1, 65535, 70000):
                try:
                    w._engine.fetch(new.id, np.array([0, 1]), width, -1)
                except mlt.InvalidArgumentError as e:
                    assert width < 1 or ("65536 wide" in str(e) and f"row width {width};" in str(e)), str(e)
                else:
                    raise AssertionError(f"engine fetch with width {width} returned")
            # The current Table still fetches.
            assert w.fetch(new, [0, 63]).shape == (2, 65536)
        print("DONE")
    """)


# Two workers record read, update, clock on one table; both start, worker 0
# runs clock 0, worker 1 never does. Every case sends SIGINT to this process
# SIGNAL_AFTER seconds into worker 0's blocked call and prints the latency.
_TWO_WORKERS = f"""
    import os, signal, threading, time
    import numpy as np
    import mltuner as mlt

    SIGNAL_AFTER = 0.5
    cluster = mlt.LocalCluster(2, mlt.Config(update_rule=mlt.UpdateRule("sgd", learning_rate=0.1),
                                             wait_timeout_s={WAIT_TIMEOUT_S}))
    w0, w1 = cluster.workers

    def record(w, finish=True):
        t = w.create_table("t", 4, 3)
        r = w.virtual_read(t); w.virtual_post_read(r)
        u = w.virtual_pre_update(t); w.virtual_update(u); w.virtual_clock()
        if finish:
            w.finish_virtual_iteration()
        return r, u

    def one_clock(w, r, u):
        w.read(r); w.post_read(r)
        w.pre_update(u)[:] = 1; w.update(u)
        w.clock()

    def start_both():
        handles = [None, None]
        def prep(i):
            handles[i] = record(cluster.workers[i])
            cluster.workers[i].start_iterations()
        threads = [threading.Thread(target=prep, args=(i,)) for i in range(2)]
        for t in threads: t.start()
        for t in threads: t.join()
        return handles

    sent = []
    def send_sigint():
        sent.append(time.monotonic())
        os.kill(os.getpid(), signal.SIGINT)

    def interrupted(call):
        timer = threading.Timer(SIGNAL_AFTER, send_sigint)
        timer.start()
        try:
            call()
        except KeyboardInterrupt:
            print("LATENCY", time.monotonic() - sent[0])
        else:
            raise AssertionError("the blocked call returned")
        finally:
            timer.cancel()

    def close():
        start = time.monotonic()
        cluster.shutdown()
        print("CLOSE", time.monotonic() - start)
"""


def test_ctrl_c_interrupts_a_read_waiting_for_a_peer_and_the_engine_goes_on() -> None:
    out = _run(_TWO_WORKERS, """
        (r0, u0), (r1, u1) = start_both()
        one_clock(w0, r0, u0)
        interrupted(lambda: w0.read(r0))  # clock 1 waits for worker 1's clock 0
        # The interrupted read took nothing: once worker 1 clocks, it reads.
        one_clock(w1, r1, u1)
        start = time.monotonic()
        values = np.array(w0.read(r0), copy=True)
        print("READ", time.monotonic() - start)
        w0.post_read(r0)
        assert values.shape == (4, 3) and np.isfinite(values).all(), values
        close()
        print("DONE")
    """)
    assert _value(out, "LATENCY") < MAX_LATENCY_S, out
    assert _value(out, "READ") < 10, out
    assert _value(out, "CLOSE") < 10, out


@pytest.mark.parametrize("call", ["read", "sync"])
def test_ctrl_c_interrupts_a_blocked_call_and_the_cluster_closes(call: str) -> None:
    out = _run(_TWO_WORKERS, f"""
        (r0, u0), (r1, u1) = start_both()
        one_clock(w0, r0, u0)
        interrupted(lambda: w0.read(r0) if {call!r} == "read" else w0.sync())
        close()  # worker 1 still never clocked
        print("DONE")
    """)
    assert _value(out, "LATENCY") < MAX_LATENCY_S, out
    assert _value(out, "CLOSE") < 10, out


def test_ctrl_c_interrupts_finish_virtual_iteration_waiting_for_the_others() -> None:
    out = _run(_TWO_WORKERS, """
        record(w0, finish=False)
        interrupted(w0.finish_virtual_iteration)  # worker 1 never finishes its own
        close()
        print("DONE")
    """)
    assert _value(out, "LATENCY") < MAX_LATENCY_S, out
    assert _value(out, "CLOSE") < 10, out


def test_a_signal_handler_that_does_not_raise_runs_and_the_wait_goes_on() -> None:
    """The waits run Python's handlers while they block; one that returns
    normally ends nothing: the read still returns once its rows come."""
    out = _run(_TWO_WORKERS, """
        handled = []
        signal.signal(signal.SIGINT, lambda *_: handled.append(time.monotonic()))
        (r0, u0), (r1, u1) = start_both()
        one_clock(w0, r0, u0)
        threading.Timer(SIGNAL_AFTER, send_sigint).start()
        # Worker 1's clock comes well after the signal, from another thread.
        late = threading.Timer(SIGNAL_AFTER + 2.5, lambda: one_clock(w1, r1, u1))
        late.start()
        w0.read(r0)
        w0.post_read(r0)
        late.join()
        print("HANDLED", handled[0] - sent[0])
        close()
        print("DONE")
    """)
    assert _value(out, "HANDLED") < 1.0, out  # not only once the read returned, 2.5 s after the signal
    assert _value(out, "CLOSE") < 10, out
