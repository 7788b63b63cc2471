"""benchmarks/trace_timeline.py: two ranks' Chrome traces read as one
timeline, cut into clocks at a marker operator. The traces here are made by
hand, so every figure the tool prints is known in advance."""

from __future__ import annotations

import gzip
import json
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from pathlib import Path
from types import ModuleType

import pytest



@pytest.fixture(scope="module")
def tool(benchmark_module: Callable[[str, str], AbstractContextManager[ModuleType]]) -> Iterator[ModuleType]:
    with benchmark_module("trace_timeline.py", "trace_timeline") as module:
        yield module


def _op(name: str, cat: str, ts: float, dur: float, stream: int = 0, nbytes: int | None = None) -> dict:
    args: dict = {"stream": stream}
    if nbytes is not None:
        args["bytes"] = nbytes
    return {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur, "pid": 0, "tid": stream, "args": args}


def _write(path: Path, events: list[dict]) -> Path:
    trace = {"traceEvents": [{"ph": "M", "name": "process_name", "args": {"name": "python3"}}, *events]}
    if path.suffix == ".gz":
        with gzip.open(path, "wt") as handle:
            json.dump(trace, handle)
    else:
        path.write_text(json.dumps(trace))
    return path


def test_two_ranks_are_one_timeline_cut_into_clocks(tool: ModuleType, tmp_path: Path,
                                                    capsys: pytest.CaptureFixture[str]) -> None:
    # Rank 0 marks clocks at 0, 1000 and 2000 us (two markers a clock).
    # Clock 0: rank 0 busy 100-300 on stream 7 and 200-400 on stream 9
    # (union 300 us), rank 1 busy 600-700; nothing runs 400-600 nor after 700.
    # Clock 1: rank 1's copy of 1100-1500 us, which rank 0's kernel overlaps.
    rank0 = [_op("aten::fill_", "cpu_op", t, 5) for t in (0, 10, 1000, 1010, 2000)] + [
        _op("k", "kernel", 100, 200, stream=7),
        _op("m", "gpu_memset", 200, 200, stream=9, nbytes=64),
        _op("k", "kernel", 1200, 100, stream=7),
        _op("cudaLaunchKernel", "cuda_runtime", 50, 10),  # host calls are not device time
    ]
    rank0 += [_op("step.forward", "user_annotation", 20, 300), _op("step.update", "user_annotation", 900, 150),
              _op("step.forward", "user_annotation", 1020, 200),  # the update counts in clock 0, where it begins
              _op("step.forward", "gpu_user_annotation", 1020, 500)]  # its span on the GPU: not host time
    rank1 = [_op("aten::fill_", "cpu_op", 3000, 5),  # markers of other ranks do not cut clocks
             _op("step.update", "user_annotation", 1800, 40),
             _op("copy", "gpu_memcpy", 600, 100, stream=22, nbytes=1 << 20),
             _op("copy", "gpu_memcpy", 1100, 400, stream=22, nbytes=1 << 20)]
    traces = [_write(tmp_path / "rank-0.json", rank0), _write(tmp_path / "rank-1.json.gz", rank1)]

    ops = [op for rank, path in enumerate(traces) for op in tool.device_ops(tool.load_trace(path), rank)]
    starts = tool.clock_starts(tool.load_trace(traces[0]), "aten::fill_", 2)
    assert starts == [0.0, 1000.0, 2000.0]
    rows = tool.summarize(ops, starts, 2)
    assert [row["wall_us"] for row in rows] == [1000.0, 1000.0]
    assert rows[0]["busy_us"] == [300.0, 100.0]
    assert rows[0]["streams"][0] == [("7", 200.0), ("9", 200.0)]
    assert rows[0]["idle_us"] == 300.0  # 700-1000, longer than 400-600
    assert rows[1]["busy_us"] == [100.0, 400.0]
    assert rows[1]["idle_us"] == 500.0  # 1500-2000
    # The compute streams: rank 0's stream 7 (300 us in all, stream 9 200),
    # rank 1's 22. Clock 0: 300-1000 and 0-600 idle; clock 1: 1300-2000 and 1500-2000.
    assert rows[0]["compute_stream"] == ["7", "22"]
    assert rows[0]["compute_idle_us"] == [700.0, 600.0]
    assert rows[1]["compute_idle_us"] == [700.0, 500.0]

    out = tmp_path / "table.md"
    assert tool.main([str(p) for p in traces] + ["--marker", "aten::fill_", "--per-clock", "2", "--clock", "0",
                                                 "--phases", "step.forward,step.update", "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert out.read_text() == printed
    assert "| rank 0 longest idle of s7 ms | rank 1 longest idle of s22 ms |" in printed
    assert "| 0 | 1.000 | 0.300 (s7 0.200, s9 0.200) | 0.100 (s22 0.100) | 0.700 | 0.600 | 0.300 |" in printed
    assert "| 1 | 600.0 | 100.0 | 22 | copy | 1048576 |" in printed  # clock 0's timeline, rank 1's copy
    assert "| 0 | 1200.0 |" not in printed  # clock 1's ops are not in clock 0's list
    assert "| clock | rank 0 step.forward | rank 0 step.update | rank 1 step.forward | rank 1 step.update |" in printed
    assert "| 0 | 0.300 | 0.150 | 0.000 | 0.000 |" in printed
    assert "| 1 | 0.200 | 0.000 | 0.000 | 0.040 |" in printed


def test_too_few_markers_is_an_error_not_an_empty_table(tool: ModuleType, tmp_path: Path) -> None:
    trace = _write(tmp_path / "rank-0.json", [_op("aten::fill_", "cpu_op", 0, 5), _op("k", "kernel", 1, 1)])
    assert tool.main([str(trace), "--marker", "aten::fill_"]) == 2
    with pytest.raises(SystemExit):
        tool.main([str(trace), "--marker", "aten::fill_", "--per-clock", "0"])
