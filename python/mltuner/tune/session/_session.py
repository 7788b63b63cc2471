"""Tuning inside a training loop on the parameter server: the loop asks for
each clock's branch, tunables and batch, and reports the clock's loss.

Every rank runs the same loop::

    session = TuningSession(job, space, num_train=len(x_train), num_validation=len(x_val))
    for step in session:
        params = worker.read(read)                          # this clock's branch
        if step.kind is BranchKind.TESTING:
            step.report(loss, accuracy=accuracy(params, x_val[step.indices], ...))
        else:
            ... gradient of x_train[step.indices] into worker.pre_update(...) ...
            step.report(loss)
        worker.clock()

Rank 0 runs the tuner (or a baseline: any ``driver``) in a background thread
against :class:`PSBranchSystem`. Each of the system's calls becomes a
command that rank 0 hands to every rank through :meth:`Job.allgather`: fork
and free are done by every worker at the same clock boundary; a run
schedules the branch for its clocks and yields them as :class:`Step` s; at
the end of the run every rank's losses travel back to rank 0, which averages
them into the tuner's :class:`ClockReport` s. Only rank 0 times clocks (the
tuner's progress is per second of rank 0's wall time, as in MLtuner, where
the tuner reads the time of the clocks of worker 0); rank 0's wait for the
other ranks' reports at the end of a run is spread over the run's clocks,
since the run is not done before the slowest worker is.

The session also owns each branch's data cursor (the next sample of the
training stream, copied at a fork) and picks each worker's sample indices:
the training set is shuffled once per epoch with the same seed on every
rank, each clock takes the next ``batch_size x world_size`` samples and
worker r takes the r-th slice; a TESTING branch runs the validation set
once from its start, split among the workers. With ``balance_batches``,
the slices are sized by each worker's speed instead (``_balance.py``): rank
0 fits every rank's busy time per clock at the end of each run and sends
the next run's shares with its command. With ``steal_batches``, a worker
that falls silent loses its slices of the clocks it has not started to the
others (``_steal.py``): every rank claims each training clock first, from a
board file the ranks of one host share (``_shared_board.py``) or from rank 0.
"""

from __future__ import annotations

import dataclasses
import math
import os
import queue
import threading
import time
import warnings
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any, Protocol, cast

import numpy as np

from mltuner._validate import is_integer
from mltuner.client._worker import Worker
from mltuner.exceptions import InvalidArgumentError, OutOfOrderError, ShutdownError, WaitTimeoutError
from mltuner.tune._config import TunerConfig
from mltuner.tune._errors import TuningError
from mltuner.tune._log import DecisionLog, run_log_copy
from mltuner.tune._space import SearchSpace
from mltuner.tune._system import BranchKind, BranchSystem, ClockReport
from mltuner.tune.session._balance import BatchBalancer, split_counts
from mltuner.tune.session._sampler import StepBatchSampler, collate_allowing_empty
from mltuner.tune.session._shared_board import SharedClaimBoard, new_board_file
from mltuner.tune.session._steal import CARRY_WINDOW, LATE_AFTER, Claim, ClaimsThroughRankZero, Wait
from mltuner.tune.session._commands import (
    Command,
    EndCommand,
    ErrorCommand,
    ForkCommand,
    FreeCommand,
    RunCommand,
    check_report,
    parse_command,
)
from mltuner.tune.tuner._tuner import Tuner

__all__ = ["TuningSession", "Step", "PSBranchSystem", "Driver", "Collective", "ServingCollective"]

# A run longer than this is split into several, so that one allgather of its
# losses stays far below the control channel's 1 MiB frame.
_MAX_CLOCKS_PER_RUN = 2000
# Clocks whose busy times a rank sends at the end of a run, for the balancer.
_BUSY_CLOCKS_SENT = 128


class Collective(Protocol):
    """What the session needs from the job: a rank and an allgather."""

    rank: int
    world_size: int
    worker: Worker

    def allgather(self, name: str, value: Any, timeout_s: float | None = None) -> list[Any]: ...


class ServingCollective(Collective, Protocol):
    """A job whose rank 0 answers requests (``steal_batches`` needs it)."""

    def serve(self, name: str, handler: Callable[[int, Any], Any] | None) -> None: ...

    def request(self, name: str, value: Any, timeout_s: float | None = None) -> Any: ...


Driver = Callable[[BranchSystem], Any]
"""Drives the branches from rank 0 and returns a result with ``branch`` and
``tunables`` attributes (a TuningResult, a baseline's result) or anything."""


@dataclasses.dataclass
class _Cursor:
    """Where a branch is in the training stream."""

    epoch: int = 0
    offset: int = 0  # samples of this epoch already used (all workers)


@dataclasses.dataclass
class _Branch:
    kind: BranchKind
    tunables: dict[str, Any]
    cursor: _Cursor
    clocks: int = 0
    slack: int | None = None  # the slack _fork gave the engine's branch; None: each read's own


@dataclasses.dataclass(frozen=True)
class Step:
    """One clock of one branch, for this worker.

    Attributes:
        branch: the branch this clock runs on (the engine's reads and updates
            of this clock go to it).
        kind: what the branch is for. TRAINING and EVALUATION clocks train on
            ``indices`` of the training set (an EVALUATION branch has
            learning rate 0, so its updates change nothing: report the loss);
            TESTING clocks evaluate ``indices`` of the validation set and
            report an accuracy.
        tunables: the branch's setting (``lr``, ``momentum``, ``batch_size``,
            ``staleness``, and any other tunable of the space, which the
            training loop applies itself).
        indices: this worker's sample indices for this clock, into the
            training set or, for TESTING, the validation set. May be empty on
            the last TESTING clock when the validation set does not divide
            among the workers, and on a training clock whose part the others
            took (``steal_batches``): read, update with zeros (the gradient
            of no samples) and clock as usual; the reported loss is ignored.
            A DataLoader takes them as ``sampler=``; for one loader over the
            whole session see :meth:`TuningSession.batch_sampler`.
        epoch: the branch's epoch in the training stream (0-based).
        clock: the branch's own clock count before this clock.
        weight: this worker's share of the clock's samples against an equal
            share (its samples x workers / the clock's samples). The servers
            sum the workers' updates: multiply the mean loss (or gradient) by
            it, and unequal batches sum to the update of equal ones. 1.0
            unless the session balances or steals batches (a TESTING clock
            whose samples do not divide among the workers aside); 0.0 for a
            clock whose part went to the others (``steal_batches``).
    """

    branch: int
    kind: BranchKind
    tunables: Mapping[str, Any]
    indices: np.ndarray
    epoch: int
    clock: int
    _session: TuningSession = dataclasses.field(repr=False, compare=False)
    weight: float = 1.0

    @property
    def batch_size(self) -> int:
        """Samples in this worker's batch this clock."""
        return len(self.indices)

    def report(self, loss: float, *, accuracy: float | None = None) -> None:
        """Records this clock's loss on this worker's batch (any clock) and,
        for TESTING clocks, its accuracy (fraction correct). Call it once per
        step, before asking for the next."""
        self._session._record(self, float(loss), accuracy)


class TuningSession:
    """Runs tuning (rank 0) and the clocks it asks for (every rank).

    Args:
        job: a :class:`mltuner.Job` (or any :class:`Collective`) whose config
            has ``branches=True``; with a ``momentum`` tunable every table's
            update rule must be ``sgd`` or ``damped_momentum``.
        space: the tunables. ``lr`` and ``momentum`` are sent to the servers'
            update rule of every table per branch (a setting the space does
            not tune stays what the tables' rules have), ``staleness`` becomes the branch's slack,
            ``batch_size`` sizes the batches; other tunables are the training
            loop's to apply from :attr:`Step.tunables`.
        num_train: training samples (the stream the cursors move through).
        num_validation: validation samples (TESTING branches run them once).
        batch_size: the per-worker batch size when the space has no
            ``batch_size`` tunable.
        validation_batch_size: per-worker batch of TESTING clocks; the
            clocks of a validation are then those that cover the validation
            set once at this batch. Default: ``config.num_clocks_to_test``
            clocks when it is set, else the batch is the space's or the
            fixed batch size.
        config: the tuner's settings. Its ``num_clocks_to_test`` (None by
            default: cover the validation set once) becomes the clocks the
            session's validations take: with ``validation_batch_size`` those
            of the batch, and a different number set in the config is an
            InvalidArgumentError; without it, the config's number as it
            is (at most ``num_validation``, so that no clock is empty), or
            when None, those of the training batch. :attr:`config` holds
            the result.
        log: the decision log, or a path for one (rank 0 only); default:
            ``$MLTUNER_TUNING_LOG`` when set (``mltuner run`` sets it).
        driver: what runs on rank 0 instead of the MLtuner :class:`Tuner`
            (a baseline, for instance); it gets the :class:`PSBranchSystem`.
        seed: the shuffle seed of the training stream.
        timeout_s: bound of every wait for the other ranks and for the driver
            (default: the job's ``wait_timeout_s``, at least 60 s).
        balance_batches: size each worker's part of a clock's samples by its
            speed, measured over the runs so far (the clock's samples stay
            the same set), so that a slower worker takes fewer and nobody
            waits for it. The training loop must then weight its loss by
            :attr:`Step.weight`. Off by default: the split then depends on
            timing, so runs are not bit-for-bit repeatable.
        steal_batches: in runs at slack >= 1, a worker that falls a clock
            behind and silent for ``steal_after`` typical clocks (a burst of
            load on its host, a pause) loses its parts of the clocks it has not started
            to the others, and the shards count those clocks as empty, so
            nobody waits for it while every sample is still computed once.
            Each rank claims each training clock of such a run first: from a
            board file the ranks share when all run on one host, else from
            rank 0 (the job must serve requests, as :class:`mltuner.Job`
            does). The training loop weights its loss by :attr:`Step.weight`
            and handles empty steps (an update of exactly zero). Off by
            default, for the same reason as ``balance_batches``.
        steal_after: with ``steal_batches``, how long a worker a clock
            behind may be silent before its parts move, in typical clocks
            of the run (the median time between a worker's claims, per part
            it computed). Shorter reacts sooner to a delay and moves parts
            over jitter more often; 0 moves them as soon as it is a clock
            behind.

    After the loop, :attr:`result` holds the driver's result on rank 0, and
    :attr:`final_branch` / :attr:`final_tunables` the branch the job ended
    with on every rank and the setting it trained with (None when the
    driver freed it; the setting None also where the job ended on the
    INIT root, whose tables train with their own rules). With
    ``steal_batches``, :attr:`clocks_given` counts this rank's training
    clocks whose part the others took, :attr:`clocks_taken` those in
    which it took part of another's, and :attr:`claim_wait_s` the seconds
    its claims waited for a rank that was not late yet.
    """

    def __init__(self, job: Collective, space: SearchSpace, *, num_train: int, num_validation: int,
                 batch_size: int | None = None, validation_batch_size: int | None = None,
                 config: TunerConfig | None = None, log: DecisionLog | str | None = None,
                 driver: Driver | None = None, seed: int = 0, timeout_s: float | None = None,
                 balance_batches: bool = False, steal_batches: bool = False,
                 steal_after: float = LATE_AFTER) -> None:
        job_config = getattr(job, "config", None)
        if job_config is not None and not getattr(job_config, "branches", False):
            raise InvalidArgumentError("tuning needs branches in the parameter server: create the job with "
                                       "Config(branches=True, ...)")
        if "momentum" in space.names:
            _check_momentum_rules(job)
        if "batch_size" not in space.names and batch_size is None:
            raise InvalidArgumentError("give batch_size= or a batch_size tunable in the space")
        if batch_size is not None and (isinstance(batch_size, bool) or not isinstance(batch_size, int)
                                       or batch_size < 1):
            raise InvalidArgumentError(f"batch_size must be an integer >= 1, got {batch_size!r}")
        max_branches = getattr(job_config, "max_branches", None)
        num_branches = (config or TunerConfig()).num_branches
        if max_branches is not None and max_branches < num_branches + 2:
            raise InvalidArgumentError(f"the tuner keeps up to {num_branches} branches alive in a search, plus "
                                       f"a frozen copy of the best model and a validation branch, but "
                                       f"Config.max_branches is {max_branches}: use at least {num_branches + 2}")
        if num_train < 1 or num_validation < 1:
            raise InvalidArgumentError(f"num_train and num_validation must be >= 1, got {num_train} and "
                                       f"{num_validation}")
        if steal_batches and not (callable(getattr(job, "serve", None)) and callable(getattr(job, "request", None))):
            raise InvalidArgumentError("steal_batches needs a job whose rank 0 answers requests (a mltuner.Job)")
        if not 0 <= steal_after < math.inf:
            raise InvalidArgumentError(f"steal_after must be a finite number of clocks >= 0, got {steal_after!r}")
        self._steal_after = float(steal_after)
        self._job = job
        self._worker = job.worker
        self._rank, self._world = job.rank, job.world_size
        self._space = space
        self._num_train, self._num_validation = int(num_train), int(num_validation)
        self._batch_size = batch_size
        self._seed = seed
        wait = float(getattr(job_config, "wait_timeout_s", 60.0) or 60.0)
        self._timeout_s = timeout_s if timeout_s is not None else max(wait, 60.0)
        config = config or TunerConfig()
        self._num_test_clocks = self._test_clocks(validation_batch_size, config.num_clocks_to_test)
        self._config = dataclasses.replace(config, num_clocks_to_test=self._num_test_clocks)
        # `mltuner run` tells rank 0 where to log through the environment.
        self._log = log if log is not None else os.environ.get("MLTUNER_TUNING_LOG")
        self.driver: Driver | None = driver  # may be set until the loop starts
        # The INIT root: the engine's branch 0, which holds the weights written
        # before start_iterations, or a previous session's final branch (the
        # model it trained; it freed every other branch, and branch 0).
        trained = self._worker.trained_branch
        self._root_branch = 0 if trained is None else trained
        self._branches: dict[int, _Branch] = {}
        self._permutations: dict[int, np.ndarray] = {}
        self._sequence = 0  # allgathers so far: their names
        self._pending: Step | None = None
        self._run: tuple[int, int] | None = None  # (branch, clocks left) of the run being yielded
        self._shares: tuple[float, ...] | None = None  # the run's batch shares; None: equal
        self._balance = balance_batches and self._world > 1  # every rank measures its clocks
        self._balancer = BatchBalancer(self._world, seed) if self._balance and self._rank == 0 else None
        steal = steal_batches and self._world > 1
        # The job that answers claims (checked above; None: no stealing), and where the ranks
        # claim, chosen when iteration starts.
        self._claim_job = cast(ServingCollective, job) if steal else None
        self._claimer: SharedClaimBoard | ClaimsThroughRankZero | None = None
        self._run_id = 0  # the allgather that started the run: its number in every rank's claims
        self._run_clock = 0  # clocks made in the run so far
        self._run_steals = False  # rank 0's word: this run's clocks are claimed
        self._run_slack = 0
        self._run_samples = 0  # the run's samples a clock (its branch's batch for every worker)
        self.clocks_given = 0  # training clocks whose part this rank lost to the others (steal_batches)
        self.clocks_taken = 0  # training clocks in which it computed a part of another rank's
        self.claim_wait_s = 0.0  # seconds its claims waited for a rank to claim or turn late
        self._run_kind = BranchKind.TRAINING
        # Per clock of the run whose part did not move (stealing): its time less the engine's
        # waits, and its samples. The balancer models a rank's speed on its own part.
        self._busy: list[float] = []
        self._busy_samples: list[int] = []
        self._part_moved = False  # this step's part went to others or took another's
        self._recent_slices: dict[int, list[np.ndarray]] = {}  # the run's last clocks' per-rank samples (stealing)
        self._reports: list[tuple[float, float | None, int]] = []  # (loss, accuracy, samples) per clock
        self._times: list[float] = []
        self._clock_start = 0.0
        self._clocks_yielded = 0
        self._started = False
        self._error: BaseException | None = None
        self.result: Any = None
        self.final_branch: int | None = None
        self.final_tunables: dict[str, Any] | None = None
        self.system: PSBranchSystem | None = None
        self._thread: threading.Thread | None = None
        if self._rank == 0:
            self.system = PSBranchSystem(self)

    # -- the training loop's side ---------------------------------------------------

    def __iter__(self) -> Iterator[Step]:
        if self._started:
            raise InvalidArgumentError("a TuningSession can be iterated once")
        left = self._worker.scheduled_ahead
        if left:
            # The session's runs would come after them: its steps would train another branch.
            raise OutOfOrderError(
                f"{left} clocks are still scheduled (Worker.schedule_branch), the next on branch "
                f"{self._worker.next_branch}: run them before the tuning session starts")
        tuned = frozenset(n for n in ("lr", "momentum") if n in self._space.names)
        self._worker.check_session_start(tuned)
        self._started = True
        if self._world > 1:
            self._check_same_arguments()
        if self._claim_job is not None:
            self._choose_claim_board(self._claim_job)
        if self._rank == 0:
            self._start_driver()
        # What the session's branches set, which the loop must leave alone.
        self._worker.tuned_settings = tuned
        try:
            while True:
                step = self._next_step()
                if step is None:
                    return
                self._pending = step
                self._clocks_yielded += 1
                stalled = self._stall_seconds() if self._balance else 0.0
                self._clock_start = time.perf_counter()
                yield step
                if self._pending is not None:
                    raise InvalidArgumentError(f"step {step.clock} of branch {step.branch} was not reported: "
                                               "call step.report(loss) once per step")
                self._times.append(time.perf_counter() - self._clock_start)
                if self._balance and not self._part_moved:
                    # The engine's waits are waits for other ranks: not this rank's own time.
                    self._busy.append(max(0.0, self._times[-1] - (self._stall_seconds() - stalled)))
                    self._busy_samples.append(len(step.indices))
        except GeneratorExit:  # the loop left early (a break, a zip with a shorter data loader, an exception)
            left, trained = self._worker.scheduled_ahead, self._worker.trained_branch
            then = ("later clocks are refused until one is scheduled (no trained branch to go on from)"
                    if trained is None else f"later clocks go on from Worker.trained_branch ({trained})")
            after = (f"; the next {left} clocks are still scheduled on branch {self._worker.next_branch} (a "
                     f"trial's or a validation's), then {then}") if left else ""
            warnings.warn(f"the training loop left the tuning session after {self._clocks_yielded} steps, before "
                          "the tuner ended it (a break or return, or an exception in the loop): final_branch is "
                          f"None and the decision log has no end{after}. Iterate the session to its end "
                          "(session.data_loader() gives each step's batch)",
                          stacklevel=2)
            raise
        finally:
            self._worker.tuned_settings = frozenset()
            if self._claimer is not None:
                self._claimer.close()
            if self.system is not None:
                self.system._close()
            if self._thread is not None:
                self._thread.join(self._timeout_s)

    @property
    def claims_shared(self) -> bool:
        """With ``steal_batches``: whether the ranks claim their clocks through
        a board file they share (every rank on one host) rather than through
        rank 0 (known once iteration started)."""
        return isinstance(self._claimer, SharedClaimBoard)

    @property
    def current_step(self) -> Step | None:
        """The step yielded last, until it is reported (None otherwise)."""
        return self._pending

    def batch_sampler(self) -> StepBatchSampler:
        """Each step's indices as the batches of a ``torch.utils.data.DataLoader``
        (``batch_sampler=``, ``num_workers=0``) over ``ConcatDataset([train_set,
        validation_set])``; a TESTING step's validation indices come shifted by
        ``num_train``. A step with none of this rank's samples yields ``[]``,
        which torch's default collate cannot take: :meth:`data_loader` makes
        the loader with a collate that turns it into a batch of 0 samples."""
        return StepBatchSampler(self, self._num_train)

    def data_loader(self, train_set: Any, validation_set: Any, *, collate_fn: Callable[[list[Any]], Any] | None = None,
                    **loader_args: Any) -> Any:
        """A ``torch.utils.data.DataLoader`` of each step's batch, in step with
        the session: :meth:`batch_sampler` over ``ConcatDataset([train_set,
        validation_set])``, ``num_workers=0``. A step with none of this rank's
        samples (its part stolen, the last validation clock of a set that does
        not split evenly) gets a batch of 0 samples shaped as the others
        (torch's layers run it; see "Stealing" in docs/tuner.md for the
        loss). Draw one batch per step, after the step::

            for step, (x, y) in zip(session, session.data_loader(train_set, val_set)):
                ...

        ``collate_fn`` (default torch's ``default_collate``) and the other
        ``loader_args`` (``pin_memory``, ...) go to the DataLoader."""
        from torch.utils.data import ConcatDataset, DataLoader

        dataset: ConcatDataset[Any] = ConcatDataset([train_set, validation_set])
        return DataLoader(dataset, batch_sampler=self.batch_sampler(), num_workers=0,
                          collate_fn=collate_allowing_empty(dataset, collate_fn), **loader_args)

    def clocks_per_epoch(self, tunables: Mapping[str, Any]) -> int:
        """Clocks in one pass over the training set with this setting."""
        return self._num_train // (self._batch_of(tunables) * self._world)

    @property
    def batch_shares(self) -> tuple[float, ...] | None:
        """Every rank's fraction of a clock's samples in the current (or
        last) run; None without ``balance_batches`` (equal parts)."""
        return self._shares

    @property
    def config(self) -> TunerConfig:
        """The tuner's settings, with ``num_clocks_to_test`` set to the clocks
        of the session's validations (see the ``config`` argument): drivers
        should validate with it too. The TESTING clocks split the
        validation set into that many parts of near-equal size."""
        return self._config

    def _test_clocks(self, validation_batch: int | None, asked: int | None) -> int:
        """The clocks of a validation (see the ``config`` argument)."""
        if validation_batch is not None:
            if not isinstance(validation_batch, int) or isinstance(validation_batch, bool) or validation_batch < 1:
                raise InvalidArgumentError(f"validation_batch_size must be an integer >= 1 or None, got "
                                           f"{validation_batch!r}")
            clocks = math.ceil(self._num_validation / (validation_batch * self._world))
            if asked is not None and asked != clocks:
                raise InvalidArgumentError(
                    f"validation_batch_size={validation_batch} covers the {self._num_validation} validation "
                    f"samples in {clocks} clock(s) on {self._world} worker(s), but the config's "
                    f"num_clocks_to_test is {asked}: give one of the two (or both agreeing)")
            return clocks
        if asked is not None:
            return min(asked, self._num_validation)
        batch = self._batch_size or int(self._space.defaults()["batch_size"])
        return math.ceil(self._num_validation / (batch * self._world))

    def _record(self, step: Step, loss: float, accuracy: float | None) -> None:
        if self._pending is not step:
            raise InvalidArgumentError("report() was called twice, or on a step other than the current one")
        if step.kind is BranchKind.TESTING and accuracy is None and len(step.indices):
            raise InvalidArgumentError("a TESTING step must report its accuracy: step.report(loss, accuracy=...)")
        if accuracy is not None and not 0.0 <= float(accuracy) <= 1.0:
            raise InvalidArgumentError(f"accuracy must be a fraction in [0, 1] (correct / samples), got {accuracy!r}")
        self._pending = None
        self._reports.append((loss, None if accuracy is None else float(accuracy), len(step.indices)))

    # -- commands -------------------------------------------------------------------

    def _next_step(self) -> Step | None:
        while self._run is None or self._run[1] == 0:
            if self._run is not None:
                self._finish_run()
            command = self._gather_command()
            if not self._execute(command):
                return None
        branch, left = self._run
        self._run = (branch, left - 1)
        return self._make_step(branch)

    def _gather_command(self) -> Command:
        mine = self.system._next_command(self._timeout_s) if self.system is not None else None
        if mine is not None and mine.get("op") == "run":
            branch = self._branches.get(mine.get("branch"))  # type: ignore[arg-type]
            training = branch is not None and branch.kind is not BranchKind.TESTING
            slack = self._slack_of(branch)
            if self._balancer is not None and branch is not None and training:
                mine["shares"] = self._balancer.fractions(self._batch_of(branch.tunables) * self._world, slack)
            elif self._balancer is not None and self._shares is not None:
                mine["shares"] = list(self._shares)
            # Under BSP a thief would wait for the late rank's last clock anyway, then compute its part
            # after it instead of beside it: stealing needs a slack (EVALUATION branches have none).
            mine["steal"] = self._claim_job is not None and training and slack >= 1
        return parse_command(self._allgather("command", mine)[0])

    def _slack_of(self, branch: _Branch | None) -> int:
        """The slack of the branch's reads in the engine, as ``_fork`` set it
        (:func:`_engine_slack`): 0 for EVALUATION and TESTING, the staleness
        of a TRAINING branch, and the reads' own for one without a staleness
        in the space, for the INIT root and for no branch."""
        slack = branch.slack if branch is not None else None
        return slack if slack is not None else int(getattr(self._worker, "read_slack", 0) or 0)

    def _execute(self, command: Command) -> bool:
        if isinstance(command, ForkCommand):
            self._fork(command.child, command.parent, command.tunables, command.kind)
        elif isinstance(command, FreeCommand):
            self._branches.pop(command.branch, None)
            self._worker.free_branch(command.branch)
        elif isinstance(command, RunCommand):
            if command.shares is not None and len(command.shares) != self._world:
                raise TuningError(f"rank 0 sent batch shares for {len(command.shares)} workers; the job has "
                                  f"{self._world}")
            self._worker.schedule_branch(command.branch, command.clocks)
            self._run = (command.branch, command.clocks)
            self._run_id, self._run_clock = self._sequence, 0
            self._recent_slices = {}
            self._run_steals = command.steal
            self._run_slack = self._slack_of(self._branches[command.branch])
            self._run_samples = self._batch_of(self._branches[command.branch].tunables) * self._world
            self._shares = command.shares
            self._run_kind = self._branches[command.branch].kind
            self._reports, self._times, self._busy, self._busy_samples = [], [], [], []
            return True
        elif isinstance(command, EndCommand):
            self.final_branch = command.branch
            # What the model is now: state_dict(), evaluation, and the clocks after the session.
            # The INIT root (a job that made no progress) trains with each table's own rule,
            # not with the setting the tuner started from.
            kept = self._branches.get(command.branch) if command.branch is not None else None
            self.final_tunables = None if kept is not None and kept.kind is BranchKind.INIT else command.tunables
            self._worker.set_trained(command.branch, self.final_tunables)
            return False
        else:
            if self._error is not None:  # rank 0 raises the driver's own exception
                raise self._error
            raise TuningError(f"the tuner on rank 0 stopped: {command.message}")
        if self.system is not None:
            self.system._done(None)
        return True

    def _fork(self, child: int, parent: int | None, tunables: dict[str, Any], kind: BranchKind) -> None:
        if parent is None:  # INIT: the root holds the weights written before start_iterations
            self._branches[child] = _Branch(kind, dict(tunables), _Cursor())
            return
        source = self._branches[int(parent)]
        training = kind is BranchKind.TRAINING
        # A setting the space does not tune stays the parent's (each table's own rule). The
        # tuned lr is the fastest table's: tables of other rates (param groups) keep their ratio.
        lr = float(tunables["lr"]) if training and "lr" in tunables else None
        momentum = float(tunables["momentum"]) if training and "momentum" in tunables else None
        slack = _engine_slack(kind, tunables)
        self._worker.fork_branch(child, int(parent), learning_rate=lr, momentum=momentum, training=training,
                                 slack=slack, keep_rate_ratios=True)
        # A TESTING branch runs the validation set from its start.
        cursor = _Cursor() if kind is BranchKind.TESTING else dataclasses.replace(source.cursor)
        self._branches[child] = _Branch(kind, dict(tunables), cursor, slack=slack)

    def _finish_run(self) -> None:
        self._run = None
        losses = [r[0] for r in self._reports]
        accuracy = [r[1] for r in self._reports]
        samples = [r[2] for r in self._reports]
        mine: dict[str, Any] = {"loss": losses, "accuracy": accuracy, "samples": samples}
        if self._balance:
            # The mean, and the last clocks' own (a bounded message at any run length).
            mine["busy"] = typical_busy(self._busy, stealing=self._claim_job is not None)
            mine["busy_samples"] = sum(self._busy_samples) / len(self._busy_samples) if self._busy_samples else 0.0
            mine["busy_clocks"] = [round(t, 6) for t in self._busy[-_BUSY_CLOCKS_SENT:]]
        waited = time.perf_counter()
        everyone = self._allgather("reports", mine)
        waited = time.perf_counter() - waited
        if self.system is None:
            return
        for rank, report in enumerate(everyone):
            check_report(rank, report, len(self._times), self._balance)
        if self._balancer is not None and self._run_kind is not BranchKind.TESTING and self._times:
            self._balancer.observe([float(r["busy_samples"]) for r in everyone],
                                   [float(r["busy"]) for r in everyone], [r["busy_clocks"] for r in everyone])
        # The run ends when the slowest worker has clocked it: rank 0's wait
        # here is part of its time. Spread over its clocks, so that a high
        # slack (rank 0 running ahead) is not counted cheaper than it is.
        extra = waited / len(self._times) if self._times else 0.0
        reports = []
        for clock, seconds in enumerate(t + extra for t in self._times):
            loss = _mean_by_samples([(float(r["loss"][clock]), r["samples"][clock]) for r in everyone])
            weighted = [(r["accuracy"][clock], r["samples"][clock]) for r in everyone
                        if r["samples"][clock] and r["accuracy"][clock] is not None]
            total = sum(n for _, n in weighted)
            acc = math.fsum(a * n for a, n in weighted) / total if total else None
            reports.append(ClockReport(loss=loss, seconds=seconds, accuracy=acc,
                                       samples=sum(int(r["samples"][clock]) for r in everyone)))
        self.system._done(reports)

    def _stall_seconds(self) -> float:
        return float(getattr(self._worker, "stall_seconds", 0.0))

    def _check_same_arguments(self) -> None:
        """Every rank must give the session the same data and settings: the
        ranks cut each clock's samples from one shuffled order, so another
        seed or set size on one rank trains on overlapping samples without
        a word, and ranks that disagree on stealing wait on each other's
        gathers until the timeout."""
        mine = {"num_train": self._num_train, "num_validation": self._num_validation,
                "batch_size": self._batch_size, "seed": self._seed, "num_clocks_to_test": self._num_test_clocks,
                "balance_batches": self._balance, "steal_batches": self._claim_job is not None}
        mine = {k: int(v) if is_integer(v) else v  # numpy's too: JSON
                for k, v in mine.items()}
        everyone = self._allgather("arguments", mine)
        for rank, theirs in enumerate(everyone):
            differ = sorted(k for k in mine if not isinstance(theirs, dict) or theirs.get(k) != mine[k])
            if differ:
                raise InvalidArgumentError(
                    "every rank must start the TuningSession with the same arguments; "
                    + ", ".join(f"{k}={mine[k]!r} here, {theirs.get(k)!r} on rank {rank}" for k in differ
                                if isinstance(theirs, dict))
                    + " (the ranks cut each clock's samples from one shuffled order of one data set)")

    def _allgather(self, what: str, value: Any) -> list[Any]:
        self._sequence += 1
        return self._job.allgather(f"tune-{self._sequence}-{what}", value, self._timeout_s)

    # -- data cursors ---------------------------------------------------------------

    def _batch_of(self, tunables: Mapping[str, Any]) -> int:
        return int(tunables["batch_size"]) if "batch_size" in tunables else int(self._batch_size or 0)

    def _make_step(self, branch_id: int) -> Step:
        branch = self._branches[branch_id]
        cursor = branch.cursor
        if branch.kind is BranchKind.TESTING:
            # Clocks of near-equal size: the tuner averages their accuracies.
            clocks = self._num_test_clocks
            part = np.array_split(np.arange(self._num_validation), clocks)[cursor.offset % clocks]
            indices, clock_samples = self._my_part(part), len(part)
            cursor.offset += 1
        else:
            batch = self._batch_of(branch.tunables)
            chunk = batch * self._world
            if cursor.offset + chunk > self._num_train:  # the rest of the epoch is dropped
                cursor.epoch, cursor.offset = cursor.epoch + 1, 0
            order = self._permutation(cursor.epoch)
            run_clock = self._run_clock
            claim = self._claim(branch_id, branch.clocks) if self._run_steals else None
            indices, clock_samples = self._my_part(order[cursor.offset:cursor.offset + chunk], claim, run_clock), chunk
            cursor.offset += chunk
        weight = len(indices) * self._world / clock_samples if clock_samples else 1.0
        step = Step(branch_id, branch.kind, branch.tunables, indices, cursor.epoch, branch.clocks, self, weight)
        branch.clocks += 1
        return step

    def _my_part(self, samples: np.ndarray, claim: Claim | None = None, run_clock: int = 0) -> np.ndarray:
        """This rank's samples of a clock: its slice (equal parts, or by the
        run's shares), or with a ``claim`` its pieces of every slice of this
        clock and of earlier ones (``run_clock``: this clock's number in the
        run) that it computes now."""
        if self._shares is None:
            slices = np.array_split(samples, self._world)
        else:
            slices = np.split(samples, np.cumsum(split_counts(len(samples), self._shares))[:-1])
        self._part_moved = False
        if claim is None:
            return slices[self._rank]
        self._recent_slices[run_clock] = slices
        self._recent_slices.pop(run_clock - CARRY_WINDOW - 1, None)  # a run's clocks come one by one
        given = claim.gives(self._rank)
        taken = claim.takes(self._rank)
        self.clocks_given += given
        self.clocks_taken += taken
        self._part_moved = given or taken
        parts = list(zip(slices, claim.owners, strict=True))
        for earlier, owners in sorted(claim.carried.items()):
            if earlier not in self._recent_slices:
                raise TuningError(f"the claim board moved parts of the run's clock {earlier} to clock {run_clock}; "
                                  f"this rank keeps the samples of the last {CARRY_WINDOW} only")
            parts += zip(self._recent_slices[earlier], owners, strict=True)
        mine = [np.array_split(part, len(who))[who.index(self._rank)] for part, who in parts if self._rank in who]
        return np.concatenate(mine) if mine else samples[:0]

    def _choose_claim_board(self, job: ServingCollective) -> None:
        """Where the ranks claim their clocks: a board file they all share
        when they run on one host (``_shared_board.py``), else rank 0's
        board through requests. Every rank must have opened rank 0's file
        and share its boot (one kernel: one monotonic clock), or none uses it."""
        path = new_board_file() if self._rank == 0 and _SHARED_CLAIMS else None
        try:
            boot = _boot_id()
            offer = self._allgather("claim-board", {"path": path, "boot": boot})[0]
            shared: SharedClaimBoard | None = None
            if isinstance(offer, dict) and isinstance(offer.get("path"), str) and boot is not None \
                    and offer.get("boot") == boot:
                try:
                    shared = SharedClaimBoard(offer["path"], self._world, self._timeout_s, self._steal_after)
                except OSError:
                    shared = None
            if all(self._allgather("claim-board-open", shared is not None)):
                self._claimer = shared
            elif shared is not None:
                shared.close()
        finally:
            if path is not None:
                os.unlink(path)  # every rank that uses it has it open
        if self._claimer is None:
            self._claimer = ClaimsThroughRankZero(self._rank, self._world, job.serve, job.request, self._timeout_s,
                                                  self._steal_after)

    def _claim(self, branch: int, branch_clock: int) -> Claim:
        """Who computes what in this training clock (the claim board); the
        decision's empty clocks are declared to every shard from here."""
        if self._claimer is None:
            raise TuningError("rank 0 runs with batch stealing, but this rank's session has steal_batches off")
        clock, self._run_clock = self._run_clock, self._run_clock + 1
        started = None
        while isinstance(claim := self._claimer.claim(self._rank, self._run_id, clock, self._run_slack,
                                                           self._run_samples), Wait):
            # This rank's read of the clock would wait for a rank that is not late yet: wait here
            # instead, where its parts can still move once it is.
            started = time.monotonic() if started is None else started
            if time.monotonic() + claim.seconds > started + self._timeout_s:
                raise WaitTimeoutError(f"rank {self._rank} waited {self._timeout_s:g} s to claim clock {clock} of "
                                       "its run: the claim board kept it waiting for a late rank")
            time.sleep(claim.seconds)
        if started is not None:
            self.claim_wait_s += time.monotonic() - started
        for late, empty in claim.declare:
            # The run's clocks are the branch's, counted from the run's start.
            self._worker.declare_empty_clock(late, branch, branch_clock - clock + empty)
        return claim

    def _permutation(self, epoch: int) -> np.ndarray:
        order = self._permutations.get(epoch)
        if order is None:
            if len(self._permutations) > 4:
                self._permutations.pop(min(self._permutations))
            order = np.random.default_rng([self._seed, epoch]).permutation(self._num_train)
            self._permutations[epoch] = order
        return order

    # -- rank 0: the driver thread --------------------------------------------------

    def _start_driver(self) -> None:
        assert self.system is not None
        system = self.system
        driver = self.driver or self._default_driver

        def body() -> None:
            try:
                result = driver(system)
            except BaseException as error:  # handed to the main thread, which raises it
                system._finish(error=error)
            else:
                system._finish(result=result)

        self._thread = threading.Thread(target=body, name="mltuner-tuner", daemon=True)
        self._thread.start()

    def _default_driver(self, system: BranchSystem) -> Any:
        log = self._log if isinstance(self._log, DecisionLog) else DecisionLog(self._log)
        owned = log is not self._log
        # log= and `mltuner run`: the run's display and report follow its own file.
        copy = run_log_copy(log.path)
        if copy is not None:
            log.listeners.append(copy)
        try:
            return Tuner(system, self._space, self._config, log=log).run()
        finally:
            if copy is not None:
                log.listeners.remove(copy)
            if owned:
                log.close()


# MLTUNER_SHARED_CLAIMS=0: claims go to rank 0 even when every rank is on one host.
_SHARED_CLAIMS = os.environ.get("MLTUNER_SHARED_CLAIMS", "1") != "0"


def _engine_slack(kind: BranchKind, tunables: Mapping[str, Any]) -> int | None:
    """The slack a forked branch of ``kind`` gets in the engine; None: each
    read's own (``Worker.fork_branch``). Only a TRAINING branch runs at its
    ``staleness``; the others (lr = 0: EVALUATION, TESTING) at 0. The INIT
    root is not forked: it keeps the reads' own."""
    if kind is BranchKind.TRAINING:
        staleness = tunables.get("staleness")
        return None if staleness is None else int(staleness)
    return 0


def _boot_id() -> str | None:
    """This kernel's boot id: ranks that share it share a monotonic clock."""
    try:
        with open("/proc/sys/kernel/random/boot_id", encoding="ascii") as file:
            return file.read().strip()
    except OSError:
        return None


def typical_busy(busy: Sequence[float], stealing: bool) -> float:
    """A rank's busy seconds per clock of a run, as the balancer models it:
    the mean, or with stealing the median. A delay that comes and goes is
    then the thieves' to absorb; the mean of a rank with bursts of delay
    would give it a smaller share for good (down to one sample a clock on 4
    workers, measured), and the others its work on every clock."""
    if not busy:
        return 0.0
    return float(np.median(busy)) if stealing else math.fsum(busy) / len(busy)


def _mean_by_samples(values: Sequence[tuple[float, int]]) -> float:
    """The mean of per-worker means, each weighted by its samples (plain
    when their samples are equal; a worker with none counts nothing)."""
    if len({n for _, n in values}) > 1:
        values = [(v, n) for v, n in values if n]
    total = sum(n for _, n in values)
    if not total or len({n for _, n in values}) == 1:
        return math.fsum(v for v, _ in values) / len(values)
    return math.fsum(v * n for v, n in values) / total


def _check_momentum_rules(job: Collective) -> None:
    """A momentum tunable needs rules that read it: sgd (torch's momentum) or
    damped_momentum, in every communicated table (or, before any table
    exists, in the job's Config)."""
    worker = job.worker
    config = getattr(job, "config", None)
    rules = [worker.update_rule_of(t) for t in worker.tables if not t.local] if worker.tables else []
    if not rules and config is not None:
        rules = [config.update_rule]
    for rule in rules:
        if rule is not None and rule.kind not in ("sgd", "damped_momentum"):
            before = "" if worker.tables else " (no tables yet: the Config's rule; wrap() the model first)"
            betas = " (Adam's betas are not tuned)" if rule.kind.startswith("adam") else ""
            raise InvalidArgumentError(
                f"the space tunes momentum but an update rule is {rule.kind!r}{before}, which has none{betas}: "
                "leave momentum out of the space (a SearchSpace of the other tunables), "
                "or train with torch.optim.SGD(momentum=...) / "
                "UpdateRule('sgd', momentum=...) (torch's) or UpdateRule('damped_momentum', ...) (MLtuner's)")


class PSBranchSystem:
    """The :class:`BranchSystem` of a :class:`TuningSession`, on rank 0.

    Its methods run on the driver's thread: each queues a command for the
    training loop's thread and waits (bounded) for it to be done on every
    rank. Branch ids are handed out in order; the INIT root is the engine's
    branch 0, whose weights the application wrote before ``start_iterations``,
    or a previous session's final branch (running it is a no-op).
    """

    def __init__(self, session: TuningSession) -> None:
        self._session = session
        # Wire form (JSON objects): what rank 0 hands to allgather.
        self._commands: queue.Queue[dict[str, Any]] = queue.Queue()
        self._answers: queue.Queue[Any] = queue.Queue()
        self._root = session._root_branch
        self._next_id = self._root + 1  # the root is the newest live branch
        self._closed = False
        self._ended = False
        self.elapsed_s = 0.0  # clock time of every branch run so far

    # -- BranchSystem ---------------------------------------------------------------

    def fork(self, parent: int | None, tunables: Mapping[str, Any], kind: BranchKind) -> int:
        """Forks a branch on every rank (:meth:`BranchSystem.fork`). The INIT
        root (``parent`` None) is the session's root branch; other branches
        get the next id.

        Raises:
            mltuner.InvalidArgumentError: ``tunables`` is not a setting of the
                space, or a branch other than INIT has no parent.
        """
        self._session._space.check_setting(tunables)
        if parent is None:
            if kind is not BranchKind.INIT:
                raise InvalidArgumentError(f"only an INIT branch has no parent, got {kind}")
            child = self._root
        else:
            child, self._next_id = self._next_id, self._next_id + 1
        self._call(ForkCommand(child, parent, dict(tunables), kind))
        return child

    def free(self, branch: int) -> None:
        """Frees ``branch`` on every rank (:meth:`BranchSystem.free`)."""
        self._call(FreeCommand(int(branch)))

    def run(self, branch: int, clocks: int) -> Sequence[ClockReport]:
        """Runs ``branch`` for ``clocks`` clocks of the training loop on every
        rank (:meth:`BranchSystem.run`), in runs of at most 2,000 clocks, and
        returns one report a clock: the ranks' losses and accuracies averaged
        by samples, rank 0's time. The INIT root runs nothing: its reports
        are zeros.

        Raises:
            mltuner.InvalidArgumentError: ``clocks`` below 1.
        """
        if clocks < 1:
            raise InvalidArgumentError(f"run needs clocks >= 1, got {clocks}")
        if branch == self._root:
            return [ClockReport(loss=0.0, seconds=0.0)] * clocks
        reports: list[ClockReport] = []
        while len(reports) < clocks:
            part = min(clocks - len(reports), _MAX_CLOCKS_PER_RUN)
            reports += self._call(RunCommand(int(branch), part))
        self.elapsed_s += math.fsum(r.seconds for r in reports)
        return reports

    def clocks_per_epoch(self, tunables: Mapping[str, Any]) -> int:
        """The session's clocks per epoch at this setting's batch size."""
        return self._session.clocks_per_epoch(tunables)

    # -- the hand-off between the two threads ------------------------------------------

    def _call(self, command: ForkCommand | FreeCommand | RunCommand) -> Any:
        if self._closed:
            raise ShutdownError("the training loop ended; the tuning session is closed")
        self._commands.put(command.to_wire())
        # A run may take hours; what must not happen is a loop that stops
        # moving. Each clock the loop yields restarts the bound.
        timeout_s = self._session._timeout_s
        clocks, deadline = -1, 0.0
        while True:
            try:
                answer = self._answers.get(timeout=0.5)
            except queue.Empty:
                if self._closed:
                    raise ShutdownError("the training loop ended while the tuner waited for it") from None
                if self._session._clocks_yielded != clocks:
                    clocks, deadline = self._session._clocks_yielded, time.monotonic() + timeout_s
                elif time.monotonic() > deadline:
                    raise TuningError(f"the training loop made no progress on {command.to_wire()['op']!r} for "
                                      f"{timeout_s:g} s") from None
                continue
            if isinstance(answer, BaseException):
                raise answer
            return answer

    def _next_command(self, timeout_s: float) -> dict[str, Any]:
        """The training loop's thread: the driver's next command (bounded)."""
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                return self._commands.get(timeout=0.5)
            except queue.Empty:
                if time.monotonic() > deadline:
                    return ErrorCommand(f"the tuner made no decision within {timeout_s:g} s").to_wire()

    def _done(self, answer: Any) -> None:
        self._answers.put(answer)

    def _finish(self, *, result: Any = None, error: BaseException | None = None) -> None:
        """The driver's thread, when the driver returns or raises."""
        if error is not None:
            message = f"{type(error).__name__}: {error}"
            self._session._error = error
            self._commands.put(ErrorCommand(message).to_wire())
            return
        self._session.result = result
        branch = getattr(result, "branch", None)
        tunables = getattr(result, "tunables", None)
        self._commands.put(EndCommand(branch if isinstance(branch, int) else None,
                                      dict(tunables) if isinstance(tunables, Mapping) else None).to_wire())

    def _close(self) -> None:
        self._closed = True
