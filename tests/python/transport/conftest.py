"""The transport tests import their pair helpers (pairs.py) by name
(pytest runs with --import-mode=importlib, which does not put test folders
on sys.path), and get the fixture `socket_threads`, which runs a test over
the C++ socket threads and over the Python fallback."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))


@pytest.fixture(params=["c++", "python"])
def socket_threads(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Each test runs over the C++ socket threads and over the Python ones
    (the fallback where no shared libzmq is found)."""
    if request.param == "python":
        monkeypatch.setenv("MLTUNER_SOCKET_THREADS", "python")
    return str(request.param)
