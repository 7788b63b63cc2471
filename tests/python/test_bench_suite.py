"""The benchmark suite (benchmarks/run.py, `mltuner bench`): it runs each
benchmark in its own bounded process, collects the figures each one writes,
and reports failures and timeouts without stopping the others."""

from __future__ import annotations

import csv
import json
import os
import subprocess
import sys
import textwrap
import time
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from pathlib import Path
from types import ModuleType

import pytest

from mltuner.cli import main

REPO = Path(__file__).resolve().parents[2]
BENCH = REPO / "benchmarks"


@pytest.fixture(scope="module")
def suite(benchmark_module: Callable[[str, str], AbstractContextManager[ModuleType]]) -> Iterator[ModuleType]:
    with benchmark_module("run.py", "bench_suite") as module:  # the suite imports figures.py beside it
        yield module


def fake_benchmark(tmp_path: Path, body: str) -> str:
    """A benchmark script taking --figures PATH, with ``body`` as its work."""
    script = tmp_path / "fake_bench.py"
    script.write_text(textwrap.dedent("""\
        import json, subprocess, sys, time
        path = sys.argv[sys.argv.index("--figures") + 1]
        def figure(name, ratio, goal=None, better="higher"):
            return {"benchmark": "fake", "name": name, "value": 2.0, "unit": "x/s", "baseline": "base",
                    "baseline_value": 2.0 / ratio, "ratio": ratio, "ratio_means": "mltuner / base",
                    "better": better, "goal": goal, "note": ""}
        """) + textwrap.dedent(body))
    return str(script)


def test_a_benchmark_s_figures_reach_the_summary(suite: ModuleType, tmp_path: Path) -> None:
    script = fake_benchmark(tmp_path, """\
        print("measuring")
        json.dump([figure("fast", 1.2, goal=1.0), figure("slow", 3.0, goal=1.5, better="lower")], open(path, "w"))
        """)
    outcome = suite.run_step(suite.Step("fake", script, [], timeout_s=60), tmp_path)
    assert outcome.status == "ok"
    assert [(f.name, f.met) for f in outcome.figures] == [("fast", True), ("slow", False)]
    assert "measuring" in (tmp_path / "fake.log").read_text()

    suite.write_csv(tmp_path / "summary.csv", [outcome])
    with open(tmp_path / "summary.csv") as f:
        rows = list(csv.DictReader(f))
    assert [(r["figure"], float(r["ratio"]), r["met"]) for r in rows] == [("fast", 1.2, "yes"), ("slow", 3.0, "NO")]
    suite.plot(tmp_path / "fake.png", "fake", outcome.figures)
    assert (tmp_path / "fake.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_a_failing_benchmark_is_reported_and_the_log_kept(suite: ModuleType, tmp_path: Path) -> None:
    script = fake_benchmark(tmp_path, 'print("broken input"); sys.exit(3)\n')
    outcome = suite.run_step(suite.Step("fake", script, [], timeout_s=60), tmp_path)
    assert outcome.status.startswith("failed (exit 3")
    assert outcome.figures == []
    assert "broken input" in (tmp_path / "fake.log").read_text()


def test_a_benchmark_over_its_limit_is_stopped_with_its_children(suite: ModuleType, tmp_path: Path) -> None:
    pid_file = tmp_path / "child.pid"
    script = fake_benchmark(tmp_path, f"""\
        child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
        open({str(pid_file)!r}, "w").write(str(child.pid))
        time.sleep(600)
        """)
    start = time.monotonic()
    outcome = suite.run_step(suite.Step("fake", script, [], timeout_s=3), tmp_path)
    assert outcome.status == "timed out after 3 s"
    assert time.monotonic() - start < 30
    child = int(pid_file.read_text())
    for _ in range(50):  # the child is killed with its group; give the kernel a moment to reap it
        if not Path(f"/proc/{child}").exists() or "Z" in Path(f"/proc/{child}/stat").read_text().split()[2]:
            break
        time.sleep(0.1)
    else:
        os.kill(child, 9)
        pytest.fail("the benchmark's child process outlived the timeout")


def test_a_real_benchmark_runs_through_the_cli(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The engine benchmark, as small as it goes, end to end: every figure
    it reports has a baseline measured in the same run."""
    monkeypatch.chdir(REPO)
    out = tmp_path / "results"
    # The suite's engine step is the smallest real benchmark (a few seconds).
    assert main(["bench", "--quick", "--only", "engine", "--out", str(out)]) == 0
    figures = json.loads((out / "figures.json").read_text())
    assert figures and all(f["benchmark"] == "engine" for f in figures)
    assert all(f["baseline_value"] > 0 and f["ratio"] > 0 for f in figures)
    machine = json.loads((out / "machine.json").read_text())
    assert machine["cores"] == os.cpu_count() and machine["numpy"]
    assert {"summary.md", "summary.csv", "engine.png", "engine.log", "engine.csv"} <= {p.name for p in out.iterdir()}


def test_unknown_names_and_a_missing_checkout_are_clear_errors(tmp_path: Path,
                                                               capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", "--source", str(tmp_path), "--list"]) == 2
    assert "no benchmarks/run.py" in capsys.readouterr().err
    done = subprocess.run([sys.executable, str(BENCH / "run.py"), "--only", "engine,warp-drive", "--list"],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode != 0
    assert "unknown benchmark(s) warp-drive" in done.stderr


def test_quick_lists_every_cpu_benchmark() -> None:
    done = subprocess.run([sys.executable, str(BENCH / "run.py"), "--quick", "--list"], capture_output=True,
                          text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    names = [line.split()[0] for line in done.stdout.splitlines()]
    assert names == ["engine", "transport", "torch", "throughput", "stragglers", "claims", "tuning"]
