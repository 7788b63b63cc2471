"""The JSON-lines decision log."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest

from mltuner.tune import DecisionLog, ProgressState
from mltuner.tune._log import run_log_copy


def test_one_json_object_per_line(tmp_path: Path) -> None:
    path = tmp_path / "log.jsonl"
    with DecisionLog(path, clock=lambda: 123.0) as log:
        log.write("fork_trial", phase="search", search=0, branch=4, tunables={"lr": 0.1})
        log.write("summary", phase="search", loss=math.nan, slope=math.inf,
                  state=ProgressState.DIVERGED, clocks=np.int64(10), accuracy=None)
    records = [json.loads(line) for line in path.read_text().splitlines()]
    assert records[0] == {"time": 123.0, "event": "fork_trial", "phase": "search", "search": 0,
                          "branch": 4, "tunables": {"lr": 0.1}}
    # No NaN in JSON: non-finite numbers are null; enums and numpy scalars are plain.
    assert records[1]["slope"] is None and records[1]["loss"] is None
    assert records[1]["state"] == "diverged" and records[1]["clocks"] == 10
    assert log.records == records


def test_lines_are_flushed_as_written(tmp_path: Path) -> None:
    path = tmp_path / "log.jsonl"
    log = DecisionLog(path)
    log.write("start", phase="init")
    assert json.loads(path.read_text())["event"] == "start"
    log.close()


def test_appends_to_an_existing_log(tmp_path: Path) -> None:
    path = tmp_path / "log.jsonl"
    for _ in range(2):
        with DecisionLog(path) as log:
            log.write("start", phase="init")
    assert len(path.read_text().splitlines()) == 2


def test_in_memory_log_and_event_filter() -> None:
    log = DecisionLog()
    log.write("validate", phase="train", accuracy=0.5)
    log.write("train", phase="train", loss=1.0)
    log.write("validate", phase="train", accuracy=0.6)
    assert [r["accuracy"] for r in log.events("validate")] == [0.5, 0.6]


def test_a_copy_for_mltuner_run_only_where_the_script_logs_elsewhere(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    followed = tmp_path / "run.jsonl"
    monkeypatch.delenv("MLTUNER_TUNING_LOG", raising=False)
    assert run_log_copy(tmp_path / "mine.jsonl") is None  # not under `mltuner run`
    monkeypatch.setenv("MLTUNER_TUNING_LOG", str(followed))
    assert run_log_copy(None) is None  # the session's default is the followed file
    assert run_log_copy(tmp_path / "." / "run.jsonl") is None  # the same file
    copy = run_log_copy(tmp_path / "mine.jsonl")
    assert copy is not None
    with DecisionLog(tmp_path / "mine.jsonl", clock=lambda: 1.0, listeners=[copy]) as log:
        log.write("start", phase="initial", loss=2.5)
        log.write("winner", phase="initial", tunables={"lr": 0.1})
    assert followed.read_text() == (tmp_path / "mine.jsonl").read_text()
    assert len(followed.read_text().splitlines()) == 2
