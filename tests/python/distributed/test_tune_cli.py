"""`mltuner tune` and `mltuner run`: real 2-process jobs, progress followed
from rank 0's decision log, the report drawn at the end."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from mltuner.cli import main

QUICK = ["--max-epochs", "2", "--trials", "4", "--eval-clocks", "5", "--trial-time", "0.05"]
# A 2-epoch job's search budget share pays for almost no trials: tests that
# need the search to run its trials bound it by --trials alone.
FULL_SEARCH = ["--search-share", "0"]


def test_tune_writes_the_log_report_and_result(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "tune"
    assert main(["tune", "--out", str(out), "--plain", *QUICK, *FULL_SEARCH]) == 0
    text = capsys.readouterr().out
    # The live lines, plain: the search's end, and a validation after each epoch.
    assert "initial search: " in text and " trials in " in text, text[-3000:]
    assert "epoch 1: val " in text and "epoch 2: val " in text, text[-3000:]
    assert "test accuracy" in text and f"report: {out / 'report.png'}" in text
    result = json.loads((out / "result.json").read_text())
    assert result["workers"] == 2 and len(result["validation_accuracies"]) == 2
    assert (out / "report.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    events = [json.loads(line)["event"] for line in (out / "decisions.jsonl").read_text().splitlines()]
    assert events[0] == "start" and events[-1] == "end"


def test_run_gives_the_script_its_log(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "run"
    # The program logs to $MLTUNER_TUNING_LOG when given no --log.
    code = main(["run", "--out", str(out), "--plain", "--", sys.executable, "-m", "mltuner.apps.mnist1d",
                 "--mode", "fixed", "--search", "", *QUICK])
    assert code == 0, capsys.readouterr().out
    assert (out / "decisions.jsonl").exists() and (out / "report.png").exists()
    assert "fixed: best validation accuracy" in capsys.readouterr().out


def test_a_failing_script_shows_its_output(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    script = tmp_path / "broken.py"
    script.write_text("import sys\nprint('about to fail')\nsys.exit(3)\n")
    assert main(["run", "--out", str(tmp_path / "out"), "--plain", "--", sys.executable, str(script)]) == 3
    text = capsys.readouterr().out
    assert "the job failed (exit code 3)" in text and "about to fail" in text


def test_run_needs_a_command(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    assert main(["run", "--out", str(tmp_path)]) == 2
    assert "give the training command" in capsys.readouterr().err


def test_tune_and_train_the_torch_cnn(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    pytest.importorskip("torch")
    out = tmp_path / "cnn"
    assert main(["tune", "--out", str(out), "--plain", "--model", "cnn", "--search", "lr,staleness",
                 "--lr-max", "1", *QUICK]) == 0, capsys.readouterr().out
    result = json.loads((out / "result.json").read_text())
    assert result["model"] == "cnn" and result["tunables"]["staleness"] in (0, 1, 3)
    assert 0.0 <= result["test_accuracy"] <= 1.0
    # A fixed setting known to train: well above chance (0.10) in 5 epochs.
    assert main(["tune", "--out", str(tmp_path / "fixed"), "--plain", "--model", "cnn", "--mode", "fixed",
                 "--search", "", "--lr", "0.3", "--max-epochs", "5"]) == 0
    fixed = json.loads((tmp_path / "fixed" / "result.json").read_text())
    assert fixed["summary"]["best_accuracy"] > 0.3, fixed["summary"]


def _first_trials(log: Path) -> list[dict[str, object]]:
    records = [json.loads(line) for line in log.read_text().splitlines()]
    return [record["tunables"] for record in records if record["event"] == "fork_trial"]


def test_one_seed_proposes_the_same_first_trials(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # Scores depend on measured times, so only the proposals before the
    # first result can be compared; the trial cap keeps them all such.
    for run in ("a", "b"):
        assert main(["tune", "--out", str(tmp_path / run), "--plain", "--seed", "3", *QUICK,
                     *FULL_SEARCH]) == 0
    capsys.readouterr()
    first, second = _first_trials(tmp_path / "a" / "decisions.jsonl"), _first_trials(tmp_path / "b" / "decisions.jsonl")
    assert len(first) == 4 and first == second


def test_ctrl_c_stops_the_job_and_draws_the_report_of_what_ran(tmp_path: Path) -> None:
    out = tmp_path / "interrupted"
    log = out / "decisions.jsonl"
    # A slowed rank keeps the job running long after its first validation.
    command = [sys.executable, "-m", "mltuner.cli", "tune", "--out", str(out), "--plain", "--max-epochs", "500",
               "--trials", "4", "--eval-clocks", "5", "--trial-time", "0.05", "--slow-rank", "1", "--slow-ms", "40"]
    cli = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                           start_new_session=True)
    try:
        deadline = time.monotonic() + 120
        while not (log.exists() and '"event": "validate"' in log.read_text()):
            assert cli.poll() is None, "the job ended before it was interrupted"
            assert time.monotonic() < deadline, "no validation within 120 s"
            time.sleep(0.2)
        cli.send_signal(signal.SIGINT)  # what Ctrl-C sends to the launcher
        output, _ = cli.communicate(timeout=60)
    finally:
        if cli.poll() is None:  # SIGTERM first: the launcher then stops its workers
            cli.terminate()
            try:
                cli.wait(timeout=20)
            except subprocess.TimeoutExpired:
                cli.kill()
                cli.wait(timeout=10)
    assert cli.returncode == 130, output
    assert "the job was stopped (exit code 130); the report shows what ran" in output
    assert f"report: {out / 'report.png'}" in output and output.count("report:") == 1, output
    assert (out / "report.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert not (out / "result.json").exists()  # the job did not finish
