"""The `mltuner` command line."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

import mltuner
from mltuner.cli import main


def test_info_reports_version_and_backends(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["info"]) == 0
    out = capsys.readouterr().out
    assert f"mltuner {mltuner.__version__}" in out
    assert f"visible GPUs: {mltuner.cuda_device_count()}" in out


def test_a_command_is_required() -> None:
    with pytest.raises(SystemExit) as exit_info:
        main([])
    assert exit_info.value.code == 2


def test_the_module_runs_as_a_program() -> None:
    done = subprocess.run([sys.executable, "-m", "mltuner.cli", "info"], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert "CUDA backend" in done.stdout


def test_version(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["--version"])
    assert exit_info.value.code == 0
    assert capsys.readouterr().out.strip() == f"mltuner {mltuner.__version__}"


# Each bad call: its arguments and a piece of its one-line message. None of
# them may start a worker or leave an output folder.
BAD_CALLS = [
    (["tune", "-n", "0"], "argument -n/--nproc: expected a number of workers (an integer >= 1), got '0'"),
    (["tune", "--nproc", "two"], "argument -n/--nproc: expected a number of workers"),
    (["launch", "-n", "0", "--", "true"], "argument -n/--nproc: expected a number of workers (an integer >= 1)"),
    (["launch", "-n", "100000", "--", "true"], "argument -n/--nproc: at most 1024 workers run on one machine, got 100000"),
    (["tune", "--workers", "0"], "unrecognized arguments: --workers 0"),
    (["tune", "--max-e", "3"], "unrecognized arguments: --max-e 3"),  # no abbreviations: workers see the same
    (["tune", "--log", "x.jsonl"], "unrecognized arguments: --log"),  # tune writes DIR/decisions.jsonl itself
    (["tune", "--trials", "0"], "argument --trials: expected an integer >= 1, got '0'"),
    (["tune", "--max-epochs", "-2"], "argument --max-epochs: expected an integer >= 1"),
    (["tune", "--lr", "nan"], "argument --lr: expected a number > 0, got 'nan'"),
    (["tune", "--momentum", "1"], "argument --momentum: expected a number in [0, 1), got '1'"),
    (["tune", "--samples", "55"], "argument --samples: expected a multiple of 10 >= 100, got '55'"),
    (["tune", "--batch-sizes", "8,0"], "argument --batch-sizes: expected comma-separated integers >= 1"),
    (["tune", "--staleness", "0,x"], "argument --staleness: expected comma-separated integers >= 0"),
    (["tune", "--model", "resnet"], "argument --model: invalid choice: 'resnet'"),
    (["tune", "--seed", "-1"], "argument --seed: expected an integer in [0, 2**32), got '-1'"),
    (["tune", "--target-accuracy", "1.5"], "argument --target-accuracy: expected a number in (0, 1]"),
    (["tune", "--search", "lr,wd"], "--search: unknown tunables ['wd']"),
    (["tune", "--lr-min", "0.5", "--lr-max", "0.1"], "--lr-min (0.5) must be smaller than --lr-max (0.1)"),
    (["tune", "--lr-min", "0.1", "--lr-max", "1"],  # trials ran at lr 0.0488, below --lr-min
     "--lr 0.01 (the starting learning rate, default 0.01) lies outside the searched range [--lr-min 0.1, "),
    (["tune", "--lr-max", "1e7", "--lr", "2"], r"learning rates must be numbers in (0, 1e+06] (the servers' limit)"),
    (["tune", "--sampler", "bogus"], "unknown sampler 'bogus'"),
    (["tune", "-n", "2", "--slow-rank", "2"], "--slow-rank 2: there are only 2 workers"),
    (["tune", "--slow-factor", "0.5"], "argument --slow-factor: expected a number >= 1, got '0.5'"),
    (["tune", "--storage", "foo://x"], "--storage 'foo://x' is not a database URL Optuna can use"),
    (["demo", "--samples", "100", "--max-epochs", "1"],
     "--samples 100 leaves 72 training samples, fewer than one clock's batch of 128 per worker x 2 workers"),
    (["demo", "--lr-max", "0"], "argument --lr-max: expected a number > 0, got '0'"),
    (["demo", "--trial-time", "0"], "argument --trial-time: expected a number > 0"),
    (["run"], "give the training command after --"),
    (["run", "--", "no-such-program-mltuner"], "no-such-program-mltuner: command not found"),
    (["frobnicate"], "invalid choice: 'frobnicate'"),
]


@pytest.mark.parametrize("argv, message", BAD_CALLS, ids=[" ".join(argv) for argv, _ in BAD_CALLS])
def test_a_bad_call_is_one_line_and_exit_code_2(argv: list[str], message: str, tmp_path: Path,
                                                monkeypatch: pytest.MonkeyPatch,
                                                capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.chdir(tmp_path)  # where the default output folder would appear
    watched = argv[0] in ("tune", "demo", "run")
    out = tmp_path / "out"
    call = [argv[0], "--out", str(out), *argv[1:]] if watched else argv
    try:
        code = main(call)
    except SystemExit as exit_info:  # argparse's own errors exit from the parser
        code = exit_info.code
    captured = capsys.readouterr()
    assert code == 2
    assert captured.out == ""
    lines = captured.err.splitlines()
    assert len(lines) == 1, captured.err
    assert lines[0].startswith(f"mltuner {argv[0]}: error: " if argv[0] != "frobnicate" else "mltuner: error: ")
    assert message in lines[0]
    assert not out.exists() and list(tmp_path.iterdir()) == []  # no output folder, not even the default one


def test_the_default_output_folder_is_not_made_by_a_bad_call(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                             capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.chdir(tmp_path)
    assert main(["tune", "--search", "nothing"]) == 2
    assert "unknown tunables" in capsys.readouterr().err
    assert not (tmp_path / "mltuner-out").exists()


def test_an_output_path_that_is_a_file_is_refused(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    taken = tmp_path / "taken"
    taken.write_text("")
    assert main(["tune", "--out", str(taken)]) == 2
    assert "exists and is not a directory" in capsys.readouterr().err


def test_tune_help_lists_the_program_options_with_defaults(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["tune", "--help"])
    assert exit_info.value.code == 0
    text = " ".join(capsys.readouterr().out.split())  # argparse wraps lines
    for option, default in [("--nproc", "2"), ("--lr", "0.01"), ("--trials", "30"), ("--max-epochs", "30"),
                            ("--batch-sizes", "8,16,32,64"), ("--seed", "0"), ("--model", "mlp")]:
        assert option in text
        assert f"(default: {default})" in text, option


def test_demo_help_shows_the_demo_defaults(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["demo", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "(default: cnn)" in text and "(default: 20000)" in text and "(default: 1.0)" in text  # full lr range


def test_the_program_refuses_the_same_values(capsys: pytest.CaptureFixture[str]) -> None:
    # The workers parse with the same definition, so a direct run refuses too.
    from mltuner.apps.mnist1d import main as program

    with pytest.raises(SystemExit) as exit_info:
        program(["--trials", "0"])
    assert exit_info.value.code == 2
    assert program(["--search", "lr,wd"]) == 2
    assert "unknown tunables ['wd']" in capsys.readouterr().err


def test_report_writes_the_name_the_job_writes(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    log = tmp_path / "decisions.jsonl"
    records = [{"time": 0.0, "event": "start", "phase": "init", "tunables": {"lr": 0.1}, "searched": ["lr"]},
               {"time": 1.0, "event": "train", "phase": "train", "branch": 1, "tunables": {"lr": 0.1},
                "loss": 1.0, "epoch": 1},
               {"time": 1.5, "event": "validate", "phase": "train", "branch": 1, "tunables": {"lr": 0.1},
                "accuracy": 0.5}]
    log.write_text("".join(json.dumps(record) + "\n" for record in records))
    assert main(["report", str(log)]) == 0
    assert (tmp_path / "report.png").read_bytes()[:4] == b"\x89PNG"
    assert f"wrote {tmp_path / 'report.png'}" in capsys.readouterr().out
