"""The exception hierarchy and the engine status code mapping."""

from __future__ import annotations

import pytest

import mltuner
from mltuner import exceptions
from mltuner.exceptions import error_for_code

EXPECTED = [
    # (class, builtin base, engine status code)
    (mltuner.InvalidArgumentError, ValueError, 1),
    (mltuner.NotFoundError, LookupError, 2),
    (mltuner.OutOfOrderError, RuntimeError, 3),
    (mltuner.WaitTimeoutError, TimeoutError, 4),
    (mltuner.ResourceExhaustedError, MemoryError, 5),
    (mltuner.ShutdownError, RuntimeError, 6),
    (mltuner.CorruptMessageError, ValueError, 7),
    (mltuner.InternalError, RuntimeError, 8),
    (mltuner.PeerLostError, ConnectionError, 9),
    (mltuner.NonFiniteError, FloatingPointError, 10),
    (mltuner.InterruptedWaitError, InterruptedError, 11),
]


@pytest.mark.parametrize(("cls", "builtin", "code"), EXPECTED, ids=[c.__name__ for c, _, _ in EXPECTED])
def test_class_derives_from_base_and_builtin(cls: type, builtin: type, code: int) -> None:
    assert issubclass(cls, mltuner.MltunerError)
    assert issubclass(cls, builtin)
    assert issubclass(cls, Exception)
    error = cls("boom")
    assert str(error) == "boom"
    with pytest.raises(mltuner.MltunerError):
        raise error
    with pytest.raises(builtin):
        raise cls("boom")


@pytest.mark.parametrize(("cls", "builtin", "code"), EXPECTED, ids=[c.__name__ for c, _, _ in EXPECTED])
def test_error_for_code(cls: type, builtin: type, code: int) -> None:
    assert error_for_code(code) is cls


@pytest.mark.parametrize("code", [0, -1, 12, 100])
def test_unknown_codes_are_internal_errors(code: int) -> None:
    assert error_for_code(code) is mltuner.InternalError


def test_base_is_not_a_builtin_category() -> None:
    assert issubclass(mltuner.MltunerError, Exception)
    for builtin in (ValueError, LookupError, RuntimeError, TimeoutError, MemoryError):
        assert not issubclass(mltuner.MltunerError, builtin)


def test_argument_type_error_is_an_invalid_argument_and_a_type_error() -> None:
    assert issubclass(mltuner.ArgumentTypeError, mltuner.InvalidArgumentError)
    assert issubclass(mltuner.ArgumentTypeError, TypeError)


def test_every_exported_error_is_covered() -> None:
    exported = {
        name for name in exceptions.__all__ if isinstance(getattr(exceptions, name), type)
    } - {"MltunerError", "ArgumentTypeError"}  # ArgumentTypeError: a Python-side InvalidArgumentError
    assert exported == {cls.__name__ for cls, _, _ in EXPECTED}
    for name in exported:
        assert getattr(mltuner, name) is getattr(exceptions, name)
    assert mltuner.MltunerError is exceptions.MltunerError


def test_engine_status_names_match_the_mapping() -> None:
    """The compiled engine's own names for the codes agree with the classes."""
    from mltuner import _core

    names = {code: _core.status_code_name(code) for _, _, code in EXPECTED}
    assert names == {
        1: "InvalidArgument",
        2: "NotFound",
        3: "OutOfOrder",
        4: "Timeout",
        5: "ResourceExhausted",
        6: "Shutdown",
        7: "CorruptMessage",
        8: "Internal",
        9: "PeerLost",
        10: "NonFinite",
        11: "Cancelled",
    }


def test_engine_errors_arrive_as_these_classes() -> None:
    with mltuner.LocalCluster(1, mltuner.Config(wait_timeout_s=20)) as cluster:
        worker = cluster.workers[0]
        with pytest.raises(mltuner.InvalidArgumentError) as e:
            worker.create_table("t", 0, 4)
        assert type(e.value) is mltuner.InvalidArgumentError
        with pytest.raises(mltuner.NotFoundError) as e2:
            worker.virtual_post_read(3)
        assert type(e2.value) is mltuner.NotFoundError
        with pytest.raises(mltuner.OutOfOrderError) as e3:
            worker.finish_virtual_iteration()
        assert type(e3.value) is mltuner.OutOfOrderError
