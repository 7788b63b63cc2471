"""End to end: MLtuner tunes the learning rate of the MNIST-1D MLP on 2
worker processes, and its choice is within a decade of the best fixed
learning rate of a grid.

The grid is an independent reference: plain single-process float64 numpy
training with the servers' momentum rule (h = (1-m) g + m h; w -= lr h) on
batches of 2 x 32 samples, three epochs per learning rate, scored by
validation accuracy.
"""

from __future__ import annotations

import io
import json
import math
import sys
from pathlib import Path

import numpy as np

from mltuner.apps.mnist1d import MLP_HIDDEN, load, parse_args
from mltuner.launch import launch
from mltuner.models import MLP

MOMENTUM, BATCH, WORKERS = 0.9, 32, 2
GRID = [10.0 ** e for e in np.arange(-3.0, 1.01, 0.5)]


def grid_best_learning_rate(epochs: int = 3) -> tuple[float, dict[float, float]]:
    data = load(parse_args([]))
    x_train, y_train, x_val, y_val = data.x_train, data.y_train, data.x_val, data.y_val
    model = MLP([x_train.shape[1], *MLP_HIDDEN["mlp"], 10])
    scores = {}
    for lr in GRID:
        params = model.init_params(np.random.default_rng(0)).astype(np.float64)
        history = np.zeros_like(params)
        rng = np.random.default_rng(1)
        for _ in range(epochs):
            order = rng.permutation(len(x_train))
            for start in range(0, len(order) - WORKERS * BATCH + 1, WORKERS * BATCH):
                batch = order[start:start + WORKERS * BATCH]
                _, grad = model.loss_and_grad(params.astype(np.float32), x_train[batch], y_train[batch])
                history = (1 - MOMENTUM) * grad + MOMENTUM * history
                params = params - lr * history
        finite = bool(np.isfinite(params).all())
        scores[lr] = model.accuracy(params.astype(np.float32), x_val, y_val) if finite else 0.0
    return max(scores, key=lambda lr: scores[lr]), scores


def test_tuned_learning_rate_is_within_a_decade_of_the_grid_best(tmp_path: Path) -> None:
    log, result = tmp_path / "decisions.jsonl", tmp_path / "result.json"
    out = io.StringIO()
    code = launch([sys.executable, "-m", "mltuner.apps.mnist1d", "--search", "lr", "--lr-min", "1e-3",
                   "--lr-max", "10", "--momentum", str(MOMENTUM), "--batch-size", str(BATCH), "--trials", "20",
                   "--max-epochs", "3", "--seed", "0", "--log", str(log), "--result", str(result)],
                  WORKERS, stdout=out, grace_seconds=10)
    assert code == 0, out.getvalue()
    records = [json.loads(line) for line in log.read_text().splitlines()]
    winner = next(r for r in records if r["event"] == "winner")
    tuned = winner["tunables"]["lr"]
    assert winner["tunables"]["momentum"] == MOMENTUM  # only lr was searched
    best, scores = grid_best_learning_rate()
    assert abs(math.log10(tuned) - math.log10(best)) <= 1.0, (tuned, best, scores)
    summary = json.loads(result.read_text())
    assert summary["workers"] == WORKERS and len(summary["validation_accuracies"]) == 3
    # Chance is 0.10; the grid's best setting reaches about 0.45 in 3 epochs,
    # a setting within a decade of it learns (above chance) in that time.
    assert summary["test_accuracy"] > 0.15, (tuned, summary)
