"""Transport benchmark: per-clock update and fresh-row traffic between local
worker processes, as a ratio to raw pyzmq moving the same bytes between the
same processes in the same run, and the latency a busy Python main thread
adds to each clock.

    python benchmarks/transport_bench.py [--quick] [--out PATH] [--figures PATH]
                                         [--sizes 10,100,1024] [--procs 2,4] [--tables 1,16] [--part-mib 4]
                                         [--switch-interval 0.0005]
                                         [--memory-limit-gb 16]

Each part runs in N fresh processes of this script (``--worker ...``),
started with the MLTUNER_* variables of ``mltuner launch`` on 127.0.0.1; each
rank writes one JSON file, and the parent prints markdown tables and writes
them to ``--out`` with a description of the machine.

1. Throughput, for each N, model size (MiB) and table count K. The model as
   K equal tables of rows of 1024 floats (default K = 1: one table, which
   the engine's clock cannot pipeline, since a table's update leaves, is
   applied and comes back as a whole; a model of layers has many tables,
   and their sends, applies and installs overlap). Every worker reads all rows (slack 0), updates
   all rows with rule "add" (zeros: the engine sends its dense slice of the
   update log whatever the values) and clocks. Per clock each process sends
   each other shard its slice of the update (model/N bytes) and each shard
   sends every other worker its rows (model/N bytes). The processes run, one
   phase after the other: raw pyzmq moving the same bytes in the same pattern
   (numpy arrays, copy=False, PUSH to each peer, one PULL per process; a
   round ends when a process has received everything due to it), the same
   over CURVE sockets (encrypted and authenticated, as mltuner's TCP sockets
   are, loopback included; its ipc:// sockets between processes of one host
   are plain: a diagnostic that prices the encryption), the same over
   ipc:// sockets (diagnostic: the address mltuner uses between processes
   of one host), the same with a copy of each received payload (diagnostic), the engine alone on a
   1-worker LocalCluster per process (diagnostic), then mltuner (by default
   its CPU processes of one host share memory: each payload is copied into
   the peer's landing region, only a notice takes the socket), then mltuner
   with every payload on its socket (diagnostic). Each phase
   times three segments of clocks after warm-up; the best segment counts,
   each segment as long as its slowest rank. Ratio = raw pyzmq time / mltuner
   time: higher is better, 1.0 = as fast as raw pyzmq; the goal is >= 0.80.
   A configuration whose estimated memory exceeds --memory-limit-gb is
   skipped, and a group that leaves the machine under 2 GiB is stopped.
2. Busy main thread. N=2, a 1 MiB model, the same clock; after each clock
   the main thread does (a) nothing, (b) ~5 ms of pure-Python arithmetic,
   which holds the GIL, or (c) ~5 ms of numpy element-wise work, which
   releases it. Added latency per clock = mean time per clock - (time of (a)
   + the work's own time measured alone), under the default GIL switch
   interval and under a smaller one (``sys.setswitchinterval``, the
   mitigation), the six cases interleaved in short segments.

Every wait is bounded; the children die with the parent (PR_SET_PDEATHSIG) and
are killed on every error path.
"""

from __future__ import annotations

import argparse
import collections
import ctypes
import datetime
import hashlib
import itertools
import json
import os
import platform
import resource
import signal
import struct
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import numpy as np
import zmq
from zmq.utils import z85

import mltuner as mt
from figures import Figure, write_figures
from machine import cpu_name, git_commit, memory_bytes
from mltuner.launch._env import free_port

MIB = 1 << 20
GB = 1e9
ROW_WIDTH = 1024  # floats per row: 4 KiB rows
GOAL = 0.80  # issue goal: mltuner at >= 80% of raw pyzmq throughput
BUSY_S = 0.005  # the busy main thread's work per clock
DEFAULT_SWITCH_S = 0.0005  # the mitigation's GIL switch interval
# mltuner's peak resident memory per process in multiples of the model,
# measured with 2 and 4 processes: 7.4x-7.6x at 100 MiB, 6.6x at 1 GiB (the
# message pool keeps at most 1 GiB idle). Parameter cache and update log (2x),
# read and update buffers, double-buffered (2x), the shard's slice, and the
# pooled message buffers of a clock in flight (2-3x). Since CPU processes of
# one host share memory (stop 45) each also holds the landing region its
# peers copy into: 1 GiB on 2 processes took over 9.3x (20 GB of a 25-GB
# machine, stopped there) where it had taken 6.6x.
MEMORY_FACTOR = 10.0
BASE_PROCESS_BYTES = 60 * MIB  # Python, numpy, zmq and mltuner loaded
MIN_AVAILABLE_BYTES = 2 * 1024 * MIB  # kill a group that leaves the machine less than this


def machine_lines(args: argparse.Namespace) -> list[str]:
    return [
        f"date: {datetime.datetime.now().strftime('%Y-%m-%d %H:%M')}",
        f"machine: {cpu_name()}, {os.cpu_count()} CPUs, {memory_bytes() / GB:.1f} GB memory, "
        f"{platform.system()} {platform.release()}",
        f"software: Python {platform.python_version()}, pyzmq {zmq.__version__}, libzmq {zmq.zmq_version()}, "
        f"numpy {np.__version__}, mltuner {mt.__version__} (tree at commit {git_commit()})",
        f"mode: {'quick' if args.quick else 'full'}; processes {args.procs}; models {args.sizes} MiB in {args.tables} table(s); "
        f"default GIL switch interval {sys.getswitchinterval() * 1e3:g} ms",
    ]


# == the worker processes ==========================================================
Json = dict[str, Any]  # a rank's results, as written to its JSON file
# Raw-mesh message header: kind, round (or control key), sender, value.
HEADER = struct.Struct("<iiiq")
HELLO, UPDATE, ROWS, CONTROL = 1, 2, 3, 4


def curve_pair(seed: str) -> tuple[bytes, bytes]:
    """A CURVE (public, secret) key pair every rank derives alike from `seed`."""
    secret = z85.encode(hashlib.blake2b(seed.encode(), digest_size=32).digest())
    return zmq.curve_public(secret), secret


class Mesh:
    """Raw pyzmq between the ranks of one group: one PULL per process bound on
    127.0.0.1 (or, given `ipc_dir`, on ipc:// in that directory), one PUSH to
    each peer. Carries the baseline's bytes and the benchmark's own control
    messages (start barrier, agreed clock counts). With `curve`, every socket
    is a CURVE socket (each PULL a server, each PUSH a client), as mltuner's
    TCP sockets are: the same pattern, encrypted."""

    def __init__(self, rank: int, ports: list[int], timeout_s: float, curve: bool = False,
                 ipc_dir: str | None = None) -> None:
        self.rank = rank
        self.size = len(ports)

        def address(peer: int) -> str:
            return f"ipc://{ipc_dir}/raw-{peer}" if ipc_dir else f"tcp://127.0.0.1:{ports[peer]}"

        self.timeout_s = timeout_s
        self.context: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
        server_public, server_secret = curve_pair("transport-bench server")
        client_public, client_secret = curve_pair("transport-bench client")
        self.inbox = self.context.socket(zmq.PULL)
        self.inbox.rcvhwm = 0
        if curve:
            self.inbox.curve_secretkey = server_secret
            self.inbox.curve_publickey = server_public
            self.inbox.curve_server = True
        self.inbox.bind(address(rank))
        self.peers: dict[int, zmq.Socket[bytes]] = {}
        for peer, port in enumerate(ports):
            if peer != rank:
                sock = self.context.socket(zmq.PUSH)
                sock.sndhwm = 0
                if curve:
                    sock.curve_serverkey = server_public
                    sock.curve_publickey = client_public
                    sock.curve_secretkey = client_secret
                sock.connect(address(peer))
                self.peers[peer] = sock
        self.counts: collections.Counter[tuple[int, int]] = collections.Counter()
        self.values: dict[int, int] = {}
        self.held: list[zmq.Frame] = []  # payloads received in this round

    def send(self, peer: int, kind: int, key: int, payload: np.ndarray | None = None, value: int = 0) -> None:
        head = HEADER.pack(kind, key, self.rank, value)
        if payload is None:
            self.peers[peer].send(head)
        else:
            frames: list[Any] = [head, payload]  # the array itself: pyzmq sends from its buffer
            self.peers[peer].send_multipart(frames, copy=False)

    def wait(self, kind: int, key: int, count: int) -> None:
        """Receives until `count` messages of (kind, key) have arrived; others
        are counted for later."""
        deadline = time.monotonic() + self.timeout_s
        while self.counts[(kind, key)] < count:
            left = deadline - time.monotonic()
            if left <= 0 or not self.inbox.poll(int(min(left, 1.0) * 1000) + 1):
                if time.monotonic() >= deadline:
                    raise TimeoutError(f"rank {self.rank}: waited {self.timeout_s:.0f} s for {count} message(s) "
                                       f"of kind {kind}, key {key}; got {self.counts[(kind, key)]}")
                continue
            frames = self.inbox.recv_multipart(copy=False)
            got_kind, got_key, _sender, value = HEADER.unpack(frames[0].bytes)
            self.counts[(got_kind, got_key)] += 1
            if got_kind == CONTROL:
                self.values[got_key] = value
            if len(frames) > 1:
                self.held.append(frames[1])
        del self.counts[(kind, key)]

    def barrier(self, key: int) -> None:
        for peer in self.peers:
            self.send(peer, HELLO, key)
        self.wait(HELLO, key, self.size - 1)

    def agree(self, key: int, value: int) -> int:
        """Rank 0's `value`, on every rank."""
        if self.rank == 0:
            for peer in self.peers:
                self.send(peer, CONTROL, key, value=value)
            return value
        self.wait(CONTROL, key, 1)
        return self.values.pop(key)

    def close(self) -> None:
        self.held.clear()
        for sock in self.peers.values():
            sock.close(linger=1000)  # let the last barrier's messages leave
        self.inbox.close(linger=0)
        self.context.term()


def die_with_parent(parent_pid: int) -> None:
    """Linux: SIGKILL this process when the parent dies, whatever way it dies."""
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass
    if os.getppid() != parent_pid:  # the parent died before prctl took effect
        os._exit(1)


def loopback_bytes() -> int:
    """Bytes received on the loopback interface so far (all processes)."""
    try:
        with open("/proc/net/dev") as f:
            for line in f:
                name, _, rest = line.partition(":")
                if name.strip() == "lo":
                    return int(rest.split()[0])
    except (OSError, ValueError, IndexError):
        pass
    return -1


def minor_faults() -> int:
    """Page faults of this process so far (all threads): first touches of
    freshly mapped memory, e.g. a newly allocated receive buffer."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def peak_rss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


SEGMENTS = 3  # timed segments per phase


def clocks_for(seconds_per_clock: float, target_s: float, low: int, high: int) -> int:
    return int(min(high, max(low, target_s / max(seconds_per_clock, 1e-6))))


def shard_rows(num_rows: int, shard: int, num_shards: int) -> int:
    """Rows of `shard` as the server splits a table (sharding/shard_range.cc ShardRange)."""
    base, extra = divmod(num_rows, num_shards)
    return base + (1 if shard < extra else 0)


class TimedLoop:
    """Runs `step` (one clock; returns the moment the clock's fresh data was
    in) for warm-up clocks, agrees on a segment length from rank 0's warm-up
    time, then times SEGMENTS segments of that many clocks, back to back. The
    parent takes the best segment (other processes on a small machine only
    ever add time), each segment as long as its slowest rank."""

    def __init__(self, mesh: Mesh, key: int, warmup: int, target_s: float, low: int, high: int) -> None:
        self.mesh, self.key, self.warmup = mesh, key, warmup
        self.target_s, self.low, self.high = target_s, low, high

    def run(self, step: Callable[[], float]) -> Json:
        marks = [step() for _ in range(self.warmup)]
        per_clock = (marks[-1] - marks[0]) / max(1, len(marks) - 1)
        k = self.mesh.agree(self.key, clocks_for(per_clock, self.target_s / SEGMENTS, self.low, self.high))
        marks = [step()]
        lo_before, faults_before = loopback_bytes(), minor_faults()
        marks += [step() for _ in range(SEGMENTS * k)]
        lo_after, faults_after = loopback_bytes(), minor_faults()
        segments = [(marks[(i + 1) * k] - marks[i * k]) / k for i in range(SEGMENTS)]
        return {"clocks": SEGMENTS * k, "segments": segments,
                "lo_bytes_per_clock": (lo_after - lo_before) / (SEGMENTS * k) if lo_before >= 0 else -1.0,
                "faults_per_clock": (faults_after - faults_before) / (SEGMENTS * k)}


def raw_phase(mesh: Mesh, model_rows: int, args: argparse.Namespace, key: int, *,
              copy_on_receive: bool = False) -> Json:
    """The baseline: the bytes of mltuner's clock, moved by pyzmq alone. With
    copy_on_receive (a diagnostic), every received payload is also copied into
    a buffer of this process, as mltuner's deliver copies into its pool."""
    n, rank = mesh.size, mesh.rank
    # The slice of the update for each peer's shard, and this shard's rows.
    updates = {peer: np.full(shard_rows(model_rows, peer, n) * ROW_WIDTH, 0.0, np.float32) for peer in mesh.peers}
    rows = np.full(shard_rows(model_rows, rank, n) * ROW_WIDTH, 0.0, np.float32)
    largest = max(shard_rows(model_rows, s, n) for s in range(n)) * ROW_WIDTH
    landing = [np.full(largest, 0.0, np.float32) for _ in range(n - 1 if copy_on_receive else 0)]
    state = {"round": 0}

    def take() -> None:
        if copy_on_receive:
            for i, frame in enumerate(mesh.held):
                values = np.frombuffer(frame.buffer, np.float32)
                np.copyto(landing[i % len(landing)][:len(values)], values)
        mesh.held.clear()

    def step() -> float:
        r = state["round"] = state["round"] + 1
        for peer, payload in updates.items():
            mesh.send(peer, UPDATE, r, payload)
        mesh.wait(UPDATE, r, n - 1)  # this shard has every worker's update
        take()
        for peer in mesh.peers:
            mesh.send(peer, ROWS, r, rows)
        mesh.wait(ROWS, r, n - 1)  # this worker has every shard's fresh rows
        take()
        return time.perf_counter()

    mesh.barrier(key)
    result = TimedLoop(mesh, key + 1, args.warmup, args.target_s, 2, 200).run(step)
    del updates, rows, landing
    return result


def mltuner_config(args: argparse.Namespace) -> mt.Config:
    parts = {} if args.part_bytes is None else {"clock_part_bytes": args.part_bytes}
    return mt.Config(update_rule=mt.UpdateRule("add"), wait_timeout_s=args.timeout, **parts)


def open_job(args: argparse.Namespace, cuda_ipc: bool | None = None) -> mt.Job:
    # A long heartbeat timeout: a 2-core machine running 4 workers that move
    # 1 GB per clock may leave a receive thread unscheduled for a while. The
    # frame limit admits the model as one table's shard slice (the 1-GiB model
    # on 2 processes sends 512-MiB slices, over the default 256 MiB).
    return mt.Job(mltuner_config(args), rendezvous_timeout_s=args.timeout, heartbeat_timeout_s=60.0,
                  max_message_bytes=max(256 << 20, 2 * (args.model_bytes or 0)), cuda_ipc=cuda_ipc)


def record_full_clock(worker: mt.Worker, num_rows: int, tables: int) -> tuple[list[int], list[int]]:
    """Every row of the model, as `tables` equal tables, read and updated in a clock."""
    ids = [worker.create_table(f"model-{k}", num_rows // tables, ROW_WIDTH) for k in range(tables)]
    reads = [worker.virtual_read(table, slack=0) for table in ids]
    for read in reads:
        worker.virtual_post_read(read)
    updates = []
    for table in ids:  # each table's update is final, and leaves, before the next one's opens
        updates.append(worker.virtual_pre_update(table))
        worker.virtual_update(updates[-1])
    worker.virtual_clock()
    worker.finish_virtual_iteration()
    worker.start_iterations()
    return reads, updates


def clock_step(worker: mt.Worker, reads: list[int], updates: list[int],
               between: Callable[[], object] | None = None) -> Callable[[], float]:
    """One clock of the benchmark as a function returning the moment the reads
    returned, i.e. when every worker's previous clock was in this worker's
    cache (slack 0). `between` runs after the clock, while the transport moves
    this clock's updates."""
    def step() -> float:
        for read in reads:
            worker.read(read)
        mark = time.perf_counter()
        for read in reads:
            worker.post_read(read)
        for update in updates:
            worker.pre_update(update)  # zeros: the engine still sends the dense slice
            worker.update(update)
        worker.clock()
        if between is not None:
            between()
        return mark

    return step


def mltuner_phase(mesh: Mesh, model_rows: int, args: argparse.Namespace, key: int,
                  cuda_ipc: bool | None = None) -> Json:
    """mltuner's clock; cuda_ipc=False keeps every payload on the sockets
    (by default CPU processes of one host share memory)."""
    with open_job(args, cuda_ipc) as job:
        worker = job.worker
        step = clock_step(worker, *record_full_clock(worker, model_rows, args.table_count))
        mesh.barrier(key)
        result = TimedLoop(mesh, key + 1, args.warmup, args.target_s, 2, 200).run(step)
        worker.sync()
        result["paths"] = sorted(set(job.data_paths.values()))
    return result


def local_phase(mesh: Mesh, model_rows: int, args: argparse.Namespace, key: int) -> Json:
    """A diagnostic: the same clock on a 1-worker LocalCluster in each process
    at once (all rows in its own shard): the engine's copies without transport."""
    with mt.LocalCluster(1, mltuner_config(args)) as cluster:
        worker = cluster.workers[0]
        step = clock_step(worker, *record_full_clock(worker, model_rows, args.table_count))
        mesh.barrier(key)
        return TimedLoop(mesh, key + 1, args.warmup, args.target_s, 2, 200).run(step)


def throughput_worker(args: argparse.Namespace, mesh: Mesh) -> Json:
    model_rows = args.model_bytes // (4 * ROW_WIDTH)
    out: Json = {"raw": raw_phase(mesh, model_rows, args, 10)}
    curve_mesh = Mesh(mesh.rank, [int(p) for p in args.curve_ports.split(",")], args.timeout, curve=True)
    try:
        curve_mesh.barrier(1)
        out["raw_curve"] = raw_phase(curve_mesh, model_rows, args, 10)
        curve_mesh.barrier(2)  # every rank is done before any of its sockets closes
    finally:
        curve_mesh.close()
    ipc_mesh = Mesh(mesh.rank, [0] * mesh.size, args.timeout, ipc_dir=args.ipc_dir)
    try:
        ipc_mesh.barrier(1)
        out["raw_ipc"] = raw_phase(ipc_mesh, model_rows, args, 10)
        ipc_mesh.barrier(2)
    finally:
        ipc_mesh.close()
    out["raw_copy"] = raw_phase(mesh, model_rows, args, 20, copy_on_receive=True)
    out["raw_peak_rss"] = peak_rss_bytes()
    out["local"] = local_phase(mesh, model_rows, args, 30)
    out["mltuner"] = mltuner_phase(mesh, model_rows, args, 40)
    out["mltuner_sockets"] = mltuner_phase(mesh, model_rows, args, 50, cuda_ipc=False)
    out["peak_rss"] = peak_rss_bytes()
    return out


# -- part 2's busy work --------------------------------------------------------------
def python_busy(iterations: int) -> int:
    """Pure-Python arithmetic: holds the GIL (save for forced switches)."""
    x = 0
    for i in range(iterations):
        x = (x + i * i) % 1000003
    return x


ALONE_SAMPLES = 4  # timings of the work alone per case and round
NUMPY_BUSY_FLOATS = 1 << 18  # 1 MiB arrays: each op releases the GIL for tens of microseconds


def numpy_busy(ops: int, a: np.ndarray, b: np.ndarray) -> None:
    """Element-wise numpy: the GIL is released inside each op."""
    for _ in range(ops):
        np.multiply(a, 1.0000001, out=a)
        np.add(a, b, out=a)


def calibrate(fn: Callable[[int], object], target_s: float) -> int:
    """The count n for which fn(n) takes about target_s (median of 5 timings,
    so that one preempted call does not skew it)."""
    n = 1
    while True:
        elapsed = float(np.median([timed(lambda: fn(n)) for _ in range(5)]))
        if elapsed > target_s / 4:
            return max(1, round(n * target_s / elapsed))
        n *= 2


def busy_worker(args: argparse.Namespace, mesh: Mesh) -> Json:
    a = np.ones(NUMPY_BUSY_FLOATS, np.float32)
    b = np.full(NUMPY_BUSY_FLOATS, 1e-6, np.float32)
    py_n = calibrate(python_busy, BUSY_S)
    np_n = calibrate(lambda n: numpy_busy(n, a, b), BUSY_S)
    work = {"none": lambda: None, "python": lambda: python_busy(py_n), "numpy": lambda: numpy_busy(np_n, a, b)}
    model_rows = args.model_bytes // (4 * ROW_WIDTH)
    switches = (sys.getswitchinterval(), args.switch_interval)
    # (switch, work) -> clock marks of each segment, and the work's times alone.
    marks: dict[tuple[float, str], list[list[float]]] = collections.defaultdict(list)
    alone: dict[tuple[float, str], list[float]] = collections.defaultdict(list)
    with open_job(args) as job:
        worker = job.worker
        read, update = record_full_clock(worker, model_rows, 1)
        key = 100
        # Round robin over the cases in short segments, so that drift in the
        # machine's speed (a VM's pure-Python speed was seen to vary 2x from
        # second to second here) touches every case alike.
        for _ in range(args.reps):
            for switch in switches:
                sys.setswitchinterval(switch)
                # The work's own time, both ranks at once as in the clock loop,
                # with nothing in flight (the transport threads idle).
                key += 1
                mesh.barrier(key)
                for name, fn in work.items():
                    alone[(switch, name)] += [timed(fn) for _ in range(ALONE_SAMPLES)]
                for name, fn in work.items():
                    step = clock_step(worker, read, update, fn)
                    key += 1
                    mesh.barrier(key)
                    for _ in range(2):  # the first clocks after a barrier start unevenly
                        step()
                    marks[(switch, name)].append([step() for _ in range(args.clocks + 1)])
        sys.setswitchinterval(switches[0])
        worker.sync()
    cases = []
    for (switch, name), segments in marks.items():
        gaps = np.concatenate([np.diff(m) for m in segments])
        cases.append({"switch_s": switch, "work": name, "clocks": len(gaps), "clock_s": float(gaps.mean()),
                      "median_s": float(np.median(gaps)), "alone_s": float(np.mean(alone[(switch, name)]))})
    return {"cases": cases, "python_iterations": py_n, "numpy_ops": np_n}


def timed(fn: Callable[[], object]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def worker_main(args: argparse.Namespace) -> int:
    die_with_parent(args.parent_pid)
    rank = int(os.environ["MLTUNER_RANK"])
    ports = [int(p) for p in args.raw_ports.split(",")]
    mesh = Mesh(rank, ports, args.timeout)
    try:
        mesh.barrier(1)
        result = throughput_worker(args, mesh) if args.worker == "throughput" else busy_worker(args, mesh)
        result["rank"] = rank
        mesh.barrier(2)  # every rank is done before any mesh socket closes
    finally:
        mesh.close()
    tmp = Path(args.result + ".tmp")
    tmp.write_text(json.dumps(result))
    tmp.rename(args.result)
    return 0


# == the parent ======================================================================
class GroupError(RuntimeError):
    pass


class CpuMeter:
    """The share of the machine's CPU time that processes other than this one
    and its children used between start and `others()`: this benchmark's
    figures assume a machine otherwise idle. Call `others()` after the
    children have been waited for (their CPU time counts only then)."""

    def __init__(self) -> None:
        self.start = self._snapshot()

    @staticmethod
    def _snapshot() -> tuple[float, float, float]:
        busy = 0.0
        try:
            with open("/proc/stat") as f:
                fields = [int(x) for x in f.readline().split()[1:]]
            # user, nice, system, idle, iowait, irq, softirq, steal, ...
            busy = (fields[0] + fields[1] + fields[2] + fields[5] + fields[6]) / os.sysconf("SC_CLK_TCK")
        except (OSError, ValueError, IndexError):
            busy = -1.0
        ours = 0.0
        for who in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN):
            usage = resource.getrusage(who)
            ours += usage.ru_utime + usage.ru_stime
        return time.monotonic(), busy, ours

    def others(self) -> float:
        now = self._snapshot()
        if self.start[1] < 0 or now[1] < 0:
            return -1.0
        capacity = (now[0] - self.start[0]) * (os.cpu_count() or 1)
        other = (now[1] - self.start[1]) - (now[2] - self.start[2])
        return max(0.0, other / capacity) if capacity > 0 else -1.0


def run_group(n: int, worker_args: list[str], timeout_s: float, wait_s: float) -> list[Json]:
    """Starts n ranks of this script in worker mode and returns their results.
    Kills every rank on a failure, a timeout or an interrupt."""
    ports: list[int] = []
    while len(ports) < 2 * n + 1:
        port = free_port()
        if port not in ports:
            ports.append(port)
    master, raw, curve = ports[0], ports[1:n + 1], ports[n + 1:]
    with tempfile.TemporaryDirectory(prefix="transport-bench-") as tmp:
        procs: list[subprocess.Popen[bytes]] = []
        logs = []
        try:
            for rank in range(n):
                env = dict(os.environ, MLTUNER_RANK=str(rank), MLTUNER_WORLD_SIZE=str(n),
                           MLTUNER_LOCAL_RANK=str(rank), MLTUNER_MASTER_ADDR="127.0.0.1",
                           MLTUNER_MASTER_PORT=str(master), PYTHONUNBUFFERED="1",
                           OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1", MKL_NUM_THREADS="1")
                # Loopback without a secret: a default local job (CURVE keys from this user's key).
                env.pop("MLTUNER_SECRET", None)
                log = open(Path(tmp) / f"rank-{rank}.log", "wb")
                logs.append(log)
                cmd = [sys.executable, str(Path(__file__).resolve()), *worker_args, "--raw-ports",
                       ",".join(map(str, raw)), "--curve-ports", ",".join(map(str, curve)), "--ipc-dir", tmp,
                       "--result", str(Path(tmp) / f"rank-{rank}.json"),
                       "--parent-pid", str(os.getpid()), "--timeout", str(wait_s)]
                procs.append(subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT))
            deadline = time.monotonic() + timeout_s
            while any(p.poll() is None for p in procs):
                failed = [i for i, p in enumerate(procs) if p.returncode not in (None, 0)]
                if failed:
                    raise GroupError(f"rank {failed[0]} exited with {procs[failed[0]].returncode}")
                if time.monotonic() > deadline:
                    raise GroupError(f"timed out after {timeout_s:.0f} s")
                available = available_memory_bytes()
                if 0 <= available < MIN_AVAILABLE_BYTES:
                    raise GroupError(f"stopped: the machine's available memory fell to {available / GB:.1f} GB")
                time.sleep(0.05)
            failed = [i for i, p in enumerate(procs) if p.returncode != 0]
            if failed:
                raise GroupError(f"rank {failed[0]} exited with {procs[failed[0]].returncode}")
            return [json.loads((Path(tmp) / f"rank-{rank}.json").read_text()) for rank in range(n)]
        except BaseException as error:
            kill_all(procs)
            if isinstance(error, GroupError):
                tails = []
                for rank in range(len(procs)):
                    text = (Path(tmp) / f"rank-{rank}.log").read_text(errors="replace").strip().splitlines()
                    tails.append(f"--- rank {rank} ---\n" + "\n".join(text[-12:]))
                raise GroupError(f"{error}\n" + "\n".join(tails)) from None
            raise
        finally:
            kill_all(procs)
            for log in logs:
                log.close()


def available_memory_bytes() -> int:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return -1


def kill_all(procs: list[subprocess.Popen[bytes]]) -> None:
    for proc in procs:
        if proc.poll() is None:
            proc.kill()
    for proc in procs:
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            pass


def estimated_bytes(n: int, model_bytes: int) -> int:
    return n * int(MEMORY_FACTOR * model_bytes + BASE_PROCESS_BYTES)


@dataclass
class Row:
    n: int
    size_mib: int
    tables: int
    raw_s: float = 0.0
    raw_curve_s: float = 0.0
    raw_ipc_s: float = 0.0
    mlt_s: float = 0.0
    mlt_sockets_s: float = 0.0  # shared memory off
    mlt_path: str = ""
    local_s: float = 0.0
    raw_copy_s: float = 0.0
    raw_clocks: int = 0
    mlt_clocks: int = 0
    peak_rss: int = 0
    raw_peak_rss: int = 0
    lo_check: float = -1.0
    other_load: float = -1.0  # share of the machine's CPU used by other processes meanwhile
    raw_faults: float = 0.0  # page faults per clock and process, as bytes
    mlt_faults: float = 0.0
    note: str = ""


def bench_throughput(args: argparse.Namespace) -> list[Row]:
    rows: list[Row] = []
    limit = int(args.memory_limit_gb * GB)
    for n, size, tables in itertools.product(args.procs, args.sizes, args.tables):
        row = Row(n, size, tables)
        rows.append(row)
        model = size * MIB
        need = estimated_bytes(n, model)
        if need > limit:
            row.note = (f"skipped: needs about {need / GB:.1f} GB ({n} x {MEMORY_FACTOR:g} x model), "
                        f"over the {args.memory_limit_gb:g} GB limit")
            print(f"N={n} {size} MiB in {tables} table(s): {row.note}", flush=True)
            continue
        print(f"N={n} {size} MiB in {tables} table(s): running ...", end="", flush=True)
        start = time.perf_counter()
        meter = CpuMeter()
        try:
            ranks = run_group(n, ["--worker", "throughput", "--model-bytes", str(model),
                                  "--table-count", str(tables), "--warmup", str(args.warmup), "--target-s", str(args.target_s)]
                             + ([] if args.part_mib is None else ["--part-bytes", str(int(args.part_mib * MIB))]),
                              timeout_s=args.group_timeout, wait_s=120.0)
        except GroupError as error:
            row.note = f"failed: {str(error).splitlines()[0]}"
            print(f"\n{error}", flush=True)
            continue
        row.other_load = meter.others()
        row.raw_s = best_segment(ranks, "raw")
        row.raw_curve_s = best_segment(ranks, "raw_curve")
        row.raw_ipc_s = best_segment(ranks, "raw_ipc")
        row.mlt_s = best_segment(ranks, "mltuner")
        row.mlt_sockets_s = best_segment(ranks, "mltuner_sockets")
        row.mlt_path = ", ".join(sorted({path for r in ranks for path in r["mltuner"]["paths"]}))
        row.local_s = best_segment(ranks, "local")
        row.raw_copy_s = best_segment(ranks, "raw_copy")
        row.raw_clocks = int(ranks[0]["raw"]["clocks"])
        row.mlt_clocks = int(ranks[0]["mltuner"]["clocks"])
        row.peak_rss = sum(int(r["peak_rss"]) for r in ranks)
        row.raw_peak_rss = sum(int(r["raw_peak_rss"]) for r in ranks)
        page = os.sysconf("SC_PAGE_SIZE")
        row.raw_faults = page * max(float(r["raw"]["faults_per_clock"]) for r in ranks)
        row.mlt_faults = page * max(float(r["mltuner"]["faults_per_clock"]) for r in ranks)
        lo = float(ranks[0]["mltuner"]["lo_bytes_per_clock"])
        row.lo_check = lo / wire_bytes(n, model) if lo >= 0 else -1.0
        print(f" {time.perf_counter() - start:.1f} s: ms per clock: raw {row.raw_s * 1e3:.1f}, raw over ipc "
              f"{row.raw_ipc_s * 1e3:.1f}, raw over CURVE {row.raw_curve_s * 1e3:.1f}, mltuner "
              f"{row.mlt_s * 1e3:.1f} ({row.mlt_path}), over sockets only {row.mlt_sockets_s * 1e3:.1f}, "
              f"raw + receive copy {row.raw_copy_s * 1e3:.1f}, engine alone "
              f"{row.local_s * 1e3:.1f}; peak RSS of all ranks "
              f"{row.raw_peak_rss / GB:.2f} GB after the raw phase, {row.peak_rss / GB:.2f} GB in all; "
              f"other processes used {100 * row.other_load:.0f}% of the CPUs", flush=True)
    return rows


def best_segment(ranks: list[Json], phase: str) -> float:
    """Seconds per clock of a phase: the best segment, each segment as long
    as its slowest rank (the ranks run the same clocks in lockstep)."""
    per_rank = [r[phase]["segments"] for r in ranks]
    return min(max(float(seg[i]) for seg in per_rank) for i in range(SEGMENTS))


def wire_bytes(n: int, model_bytes: int) -> int:
    """Bytes crossing between processes per clock, all processes together:
    each sends (N-1)/N of the model as updates and (N-1)/N as rows."""
    model_rows = model_bytes // (4 * ROW_WIDTH)
    per_shard = [shard_rows(model_rows, s, n) * ROW_WIDTH * 4 for s in range(n)]
    return 2 * (n - 1) * sum(per_shard)


def load_text(share: float) -> str:
    return "n/a" if share < 0 else f"{100 * share:.0f}%"


def throughput_table(rows: list[Row]) -> list[str]:
    lines = [
        "| N | model | raw pyzmq ms/clock | mltuner ms/clock | ratio (raw/mltuner) | goal >= 0.80 "
        "| raw GB/s | mltuner GB/s | mltuner's path | mltuner over sockets ms/clock | ratio (raw/sockets) "
        "| raw over ipc ms/clock | ratio (raw over ipc/mltuner) "
        "| raw over CURVE ms/clock | ratio (raw over CURVE/mltuner) "
        "| raw + receive copy ms/clock | engine alone ms/clock "
        "| page faults MiB/clock (raw, mltuner) | peak RSS, all processes | loopback bytes / expected "
        "| clocks (raw, mltuner) | other load |",
        "|--:|--:|--:|--:|--:|:-:|--:|--:|:--|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|",
    ]
    for r in rows:
        model = f"{r.size_mib} MiB" + (f" in {r.tables} tables" if r.tables > 1 else "")
        if r.note:
            lines.append(f"| {r.n} | {model} | {r.note} | | | | | | | | | | | | | | | | | | | |")
            continue
        wire = wire_bytes(r.n, r.size_mib * MIB)
        ratio = r.raw_s / r.mlt_s
        check = f"{r.lo_check:.2f}" if r.lo_check >= 0 else "n/a"
        lines.append(
            f"| {r.n} | {model} | {r.raw_s * 1e3:.1f} | {r.mlt_s * 1e3:.1f} | {ratio:.2f} | "
            f"{'yes' if ratio >= GOAL else 'NO'} | {wire / r.raw_s / GB:.2f} | {wire / r.mlt_s / GB:.2f} | "
            f"{r.mlt_path} | {r.mlt_sockets_s * 1e3:.1f} | {r.raw_s / r.mlt_sockets_s:.2f} | "
            f"{r.raw_ipc_s * 1e3:.1f} | {r.raw_ipc_s / r.mlt_s:.2f} | "
            f"{r.raw_curve_s * 1e3:.1f} | {r.raw_curve_s / r.mlt_s:.2f} | "
            f"{r.raw_copy_s * 1e3:.1f} | {r.local_s * 1e3:.1f} | {r.raw_faults / MIB:.0f}, {r.mlt_faults / MIB:.0f} | "
            f"{r.peak_rss / GB:.1f} GB | {check} | "
            f"{r.raw_clocks}, {r.mlt_clocks} | {load_text(r.other_load)} |")
    return lines


THROUGHPUT_NOTES = """\
One table of rows of 1024 floats covering the model; every worker reads all rows (slack 0), adds a zero
update to all rows (rule "add") and clocks. Per clock and process, (N-1)/N of the model goes out as update
slices and (N-1)/N as fresh rows, and as much comes in. Raw pyzmq moves the same bytes in the same pattern
(numpy arrays, copy=False, PUSH/PULL on 127.0.0.1; a round ends when a process has received every message
due to it), in the same processes, before mltuner. ms/clock: after warm-up, the best of three segments of
clocks, each segment as long as its slowest rank. GB/s = bytes crossing between processes per clock, all
processes together (2 (N-1) x model), / time per clock. ratio = raw time / mltuner time (1.0 = as fast as
raw pyzmq). mltuner's path: how its payloads crossed ("shared-memory": CPU processes of one host copy
each payload into the peer's mapped landing region and send only a notice, the default; "host-frames (...)":
through the sockets). Five diagnostics, not baselines: "mltuner over sockets" is mltuner with shared memory
off (Job(cuda_ipc=False)), every payload on its ipc:// socket; "raw over ipc" is the raw pattern over ipc://
sockets, the address mltuner's processes of one host use (plain, authenticated by their private
directory); "raw over CURVE" is the raw pattern over
CURVE sockets (encrypted, as mltuner's TCP sockets are, loopback included; no authenticator, which acts
only at connection time); "raw + receive copy" is the
raw pattern where each process also
copies every payload it receives into a buffer of its own (as mltuner's deliver copies into its pool);
"engine alone" is the same clock on a 1-worker LocalCluster in each of the N processes at once (all rows in
its own shard, no transport): the engine's own copies under the same sharing of the CPUs. "loopback bytes /
expected": the lo interface's byte counter over mltuner's timed clocks against 2 (N-1) x model (1.00 means
the zero updates are sent in full; other loopback traffic on the machine would add to it). Page faults:
minor faults per clock of the busiest process (all its threads) x the page size, i.e. memory touched for the
first time each clock, such as freshly allocated receive buffers. Peak RSS: the processes' peaks summed,
whichever phase was largest. Other load: the share of all CPUs that processes other than the benchmark's
used while the configuration ran (from /proc/stat); above a few percent, its row is disturbed."""


def throughput_figures(rows: list[Row]) -> list[Figure]:
    figures = []
    for r in rows:
        tables = f" in {r.tables} tables" if r.tables > 1 else ""
        name = f"N={r.n}, {r.size_mib} MiB model{tables}: updates + fresh rows per clock"
        if r.note:
            figures.append(Figure("transport", name, None, "ms/clock", "raw pyzmq", None, None,
                                  "raw time / mltuner time", goal=GOAL, note=r.note))
            continue
        figures.append(Figure("transport", name, r.mlt_s * 1e3, "ms/clock", "raw pyzmq", r.raw_s * 1e3,
                              r.raw_s / r.mlt_s, "raw time / mltuner time", goal=GOAL,
                              note=f"engine alone {r.local_s * 1e3:.1f} ms/clock"))
    return figures


def busy_figures(result: Json) -> list[Figure]:
    """Pure-Python work between clocks under the default GIL switch interval
    and the mitigation: the clock's time against no overlap at all."""
    figures, base = [], 0.0
    for c in result["cases"]:
        if c["work"] == "none":
            base = c["clock_s"]
        elif c["work"] == "python":
            ideal = base + c["alone_s"]
            figures.append(Figure(
                "transport", f"busy Python main thread, switch interval {c['switch_s'] * 1e3:g} ms",
                c["clock_s"] * 1e3, "ms/clock", "clock + work, no overlap", ideal * 1e3, ideal / c["clock_s"],
                "ideal time / measured time", note=f"added {(c['clock_s'] - ideal) * 1e3:+.2f} ms/clock"))
    return figures


def bench_busy(args: argparse.Namespace) -> Json:
    print(f"busy main thread: N=2, {args.busy_mib} MiB model ...", end="", flush=True)
    start = time.perf_counter()
    meter = CpuMeter()
    ranks = run_group(2, ["--worker", "busy", "--model-bytes", str(args.busy_mib * MIB),
                          "--reps", str(args.busy_reps), "--clocks", str(args.busy_clocks),
                          "--switch-interval", str(args.switch_interval)],
                      timeout_s=args.group_timeout, wait_s=60.0)
    other_load = meter.others()
    print(f" {time.perf_counter() - start:.1f} s; other processes used {load_text(other_load)} of the CPUs",
          flush=True)
    cases = []
    for i, case in enumerate(ranks[0]["cases"]):
        per_rank = [r["cases"][i] for r in ranks]
        cases.append({"switch_s": case["switch_s"], "work": case["work"], "clocks": case["clocks"],
                      "clock_s": max(float(c["clock_s"]) for c in per_rank),
                      "median_s": max(float(c["median_s"]) for c in per_rank),
                      "alone_s": max(float(c["alone_s"]) for c in per_rank)})
    return {"cases": cases, "other_load": other_load}


WORK_NAMES = {"none": "(a) nothing", "python": "(b) pure Python (holds the GIL)",
              "numpy": "(c) numpy element-wise (releases the GIL)"}


def busy_table(result: Json) -> list[str]:
    lines = [
        "| GIL switch interval | main thread between clocks | work alone ms | ms/clock (mean) | ms/clock (median) "
        "| ideal ms | added ms/clock |",
        "|--:|:--|--:|--:|--:|--:|--:|",
    ]
    base = 0.0
    for c in result["cases"]:
        if c["work"] == "none":
            base = c["clock_s"]
        ideal = base + (c["alone_s"] if c["work"] != "none" else 0.0)
        added = c["clock_s"] - ideal
        lines.append(f"| {c['switch_s'] * 1e3:g} ms | {WORK_NAMES[c['work']]} | {c['alone_s'] * 1e3:.2f} | "
                     f"{c['clock_s'] * 1e3:.2f} | {c['median_s'] * 1e3:.2f} | {ideal * 1e3:.2f} | "
                     f"{added * 1e3:+.2f} |")
    lines += ["", f"Other processes used {load_text(result['other_load'])} of the CPUs meanwhile."]
    return lines


BUSY_NOTES = """\
N=2, a 1 MiB model, the clock of part 1 (read all rows at slack 0, update all rows, clock). After clock(),
while the transport threads send this clock's updates and receive the fresh rows, the main thread does
(a) nothing, (b) pure-Python arithmetic (holds the GIL but for forced switches) or (c) numpy element-wise
ops on 1 MiB arrays (release the GIL inside each op), each calibrated to about 5 ms at start-up. The six
cases run interleaved, in segments of 15 clocks round-robin, so that the machine's drift touches all alike.
work alone: the work's mean time with no clock running (both ranks at once, between segments). ideal =
ms/clock of (a) under the same switch interval + work alone, i.e. no overlap at all; added = mean ms/clock -
ideal (negative: the transport overlapped with the work). Both ranks work at once, so on 2 CPUs they also
compete with the transport and engine threads for CPU time: (c) shows that share, and (b) - (c) is what
holding the GIL adds."""


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="10 and 100 MiB, N=2 only (< 2 minutes)")
    parser.add_argument("--out", default="results/transport_bench.md", help="markdown file for the tables")
    parser.add_argument("--figures", metavar="PATH", help="write the headline figures for the suite (JSON)")
    parser.add_argument("--sizes", help="model sizes in MiB (default 10,100,1024; quick 10,100)")
    parser.add_argument("--procs", help="process counts (default 2,4; quick 2)")
    parser.add_argument("--tables", default="1", help="the model as this many equal tables (default 1)")
    parser.add_argument("--part-mib", type=float,
                        help="Config.clock_part_bytes in MiB (0: every shard's rows whole; default: Config's)")
    parser.add_argument("--switch-interval", type=float, default=DEFAULT_SWITCH_S,
                        help=f"GIL switch interval of the mitigation, seconds (default {DEFAULT_SWITCH_S})")
    parser.add_argument("--memory-limit-gb", type=float, default=16.0,
                        help="skip a configuration whose estimated memory exceeds this (default 16)")
    parser.add_argument("--skip-throughput", action="store_true", help="run part 2 only")
    parser.add_argument("--skip-busy", action="store_true", help="run part 1 only")
    # Worker mode (internal): run by the parent, one process per rank.
    parser.add_argument("--worker", choices=["throughput", "busy"], help=argparse.SUPPRESS)
    parser.add_argument("--raw-ports", help=argparse.SUPPRESS)
    parser.add_argument("--curve-ports", help=argparse.SUPPRESS)
    parser.add_argument("--ipc-dir", help=argparse.SUPPRESS)
    parser.add_argument("--result", help=argparse.SUPPRESS)
    parser.add_argument("--parent-pid", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--model-bytes", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--table-count", type=int, default=1, help=argparse.SUPPRESS)
    parser.add_argument("--part-bytes", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--warmup", type=int, default=3, help=argparse.SUPPRESS)
    parser.add_argument("--target-s", type=float, default=2.0, help=argparse.SUPPRESS)
    parser.add_argument("--timeout", type=float, default=120.0, help=argparse.SUPPRESS)
    parser.add_argument("--reps", type=int, default=3, help=argparse.SUPPRESS)
    parser.add_argument("--clocks", type=int, default=40, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        return worker_main(args)
    if not args.switch_interval > 0:
        parser.error("--switch-interval must be > 0 seconds")

    args.sizes = [int(x) for x in (args.sizes or ("10,100" if args.quick else "10,100,1024")).split(",")]
    args.procs = [int(x) for x in (args.procs or ("2" if args.quick else "2,4")).split(",")]
    args.tables = [int(x) for x in args.tables.split(",")]
    args.target_s = 1.5 if args.quick else 3.0  # seconds of timed clocks per phase
    args.warmup = 3
    args.busy_mib = 1
    args.busy_reps = 12 if args.quick else 30
    args.busy_clocks = 15
    args.group_timeout = 300.0
    # SIGTERM runs the cleanup (finally blocks kill the children) like Ctrl-C.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))

    head = machine_lines(args)
    print("\n".join(head), flush=True)
    start = time.perf_counter()
    sections = []
    figures: list[Figure] = []
    if not args.skip_throughput:
        print("\n== Part 1: per-clock update + fresh-row traffic, mltuner vs raw pyzmq ==", flush=True)
        rows = bench_throughput(args)
        figures += throughput_figures(rows)
        table = throughput_table(rows)
        sections.append(("Per-clock update + fresh-row traffic, mltuner vs raw pyzmq", THROUGHPUT_NOTES, table))
        print("\n" + THROUGHPUT_NOTES + "\n\n" + "\n".join(table), flush=True)
    if not args.skip_busy:
        print("\n== Part 2: latency added per clock by a busy main thread ==", flush=True)
        try:
            busy = bench_busy(args)
        except GroupError as error:
            print(f"\nthe busy-main-thread group failed: {error}", flush=True)
            return 1
        figures += busy_figures(busy)
        table = busy_table(busy)
        sections.append(("Latency added per clock by a busy Python main thread", BUSY_NOTES, table))
        print("\n" + BUSY_NOTES + "\n\n" + "\n".join(table), flush=True)
    elapsed = time.perf_counter() - start
    print(f"\ntotal {elapsed:.1f} s")

    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    text = ["# mltuner transport benchmark", "", "```", *head, f"total time: {elapsed:.0f} s", "```"]
    for title, notes, table in sections:
        text += ["", f"## {title}", "", notes, "", *table]
    out.write_text("\n".join(text) + "\n")
    print(f"wrote {out}")
    write_figures(args.figures, figures)
    return 0


if __name__ == "__main__":
    sys.exit(main())
