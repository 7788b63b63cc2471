"""Where a job's secret comes from: MLTUNER_SECRET, a private key file, or
this user's own loopback key; files others may read are refused."""

from __future__ import annotations

import os
import threading
from pathlib import Path

import pytest

import mltuner
from mltuner.launch import detect_environment
from mltuner.transport._security import read_secret_file, user_loopback_secret

VARS = {"MLTUNER_RANK": "0", "MLTUNER_WORLD_SIZE": "2", "MLTUNER_LOCAL_RANK": "0",
        "MLTUNER_MASTER_ADDR": "10.0.0.1", "MLTUNER_MASTER_PORT": "29400"}


def key_file(tmp_path: Path, text: str, mode: int = 0o600) -> Path:
    path = tmp_path / "job.key"
    path.write_text(text)
    path.chmod(mode)
    return path


def test_secret_file_is_read(tmp_path: Path) -> None:
    path = key_file(tmp_path, "0123456789abcdef0123\n")
    found = detect_environment({**VARS, "MLTUNER_SECRET_FILE": str(path)})
    assert found.secret == "0123456789abcdef0123"


def test_secret_variable_wins_over_the_file(tmp_path: Path) -> None:
    path = key_file(tmp_path, "0123456789abcdef0123")
    found = detect_environment({**VARS, "MLTUNER_SECRET": "from-the-variable", "MLTUNER_SECRET_FILE": str(path)})
    assert found.secret == "from-the-variable"


@pytest.mark.parametrize("mode", [0o640, 0o604])
def test_a_secret_file_others_may_read_is_refused(tmp_path: Path, mode: int) -> None:
    path = key_file(tmp_path, "0123456789abcdef0123", mode)
    with pytest.raises(mltuner.InvalidArgumentError, match="other users"):
        detect_environment({**VARS, "MLTUNER_SECRET_FILE": str(path)})


def test_a_short_or_missing_secret_file_is_refused(tmp_path: Path) -> None:
    with pytest.raises(mltuner.InvalidArgumentError, match="at least 16"):
        read_secret_file(key_file(tmp_path, "short"))
    with pytest.raises(mltuner.InvalidArgumentError, match="cannot read"):
        read_secret_file(tmp_path / "absent.key")


def test_the_user_key_is_made_once_private_and_shared(tmp_path: Path) -> None:
    directory = tmp_path / "keys"
    found: list[str] = []
    threads = [threading.Thread(target=lambda: found.append(user_loopback_secret(directory))) for _ in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(10)
    assert len(found) == 8 and len(set(found)) == 1 and len(found[0]) == 64
    assert os.stat(directory).st_mode & 0o777 == 0o700
    assert os.stat(directory / "loopback.key").st_mode & 0o777 == 0o600
    assert sorted(p.name for p in directory.iterdir()) == ["loopback.key"]  # no candidates left behind


def test_a_user_key_directory_others_may_open_is_refused(tmp_path: Path) -> None:
    directory = tmp_path / "keys"
    directory.mkdir(mode=0o755)
    directory.chmod(0o755)
    with pytest.raises(mltuner.InvalidArgumentError, match="other users"):
        user_loopback_secret(directory)
