"""One search episode (mltuner.md §1.1 steps 1-4, with a time budget): the
starting progress, then the paper's trial-time rule with concurrent trials,
which sets the start length, then successive halving over new trials, then
the winner, which keeps its trial progress.

Successive halving replaces the paper's sequential search (one trial after
another, each for the full trial time): rung 0 runs as many new trials as
the budget pays for to the start length, every rung keeps the better half
(by slope) and doubles their length, and a trial that falls behind the best
one during its run stops there. The cost is bounded by the budget, not by
the trial cap times the trial time.

The budget has a floor (:class:`SearchBudget`): a share of a short job pays
for trials too short to tell settings apart, so a search may go past its
share, up to a ceiling, for what the trial-time rule takes to find its
trial time plus successive halving over a few trials of that length.
"""

from __future__ import annotations

import dataclasses
import math
import statistics
from collections.abc import Mapping, Sequence
from typing import Any, Literal

from mltuner.exceptions import InvalidArgumentError
from mltuner.tune._config import TunerConfig
from mltuner.tune._errors import TuningError
from mltuner.tune._log import DecisionLog
from mltuner.tune._progress import ProgressState
from mltuner.tune.tuner._searcher import STOP_THRESHOLD, Searcher
from mltuner.tune._system import BranchKind, BranchSystem, ClockReport
from mltuner.tune.tuner._trial import Trial

__all__ = ["SearchEpisode", "SearchResult", "SearchBudget", "halving_size", "halving_cost"]

_PHASE = "search"
# Checks of a trial against the best one during its run in a rung: it runs
# in this many parts, and may stop after each but the last.
_CHECKS_PER_RUN = 4
# Losses in the last quarter of a curve needed to judge its level (_clearly_lowest).
_MIN_TAIL = 8
# The least drop below the start that counts there, as a share of the start.
_CLEAR_DROP = 0.02


def _rank(trial: Trial) -> float:
    # Lower slopes are better; no progress (NaN) ranks last.
    return trial.slope if math.isfinite(trial.slope) else math.inf


def halving_cost(trials: int, length_s: float) -> float:
    """Seconds of successive halving over ``trials`` trials that start at
    ``length_s``, one of which (the trial-time phase's winner) has run it
    already: rung 0 runs the others to the start length, and every later
    rung runs the better half on to twice its length, until one is left.
    Trials that stop early because they cannot beat the best cost less."""
    cost = (trials - 1) * length_s
    kept = trials
    while True:
        kept = math.ceil(kept / 2)
        if kept <= 1:
            return cost
        cost += kept * length_s  # each survivor runs from length to 2 x length
        length_s *= 2


def halving_size(budget_s: float, length_s: float, most: int) -> int:
    """Trials in rung 0 of successive halving (the phase's winner among
    them) that ``budget_s`` pays for by :func:`halving_cost`, at least 1 and
    at most ``most``."""
    if length_s <= 0 or not math.isfinite(budget_s):
        return most
    n = 1
    while n < most and halving_cost(n + 1, length_s) <= budget_s:
        n += 1
    return n


@dataclasses.dataclass(frozen=True)
class SearchBudget:
    """What one search may spend on its clocks (the evaluation branch and
    every trial).

    Attributes:
        share: the search's share of the job's budget.
        ceiling: the most the job's searches may spend together when the
            floor raises them, at least ``share``; None: the share is a
            hard limit. The floor is what the trial-time rule takes to find
            the trial time (rounds of doubling until a trial converges or
            all reach the one-epoch cap) plus :func:`halving_cost` of
            ``TunerConfig.floor_trials`` trials of that length; every raise
            is a ``budget_floor`` record. The floor may raise this search
            to ``max(share, ceiling - spent_before_s)``: never past the
            ceiling, and never below its share.
        unit: ``"seconds"`` of clocks, or ``"epochs"`` at the parent's
            setting, turned into seconds once the evaluation branch has run
            (see :class:`SearchEpisode`).
        spent_before_s: seconds the job's earlier searches spent.
    """

    share: float
    ceiling: float | None = None
    unit: Literal["seconds", "epochs"] = "seconds"
    spent_before_s: float = 0.0

    def __post_init__(self) -> None:
        if not (isinstance(self.share, (int, float)) and math.isfinite(self.share)
                and self.share > 0):
            raise InvalidArgumentError(f"a search budget must be > 0, got {self.share!r}")
        if self.ceiling is not None and not (
                isinstance(self.ceiling, (int, float)) and math.isfinite(self.ceiling)
                and self.ceiling >= self.share):
            raise InvalidArgumentError(
                f"a search budget's ceiling must be at least its share ({self.share}), "
                f"got {self.ceiling!r}")
        if not (math.isfinite(self.spent_before_s) and self.spent_before_s >= 0):
            raise InvalidArgumentError(
                f"spent_before_s must be a finite number >= 0, got {self.spent_before_s!r}")
        if self.unit not in ("seconds", "epochs"):
            raise InvalidArgumentError(
                f"a search budget's unit is 'seconds' or 'epochs', got {self.unit!r}")



def run_clocks(system: BranchSystem, branch: int, clocks: int) -> Sequence[ClockReport]:
    """``system.run(branch, clocks)``, checked: a system that runs fewer
    clocks than asked would make the tuner's loops spin.

    Raises:
        TuningError: the system returned another number of clock reports.
    """
    reports = system.run(branch, clocks)
    if len(reports) != clocks:
        raise TuningError(
            f"the training system returned {len(reports)} clock reports for branch {branch}, "
            f"asked to run {clocks} clocks"
        )
    return reports

@dataclasses.dataclass(frozen=True)
class SearchResult:
    """How a search episode ended.

    Attributes:
        winner: the trial that becomes the training branch, or None when no
            trial made progress (§1.1 step 3a).
        trials: how many trials the episode forked (caps the next re-tune).
        starting_progress: the baseline loss every trial was measured from.
        trial_time: the start length of successive halving (the paper's
            trial time), in seconds.
        all_diverged: every trial diverged (a non-finite or 10x loss).
        seconds: clock time the episode spent (its evaluation branch and
            every trial), in seconds.
        budget_s: the episode's budget at its end, the floor's raises
            included (None: unbounded).
        budget_exhausted: the budget stopped the search (without a winner,
            the budget ran out before any trial made progress: that says
            nothing about the model).
        share_s: the budget's share before the floor raised it (None:
            unbounded).
        diverged: the settings of the trials that diverged.
    """

    winner: Trial | None
    trials: int
    starting_progress: float
    trial_time: float
    all_diverged: bool
    seconds: float = 0.0
    budget_s: float | None = None
    budget_exhausted: bool = False
    share_s: float | None = None
    diverged: tuple[dict[str, Any], ...] = ()


class SearchEpisode:
    """Runs one search from ``parent`` (the INIT branch, the training
    branch at a re-tune, or the frozen best branch after a rollback). Frees
    every trial it forks except the winner; ``parent`` stays alive whatever
    happens (the tuner keeps it until the winner has survived a validation).

    Args:
        budget: what the search may spend, with its floor (see
            :class:`SearchBudget`); None is unbounded. The search stops
            forking trials and halving once the next step would overrun it,
            so it ends within about one trial run of the budget. A budget in
            epochs is turned into seconds with ``epoch_seconds`` (the
            tuner's measured epoch time) or, when that is None, with the
            evaluation branch's time per clock times the clocks of one epoch
            at the parent's setting.
        budget_s: shorthand for ``SearchBudget(budget_s)``: a hard limit in
            seconds, with no floor.
        trial_time_s: the first trial time, in place of
            ``config.initial_trial_time_s`` (a climb check runs its trials
            at the length an earlier search measured).
    """

    def __init__(
        self,
        system: BranchSystem,
        config: TunerConfig,
        searcher: Searcher,
        log: DecisionLog,
        *,
        index: int,
        parent: int,
        parent_tunables: Mapping[str, Any],
        trial_cap: int | None,
        budget: SearchBudget | None = None,
        budget_s: float | None = None,
        epoch_seconds: float | None = None,
        untrained: bool = False,
        trial_time_s: float | None = None,
    ) -> None:
        if budget is not None and budget_s is not None:
            raise InvalidArgumentError("give a search budget or budget_s, not both")
        if budget_s is not None:
            budget = SearchBudget(budget_s)
        if trial_time_s is not None and not (math.isfinite(trial_time_s) and trial_time_s > 0):
            raise InvalidArgumentError(f"trial_time_s must be > 0 or None, got {trial_time_s!r}")
        self._system = system
        self._config = config
        self._searcher = searcher
        self._log = log
        self._index = index
        self._parent = parent
        self._parent_tunables = dict(parent_tunables)
        self._trial_cap = trial_cap
        self._planned = budget
        self._epoch_seconds = epoch_seconds
        self._untrained = untrained  # the parent is the untrained model (_clearly_lowest)
        self._initial_trial_time = (trial_time_s if trial_time_s is not None
                                    else config.initial_trial_time_s)
        self._eval_epoch_s: float | None = None  # one epoch at the parent's setting
        self._floor_s = 0.0  # what the floor asked for so far, in seconds
        self._trials: list[Trial] = []
        self._baseline = math.nan
        self._trial_time = math.nan
        self._spent = 0.0
        self._stop_reason: str | None = None
        self._phase_a_trials = 0

    def run(self) -> SearchResult:
        """Runs the search: the starting progress (an evaluation branch from
        ``parent``), then trials of the trial time and successive halving
        among them, until the stop rule, the trial cap or the budget ends
        it. Returns how it ended; the winner's branch stays alive for the
        caller, every other trial is freed."""
        self._baseline = self._starting_progress()
        first = self._new_trial()
        if first is None:
            return self._finish(None)
        # §1.1 step 3a: the trial time starts at the searcher's first decision
        # time; measured, no shorter than the first trial's samples (§1.2: no
        # trial runs less). Below that, a round only forks one more trial of
        # samples, which every later round then extends: rounds that cost
        # and decide nothing.
        initial = self._initial_trial_time
        if initial is not None:
            self._trial_time = initial
            self._note("trial_time", trial_time_s=self._trial_time, reason="initial")
        else:
            decision = self._searcher.decision_seconds
            self._extend(first, 0.0)
            self._trial_time = max(decision, first.run_time)
            self._note("trial_time", trial_time_s=self._trial_time, reason="initial",
                       decision_s=decision, samples_s=first.run_time)
        winner, keep_searching = self._find_trial_time(first)
        self._phase_a_trials = len(self._trials)
        if winner is not None and keep_searching:
            winner = self._halving(winner)
        return self._finish(winner)

    # -- §1.1 step 1 -----------------------------------------------------------------

    def _starting_progress(self) -> float:
        system = self._system
        branch = system.fork(self._parent, self._parent_tunables, BranchKind.EVALUATION)
        try:
            reports = self._run(branch, self._config.num_clocks_to_eval)
        finally:
            system.free(branch)
        losses = [float(r.loss) for r in reports]
        for clock, loss in enumerate(losses):
            if not math.isfinite(loss) and self._index == 0:
                raise TuningError(
                    f"the loss is {loss} at clock {clock} of the evaluation branch (lr = 0, "
                    f"search {self._index}), before any trial trained: the model gives a "
                    "non-finite loss from the first clock. Check the initial weights, the input "
                    "data and the loss function."
                )
            if not math.isfinite(loss):
                raise TuningError(
                    f"the loss is {loss} at clock {clock} of the evaluation branch (lr = 0) that "
                    f"starts search {self._index}, from branch {self._parent}, the model trained so far: "
                    "its weights or the data give a non-finite loss without any update (check the data of "
                    "those clocks, and the loss for inputs it cannot take)."
                )
        baseline = math.fsum(losses) / len(losses)
        # From the second clock on, as a trial's time per clock (§1.2).
        seconds = [float(r.seconds) for r in reports][1:] or [float(reports[0].seconds)]
        per_clock = math.fsum(seconds) / len(seconds)
        self._eval_epoch_s = per_clock * self._system.clocks_per_epoch(self._parent_tunables)
        self._note("starting_progress", branch=branch, loss=baseline,
                   tunables=self._parent_tunables, clocks=len(losses),
                   budget_s=self._budget, ceiling_s=self._ceiling)
        return baseline

    # -- the budget, in seconds ---------------------------------------------------------

    def _unit_s(self) -> float | None:
        """Seconds per unit of the budget. An epoch is the tuner's measured
        one when given, else one of the setting that will train: the best
        trial's so far (its time per clock x its clocks per epoch; batch
        sizes make epochs of one job differ severalfold), before any the
        evaluation branch's at the parent's setting."""
        planned = self._planned
        if planned is None or planned.unit == "seconds":
            return 1.0
        if self._epoch_seconds is not None:
            return self._epoch_seconds
        leader = min((t for t in self._trials if math.isfinite(t.slope)), key=_rank,
                     default=None)
        if leader is not None:
            return leader.time_per_clock() * leader.cap
        return self._eval_epoch_s

    @property
    def _share(self) -> float | None:
        unit = self._unit_s()
        return None if self._planned is None or unit is None else self._planned.share * unit

    @property
    def _ceiling(self) -> float | None:
        planned, unit, share = self._planned, self._unit_s(), self._share
        if planned is None or planned.ceiling is None or unit is None or share is None:
            return None
        return max(share, planned.ceiling * unit - planned.spent_before_s)

    @property
    def _budget(self) -> float | None:
        """The limit now: the share, raised by the floor up to the ceiling."""
        share, ceiling = self._share, self._ceiling
        if share is None or ceiling is None:
            return share
        return max(share, min(self._floor_s, ceiling))

    # -- §1.1 step 3a: finding the trial time (paper Algorithm 1) ---------------------

    def _find_trial_time(self, first: Trial) -> tuple[Trial | None, bool]:
        """Returns the phase's winner and whether successive halving follows."""
        open_trials = [first]
        while True:
            for trial in open_trials:
                self._extend(trial, self._trial_time)
            for trial in open_trials:
                self._summarize(trial)
            converging = [t for t in open_trials if t.summary is not None
                          and t.summary.state is ProgressState.CONVERGING
                          and t.summary.made_progress]
            if converging:
                winner = min(converging, key=lambda t: t.slope)
                for trial in open_trials:
                    if trial is not winner:
                        self._drop(trial, "lost")
                # The winner's run time is the start length of the halving.
                self._trial_time = winner.run_time
                self._note("trial_time", trial_time_s=self._trial_time, reason="converging",
                           branch=winner.branch)
                return winner, True

            progressing = [t for t in open_trials if math.isfinite(t.slope)]
            best = min(progressing, key=lambda t: t.slope, default=None)
            if best is None and self._untrained:
                # From the untrained model, short noisy curves may have no
                # slope yet (their largest rise outweighs their drop) while
                # one is clearly below the start: keep that one rather than
                # end the search with nothing and train the start setting
                # (seen: lr 0.01 crawling to 44%). From a trained model a
                # level alone says too little: there the rule stays.
                best = self._clearly_lowest(open_trials)
            survivors = []
            all_diverged = all(t.summary is not None and t.summary.state is ProgressState.DIVERGED
                               for t in open_trials)
            for trial in open_trials:
                assert trial.summary is not None
                if trial.summary.state is ProgressState.DIVERGED:
                    self._drop(trial, "diverged")
                elif trial.capped and trial is not best:
                    # §1.2: one epoch is the most a trial may run.
                    self._drop(trial, "capped")
                else:
                    survivors.append(trial)
            open_trials = survivors
            if all_diverged:
                # Every trial diverged, which says nothing about the trial
                # time: the floor pays for another setting at this one, as it
                # pays for the doubling rounds until a trial converges (seen:
                # a short job's search ended at its first trial, lr 16.7 of
                # [1e-3, 100], and the job with "no setting trains this model").
                new = None
                if self._may_fork(0) and (self._affords(self._trial_time) or self._raise_budget(
                        self._spent + self._trial_time, "trial_time", trial_time_s=self._trial_time)):
                    new = self._new_trial()
                if new is None:  # (_new_trial says why where it found no setting)
                    self._stop_once("budget" if self._may_fork(0) else "trial_cap")
                    return None, False
                open_trials.append(new)
                continue
            under_cap = any(not t.capped for t in open_trials)
            doubled = self._trial_time * 2
            # Another round costs every open trial's way to the doubled time,
            # and the new trial's; the floor pays for it (up to the ceiling)
            # while the rule is still looking for its trial time.
            cost = sum(max(0.0, doubled - t.run_time) for t in open_trials if not t.capped)
            if self._may_fork(len(open_trials)):
                cost += doubled
            affordable = self._affords(cost) or (under_cap and self._raise_budget(
                self._spent + cost, "trial_time", trial_time_s=doubled))
            if under_cap and affordable:
                self._trial_time = doubled
                self._note("trial_time", trial_time_s=self._trial_time, reason="doubled")
            # Where the doubled round is out of reach, what is left still buys
            # new settings at the current trial time: breadth where depth is
            # unaffordable (a short job's initial search otherwise stopped
            # with half its budget unspent and four random settings tried).
            widen = (not affordable and self._may_fork(len(open_trials))
                     and self._affords(self._trial_time))
            if not (affordable or widen):
                self._stop_once("budget")
            # (widen already includes the branch check)
            new = (self._new_trial() if widen or (affordable and self._may_fork(len(open_trials)))
                   else None)
            if new is not None:
                if widen:
                    self._note("trial_time", trial_time_s=self._trial_time, reason="widened",
                               branch=new.branch)
                open_trials.append(new)
            elif not (under_cap and affordable):
                # Nothing left to schedule: the best trial wins even if unstable;
                # with no progress at all, the search found nothing.
                for trial in open_trials:
                    if trial is not best:
                        self._drop(trial, "no_progress")
                if best is None:
                    return None, False
                self._trial_time = best.run_time
                return best, False

    def _clearly_lowest(self, trials: list[Trial]) -> Trial | None:
        """The trial whose last quarter of losses lies lowest below the
        starting progress, clearly (see below); None when none does (or none
        has enough clocks to tell)."""
        best: Trial | None = None
        best_mean = self._baseline
        for trial in trials:
            if trial.summary is None or trial.summary.state is ProgressState.DIVERGED:
                continue
            tail = trial.losses[-max(1, len(trial.losses) // 4):]
            if len(tail) < _MIN_TAIL or not all(math.isfinite(v) for v in tail):
                continue
            mean = statistics.fmean(tail)
            error = statistics.stdev(tail) / math.sqrt(len(tail))
            # Clearly: by three standard errors, and by a share of the start
            # that a smooth but negligible drift (lr 1e-3) does not reach.
            margin = max(3 * error, _CLEAR_DROP * abs(self._baseline))
            if mean + margin < self._baseline and mean < best_mean:
                best, best_mean = trial, mean
        return best

    # -- successive halving ------------------------------------------------------------

    def _halving(self, best: Trial) -> Trial:
        length = self._trial_time
        slots = self._config.num_branches - 2  # the parent and the phase's winner
        bound = "branches"
        if self._trial_cap is not None and self._trial_cap - len(self._trials) <= slots:
            slots, bound = self._trial_cap - len(self._trials), "trial_cap"
        # The floor: halving over floor_trials trials of the start length.
        floor_trials = min(self._config.floor_trials, max(0, slots) + 1)
        self._raise_budget(self._spent + halving_cost(floor_trials, length), "halving",
                           length_s=length, trials=floor_trials)
        most = max(0, slots)
        remaining = math.inf if self._budget is None else self._budget - self._spent
        self._note("halving", rung=0, length_s=length,
                   trials=halving_size(remaining, length, most + 1))
        rung = [best]
        while True:
            if len(self._trials) - self._phase_a_trials >= most:
                self._stop_once(bound)
                break
            # One more trial of the start length, and the later rungs of a
            # rung one larger; a loser that stopped early leaves its unspent
            # time to the next trial.
            later = halving_cost(len(rung) + 1, length) - len(rung) * length
            if not self._affords(length + later):
                self._stop_once("budget")
                break
            trial = self._new_trial()
            if trial is None:
                break
            rival = min(rung, key=_rank)
            if self._run_against(trial, length, rival):
                rung.append(trial)
        number = 0
        while len(rung) > 1:
            rung.sort(key=_rank)
            keep = rung[: math.ceil(len(rung) / 2)]
            for trial in rung[len(keep):]:
                self._drop(trial, "halved")
            rung = keep
            if len(rung) == 1:
                break
            cost = sum(max(0.0, 2 * length - t.run_time) for t in rung)
            if not self._affords(cost):
                self._stop_once("budget")
                break
            length *= 2
            number += 1
            self._note("halving", rung=number, length_s=length, trials=len(rung))
            survivors = [rung[0]]
            self._extend(rung[0], length)
            self._summarize(rung[0])
            for trial in rung[1:]:
                rival = min(survivors, key=_rank)
                if self._run_against(trial, length, rival):
                    survivors.append(trial)
            rung = survivors
        winner = min(rung, key=_rank)
        for trial in rung:
            if trial is not winner:
                self._drop(trial, "halved")
        return winner

    def _run_against(self, trial: Trial, length: float, rival: Trial) -> bool:
        """Runs ``trial`` to ``length`` seconds in parts, stopping it as soon
        as it cannot beat ``rival``: it diverged, made no progress, or its
        slope is more than STOP_THRESHOLD worse than the rival's (a slope
        per second flattens as training goes on, so a trial behind at part
        of the length stays behind). Returns whether it ran to the end;
        one that did not is dropped."""
        samples = self._config.num_progress_samples
        while True:
            more = trial.clocks_to_reach(length, samples)
            if more <= 0:
                break
            # A new trial first runs its samples (its time per clock is not
            # known before); then parts of about a quarter of its length.
            part = max(samples, math.ceil((trial.clocks + more) / _CHECKS_PER_RUN))
            self._record(trial, more if trial.clocks == 0 else min(part, more))
            summary = self._summarize(trial)
            if summary.state is ProgressState.DIVERGED:
                self._drop(trial, "diverged")
                return False
            if trial.clocks_to_reach(length, samples) <= 0:
                break
            if trial.clocks >= 2 * samples and (
                    not summary.made_progress
                    or summary.slope > rival.slope * (1.0 - STOP_THRESHOLD)):
                self._drop(trial, "cannot_beat")
                return False
        return True

    # -- trials ------------------------------------------------------------------------

    def _may_fork(self, open_trials: int) -> bool:
        # The parent takes one of the num_branches slots.
        return (open_trials + 1 < self._config.num_branches
                and (self._trial_cap is None or len(self._trials) < self._trial_cap))

    def _new_trial(self) -> Trial | None:
        if self._trial_cap is not None and len(self._trials) >= self._trial_cap:
            self._stop_once("trial_cap")
            return None
        if self._searcher.should_stop(t.slope for t in self._trials):
            self._stop_once("exhausted" if self._searcher.exhausted() else "top_k_close")
            return None
        proposal = self._searcher.ask()
        if proposal is None:
            self._stop_once("exhausted")
            return None
        cap = self._system.clocks_per_epoch(proposal.tunables)
        if cap < 1:
            raise InvalidArgumentError(
                f"the setting {proposal.tunables} gives {cap} clocks per epoch: one batch is "
                "larger than the whole epoch"
            )
        branch = self._system.fork(self._parent, proposal.tunables, BranchKind.TRAINING)
        trial = Trial(proposal, branch, cap)
        self._trials.append(trial)
        self._note("fork_trial", branch=branch, tunables=proposal.tunables,
                   trial=proposal.number, varied=proposal.varied, cap_clocks=cap,
                   enqueued=proposal.enqueued)
        return trial

    def _extend(self, trial: Trial, length: float) -> None:
        # A new trial runs its first clocks to measure its time per clock, then
        # on to ``length`` (§1.2); an older one only the second step.
        passes = 2 if trial.clocks == 0 else 1
        for _ in range(passes):
            clocks = trial.clocks_to_reach(length, self._config.num_progress_samples)
            if clocks > 0:
                self._record(trial, clocks)

    def _record(self, trial: Trial, clocks: int) -> None:
        trial.record(self._run(trial.branch, clocks))

    def _run(self, branch: int, clocks: int) -> Sequence[ClockReport]:
        reports = run_clocks(self._system, branch, clocks)
        self._spent += math.fsum(float(r.seconds) for r in reports)
        return reports

    def _affords(self, seconds: float) -> bool:
        return self._budget is None or self._spent + seconds <= self._budget

    def _raise_budget(self, needed: float, reason: str, **fields: Any) -> bool:
        """The floor: raises the budget towards ``needed`` seconds, never
        past the ceiling, and logs it (``budget_floor``). Returns whether
        the budget now covers ``needed``."""
        budget, ceiling = self._budget, self._ceiling
        if budget is None or needed <= budget:
            return True
        if ceiling is None or budget >= ceiling:
            return False
        self._floor_s = needed
        self._note("budget_floor", reason=reason, share_s=self._share, budget_s=self._budget,
                   ceiling_s=ceiling, needed_s=needed, spent_s=self._spent, **fields)
        return needed <= ceiling

    def _summarize(self, trial: Trial) -> Any:
        summary = trial.summarize(self._baseline)
        self._note("summary", branch=trial.branch, tunables=trial.tunables,
                   loss=trial.losses[-1], state=summary.state, slope=summary.slope,
                   noise=summary.noise, range=summary.range, run_time_s=trial.run_time,
                   clocks=trial.clocks, spent_s=self._spent)
        return summary

    def _tell(self, trial: Trial, outcome: str) -> None:
        if trial.told or trial.summary is None:
            return
        trial.told = True
        self._searcher.tell(trial.proposal, trial.summary, trial.losses, {
            "branch": trial.branch, "outcome": outcome, "run_time_s": trial.run_time,
            "search": self._index,
        }, seconds=trial.seconds)

    def _drop(self, trial: Trial, reason: str) -> None:
        self._tell(trial, reason)
        self._system.free(trial.branch)
        self._note("free_trial", branch=trial.branch, tunables=trial.tunables, reason=reason,
                   slope=trial.slope, run_time_s=trial.run_time)

    # -- §1.1 step 4 -------------------------------------------------------------------

    def _finish(self, winner: Trial | None) -> SearchResult:
        study = self._searcher.study
        study.set_user_attr("starting_progress", self._baseline)
        study.set_user_attr("trial_time_s", self._trial_time if math.isfinite(self._trial_time)
                            else None)
        study.set_user_attr("seconds", self._spent)
        study.set_user_attr("budget_s", self._budget)
        study.set_user_attr("share_s", self._share)
        if winner is not None:
            self._tell(winner, "best")
            study.set_user_attr("winner_trial", winner.proposal.number)
            study.set_user_attr("winner_tunables", winner.tunables)
            self._note("winner", branch=winner.branch, tunables=winner.tunables,
                       slope=winner.slope, state=winner.summary.state if winner.summary else None,
                       clocks=winner.clocks, trials=len(self._trials),
                       trial_time_s=self._trial_time, seconds=self._spent,
                       budget_s=self._budget, share_s=self._share)
        else:
            self._note("no_progress", branch=self._parent, trials=len(self._trials),
                       seconds=self._spent, budget_s=self._budget, share_s=self._share)
        self._searcher.publish()
        diverged = tuple(dict(t.tunables) for t in self._trials
                         if t.summary is not None and t.summary.state is ProgressState.DIVERGED)
        return SearchResult(winner, len(self._trials), self._baseline, self._trial_time,
                            bool(self._trials) and len(diverged) == len(self._trials), self._spent, self._budget,
                            self._stop_reason == "budget", self._share, diverged)

    # -- helpers -----------------------------------------------------------------------

    def _stop_once(self, reason: str) -> None:
        if self._stop_reason is None:
            self._stop_reason = reason
            self._note("search_stop", reason=reason, trials=len(self._trials),
                       seconds=self._spent, budget_s=self._budget)

    def _note(self, event: str, **fields: Any) -> None:
        self._log.write(event, phase=_PHASE, search=self._index, **fields)
