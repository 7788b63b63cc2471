"""Fixtures for the tuner tests: the training systems of :mod:`mltuner.testing`
(tests are imported with --import-mode=importlib, so helpers come through
fixtures)."""

from __future__ import annotations

import pytest

from mltuner.testing import QuadraticSystem, ScriptedSystem


@pytest.fixture(name="quadratic_system")
def quadratic_system_fixture() -> type[QuadraticSystem]:
    return QuadraticSystem


@pytest.fixture(name="scripted_system")
def scripted_system_fixture() -> type[ScriptedSystem]:
    return ScriptedSystem
