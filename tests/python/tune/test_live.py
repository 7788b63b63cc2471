"""The live display and the decision log's listeners."""

from __future__ import annotations

import io
import json
import logging
from pathlib import Path
from typing import Any

import pytest
from rich.console import Console

from mltuner.tune import DecisionLog, SearchSpace, Tuner, TunerConfig, Uniform
from mltuner.tune.display._live import LiveDisplay

SETTING = {"lr": 0.01, "momentum": 0.9, "batch_size": 32}


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        self.now += 1.5
        return self.now


def write_events(log: DecisionLog) -> None:
    log.write("start", phase="init", tunables=SETTING, sampler="tpe", max_epochs=10,
              searched=["lr", "momentum"])
    log.write("search_start", phase="search", search=0, branch=0, tunables=SETTING,
              searched=["lr", "momentum"], budget_s=12.0)
    log.write("fork_trial", phase="search", search=0, branch=2, tunables={**SETTING, "lr": 0.1},
              trial=0)
    log.write("summary", phase="search", search=0, branch=2, loss=1.25, state="converging",
              slope=-0.0123456, noise=0.01, spent_s=3.0)
    log.write("budget_floor", phase="search", search=0, reason="trial_time", share_s=12.0,
              budget_s=18.0, ceiling_s=24.0, needed_s=18.0, spent_s=3.0)
    log.write("free_trial", phase="search", search=0, branch=2, reason="diverged",
              slope=float("nan"))
    log.write("winner", phase="search", search=0, branch=3, tunables=SETTING, trials=1,
              seconds=3.5)
    log.write("validate", phase="train", branch=3, tunables=SETTING, accuracy=0.5, epoch=1,
              best_accuracy=0.5)
    log.write("retune_skipped", phase="train", branch=3, tunables=SETTING, epoch=1,
              reason="search_budget", search_seconds=24.5)
    log.write("rollback", phase="train", branch=3, tunables=SETTING, reason="accuracy",
              accuracy=0.1, best_accuracy=0.5)
    log.write("end", phase="end", outcome="converged", branch=3, accuracy=0.5, trials=1,
              epochs=1, tunables=SETTING)


# One line per decision, in words; trials forked, summarised or freed have none.
EXPECTED_LINES = [
    "[     0.0s] start: searching lr, momentum with tpe",
    "[     1.5s] initial search: searching lr, momentum within 12.0 s",
    "[     6.0s] initial search: budget raised from 12.0 s to 18.0 s to find its trial time",
    "[     9.0s] initial search: 1 trials in 3.5 s, chose lr=0.01 momentum=0.9 batch_size=32",
    "[    10.5s] epoch 1: val 50.0% (best 50.0%)",
    "[    12.0s] epoch 1: no re-tune, the searches have spent their share of the job (24.5 s)",
    "[    13.5s] rolled back to the best model (val 50.0%): validation fell to 10.0% with "
    "lr=0.01 momentum=0.9 batch_size=32",
    "[    15.0s] done: converged after 1 epochs, best val 50.0% with lr=0.01 momentum=0.9 "
    "batch_size=32",
]


def test_plain_lines_when_not_a_terminal(capsys: pytest.CaptureFixture[str]) -> None:
    # pytest captures stdout into a file that is not a terminal, as in CI.
    display = LiveDisplay()
    with DecisionLog(clock=FakeClock(), listeners=[display]) as log:
        write_events(log)
    assert capsys.readouterr().out.splitlines() == EXPECTED_LINES


def test_plain_lines_to_a_given_file() -> None:
    out = io.StringIO()
    with DecisionLog(clock=FakeClock(), listeners=[LiveDisplay(file=out)]) as log:
        write_events(log)
    assert out.getvalue().splitlines() == EXPECTED_LINES


def test_the_display_stops_at_the_end_record() -> None:
    out = io.StringIO()
    with DecisionLog(clock=FakeClock(), listeners=[LiveDisplay(file=out)]) as log:
        write_events(log)
        log.write("train", phase="train", loss=1.0)
    assert len(out.getvalue().splitlines()) == len(EXPECTED_LINES)


def test_live_table_in_a_terminal() -> None:
    out = io.StringIO()
    display = LiveDisplay(file=out, terminal=True)
    with DecisionLog(clock=FakeClock(), listeners=[display]) as log:
        write_events(log)
    text = out.getvalue()
    assert "\x1b[" in text  # a terminal rendering, not plain lines
    for expected in ("trials so far", "lr=0.01 momentum=0.9 batch_size=32", "converged",
                     "best val accuracy", "12.0 s", "epochs", "initial search (s)", "decisions",
                     "rolled back to the best model"):
        assert expected in text, expected
    assert "fork_trial" not in text


def test_table_shows_the_current_state() -> None:
    display = LiveDisplay(file=io.StringIO())
    with DecisionLog(clock=FakeClock(), listeners=[display]) as log:
        write_events(log)
    out = io.StringIO()
    Console(file=out, width=100, color_system=None).print(display.table())
    rows = dict(line.strip().split("  ", 1) for line in out.getvalue().splitlines()
                if line.strip())
    assert {k.strip(): v.strip() for k, v in rows.items()} == {
        "now": "end",
        "setting": "lr=0.01 momentum=0.9 batch_size=32",
        "best val accuracy": "50.0%",
        "last loss": "1.25",
        "trials so far": "1",
        "elapsed": "15.0 s",
        "outcome": "converged",
    }
    assert list(display.history)[-1].startswith("done: converged")


def test_a_rendering_failure_falls_back_to_plain_lines(
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    out = io.StringIO()
    display = LiveDisplay(file=out, terminal=True)
    calls = {"n": 0}
    real_table = LiveDisplay.table

    def flaky_table(self: LiveDisplay) -> Any:
        calls["n"] += 1
        if calls["n"] > 3:
            raise RuntimeError("the terminal went away")
        return real_table(self)

    monkeypatch.setattr(LiveDisplay, "table", flaky_table)
    with caplog.at_level(logging.WARNING), DecisionLog(clock=FakeClock(),
                                                       listeners=[display]) as log:
        write_events(log)
        assert log.listeners == [display]   # it coped by itself
    assert "live display failed; printing plain lines" in caplog.text
    # The table drew the first records; plain lines carry on from the failure.
    assert out.getvalue().splitlines()[-3:] == EXPECTED_LINES[-3:]


def test_a_listener_that_raises_does_not_break_the_log(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    seen: list[str] = []

    def broken(record: dict[str, Any]) -> None:
        raise ValueError("cannot draw")

    path = tmp_path / "decisions.jsonl"
    with caplog.at_level(logging.WARNING), DecisionLog(
            path, clock=FakeClock(), listeners=[broken, lambda r: seen.append(r["event"])]) as log:
        write_events(log)
        assert len(log.listeners) == 1   # the broken one was removed
    events = [json.loads(line)["event"] for line in path.read_text().splitlines()]
    assert events == seen == [r["event"] for r in log.records]
    assert len(events) == 11
    # Reported once, with its traceback, not once per event.
    failures = [r for r in caplog.records if "listener" in r.getMessage()]
    assert len(failures) == 1 and failures[0].exc_info is not None
    assert "'start' record" in failures[0].getMessage()


def test_listeners_see_records_after_they_are_written(tmp_path: Path) -> None:
    path = tmp_path / "decisions.jsonl"
    lines_when_called: list[int] = []
    log = DecisionLog(path)
    log.listeners.append(lambda r: lines_when_called.append(len(path.read_text().splitlines())))
    log.write("start", phase="init")
    log.write("init", phase="init", branch=0)
    log.close()
    assert lines_when_called == [1, 2]


def test_live_display_follows_a_tuning_run(scripted_system: Any) -> None:
    system = scripted_system(lambda t, c: 10.0 / (1 + t["lr"] * c), accuracies=[0.5, 0.6, 0.7])
    out = io.StringIO()
    space = SearchSpace([Uniform("lr", 0.01, 1.0, default=0.1)])
    config = TunerConfig(sampler="grid", seed=0, max_epochs=2, initial_trial_time_s=0.1,
                         num_clocks_to_test=2)
    with LiveDisplay(file=out) as display:
        log = DecisionLog(listeners=[display])
        Tuner(system, space, config, log=log).run()
    lines = out.getvalue().splitlines()
    # One line per decision: never one per trial.
    assert len(lines) < len(log.records) and not any("fork_trial" in line for line in lines)
    assert lines[0] == "[     0.0s] start: searching lr with grid"
    assert lines[-1].startswith("[") and "done: max_epochs after 2 epochs" in lines[-1]
    assert sum("epoch " in line and ": val " in line for line in lines) == 2
