"""Where a job's messages wait between threads and processes: reads the hop
logs its processes wrote (``MLTUNER_HOP_LOG=<folder>``, cluster/hop_log.h)
and prints how long each leg of each message's way took.

    MLTUNER_HOP_LOG=/tmp/hops mltuner launch -n 2 -- python train.py
    python benchmarks/hop_timeline.py /tmp/hops [--out PATH]

A message is queued by the thread that sends it (the reclaimer's updates,
the shard's rows); one for another process is put on its socket by the send
thread (logged per socket message, a batch or a CUDA IPC notice, not per
message) and admitted by the receiver's receive thread; then the receiving
shard or engine inbox thread delivers it and is done with it. The legs, in
milliseconds (median, 90th percentile and most, over the messages of one
type and route):

- ``queued -> admitted``: the way to another process: the send thread, the
  socket, the receive thread;
- ``admitted -> delivered``: the wait in the receiver's inbox;
- ``queued -> delivered``: a message to a shard or engine of its own process;
- ``delivered -> done``: handling it (a shard's apply and push, an install).

Then, per rank, the send thread's in-order waits for CUDA IPC releases
(``release-wait``): stop 43 found those holding back every later message
when a peer on another GPU was taken for one on this GPU (docs/results.md).

A message is known by its type, table, clock, sender and receiver; several
with the same identity (a table's clock in parts) are matched in order. The
processes of one host share the steady clock, so their files merge.
"""

from __future__ import annotations

import argparse
import collections
import statistics
import sys
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

# wire/message.h, MessageType
TYPE_NAMES = {1: "clock update", 2: "start", 3: "rows", 4: "fetch", 5: "fetch reply", 6: "init add", 7: "ack",
              8: "error", 9: "ready", 10: "fork", 11: "free branch", 12: "branch rows"}
DELIVERED = {"shard", "engine"}
DONE = {"shard-done", "engine-done"}


@dataclass(frozen=True)
class Hop:
    """One line of a hop log."""

    us: int
    rank: int
    thread: str
    hop: str
    type: int
    table: int
    clock: int
    sender: int
    receiver: int
    bytes: int

    @property
    def message(self) -> tuple[int, int, int, int, int]:
        return (self.type, self.table, self.clock, self.sender, self.receiver)


def read_hops(paths: Iterable[Path]) -> list[Hop]:
    """Every line of the files (or of the hops-*.tsv files in the folders), in time order."""
    hops: list[Hop] = []
    for path in paths:
        files = sorted(path.glob("hops-*.tsv")) if path.is_dir() else [path]
        for file in files:
            for number, line in enumerate(file.read_text().splitlines(), 1):
                fields = line.split("\t")
                if len(fields) != 10:
                    raise ValueError(f"{file}:{number}: {len(fields)} fields, not 10: {line!r}")
                us, rank, thread, hop, *numbers = fields
                hops.append(Hop(int(us), int(rank), thread, hop, *(int(n) for n in numbers)))
    hops.sort(key=lambda h: h.us)
    return hops


def legs(hops: Sequence[Hop]) -> dict[tuple[str, str, str], list[float]]:
    """(message type, route, leg) -> the leg's milliseconds for each message."""
    # Per message identity and hop: the times, in order (the i-th of each hop is one message).
    times: dict[tuple[tuple[int, ...], str], list[int]] = collections.defaultdict(list)
    for hop in hops:
        if hop.type >= 0:
            times[(hop.message, hop.hop)].append(hop.us)
    out: dict[tuple[str, str, str], list[float]] = collections.defaultdict(list)
    identities = {message for message, name in times if name == "queued"}
    for message in identities:
        kind = TYPE_NAMES.get(message[0], f"type {message[0]}")
        remote = message[3] != message[4]
        route = "to another process" if remote else "within a process"
        queued = times[(message, "queued")]
        admitted = times.get((message, "admitted"), [])
        delivered = sorted(times.get((message, "shard"), []) + times.get((message, "engine"), []))
        done = sorted(times.get((message, "shard-done"), []) + times.get((message, "engine-done"), []))
        for i, start in enumerate(queued):
            if remote and i < len(admitted):
                out[(kind, route, "queued -> admitted")].append((admitted[i] - start) / 1e3)
                if i < len(delivered):
                    out[(kind, route, "admitted -> delivered")].append((delivered[i] - admitted[i]) / 1e3)
            elif not remote and i < len(delivered):
                out[(kind, route, "queued -> delivered")].append((delivered[i] - start) / 1e3)
            if i < len(delivered) and i < len(done):
                out[(kind, route, "delivered -> done")].append((done[i] - delivered[i]) / 1e3)
    return out


def release_waits(hops: Sequence[Hop]) -> dict[int, list[float]]:
    """Per rank, the milliseconds of each of its send thread's in-order release waits."""
    began: dict[tuple[int, str], int] = {}
    out: dict[int, list[float]] = collections.defaultdict(list)
    for hop in hops:
        key = (hop.rank, hop.thread)
        if hop.hop == "release-wait":
            began[key] = hop.us
        elif hop.hop == "release-waited" and key in began:
            out[hop.rank].append((hop.us - began.pop(key)) / 1e3)
    return out


def percentile(values: Sequence[float], fraction: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(fraction * len(ordered)))]


def report(hops: Sequence[Hop]) -> str:
    lines = ["| message | route | leg | messages | median ms | p90 ms | most ms |", "|:--|:--|:--|--:|--:|--:|--:|"]
    for (kind, route, leg), values in sorted(legs(hops).items()):
        lines.append(f"| {kind} | {route} | {leg} | {len(values)} | {statistics.median(values):.2f} | "
                     f"{percentile(values, 0.9):.2f} | {max(values):.2f} |")
    waits = release_waits(hops)
    lines += ["", "| rank | send thread's in-order release waits | total ms | most ms |", "|--:|--:|--:|--:|"]
    for rank in sorted({hop.rank for hop in hops}):
        values = waits.get(rank, [])
        lines.append(f"| {rank} | {len(values)} | {sum(values):.1f} | {max(values, default=0.0):.1f} |")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("paths", type=Path, nargs="+", help="hop log folders (MLTUNER_HOP_LOG) or hops-*.tsv files")
    parser.add_argument("--out", type=Path, help="also write the tables here (markdown)")
    args = parser.parse_args(argv)
    hops = read_hops(args.paths)
    if not hops:
        print("no hops in " + ", ".join(map(str, args.paths)) + " (was MLTUNER_HOP_LOG set for the job?)",
              file=sys.stderr)
        return 1
    text = report(hops)
    print(text)
    if args.out:
        args.out.write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
