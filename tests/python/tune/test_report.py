"""The decision-log report: a PNG of loss and accuracy over time, and its CLI."""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import matplotlib.image
import pytest

from mltuner import InvalidArgumentError
from mltuner.cli import main
from mltuner.tune import BranchKind, ClockReport, DecisionLog, Tuner, TunerConfig, default_space
from mltuner.tune.display._report import read_log, write_report

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
FIGURE_PIXELS = (7 * 110, 13 * 110)   # (height, width): figsize (13, 7) at 110 dpi


class FakeClock:
    def __init__(self) -> None:
        self.now = 1_700_000_000.0

    def __call__(self) -> float:
        return self.now


def synthetic_log(path: Path) -> None:
    """A hand-written run: an initial search, three epochs, a re-tune, two
    more epochs; the clock advances as a job's would."""
    clock = FakeClock()
    setting = {"lr": 0.01, "momentum": 0.9, "batch_size": 32, "staleness": 0}
    with DecisionLog(path, clock=clock) as log:
        def at(seconds: float, event: str, phase: str, **fields: Any) -> None:
            clock.now += seconds
            log.write(event, phase=phase, **fields)

        at(0, "start", "init", tunables=setting, sampler="tpe", retune="full")
        at(1, "init", "init", branch=0)
        at(0, "search_start", "search", search=0, branch=0, tunables=setting, marginal=False)
        at(5, "starting_progress", "search", search=0, branch=1, loss=2.3)
        for i, (lr, loss) in enumerate([(0.1, 1.9), (0.003, 2.2), (0.03, 1.7)]):
            at(0.1, "fork_trial", "search", search=0, branch=2 + i, tunables={**setting, "lr": lr})
            at(10, "summary", "search", search=0, branch=2 + i, loss=loss, state="converging",
               slope=-0.01)
        winner = {**setting, "lr": 0.03}
        at(0.1, "winner", "search", search=0, branch=4, tunables=winner, trials=3)
        for epoch, (loss, accuracy) in enumerate([(1.5, 0.4), (1.2, 0.5), (1.1, 0.52)], 1):
            at(30, "train", "train", branch=4, tunables=winner, loss=loss, epoch=epoch)
            at(2, "validate", "train", branch=4, tunables=winner, accuracy=accuracy)
        at(0, "retune", "train", branch=4, tunables=winner, epoch=3)
        at(0, "search_start", "search", search=1, branch=4, tunables=winner, marginal=True)
        at(5, "starting_progress", "search", search=1, branch=5, loss=1.1)
        at(0.1, "fork_trial", "search", search=1, branch=6, tunables={**winner, "lr": 0.01})
        at(10, "summary", "search", search=1, branch=6, loss=1.0, state="converging")
        final = {**winner, "lr": 0.01}
        at(0.1, "winner", "search", search=1, branch=6, tunables=final, trials=1)
        for epoch, (loss, accuracy) in enumerate([(0.9, 0.6), (0.85, 0.61)], 4):
            at(30, "train", "train", branch=6, tunables=final, loss=loss, epoch=epoch)
            at(2, "validate", "train", branch=6, tunables=final, accuracy=accuracy)
        at(0, "end", "end", outcome="max_epochs", branch=6, tunables=final, accuracy=0.61)


def check_png(path: Path) -> None:
    data = path.read_bytes()
    assert data[:8] == PNG_MAGIC
    image = matplotlib.image.imread(path)
    assert image.shape[:2] == FIGURE_PIXELS
    # Something was drawn: not a blank canvas.
    assert image[..., :3].std() > 0.05


def test_report_of_a_synthetic_log(tmp_path: Path) -> None:
    log = tmp_path / "decisions.jsonl"
    synthetic_log(log)
    png = write_report(log)
    assert png == tmp_path / "report.png"  # the name the job gives it
    check_png(png)


def test_training_is_drawn_only_where_it_ran(tmp_path: Path) -> None:
    from mltuner.tune.display._report import _collect, _split_runs, _title

    log = tmp_path / "decisions.jsonl"
    synthetic_log(log)
    with log.open("a") as file:  # a rollback after the last epoch
        file.write(json.dumps({"time": 1_700_000_400.0, "event": "rollback", "phase": "train",
                               "reason": "accuracy"}) + "\n")
    run = _collect(_split_runs(read_log(log))[-1], 1, 1)
    # Epochs 1-3, then the re-tune, then epochs 4-5: two segments, no line
    # across the search.
    assert [len(segment) for segment in run.train if segment] == [3, 2]
    assert [len(segment) for segment in run.accuracy_runs if segment] == [3, 2]
    assert [reason for _, reason in run.rollbacks] == ["accuracy"]
    (tmp_path / "result.json").write_text(json.dumps(
        {"model": "cnn", "workers": 2, "test_accuracy": 0.953}))
    title = _title(run, log)
    assert title.startswith("MLtuner: cnn on 2 workers\n")
    assert "outcome: max_epochs" in title and "test accuracy 95.3%" in title
    assert "1 rollback" in title
    check_png(write_report(log))


def test_dashboard_command(tmp_path: Path) -> None:
    from mltuner.tune import dashboard_command

    log = tmp_path / "decisions.jsonl"
    synthetic_log(log)
    assert dashboard_command(log) is None  # no journal
    (tmp_path / "optuna.journal").write_text("")
    assert dashboard_command(log) == f"optuna-dashboard {tmp_path / 'optuna.journal'}"


def test_report_to_a_chosen_path(tmp_path: Path) -> None:
    log = tmp_path / "decisions.jsonl"
    synthetic_log(log)
    png = write_report(log, tmp_path / "out" / "run.png")
    assert png == tmp_path / "out" / "run.png"
    check_png(png)


def test_report_draws_the_last_of_appended_runs(tmp_path: Path) -> None:
    log = tmp_path / "decisions.jsonl"
    synthetic_log(log)
    synthetic_log(log)
    assert sum(r["event"] == "start" for r in read_log(log)) == 2
    check_png(write_report(log))


def test_report_of_an_unfinished_run(tmp_path: Path) -> None:
    # A crashed job leaves a log that stops in the middle of a search.
    log = tmp_path / "decisions.jsonl"
    synthetic_log(log)
    lines = log.read_text().splitlines()
    cut = next(i for i, line in enumerate(lines) if '"search": 1' in line) + 2
    log.write_text("\n".join(lines[:cut]) + "\n")
    check_png(write_report(log))


class TimedSystem:
    """Wraps a simulated system so that the log's clock follows the
    simulated seconds, as it would follow a real job's."""

    def __init__(self, system: Any, clock: FakeClock) -> None:
        self.system = system
        self.clock = clock

    def fork(self, parent: int | None, tunables: Mapping[str, Any], kind: BranchKind) -> int:
        return int(self.system.fork(parent, tunables, kind))

    def free(self, branch: int) -> None:
        self.system.free(branch)

    def run(self, branch: int, clocks: int) -> Sequence[ClockReport]:
        reports: Sequence[ClockReport] = self.system.run(branch, clocks)
        self.clock.now += sum(r.seconds for r in reports)
        return reports

    def clocks_per_epoch(self, tunables: Mapping[str, Any]) -> int:
        return int(self.system.clocks_per_epoch(tunables))


def test_report_of_a_real_tuning_run(quadratic_system: Any, tmp_path: Path) -> None:
    clock = FakeClock()
    path = tmp_path / "decisions.jsonl"
    config = TunerConfig(seed=0, initial_trial_time_s=0.2, num_clocks_to_test=10,
                         max_trials_per_search=40, study_name_prefix="job")
    with DecisionLog(path, clock=clock) as log:
        Tuner(TimedSystem(quadratic_system(seed=0), clock), default_space([8, 32, 128]),
              config, log=log).run()
    assert any(r["event"] == "retune" for r in read_log(path))
    check_png(write_report(path))


def test_report_of_a_log_with_nothing_to_plot(tmp_path: Path) -> None:
    log = tmp_path / "decisions.jsonl"
    with DecisionLog(log) as writer:
        writer.write("start", phase="init")
    check_png(write_report(log))


def test_odd_field_values_are_skipped(tmp_path: Path) -> None:
    # Valid lines whose optional fields have unexpected types draw what they can.
    log = tmp_path / "decisions.jsonl"
    synthetic_log(log)
    with log.open("a") as file:
        for record in ({"event": "search_start", "search": "two", "marginal": "yes"},
                       {"event": "winner", "search": [1], "tunables": "lr=1", "trials": 2.5},
                       {"event": "train", "loss": "low"}, {"event": "validate", "accuracy": True},
                       {"event": "end", "outcome": {"a": 1}}):
            file.write(json.dumps({"time": 1_700_000_300.0, "phase": "train", **record}) + "\n")
    check_png(write_report(log))


# -- errors --------------------------------------------------------------------------


def test_missing_log(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="no decision log at .*nothing.jsonl"):
        write_report(tmp_path / "nothing.jsonl")


@pytest.mark.parametrize("text", ["", "\n\n  \n"])
def test_empty_log(tmp_path: Path, text: str) -> None:
    log = tmp_path / "decisions.jsonl"
    log.write_text(text)
    with pytest.raises(InvalidArgumentError, match="is empty"):
        write_report(log)
    assert not (tmp_path / "report.png").exists()


@pytest.mark.parametrize(("line", "message"), [
    ('{"time": 1.0, "event": "start"', r":2: not JSON"),
    ("[1, 2]", r":2: a list, not a JSON object"),
    ('{"event": "train"}', r":2: no numeric 'time' field"),
    ('{"time": "noon", "event": "train"}', r":2: no numeric 'time' field"),
    ('{"time": 2.0}', r":2: no 'event' field"),
])
def test_malformed_log(tmp_path: Path, line: str, message: str) -> None:
    log = tmp_path / "decisions.jsonl"
    log.write_text(json.dumps({"time": 1.0, "event": "start", "phase": "init"}) + "\n"
                   + line + "\n")
    with pytest.raises(InvalidArgumentError, match=message):
        write_report(log)


def test_a_last_line_cut_off_by_a_dying_job_is_left_out(tmp_path: Path) -> None:
    from mltuner.tune.display._report import read_log

    log = tmp_path / "decisions.jsonl"
    log.write_text(json.dumps({"time": 1.0, "event": "start", "phase": "init"}) + "\n"
                   + '{"time": 2.0, "event": "summ')  # no newline: the job died in this write
    with pytest.warns(UserWarning, match=r":2: the last line is cut off"):
        assert [r["event"] for r in read_log(log)] == ["start"]


# -- command line ----------------------------------------------------------------------


def test_cli_report(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    log = tmp_path / "decisions.jsonl"
    synthetic_log(log)
    assert main(["report", str(log)]) == 0  # the name the job gives it, beside the log
    assert capsys.readouterr().out.strip() == f"wrote {tmp_path / 'report.png'}"
    check_png(tmp_path / "report.png")

    assert main(["report", str(log), "-o", str(tmp_path / "other.png")]) == 0
    assert capsys.readouterr().out.strip() == f"wrote {tmp_path / 'other.png'}"
    check_png(tmp_path / "other.png")


def test_cli_report_errors(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["report", str(tmp_path / "nothing.jsonl")]) == 1
    assert "mltuner report: error: no decision log at" in capsys.readouterr().err
    (tmp_path / "bad.jsonl").write_text("not json\n")
    assert main(["report", str(tmp_path / "bad.jsonl")]) == 1
    assert "bad.jsonl:1: not JSON" in capsys.readouterr().err
