"""Baselines to compare MLtuner with, driven through the same branch system
(a fixed setting, Optuna TPE with whole runs, Hyperband), and the tuner
measured the same way."""

from __future__ import annotations

from mltuner.tune.baselines._baselines import (
    BaselineConfig,
    BaselineResult,
    BaselineTrial,
    TimedSystem,
    curve_from_log,
    mltuner_result,
    run_fixed,
    run_hyperband,
    run_mltuner,
    run_optuna,
    running_best,
    time_to_target,
)

__all__ = [
    "BaselineConfig", "BaselineResult", "BaselineTrial", "TimedSystem", "curve_from_log",
    "mltuner_result", "run_fixed", "run_hyperband", "run_mltuner", "run_optuna", "running_best",
    "time_to_target",
]
