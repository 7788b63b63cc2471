"""MNIST-1D classification, data-parallel through the parameter server, with
its hyperparameters tuned during training (or by a baseline).

Each of the job's processes runs this program (``mltuner tune`` starts them
with ``mltuner launch``)::

    mltuner launch -n 2 -- python -m mltuner.apps.mnist1d --log decisions.jsonl

The model is a numpy :class:`~mltuner.models.MLP` (``--model mlp``: the
MNIST-1D authors' 100-100 MLP, ``logreg``: logistic regression) whose
parameters are one table, or the authors' CNN in PyTorch through
:mod:`mltuner.torch` (``--model cnn``, one table per layer, on the GPU when
there is one); the servers apply momentum SGD with each branch's learning
rate and momentum. 10% of the training set is held out for the
tuner's validation; the test set is used once, at the end, for the reported
accuracy. Rank 0 prints the result and writes it as JSON (``--result``).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Literal, Protocol

import numpy as np

import mltuner as mlt
from mltuner.apps._mnist1d_options import MLP_HIDDEN, SEARCHABLE, build_parser
from mltuner.datasets import load_mnist1d
from mltuner.exceptions import InvalidArgumentError
from mltuner.models import MLP
from mltuner.tune import (
    BaselineConfig,
    BaselineResult,
    BranchKind,
    BranchSystem,
    DecisionLog,
    Listener,
    LiveDisplay,
    SearchSpace,
    Step,
    TunerConfig,
    TuningResult,
    TuningSession,
    default_space,
    format_tunables,
    run_fixed,
    run_hyperband,
    run_mltuner,
    run_optuna,
)
from mltuner.tune import Driver
from mltuner.tune._log import run_log_copy

__all__ = ["main", "build_space", "check_args", "load", "parse_args", "tuner_config", "update_rule", "MLP_HIDDEN",
           "Data"]

PROG = "python -m mltuner.apps.mnist1d"


def build_space(args: argparse.Namespace) -> SearchSpace:
    """The paper's tunables, searched only where ``--search`` names them."""
    searched = searched_names(args)
    unknown = searched - set(SEARCHABLE)
    if unknown:
        raise InvalidArgumentError(
            f"--search: unknown tunables {sorted(unknown)}; choose from {', '.join(SEARCHABLE)}")
    space = default_space(args.batch_sizes if "batch_size" in searched else [args.batch_size],
                          staleness=args.staleness if "staleness" in searched else args.staleness[:1],
                          # (check_args keeps a searched --lr in the range; unsearched, only it counts)
                          lr_range=(min(args.lr_min, args.lr), max(args.lr_max, args.lr)))
    defaults = {"lr": args.lr, "momentum": args.momentum}
    tunables = [dataclasses.replace(t, search=t.name in searched, **({"default": defaults[t.name]}
                                                                      if t.name in defaults else {}))
                for t in space]
    return SearchSpace(tunables)


def searched_names(args: argparse.Namespace) -> set[str]:
    """The tunables ``--search`` names."""
    return {name.strip() for name in args.search.split(",") if name.strip()}


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    """The program's options (see _mnist1d_options, shared with ``mltuner tune``)."""
    parser = build_parser(prog=PROG, description=__doc__.split("\n\n")[0])
    return parser.parse_args(argv)


def update_rule(args: argparse.Namespace) -> mlt.UpdateRule:
    """The servers' rule: MLtuner's damped momentum SGD with the starting
    learning rate and momentum (the tuner's momentum is this rule's m)."""
    return mlt.UpdateRule("damped_momentum", learning_rate=args.lr, momentum=args.momentum)


# The most samples a worker validates in one clock by default: each clock costs
# the job a clock's overhead and, on a straggler's host, a delay, while one of
# this model's forward and backward passes over 1,024 samples is small.
VALIDATION_SAMPLES_PER_CLOCK = 1024


def validation_clocks(args: argparse.Namespace, num_validation: int, world_size: int) -> int:
    """The clocks of a validation, which covers the validation set once:
    ``--test-clocks`` (at most one sample a worker a clock), by default the
    fewest clocks of at most ``VALIDATION_SAMPLES_PER_CLOCK`` samples a
    worker, as a DDP loop validates in one pass."""
    if args.test_clocks is not None:
        return min(int(args.test_clocks), max(1, -(-num_validation // world_size)))
    return max(1, -(-num_validation // (VALIDATION_SAMPLES_PER_CLOCK * world_size)))


def tuner_config(args: argparse.Namespace, num_clocks_to_test: int | None = None) -> TunerConfig:
    return TunerConfig(
        sampler=args.sampler, retune=args.retune, seed=args.seed, storage=args.storage,
        num_clocks_to_eval=args.eval_clocks, num_clocks_to_test=num_clocks_to_test,
        max_trials_per_search=args.trials, max_epochs=args.max_epochs,
        target_accuracy=args.target_accuracy,
        initial_trial_time_s=args.trial_time, num_branches=30,
        search_share=args.search_share if args.search_share > 0 else None, time_budget_s=args.time_budget,
        max_search_share=max(args.max_search_share, args.search_share) if args.search_share > 0 else None,
        retune_tunables=None if args.retune_search == "all" else tuple(args.retune_search.split(",")),
        rollback=not args.no_rollback, retune_every_epochs=args.retune_every,
        batch_check=not args.no_batch_check, batch_check_lr_scaling=args.batch_check_lr)


def check_args(args: argparse.Namespace, world_size: int | None = None) -> None:
    """Checks what the parser cannot: the options together, as the workers
    will use them (``mltuner tune`` calls it before starting any).

    Raises:
        mltuner.InvalidArgumentError: naming the option and the problem.
    """
    if not args.lr_min < args.lr_max:
        raise InvalidArgumentError(f"--lr-min ({args.lr_min:g}) must be smaller than --lr-max ({args.lr_max:g})")
    if "lr" in searched_names(args) and not args.lr_min <= args.lr <= args.lr_max:
        raise InvalidArgumentError(
            f"--lr {args.lr:g} (the starting learning rate, default 0.01) lies outside the searched range "
            f"[--lr-min {args.lr_min:g}, --lr-max {args.lr_max:g}]: give an --lr inside it")
    if world_size is not None and args.slow_rank >= world_size:
        raise InvalidArgumentError(f"--slow-rank {args.slow_rank}: there are only {world_size} workers")
    build_space(args)
    tuner_config(args)
    try:
        update_rule(args)
    except ValueError as error:
        raise InvalidArgumentError(str(error)) from None
    train = training_samples(args.samples)
    largest = max(args.batch_sizes) if "batch_size" in searched_names(args) else args.batch_size
    if largest * (world_size or 1) > train:
        raise InvalidArgumentError(
            f"--samples {args.samples} leaves {train} training samples, fewer than one clock's batch of "
            f"{largest} per worker x {world_size or 1} workers: use more samples or smaller batch sizes")
    if args.storage is not None:
        _check_storage(args.storage)


def _check_storage(url: str) -> None:
    """An Optuna storage URL whose database driver is installed (checked
    without connecting: a sqlite file is not made here)."""
    from sqlalchemy.engine import make_url
    from sqlalchemy.exc import ArgumentError, NoSuchModuleError

    try:
        make_url(url).get_dialect()
    except (ArgumentError, NoSuchModuleError, ValueError) as error:
        raise InvalidArgumentError(f"--storage {url!r} is not a database URL Optuna can use ({error}); "
                                   "e.g. sqlite:///tuning.db") from None


def training_samples(samples: int) -> int:
    """The samples the tuner trains on with ``--samples``: MNIST-1D's 80%
    training split less the tenth held out for validation (:func:`load`)."""
    train = samples * 4 // 5
    return train - train // 10


@dataclasses.dataclass(frozen=True)
class Data:
    """MNIST-1D split three ways: the tuner validates on the last 10% of the
    training split; the test split is used once, at the end."""

    x_train: np.ndarray
    y_train: np.ndarray
    x_val: np.ndarray
    y_val: np.ndarray
    x_test: np.ndarray
    y_test: np.ndarray


def load(args: argparse.Namespace) -> Data:
    data = load_mnist1d(num_samples=args.samples)
    cut = len(data.x_train) - len(data.x_train) // 10
    return Data(data.x_train[:cut], data.y_train[:cut], data.x_train[cut:], data.y_train[cut:],
                data.x_test, data.y_test)


class Trainer(Protocol):
    """One model's side of the loop: runs a clock the session asked for."""

    def clock(self, step: Step) -> None:
        """Reads, computes, reports (loss; accuracy on TESTING) and clocks."""

    def test_accuracy(self, branch: int) -> float:
        """Accuracy of ``branch``'s parameters on the test split."""

    def compute_seconds(self, samples: int) -> float:
        """Seconds of the model's forward and backward pass over ``samples``
        training samples, outside the engine."""


def host(buffer: object) -> np.ndarray:
    """The engine's buffer as numpy (the engine runs on the CPU here)."""
    assert isinstance(buffer, np.ndarray)
    return buffer


@dataclasses.dataclass(frozen=True)
class _Outcome:
    """What the driver hands back: the summary and the branch it kept."""

    summary: BaselineResult
    branch: int | None
    tunables: dict[str, Any] | None
    tuning: TuningResult | None = None


def make_driver(args: argparse.Namespace, space: SearchSpace, session: TuningSession,
                log: DecisionLog | None) -> Driver:
    """The rank-0 driver of ``--mode``: MLtuner or one of its baselines."""
    config = session.config
    baseline = BaselineConfig.matching(config, target_accuracy=args.target_accuracy, n_trials=args.trials,
                                       time_budget_s=args.time_budget, storage=args.storage)

    def drive(system: BranchSystem) -> _Outcome:
        if args.mode == "tune":
            summary, tuning = run_mltuner(system, space, config, target_accuracy=args.target_accuracy, log=log,
                                          keep_branch=True)
            return _Outcome(summary, tuning.branch, tuning.tunables, tuning)
        if args.mode == "fixed":
            summary = run_fixed(system, space.defaults(), baseline, space=space, log=log)
        elif args.mode == "optuna":
            summary = run_optuna(system, space, baseline, log=log)
        else:
            summary = run_hyperband(system, space, baseline, log=log)
        return _Outcome(summary, None, summary.best_tunables)

    return drive


def open_log(args: argparse.Namespace) -> DecisionLog | None:
    """Rank 0's decision log, shown live when --live asks for it."""
    listeners: list[Listener] = [LiveDisplay()] if args.live else []
    copy = run_log_copy(args.log)  # --log under `mltuner run`: its display follows its own file
    listeners += [copy] if copy is not None else []
    path = args.log or os.environ.get("MLTUNER_TUNING_LOG")
    return DecisionLog(path, listeners=listeners) if path or listeners else None


class NumpyMLP:
    """The numpy MLP (or logistic regression): one table, one read and one
    update per clock, the gradient computed by hand."""

    def __init__(self, args: argparse.Namespace, data: Data, worker: mlt.Worker) -> None:
        self._data, self._worker = data, worker
        self._model = MLP([data.x_train.shape[1], *MLP_HIDDEN[args.model], int(data.y_train.max()) + 1])
        self._layout = mlt.TensorLayout(row_width=256).add("params", (self._model.num_params,))
        self._table = worker.create_tensor_table("mnist1d", self._layout)
        self._read = worker.virtual_read(self._table)
        worker.virtual_post_read(self._read)
        self._grad = worker.virtual_pre_update(self._table)
        worker.virtual_update(self._grad)
        worker.virtual_clock()
        worker.finish_virtual_iteration()
        if worker.rank == 0:  # the initial weights, written into the root branch
            weights = self._model.init_params(np.random.default_rng(args.seed))
            host(worker.pre_update(self._grad))[...] = self._layout.pack({"params": weights})
            worker.update(self._grad)
        worker.start_iterations()

    def clock(self, step: Step) -> None:
        worker, data, layout = self._worker, self._data, self._layout
        params = layout.view(host(worker.read(self._read)), "params")
        if step.kind is BranchKind.TESTING:
            x, y = data.x_val[step.indices], data.y_val[step.indices]
            accuracy = self._model.accuracy(params, x, y) if len(y) else 0.0
            worker.post_read(self._read)
            host(worker.pre_update(self._grad))[...] = 0.0
            step.report(0.0, accuracy=accuracy)
        else:
            if len(step.indices):
                loss, gradient = self._model.loss_and_grad(params, data.x_train[step.indices],
                                                            data.y_train[step.indices])
            else:  # the others took this clock's part (--steal-batches)
                loss, gradient = 0.0, np.zeros_like(params)
            worker.post_read(self._read)
            layout.view(host(worker.pre_update(self._grad)), "params")[...] = gradient * step.weight
            step.report(loss)
        worker.update(self._grad)
        worker.clock()

    def test_accuracy(self, branch: int) -> float:
        self._worker.sync()
        weights = self._layout.view(host(self._worker.fetch(self._table, branch=branch)), "params")
        return self._model.accuracy(weights, self._data.x_test, self._data.y_test)

    def compute_seconds(self, samples: int) -> float:
        params = self._model.init_params(np.random.default_rng(0))
        x, y = self._data.x_train[:samples], self._data.y_train[:samples]
        return median_seconds(lambda: self._model.loss_and_grad(params, x, y))


def median_seconds(run: Callable[[], object], repeats: int = 15, warmup: int = 3) -> float:
    """Median wall seconds of ``run()`` after ``warmup`` calls."""
    for _ in range(warmup):
        run()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        run()
        times.append(time.perf_counter() - start)
    return float(np.median(times))


class Straggler:
    """Slows one rank on purpose (benchmarks of bounded staleness).

    - ``--slow-factor F``: the rank computes F times as slowly, as a slower
      device would. After a training clock of n samples it sleeps (F - 1) x
      its model's forward and backward time for n samples, measured before
      training at powers of two up to the clock's samples and interpolated.
      So a rank given fewer samples (``--balance-batches``) also sleeps
      less, as a slower device computing less would.
    - ``--slow-ms``: a sleep after a clock, with probability
      ``--slow-probability`` (lower than 1: bursts of delay, as from a noisy
      neighbour, whatever the rank computes).

    Args:
        args: the program's options.
        rank: this process's rank.
        compute_seconds: the model's forward and backward seconds for n
            samples (needed with a slow factor).
        max_samples: the most samples a clock of this rank can hold.
    """

    def __init__(self, args: argparse.Namespace, rank: int, compute_seconds: Callable[[int], float] | None = None,
                 max_samples: int = 1) -> None:
        slowed = rank == args.slow_rank
        self._delay_s = args.slow_ms / 1000.0 if slowed else 0.0
        self._probability = args.slow_probability
        self._rng = np.random.default_rng([args.seed, rank])
        self._extra = (args.slow_factor - 1.0) if slowed else 0.0
        self._sizes: list[int] = []
        self._seconds: list[float] = []
        if self._extra > 0:
            if compute_seconds is None:
                raise InvalidArgumentError("--slow-factor needs the model's compute time")
            top = max(max_samples, 1)
            self._sizes = sorted({2**k for k in range(top.bit_length())} | {top})
            self._seconds = [compute_seconds(n) for n in self._sizes]

    def sleep_seconds(self, samples: int) -> float:
        """The factor's sleep after a training clock of ``samples`` samples."""
        if self._extra <= 0 or samples <= 0:
            return 0.0
        if samples > self._sizes[-1] and len(self._sizes) > 1:  # a larger batch than planned: the last slope
            slope = (self._seconds[-1] - self._seconds[-2]) / (self._sizes[-1] - self._sizes[-2])
            return self._extra * (self._seconds[-1] + slope * (samples - self._sizes[-1]))
        return self._extra * float(np.interp(samples, self._sizes, self._seconds))

    def after_clock(self, samples: int = 0) -> None:
        """Sleeps after a clock: ``samples`` are its training samples (0 for
        a validation clock, which the factor does not slow)."""
        pause = self.sleep_seconds(samples)
        if self._delay_s > 0 and self._rng.random() < self._probability:
            pause += self._delay_s
        if pause > 0:
            time.sleep(pause)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        check_args(args)
    except InvalidArgumentError as error:
        print(f"{PROG}: error: {error}", file=sys.stderr)
        return 2
    data = load(args)
    space = build_space(args)
    device: Literal["cpu", "cuda"] = "cpu"
    if args.model == "cnn":
        from mltuner.apps._cnn import engine_device

        device = engine_device()
    config = mlt.Config(update_rule=update_rule(args), branches=True, max_branches=40, wait_timeout_s=60,
                        device=device)
    start = time.perf_counter()
    with mlt.Job(config) as job:
        log = open_log(args) if job.rank == 0 else None
        if args.model == "cnn":
            from mltuner.apps._cnn import TorchCNN

            trainer: Trainer = TorchCNN(args, data, job.worker)
        else:
            trainer = NumpyMLP(args, data, job.worker)
        session = TuningSession(job, space, num_train=len(data.x_train), num_validation=len(data.x_val),
                                config=tuner_config(args, validation_clocks(args, len(data.x_val), job.world_size)),
                                seed=args.seed, balance_batches=args.balance_batches,
                                steal_batches=args.steal_batches, steal_after=args.steal_after)
        session.driver = make_driver(args, space, session, log)
        searched = searched_names(args)
        largest_batch = max(args.batch_size, *args.batch_sizes) if "batch_size" in searched else args.batch_size
        straggler = Straggler(args, job.rank, trainer.compute_seconds, largest_batch * job.world_size)
        for step in session:
            trainer.clock(step)
            straggler.after_clock(0 if step.kind is BranchKind.TESTING else len(step.indices))
        final = session.final_branch
        test_accuracy = trainer.test_accuracy(final) if final is not None else None
        outcome = session.result
        shares = session.batch_shares
        stolen = session.clocks_taken
        claim_wait_s = session.claim_wait_s
    elapsed = time.perf_counter() - start
    if log is not None:
        log.close()
    if job.rank == 0:
        report(args, outcome, elapsed, job.world_size, test_accuracy, shares, stolen, claim_wait_s)
    return 0


def report(args: argparse.Namespace, outcome: _Outcome, elapsed: float, workers: int,
           test_accuracy: float | None, batch_shares: Sequence[float] | None = None, clocks_taken: int = 0,
           claim_wait_s: float = 0.0) -> None:
    """Prints the result and writes it as JSON (rank 0)."""
    summary = outcome.summary
    result: dict[str, Any] = {
        "model": args.model, "mode": args.mode, "workers": workers, "seed": args.seed, "seconds": elapsed,
        "test_accuracy": test_accuracy, "tunables": outcome.tunables,
        "summary": dataclasses.asdict(summary), "log": args.log,
        "batch_shares": list(batch_shares) if batch_shares is not None else None,
        # Rank 0's clocks with part of a late rank's samples, and its seconds waiting to claim (--steal-batches).
        "clocks_taken": clocks_taken, "claim_wait_s": claim_wait_s}
    if outcome.tuning is not None:
        result["validation_accuracies"] = outcome.tuning.accuracies
        result["outcome"] = outcome.tuning.outcome.value
        result["rollbacks"] = outcome.tuning.rollbacks
        result["search_seconds"] = outcome.tuning.search_seconds
        result["clock_seconds"] = outcome.tuning.seconds
        result["searches"] = outcome.tuning.searches
        # The searches' share of the job's time (rank 0, the job's start to its end).
        result["search_share"] = outcome.tuning.search_seconds / elapsed if elapsed > 0 else None
    best = "-" if summary.best_accuracy is None else f"{summary.best_accuracy:.1%}"
    print(f"{args.mode}: best validation accuracy {best} after {summary.time_s:.1f} s of clocks "
          f"({elapsed:.1f} s in all) on {workers} workers; {summary.trials} trial(s), {summary.epochs} epoch(s)")
    if args.target_accuracy is not None:
        reached = f"{summary.time_to_target_s:.1f} s" if summary.time_to_target_s is not None else "not reached"
        print(f"time to {args.target_accuracy:.0%} validation accuracy: {reached}")
    if outcome.tuning is not None:
        tuning = outcome.tuning
        print(f"{tuning.searches} search(es): {tuning.search_seconds:.1f} s of clocks, "
              f"{result['search_share'] or 0:.0%} of the job's {elapsed:.1f} s; {tuning.rollbacks} rollback(s)")
    if test_accuracy is not None:
        print(f"test accuracy {test_accuracy:.1%} with {format_tunables(outcome.tunables)}")
    if args.result:
        Path(args.result).write_text(json.dumps(result, indent=2, default=str) + "\n")


if __name__ == "__main__":
    sys.exit(main())
