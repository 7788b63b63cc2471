"""A model whose loss sits at its start for its first epochs, whatever the
setting: the initial search sees no progress before its budget runs out,
training starts at the start setting, and the tuner searches again as soon
as that setting has moved the loss, not at a plateau or a periodic
re-tune much later."""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from mltuner.tune import LogUniform, SearchSpace, Tuner, TunerConfig

EPOCH = 100          # training clocks per epoch
FLAT = 300           # clocks at the starting loss, for every setting
START = {"lr": 0.01}  # slow: a re-tune should find a larger rate


def loss(t: Mapping[str, Any], c: int) -> float:
    if c < FLAT:
        return 10.0
    return 10.0 * math.exp(-0.05 * float(t["lr"]) * (c - FLAT)) + 0.1


def accuracy(t: Mapping[str, Any], c: int) -> float:
    return 0.1 + 0.8 * (1.0 - math.exp(-max(0, c - FLAT) / 2000.0))


def test_a_search_that_saw_no_progress_is_retried_once_the_loss_moves(scripted_system: Any) -> None:
    system = scripted_system(loss, seconds=lambda t: 0.125, clocks_per_epoch=EPOCH, accuracy=accuracy)
    config = TunerConfig(sampler="random", seed=0, initial_trial_time_s=1.25, num_clocks_to_eval=10,
                         num_clocks_to_test=5, max_trials_per_search=6, max_epochs=30,
                         initial_setting=START)
    tuner = Tuner(system, SearchSpace([LogUniform("lr", 0.01, 1.0)]), config)
    result = tuner.run()
    log = tuner.log
    untuned = log.events("train_untuned")
    assert untuned and untuned[0]["reason"] == "search_budget" and untuned[0]["tunables"] == START
    retune = log.events("retune")[0]
    # The loss leaves its start at clock 300: the validation of epoch 4 is
    # the first after a chunk clearly below it.
    assert retune["reason"] == "untuned" and retune["epoch"] == 4
    winner = next(r for r in log.events("winner") if r["search"] == 1)
    assert winner["tunables"]["lr"] > START["lr"]
    assert result.tunables["lr"] > START["lr"]
    assert system.live() == [result.branch]
