"""The search space: which tunables exist, their ranges and defaults.

A tunable is declared as one of three kinds (mltuner.md §2):

- :class:`LogUniform`: continuous on a log scale (the learning rate);
- :class:`Uniform`: continuous on a linear scale (momentum);
- :class:`Choice`: one of a list of values (batch size, staleness), searched
  as an Optuna categorical parameter whose values are the real ones (16, not
  index 2), so the study reads as the settings that ran.

A declaration with ``search=False`` is not searched: it always takes its
default (the paper's ``to_search`` flag).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Collection, Iterator, Mapping, Sequence
from typing import Any, Union

from optuna.distributions import BaseDistribution, CategoricalDistribution, FloatDistribution

from mltuner._config import MAX_LEARNING_RATE
from mltuner.exceptions import InvalidArgumentError

__all__ = [
    "LogUniform",
    "Uniform",
    "Choice",
    "Tunable",
    "SearchSpace",
    "default_space",
    "GRID_POINTS",
    "MAX_MOMENTUM",
]

# §1.5 grid_size = 10: 11 points per continuous axis.
GRID_POINTS = 11
# The largest momentum default_space offers: the engine refuses 1.0.
MAX_MOMENTUM = 0.99


def _check_name(name: str) -> None:
    if not isinstance(name, str) or not name or not name.isidentifier():
        raise InvalidArgumentError(
            f"a tunable name must be a non-empty identifier (letters, digits, _), got {name!r}"
        )


def _check_bounds(name: str, low: float, high: float) -> None:
    if not (math.isfinite(low) and math.isfinite(high)):
        raise InvalidArgumentError(f"tunable {name!r}: bounds must be finite, got [{low}, {high}]")
    if not low < high:
        raise InvalidArgumentError(
            f"tunable {name!r}: low must be smaller than high, got [{low}, {high}] "
            "(use search=False to fix a value)"
        )


@dataclasses.dataclass(frozen=True)
class LogUniform:
    """A continuous tunable searched on a log scale over ``[low, high]``
    (``low > 0``). The default is the geometric midpoint unless given."""

    name: str
    low: float
    high: float
    default: float | None = None
    search: bool = True

    def __post_init__(self) -> None:
        _check_name(self.name)
        _check_bounds(self.name, self.low, self.high)
        if self.low <= 0:
            raise InvalidArgumentError(
                f"tunable {self.name!r}: a log-scale range needs low > 0, got {self.low}"
            )
        if self.default is not None and not self.low <= self.default <= self.high:
            raise InvalidArgumentError(
                f"tunable {self.name!r}: default {self.default} is outside "
                f"[{self.low}, {self.high}]"
            )

    @property
    def default_value(self) -> float:
        """``default``, else the geometric midpoint of the range."""
        if self.default is not None:
            return float(self.default)
        return math.sqrt(self.low * self.high)

    def distribution(self) -> BaseDistribution:
        """The Optuna distribution a searcher samples: a float on a log scale."""
        return FloatDistribution(self.low, self.high, log=True)

    def encode(self, value: Any) -> Any:
        """The Optuna parameter for a setting's ``value``: the float itself."""
        return float(value)

    def decode(self, param: Any) -> Any:
        """The setting's value for an Optuna parameter: the float itself."""
        return float(param)

    def grid(self) -> list[Any]:
        """:data:`GRID_POINTS` values evenly spaced in log scale, both ends
        included (the grid sampler's points)."""
        # Evenly spaced exponents; the ends are set exactly so that rounding in
        # 10**x never leaves the distribution's range.
        lo, hi = math.log10(self.low), math.log10(self.high)
        step = (hi - lo) / (GRID_POINTS - 1)
        inner = [10.0 ** (lo + i * step) for i in range(1, GRID_POINTS - 1)]
        return [self.low, *inner, self.high]


@dataclasses.dataclass(frozen=True)
class Uniform:
    """A continuous tunable searched on a linear scale over ``[low, high]``.
    The default is the midpoint unless given."""

    name: str
    low: float
    high: float
    default: float | None = None
    search: bool = True

    def __post_init__(self) -> None:
        _check_name(self.name)
        _check_bounds(self.name, self.low, self.high)
        if self.default is not None and not self.low <= self.default <= self.high:
            raise InvalidArgumentError(
                f"tunable {self.name!r}: default {self.default} is outside "
                f"[{self.low}, {self.high}]"
            )

    @property
    def default_value(self) -> float:
        """``default``, else the midpoint of the range."""
        if self.default is not None:
            return float(self.default)
        return (self.low + self.high) / 2

    def distribution(self) -> BaseDistribution:
        """The Optuna distribution a searcher samples: a float on a linear scale."""
        return FloatDistribution(self.low, self.high)

    def encode(self, value: Any) -> Any:
        """The Optuna parameter for a setting's ``value``: the float itself."""
        return float(value)

    def decode(self, param: Any) -> Any:
        """The setting's value for an Optuna parameter: the float itself."""
        return float(param)

    def grid(self) -> list[Any]:
        """:data:`GRID_POINTS` evenly spaced values, both ends included (the
        grid sampler's points)."""
        step = (self.high - self.low) / (GRID_POINTS - 1)
        inner = [self.low + i * step for i in range(1, GRID_POINTS - 1)]
        return [self.low, *inner, self.high]


@dataclasses.dataclass(frozen=True)
class Choice:
    """A tunable that takes one of ``values`` (numbers, strings, booleans).
    Searchers see the values themselves, as an Optuna categorical parameter.
    The paper searched an ordinal index instead (§2); with the few values a
    batch size or staleness takes, the study's readability is worth more
    than the order. The default is the first value unless given."""

    name: str
    values: Sequence[Any]
    default: Any = None
    search: bool = True

    def __post_init__(self) -> None:
        _check_name(self.name)
        values = tuple(self.values)
        if not values:
            raise InvalidArgumentError(f"tunable {self.name!r}: the list of values is empty")
        if len(set(map(repr, values))) != len(values):
            raise InvalidArgumentError(f"tunable {self.name!r}: duplicate values in {list(values)}")
        bad = [v for v in values if v is not None and not isinstance(v, (bool, int, float, str))]
        if bad:
            raise InvalidArgumentError(
                f"tunable {self.name!r}: values must be numbers, strings or booleans "
                f"(what an Optuna study stores), got {bad}"
            )
        if self.default is not None and self.default not in values:
            raise InvalidArgumentError(
                f"tunable {self.name!r}: default {self.default!r} is not one of {list(values)}"
            )
        object.__setattr__(self, "values", values)

    @property
    def default_value(self) -> Any:
        """``default``, else the first value."""
        return self.values[0] if self.default is None else self.default

    def distribution(self) -> BaseDistribution:
        """The Optuna distribution a searcher samples: a categorical of the
        values themselves."""
        return CategoricalDistribution(list(self.values))

    def encode(self, value: Any) -> Any:
        """The Optuna parameter for a setting's ``value``: the value itself.

        Raises:
            mltuner.InvalidArgumentError: ``value`` is not one of ``values``.
        """
        if value not in self.values:
            raise InvalidArgumentError(f"tunable {self.name!r}: {value!r} is not one of "
                                       f"{list(self.values)}")
        return value

    def decode(self, param: Any) -> Any:
        """The setting's value for an Optuna parameter: the parameter itself."""
        return param

    def grid(self) -> list[Any]:
        """Every value, in order (the grid sampler's points)."""
        return list(self.values)


Tunable = Union[LogUniform, Uniform, Choice]


def _param_name(tunable: Tunable) -> str:
    # Every tunable's Optuna parameter carries its own name (the index
    # parameters `<name>_index` of earlier versions are gone).
    return tunable.name


def _check_server_values(tunable: Tunable) -> None:
    """The tunables the parameter server reads take only values it can run
    (checked here, before any branch exists, not by a fork mid-run): every
    value a search may propose, or the default of one not searched."""
    name = tunable.name
    if isinstance(tunable, Choice):
        values: Sequence[Any] = tunable.values if tunable.search else (tunable.default_value,)
    else:
        values = (tunable.low, tunable.high) if tunable.search else (tunable.default_value,)
    if name in ("batch_size", "staleness"):
        least = 1 if name == "batch_size" else 0
        if not isinstance(tunable, Choice) or not all(
                isinstance(v, int) and not isinstance(v, bool) and v >= least for v in tunable.values):
            raise InvalidArgumentError(
                f"tunable {name!r}: a Choice of integers >= {least} is needed, got {tunable!r}")
    elif name == "lr":
        if not all(isinstance(v, (int, float)) and not isinstance(v, bool) and 0 < v <= MAX_LEARNING_RATE
                   for v in values):
            raise InvalidArgumentError(
                f"tunable 'lr': learning rates must be numbers in (0, {MAX_LEARNING_RATE:g}] (the servers' "
                f"limit), got {tunable!r}")
    elif name == "momentum":
        if not all(isinstance(v, (int, float)) and not isinstance(v, bool) and 0 <= v <= MAX_MOMENTUM
                   for v in values):
            raise InvalidArgumentError(
                f"tunable 'momentum': values must lie in [0, {MAX_MOMENTUM}], got {tunable!r}")


class SearchSpace:
    """An ordered, validated set of tunable declarations.

    Raises :class:`~mltuner.InvalidArgumentError` for an empty space or a
    duplicate name. Decoded settings (what the training system receives) map
    each tunable's name to its value; encoded settings (what Optuna sees) map
    each searched tunable's name to its value too: the two differ only in
    that the encoded one leaves out the tunables that are not searched.
    """

    def __init__(self, tunables: Sequence[Tunable]) -> None:
        tunables = tuple(tunables)
        if not tunables:
            raise InvalidArgumentError(
                "the search space is empty: declare at least one tunable "
                "(LogUniform, Uniform or Choice), e.g. default_space(batch_sizes=[...])"
            )
        for tunable in tunables:
            if not isinstance(tunable, (LogUniform, Uniform, Choice)):
                raise InvalidArgumentError(
                    f"search space entries must be LogUniform, Uniform or Choice, got {tunable!r}"
                )
        names = [t.name for t in tunables]
        duplicates = sorted({n for n in names if names.count(n) > 1})
        if duplicates:
            raise InvalidArgumentError(f"duplicate tunable names in the search space: {duplicates}")
        for tunable in tunables:
            _check_server_values(tunable)
        self._tunables = tunables
        self._by_name = {t.name: t for t in tunables}

    def __iter__(self) -> Iterator[Tunable]:
        return iter(self._tunables)

    def __len__(self) -> int:
        return len(self._tunables)

    def __getitem__(self, name: str) -> Tunable:
        return self._by_name[name]

    def __repr__(self) -> str:
        return f"SearchSpace({list(self._tunables)!r})"

    @property
    def names(self) -> list[str]:
        return [t.name for t in self._tunables]

    @property
    def searched(self) -> list[Tunable]:
        """The declarations with ``search=True``, in declaration order."""
        return [t for t in self._tunables if t.search]

    def defaults(self) -> dict[str, Any]:
        """The decoded default setting."""
        return {t.name: t.default_value for t in self._tunables}

    def distributions(self) -> dict[str, BaseDistribution]:
        """Optuna distributions of the searched tunables, by parameter name."""
        return {_param_name(t): t.distribution() for t in self.searched}

    def param_name(self, name: str) -> str:
        return _param_name(self._by_name[name])

    def encode(self, setting: Mapping[str, Any]) -> dict[str, Any]:
        """Optuna parameters of the searched tunables of a decoded setting."""
        return {_param_name(t): t.encode(setting[t.name]) for t in self.searched}

    def decode(self, params: Mapping[str, Any]) -> dict[str, Any]:
        """The full decoded setting: searched tunables from ``params``, the
        others at their defaults."""
        setting = self.defaults()
        for tunable in self.searched:
            setting[tunable.name] = tunable.decode(params[_param_name(tunable)])
        return setting

    def narrowed(self, searched: Collection[str], setting: Mapping[str, Any]) -> SearchSpace:
        """This space with only the tunables named in ``searched`` (and
        searched here) still searched, every other one fixed at its value in
        ``setting``: the space of a re-tune that keeps what cannot help late
        in training."""
        self.check_setting(setting)
        keep = set(searched)
        return SearchSpace([
            t if t.search and t.name in keep
            else dataclasses.replace(t, search=False, default=setting[t.name])
            for t in self._tunables
        ])

    def check_setting(self, setting: Mapping[str, Any]) -> None:
        """Raises InvalidArgumentError unless ``setting`` names every tunable
        with a value inside its declaration."""
        missing = [n for n in self.names if n not in setting]
        extra = [n for n in setting if n not in self._by_name]
        if missing or extra:
            raise InvalidArgumentError(
                f"a setting must name exactly the tunables {self.names}: "
                f"missing {missing}, unknown {extra}"
            )
        for tunable in self._tunables:
            value = setting[tunable.name]
            if isinstance(tunable, Choice):
                ok = value in tunable.values
            else:
                ok = isinstance(value, (int, float)) and tunable.low <= value <= tunable.high
            if not ok:
                raise InvalidArgumentError(
                    f"tunable {tunable.name!r}: value {value!r} is outside its declaration "
                    f"{tunable!r}"
                )


def default_space(
    batch_sizes: Sequence[int],
    *,
    staleness: Sequence[int] = (0, 1, 3, 7),
    lr_range: tuple[float, float] = (1e-5, 1.0),
) -> SearchSpace:
    """The tunables of the MLtuner paper (Table 3, mltuner.md §2), under the
    names the parameter server reads: ``lr`` (log, default 1e-2), ``momentum``
    (linear in [0, 0.99], default 0.9), ``batch_size`` per worker (default: the
    largest) and ``staleness`` (default 0). The paper's momentum range is
    [0, 1]; the servers refuse momentum 1 (the history would never decay), so
    the range stops at MAX_MOMENTUM, where grid, GP and CMA-ES proposals on the
    bound stay valid.

    ``batch_sizes`` depends on the model (AlexNet {4, 16, 64, 256},
    Inception-BN {2, 4, 8, 16, 32}, ...); a single size is not searched.
    """
    sizes = sorted(int(b) for b in batch_sizes)
    if not sizes or sizes[0] < 1:
        raise InvalidArgumentError(
            f"batch_sizes must be positive integers, got {list(batch_sizes)}"
        )
    slacks = sorted(int(s) for s in staleness)
    if not slacks or slacks[0] < 0:
        raise InvalidArgumentError(f"staleness values must be >= 0, got {list(staleness)}")
    lr_default = 1e-2 if lr_range[0] <= 1e-2 <= lr_range[1] else None
    return SearchSpace([
        LogUniform("lr", lr_range[0], lr_range[1], default=lr_default),
        Uniform("momentum", 0.0, MAX_MOMENTUM, default=0.9),
        Choice("batch_size", sizes, default=sizes[-1], search=len(sizes) > 1),
        Choice("staleness", slacks, default=0 if 0 in slacks else None, search=len(slacks) > 1),
    ])
