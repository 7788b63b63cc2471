"""Raw socket throughput between two processes of this host: pyzmq PUSH ->
PULL moving large numpy arrays (copy=False), over tcp:// on 127.0.0.1 and
over ipc://, with and without the job's CURVE keys (mltuner's sockets use
CURVE everywhere). It shows what the transport's choice of address can
gain, and what CURVE costs, on this machine.

    python benchmarks/socket_bench.py [--mib 50] [--messages 12] [--repeat 2]

Each case runs in two fresh processes (spawned), bounded by a timeout; the
receiver times the messages after the first. Prints a markdown table.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import tempfile
import time
from multiprocessing.queues import Queue
from typing import Any

import numpy as np
import zmq

from mltuner.launch._env import free_port
from mltuner.transport._security import derive_keys, secure_client, secure_server, start_authenticator

SECRET = "socket-bench-secret-0123456789"
TIMEOUT_S = 120.0


def receive(endpoint: str, curve: bool, size: int, count: int, results: Queue[Any]) -> None:
    context = zmq.Context()
    authenticator = start_authenticator(context, derive_keys(SECRET)) if curve else None
    socket = context.socket(zmq.PULL)
    socket.rcvtimeo = int(TIMEOUT_S * 1000)
    if curve:
        secure_server(socket, derive_keys(SECRET))
    socket.bind(endpoint)
    results.put("bound")
    try:
        socket.recv(copy=False)  # the first message: connection and handshake done
        start = time.perf_counter()
        for _ in range(count):
            frame = socket.recv(copy=False)
            assert len(frame) == size
        results.put(count * size / (time.perf_counter() - start))
    except zmq.Again:
        results.put(float("nan"))
    finally:
        socket.close(linger=0)
        if authenticator is not None:
            authenticator.stop()
        context.term()


def send(endpoint: str, curve: bool, size: int, count: int) -> None:
    context = zmq.Context()
    socket = context.socket(zmq.PUSH)
    socket.sndtimeo = int(TIMEOUT_S * 1000)
    if curve:
        secure_client(socket, derive_keys(SECRET))
    socket.connect(endpoint)
    payload = np.zeros(size // 4, dtype=np.float32)
    for _ in range(count + 1):
        socket.send(payload, copy=False)
    socket.close(linger=int(TIMEOUT_S * 1000))
    context.term()


def run_case(endpoint: str, curve: bool, size: int, count: int) -> float:
    spawn = mp.get_context("spawn")
    results: Queue[Any] = spawn.Queue()
    receiver = spawn.Process(target=receive, args=(endpoint, curve, size, count, results))
    receiver.start()
    try:
        results.get(timeout=TIMEOUT_S)  # bound
        sender = spawn.Process(target=send, args=(endpoint, curve, size, count))
        sender.start()
        try:
            return float(results.get(timeout=TIMEOUT_S))
        finally:
            sender.join(TIMEOUT_S)
            if sender.is_alive():
                sender.kill()
    finally:
        receiver.join(TIMEOUT_S)
        if receiver.is_alive():
            receiver.kill()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--mib", type=int, default=50, help="message size in MiB")
    parser.add_argument("--messages", type=int, default=12, help="timed messages per case")
    parser.add_argument("--repeat", type=int, default=2, help="runs of each case (the best is shown)")
    args = parser.parse_args()
    size = args.mib << 20
    print(f"{os.cpu_count()} CPUs, pyzmq {zmq.__version__}, libzmq {zmq.zmq_version()}, "
          f"{args.messages} messages of {args.mib} MiB, best of {args.repeat}\n")
    print("| address | CURVE | GB/s (best) | all runs |\n|:--|:-:|--:|:--|")
    with tempfile.TemporaryDirectory(prefix="sb-") as directory:
        for curve in (False, True):
            for kind in ("tcp", "ipc"):
                runs = []
                for _ in range(args.repeat):
                    endpoint = (f"tcp://127.0.0.1:{free_port()}" if kind == "tcp"
                                else f"ipc://{directory}/s{len(runs)}{int(curve)}")
                    runs.append(run_case(endpoint, curve, size, args.messages) / 1e9)
                print(f"| {kind}:// | {'on' if curve else 'off'} | {max(runs):.2f} | "
                      f"{', '.join(f'{r:.2f}' for r in runs)} |", flush=True)


if __name__ == "__main__":
    main()
