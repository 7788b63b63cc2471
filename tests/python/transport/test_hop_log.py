"""The hop log (MLTUNER_HOP_LOG, cluster/hop_log.h) of a real 2-process job,
read by benchmarks/hop_timeline.py: every message to another process is
logged at each hop of its way, in an order that time respects, and the tool
tells the legs apart."""

from __future__ import annotations

import io
import os
import sys
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from pathlib import Path
from types import ModuleType

import pytest

from mltuner.launch import launch

ROOT = Path(__file__).resolve().parents[3]
CLOCKS = 20


@pytest.fixture(scope="module")
def tool(benchmark_module: Callable[[str, str], AbstractContextManager[ModuleType]]) -> Iterator[ModuleType]:
    with benchmark_module("hop_timeline.py", "hop_timeline") as module:
        yield module


@pytest.fixture(scope="module")
def hop_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("hops") / "made-by-the-job"  # the processes make the folder
    out = io.StringIO()
    code = launch([sys.executable, str(ROOT / "examples" / "softmax_regression.py"), "--clocks", str(CLOCKS)], 2,
                  env={**os.environ, "MLTUNER_HOP_LOG": str(folder)}, stdout=out, grace_seconds=10)
    assert code == 0, out.getvalue()
    return folder


def test_each_process_logs_every_hop_of_its_messages_in_time_order(tool: ModuleType, hop_folder: Path) -> None:
    assert len(list(hop_folder.glob("hops-*.tsv"))) == 2  # one file per process
    hops = tool.read_hops([hop_folder])
    assert {hop.rank for hop in hops} == {0, 1}
    # Each worker's clock updates for the other's shard: queued by its
    # reclaimer, admitted by the other's receive thread, then delivered to and
    # handled by that shard, every table and clock once.
    for sender in (0, 1):
        receiver = 1 - sender
        updates = [h for h in hops if h.type == 1 and h.sender == sender and h.receiver == receiver]
        by_hop: dict[str, list] = {}
        for hop in updates:
            by_hop.setdefault(hop.hop, []).append(hop)
        assert set(by_hop) == {"queued", "admitted", "shard", "shard-done"}, set(by_hop)
        assert {h.rank for h in by_hop["queued"]} == {sender}
        assert {h.rank for h in by_hop["admitted"] + by_hop["shard"]} == {receiver}
        assert {h.thread for h in by_hop["queued"]} == {"mlt-reclaimer"}
        assert {h.thread for h in by_hop["shard"]} == {"mlt-shard"}
        clocks = sorted(h.clock for h in by_hop["queued"])
        assert len(clocks) >= CLOCKS and len(by_hop["admitted"]) == len(clocks) == len(by_hop["shard-done"])
        for queued, admitted, delivered, done in zip(*(sorted(by_hop[name], key=lambda h: (h.message, h.us))
                                                       for name in ("queued", "admitted", "shard", "shard-done"))):
            assert queued.message == admitted.message == delivered.message == done.message
            assert queued.us <= admitted.us <= delivered.us <= done.us
    # The send thread logs each socket message it sends, with its receiver.
    sockets = [h for h in hops if h.hop == "socket"]
    assert sockets and {h.thread for h in sockets} == {"mlt-send"} and {h.receiver for h in sockets} == {0, 1}


def test_the_tool_reports_each_leg_per_type_and_route(tool: ModuleType, hop_folder: Path,
                                                      capsys: pytest.CaptureFixture[str]) -> None:
    legs = tool.legs(tool.read_hops([hop_folder]))
    for leg in ("queued -> admitted", "admitted -> delivered", "delivered -> done"):
        assert len(legs[("clock update", "to another process", leg)]) >= 2 * CLOCKS
        assert all(ms >= 0 for ms in legs[("clock update", "to another process", leg)])
    assert len(legs[("rows", "within a process", "queued -> delivered")]) >= 2 * CLOCKS
    assert tool.main([str(hop_folder)]) == 0
    text = capsys.readouterr().out
    assert "| clock update | to another process | queued -> admitted |" in text
    assert "| 0 | 0 | 0.0 | 0.0 |" in text  # no CUDA IPC: no release waits on the send thread


def test_the_tool_says_when_there_is_nothing_to_read(tool: ModuleType, tmp_path: Path,
                                                     capsys: pytest.CaptureFixture[str]) -> None:
    assert tool.main([str(tmp_path)]) == 1
    assert "MLTUNER_HOP_LOG" in capsys.readouterr().err
