"""Search space declarations: encoding for Optuna, grids, defaults, errors."""

from __future__ import annotations

import math
from typing import Any

import pytest
from optuna.distributions import CategoricalDistribution, FloatDistribution

from mltuner import InvalidArgumentError
from mltuner.tune import Choice, LogUniform, SearchSpace, Uniform, default_space


def test_default_space_is_the_papers() -> None:
    space = default_space([4, 16, 64, 256])
    assert space.names == ["lr", "momentum", "batch_size", "staleness"]
    assert space.defaults() == {"lr": 1e-2, "momentum": 0.9, "batch_size": 256, "staleness": 0}
    lr = space["lr"]
    assert isinstance(lr, LogUniform) and (lr.low, lr.high) == (1e-5, 1.0)
    slack = space["staleness"]
    assert isinstance(slack, Choice) and tuple(slack.values) == (0, 1, 3, 7)


def test_a_single_batch_size_is_not_searched() -> None:
    space = default_space([32])
    assert [t.name for t in space.searched] == ["lr", "momentum", "staleness"]
    assert space.defaults()["batch_size"] == 32


def test_distributions_hold_the_real_values() -> None:
    space = default_space([4, 16, 64])
    dists = space.distributions()
    assert dists["lr"] == FloatDistribution(1e-5, 1.0, log=True)
    # The engine refuses momentum 1: the range stops short of it.
    assert dists["momentum"] == FloatDistribution(0.0, 0.99)
    # A study lists batch size 16, not index 1.
    assert dists["batch_size"] == CategoricalDistribution([4, 16, 64])
    assert dists["staleness"] == CategoricalDistribution([0, 1, 3, 7])


def test_no_momentum_grid_point_reaches_one() -> None:
    assert max(default_space([8])["momentum"].grid()) == 0.99  # type: ignore[union-attr]


def test_narrowed_keeps_the_rest_at_the_setting() -> None:
    space = default_space([8, 32])
    setting = {"lr": 0.1, "momentum": 0.5, "batch_size": 8, "staleness": 3}
    narrowed = space.narrowed(["lr", "momentum"], setting)
    assert [t.name for t in narrowed.searched] == ["lr", "momentum"]
    assert narrowed.defaults() == {**space.defaults(), "batch_size": 8, "staleness": 3}


def test_encode_decode_round_trip() -> None:
    space = SearchSpace([
        LogUniform("lr", 1e-4, 1.0),
        Choice("batch_size", [8, 32, 128]),
        Uniform("momentum", 0.0, 1.0, search=False, default=0.5),
    ])
    setting = {"lr": 0.01, "batch_size": 32, "momentum": 0.5}
    params = space.encode(setting)
    assert params == {"lr": 0.01, "batch_size": 32}
    assert space.decode(params) == setting


def test_defaults_when_not_given() -> None:
    assert LogUniform("x", 1e-4, 1.0).default_value == pytest.approx(1e-2)
    assert Uniform("y", 2.0, 4.0).default_value == 3.0
    assert Choice("z", ["a", "b"]).default_value == "a"


def test_grids_have_eleven_points_per_continuous_axis() -> None:
    log_grid = LogUniform("lr", 1e-5, 1.0).grid()
    assert len(log_grid) == 11
    assert log_grid[0] == 1e-5 and log_grid[-1] == 1.0
    assert [round(math.log10(v), 9) for v in log_grid] == [-5 + 0.5 * i for i in range(11)]
    lin_grid = Uniform("m", 0.0, 1.0).grid()
    assert lin_grid == pytest.approx([i / 10 for i in range(11)])
    assert Choice("b", [4, 16, 64]).grid() == [4, 16, 64]


def test_check_setting() -> None:
    space = default_space([8, 32])
    space.check_setting({"lr": 0.1, "momentum": 0.0, "batch_size": 8, "staleness": 7})
    with pytest.raises(InvalidArgumentError, match="outside"):
        space.check_setting({"lr": 2.0, "momentum": 0.0, "batch_size": 8, "staleness": 0})
    with pytest.raises(InvalidArgumentError, match="outside"):
        space.check_setting({"lr": 0.1, "momentum": 0.0, "batch_size": 16, "staleness": 0})
    with pytest.raises(InvalidArgumentError, match="missing"):
        space.check_setting({"lr": 0.1})


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (lambda: SearchSpace([]), "empty"),
        (lambda: SearchSpace([Uniform("a", 0, 1), LogUniform("a", 1e-3, 1)]), "duplicate"),
        (lambda: Choice("b", [(1, 2), (3, 4)]), "numbers, strings or booleans"),
        (lambda: SearchSpace(["lr"]), "LogUniform, Uniform or Choice"),  # type: ignore[list-item]
        (lambda: Uniform("a", 1.0, 1.0), "smaller than high"),
        (lambda: Uniform("a", 2.0, 1.0), "smaller than high"),
        (lambda: Uniform("a", 0.0, math.inf), "finite"),
        (lambda: LogUniform("lr", 0.0, 1.0), "low > 0"),
        (lambda: LogUniform("lr", 1e-3, 1.0, default=2.0), "outside"),
        (lambda: Uniform("m", 0.0, 1.0, default=-0.1), "outside"),
        (lambda: Choice("b", []), "empty"),
        (lambda: Choice("b", [1, 1]), "duplicate"),
        (lambda: Choice("b", [1, 2], default=3), "not one of"),
        (lambda: Uniform("", 0.0, 1.0), "identifier"),
        (lambda: Uniform("learning rate", 0.0, 1.0), "identifier"),
        (lambda: default_space([]), "batch_sizes"),
        (lambda: default_space([0, 4]), "batch_sizes"),
        (lambda: default_space([4], staleness=[-1]), "staleness"),
    ],
)
def test_bad_declarations_are_refused(make: object, message: str) -> None:
    with pytest.raises(InvalidArgumentError, match=message):
        make()  # type: ignore[operator]


@pytest.mark.parametrize("tunable, message", [
    (Choice("batch_size", [0, 32], default=32), "batch_size.*integers >= 1"),
    (Choice("batch_size", [16.5, 32], default=32), "batch_size.*integers >= 1"),
    (Choice("batch_size", [True, 32], default=32), "batch_size.*integers >= 1"),
    (Choice("staleness", [-1, 0], default=0), "staleness.*integers >= 0"),
    (Choice("staleness", ["a", 0], default=0), "staleness.*integers >= 0"),
    (Uniform("lr", -1.0, 1.0), r"learning rates must be numbers in \(0, 1e\+06\]"),
    (Choice("lr", [0.0, 0.1], default=0.1), r"learning rates must be numbers in \(0, 1e\+06\]"),
    (LogUniform("lr", 1e-30, 1e30), r"learning rates must be numbers in \(0, 1e\+06\]"),  # a fork refused 4.6e20
    (LogUniform("lr", 1e-3, 1e7, default=1e-2), "the servers' limit"),
    (Uniform("momentum", 0.0, 1.0), r"momentum.*\[0, 0.99\]"),
])
def test_values_the_servers_cannot_run_are_refused_with_the_space(tunable: Any, message: str) -> None:
    """Before any branch exists, not by a fork in the middle of the run."""
    with pytest.raises(InvalidArgumentError, match=message):
        SearchSpace([tunable])
