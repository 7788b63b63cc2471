"""The Optuna searcher: samplers, marginal re-tunes, storage, the stop rule."""

from __future__ import annotations

import importlib.util
import math
from pathlib import Path

import optuna
import pytest

from mltuner import InvalidArgumentError
from mltuner.tune import (
    SAMPLERS,
    Choice,
    LogUniform,
    ProgressState,
    ProgressSummary,
    SearchSpace,
    Searcher,
    Uniform,
    default_space,
    open_storage,
    top_k_close,
)
from mltuner.tune.tuner._design import startup_design, value_at
from mltuner.tune.tuner._searcher import MAX_REPORTED_POINTS


def summary(slope: float) -> ProgressSummary:
    state = ProgressState.CONVERGING if math.isfinite(slope) else ProgressState.DIVERGED
    return ProgressSummary(state, slope, 0.0, -1.0, 1.0, 11)


def score(tunables: dict[str, object]) -> float:
    # Best near lr = 1e-2: a slope that is lower the closer log10(lr) is to -2.
    return -10.0 / (1.0 + (math.log10(float(tunables["lr"])) + 2.0) ** 2)  # type: ignore[arg-type]


def has(*modules: str) -> bool:
    return all(importlib.util.find_spec(m) is not None for m in modules)


NEEDS = {"gp": ("torch", "scipy"), "cmaes": ("cmaes",)}


@pytest.mark.parametrize("sampler", SAMPLERS)
def test_every_sampler_asks_and_tells(sampler: str) -> None:
    if not has(*NEEDS.get(sampler, ())):
        pytest.skip(f"{sampler} needs {NEEDS[sampler]}")
    space = default_space([8, 32, 128])
    searcher = Searcher(space, sampler=sampler, seed=3, n_startup_trials=2)
    for i in range(6):
        proposal = searcher.ask()
        assert proposal is not None and proposal.number == i
        space.check_setting(proposal.tunables)
        slope = math.nan if i == 2 else score(proposal.tunables)
        searcher.tell(proposal, summary(slope), [10.0, 9.0, 8.5])
    trials = searcher.study.trials
    assert [t.state for t in trials] == [optuna.trial.TrialState.COMPLETE] * 6
    assert trials[2].value == 0.0  # no progress is told as 0
    assert trials[0].value == pytest.approx(score(trials[0].user_attrs["tunables"]))
    assert searcher.pending() == []


def test_missing_optional_dependency_is_a_clear_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None)
    with pytest.raises(ImportError, match="pip install cmaes"):
        Searcher(default_space([8]), sampler="cmaes")


def test_unknown_sampler_is_refused() -> None:
    with pytest.raises(InvalidArgumentError, match="unknown sampler 'hyperband'"):
        Searcher(default_space([8]), sampler="hyperband")


def test_nothing_to_search_is_refused() -> None:
    space = SearchSpace([Uniform("m", 0.0, 1.0, search=False)])
    with pytest.raises(InvalidArgumentError, match="nothing to search"):
        Searcher(space)


def test_same_seed_same_proposals() -> None:
    def run(seed: int) -> list[dict[str, object]]:
        searcher = Searcher(default_space([8, 32]), seed=seed, n_startup_trials=3)
        out = []
        for _ in range(6):
            proposal = searcher.ask()
            assert proposal is not None
            out.append(proposal.tunables)
            searcher.tell(proposal, summary(score(proposal.tunables)), [1.0])
        return out

    assert run(5) == run(5)
    assert run(5) != run(6)


def test_grid_tries_every_point_once_then_stops() -> None:
    space = SearchSpace([Uniform("m", 0.0, 1.0), Choice("b", [8, 32])])
    searcher = Searcher(space, sampler="grid", seed=0)
    seen = set()
    for _ in range(22):  # 11 momentum points x 2 batch sizes
        assert not searcher.should_stop([])
        proposal = searcher.ask()
        assert proposal is not None
        seen.add((round(proposal.tunables["m"], 6), proposal.tunables["b"]))
        searcher.tell(proposal, summary(-1.0), [1.0])
    assert len(seen) == 22
    assert searcher.exhausted() and searcher.should_stop([])
    assert searcher.ask() is None


def test_marginal_retune_varies_exactly_one_tunable() -> None:
    space = default_space([8, 32, 128])
    base = {"lr": 0.01, "momentum": 0.9, "batch_size": 32, "staleness": 1}
    searcher = Searcher(space, seed=1, base_setting=base, n_startup_trials=2)
    assert searcher.marginal
    varied = []
    for _ in range(8):
        proposal = searcher.ask()
        assert proposal is not None
        changed = [k for k in base if proposal.tunables[k] != base[k]]
        assert len(changed) <= 1
        assert set(changed) <= {proposal.varied}
        varied.append(proposal.varied)
        searcher.tell(proposal, summary(score(proposal.tunables)), [1.0])
    # The searched tunables take turns.
    assert varied == ["lr", "momentum", "batch_size", "staleness"] * 2


def test_marginal_grid_tries_the_current_setting_first() -> None:
    space = SearchSpace([LogUniform("lr", 1e-4, 1.0), Choice("b", [8, 32, 128])])
    base = {"lr": 1e-2, "b": 32}
    searcher = Searcher(space, sampler="grid", seed=2, base_setting=base)
    first = searcher.ask()
    assert first is not None and first.tunables == base and first.varied is None
    searcher.tell(first, summary(-1.0), [1.0])
    count = 0
    while (proposal := searcher.ask()) is not None:
        changed = [k for k in base if proposal.tunables[k] != pytest.approx(base[k])]
        assert changed == [proposal.varied]
        searcher.tell(proposal, summary(-1.0), [1.0])
        count += 1
    assert count == 10 + 2  # the other lr grid points, the other batch sizes
    assert searcher.should_stop([])


def test_base_setting_must_fit_the_space() -> None:
    with pytest.raises(InvalidArgumentError, match="outside"):
        Searcher(default_space([8, 32]), base_setting={
            "lr": 10.0, "momentum": 0.9, "batch_size": 32, "staleness": 0})


def test_each_trial_is_told_once() -> None:
    searcher = Searcher(default_space([8]), seed=0)
    proposal = searcher.ask()
    assert proposal is not None
    searcher.tell(proposal, summary(-1.0), [1.0])
    with pytest.raises(InvalidArgumentError, match="already told"):
        searcher.tell(proposal, summary(-1.0), [1.0])


@pytest.mark.parametrize("kind", ["sqlite", "journal"])
def test_storage_records_values_and_curves(tmp_path: Path, kind: str) -> None:
    url = f"sqlite:///{tmp_path / 'x.db'}" if kind == "sqlite" else f"journal:{tmp_path / 'x.log'}"
    searcher = Searcher(default_space([8, 32]), seed=0, storage=url, study_name="job-initial")
    curves = [[10.0, 9.0, 8.0], [10.0, math.nan, math.inf], [10.0, 9.5, 9.4, 9.3]]
    slopes = [-2.0, math.nan, -0.5]
    for curve, slope in zip(curves, slopes):
        proposal = searcher.ask()
        assert proposal is not None
        searcher.tell(proposal, summary(slope), curve, {"branch": 3, "outcome": "lost"})
    searcher.publish()  # the search works in memory and publishes at its end

    storage = open_storage(url)  # a fresh reader
    assert storage is not None
    study = optuna.load_study(study_name="job-initial", storage=storage)
    trials = study.trials
    assert [t.value for t in trials] == [-2.0, 0.0, -0.5]
    assert trials[0].intermediate_values == {0: 10.0, 1: 9.0, 2: 8.0}
    assert trials[2].intermediate_values == {0: 10.0, 1: 9.5, 2: 9.4, 3: 9.3}
    assert math.isnan(trials[1].intermediate_values[1])
    assert trials[1].intermediate_values[2] == math.inf
    assert trials[0].user_attrs["outcome"] == "lost"
    assert trials[0].user_attrs["state"] == "converging"
    assert trials[1].user_attrs["slope"] is None
    assert set(trials[0].user_attrs["tunables"]) == {"lr", "momentum", "batch_size", "staleness"}
    assert set(trials[0].params) == {"lr", "momentum", "staleness", "batch_size"}
    assert trials[0].params["batch_size"] in (8, 32)  # the real value, not an index


def test_intermediate_values_against_milliseconds() -> None:
    searcher = Searcher(default_space([8]), seed=0)
    proposal = searcher.ask()
    assert proposal is not None
    searcher.tell(proposal, summary(-1.0), [3.0, 2.0, 1.0], seconds=[0.5, 0.25, 0.0001])
    # Steps are the run time in ms at each clock's end; a step never repeats.
    assert searcher.study.trials[0].intermediate_values == {500: 3.0, 750: 2.0, 751: 1.0}


def test_tpe_uses_the_constant_liar() -> None:
    searcher = Searcher(default_space([8]), sampler="tpe")
    assert searcher.study.sampler._constant_liar  # type: ignore[attr-defined]


def test_enqueued_setting_comes_first_and_exclusions_are_skipped() -> None:
    space = SearchSpace([LogUniform("lr", 1e-3, 1.0)])
    searcher = Searcher(space, sampler="random", seed=0, excluded=lambda t: t["lr"] >= 0.1)
    assert searcher.enqueue({"lr": 0.05})
    assert not searcher.enqueue({"lr": 0.5})  # excluded: not queued
    first = searcher.ask()
    assert first is not None and first.enqueued and first.tunables == {"lr": 0.05}
    searcher.tell(first, summary(-1.0), [1.0])
    for _ in range(10):
        proposal = searcher.ask()
        assert proposal is not None and proposal.tunables["lr"] < 0.1
        searcher.tell(proposal, summary(-1.0), [1.0])
    excluded = [t for t in searcher.study.trials if t.user_attrs.get("outcome") == "excluded"]
    assert excluded and all(t.value == 0.0 and t.params["lr"] >= 0.1 for t in excluded)


def test_a_space_left_empty_by_exclusions_is_exhausted() -> None:
    searcher = Searcher(SearchSpace([LogUniform("lr", 1e-3, 1.0)]), sampler="random", seed=0,
                        excluded=lambda t: True)
    assert searcher.ask() is None and searcher.exhausted()


def test_an_existing_study_name_is_refused(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'x.db'}"
    Searcher(default_space([8]), storage=url, study_name="job")
    with pytest.raises(InvalidArgumentError, match="already has a study named 'job'"):
        Searcher(default_space([8]), storage=url, study_name="job")


def test_long_curves_are_reported_as_window_means() -> None:
    searcher = Searcher(default_space([8]), seed=0)
    proposal = searcher.ask()
    assert proposal is not None
    losses = [float(i) for i in range(1000)]
    searcher.tell(proposal, summary(-1.0), losses)
    values = searcher.study.trials[0].intermediate_values
    assert len(values) == MAX_REPORTED_POINTS
    assert values[9] == pytest.approx(4.5)  # the mean of clocks 0..9
    assert max(values) == 999


def test_top_k_close() -> None:
    assert top_k_close([-10.0, -9.5, -9.4, -9.2, -9.1])         # 1 - 9.1/10 = 0.09
    assert not top_k_close([-10.0, -9.5, -9.4, -9.2, -8.9])     # 0.11
    assert not top_k_close([-10.0, -9.9, -9.8, -9.7])           # fewer than 5
    assert top_k_close([math.nan, -10.0, -9.9, math.nan, -9.8, -9.7, -9.6, -1.0])
    assert not top_k_close([math.nan] * 6)


def test_only_model_based_samplers_use_the_stop_rule() -> None:
    close = [-10.0, -9.9, -9.8, -9.7, -9.6]
    assert Searcher(default_space([8]), sampler="tpe").should_stop(close)
    assert not Searcher(default_space([8]), sampler="random").should_stop(close)
    assert not Searcher(default_space([8]), sampler="grid").should_stop(close)


# -- the startup design ------------------------------------------------------------------

DESIGN_SPACE = default_space([32, 64, 128], lr_range=(1e-5, 1.0))


def test_every_prefix_of_the_design_spreads_over_the_learning_rate() -> None:
    for seed in range(20):
        design = startup_design(DESIGN_SPACE, 8, seed)
        # Where in the log range each learning rate lies, in [0, 1).
        units = [math.log(d["lr"] / 1e-5) / math.log(1e5) for d in design]
        for size in (2, 4, 8):
            assert sorted(int(u * size) for u in units[:size]) == list(range(size))
        momenta = [int(d["momentum"] / 0.99 * 3) for d in design[:3]]
        assert sorted(momenta) == [0, 1, 2]
        for setting in design:
            DESIGN_SPACE.check_setting(setting)
    assert startup_design(DESIGN_SPACE, 4, 1) == startup_design(DESIGN_SPACE, 4, 1)
    assert startup_design(DESIGN_SPACE, 4, 1) != startup_design(DESIGN_SPACE, 4, 2)


def test_value_at_follows_each_tunables_scale() -> None:
    assert value_at(LogUniform("lr", 1e-4, 1.0), 0.5) == pytest.approx(1e-2)
    assert value_at(Uniform("m", 0.0, 0.5), 0.5) == pytest.approx(0.25)
    assert [value_at(Choice("b", [8, 16, 32]), u) for u in (0.0, 0.34, 0.99)] == [8, 16, 32]


@pytest.mark.parametrize("sampler", ["tpe", "cmaes", "gp"])
def test_model_based_samplers_start_with_the_design_after_enqueued_settings(sampler: str) -> None:
    if sampler == "gp" and not has("torch", "scipy") or sampler == "cmaes" and not has("cmaes"):
        pytest.skip(f"{sampler} needs optional packages")
    searcher = Searcher(DESIGN_SPACE, sampler=sampler, seed=3, n_startup_trials=4)
    current = DESIGN_SPACE.defaults()
    assert searcher.enqueue(current)
    asked = []
    for _ in range(4):
        proposal = searcher.ask()
        assert proposal is not None
        asked.append(proposal)
        searcher.tell(proposal, summary(-1.0), [1.0, 0.5])
    assert asked[0].enqueued and asked[0].tunables == current
    # The enqueued setting counts as one of the startup trials.
    assert [p.tunables for p in asked[1:]] == startup_design(DESIGN_SPACE, 3, 3)
    assert not any(p.enqueued for p in asked[1:])


def test_random_and_marginal_searches_have_no_design() -> None:
    design = startup_design(DESIGN_SPACE, 2, 0)
    random_ = Searcher(DESIGN_SPACE, sampler="random", seed=0)
    assert random_.ask().tunables != design[0]  # type: ignore[union-attr]
    marginal = Searcher(DESIGN_SPACE, sampler="tpe", seed=0,
                        base_setting=DESIGN_SPACE.defaults())
    proposal = marginal.ask()
    assert proposal is not None
    changed = [k for k, v in proposal.tunables.items() if v != DESIGN_SPACE.defaults()[k]]
    assert len(changed) <= 1
