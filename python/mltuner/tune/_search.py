"""One search episode (mltuner.md §1.1 steps 1-4): the starting progress, then
trial-time discovery with concurrent trials, then a sequential search, then
the winner, which keeps its trial progress."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from typing import Any

from mltuner.exceptions import InvalidArgumentError
from mltuner.tune._config import TunerConfig
from mltuner.tune._errors import TuningError
from mltuner.tune._log import DecisionLog
from mltuner.tune._progress import ProgressState
from mltuner.tune._searcher import Searcher
from mltuner.tune._system import BranchKind, BranchSystem
from mltuner.tune._trial import Trial

__all__ = ["SearchEpisode", "SearchResult"]

_PHASE = "search"


@dataclasses.dataclass(frozen=True)
class SearchResult:
    """How a search episode ended.

    Attributes:
        winner: the trial that becomes the training branch, or None when no
            trial made progress (§1.1 step 3a: the model has converged).
        trials: how many trials the episode forked (caps the next re-tune).
        starting_progress: the baseline loss every trial was measured from.
        trial_time: the final trial time, in seconds.
        all_diverged: every trial diverged (a non-finite or 10x loss).
    """

    winner: Trial | None
    trials: int
    starting_progress: float
    trial_time: float
    all_diverged: bool


class SearchEpisode:
    """Runs one search from ``parent`` (the INIT branch, or the training
    branch at a re-tune). Frees every trial it forks except the winner, and
    frees ``parent`` when there is a winner (§1.1 step 4); without a winner
    the parent stays alive and the caller keeps it."""

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
    ) -> None:
        self._system = system
        self._config = config
        self._searcher = searcher
        self._log = log
        self._index = index
        self._parent = parent
        self._parent_tunables = dict(parent_tunables)
        self._trial_cap = trial_cap
        self._trials: list[Trial] = []
        self._baseline = math.nan
        self._trial_time = math.nan
        self._stop_logged = False

    def run(self) -> SearchResult:
        self._baseline = self._starting_progress()
        first = self._new_trial()
        if first is None:
            return self._finish(None)
        # §1.1 step 3a: the trial time starts at the searcher's first decision time.
        initial = self._config.initial_trial_time_s
        self._trial_time = initial if initial is not None else self._searcher.decision_seconds
        self._note("trial_time", trial_time_s=self._trial_time, reason="initial")
        winner, keep_searching = self._find_trial_time(first)
        if winner is not None and keep_searching:
            winner = self._sequential(winner)
        return self._finish(winner)

    # -- §1.1 step 1 -----------------------------------------------------------------

    def _starting_progress(self) -> float:
        system = self._system
        branch = system.fork(self._parent, self._parent_tunables, BranchKind.EVALUATION)
        try:
            reports = system.run(branch, self._config.num_clocks_to_eval)
        finally:
            system.free(branch)
        self._check_count(branch, reports, self._config.num_clocks_to_eval)
        losses = [float(r.loss) for r in reports]
        for clock, loss in enumerate(losses):
            if not math.isfinite(loss):
                raise TuningError(
                    f"the loss is {loss} at clock {clock} of the evaluation branch (lr = 0, "
                    f"search {self._index}), before any trial trained: the model gives a "
                    "non-finite loss from the first clock. Check the initial weights, the input "
                    "data and the loss function."
                )
        baseline = math.fsum(losses) / len(losses)
        self._note("starting_progress", branch=branch, loss=baseline,
                   tunables=self._parent_tunables, clocks=len(losses))
        return baseline

    # -- §1.1 step 3a: finding the trial time (paper Algorithm 1) ---------------------

    def _find_trial_time(self, first: Trial) -> tuple[Trial | None, bool]:
        """Returns the phase's winner and whether the sequential search follows."""
        open_trials = [first]
        while True:
            for trial in open_trials:
                self._extend(trial)
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
                # The winner's run time is the trial time of the sequential search.
                self._trial_time = winner.run_time
                self._note("trial_time", trial_time_s=self._trial_time, reason="converging",
                           branch=winner.branch)
                self._tell(winner, "best")
                return winner, True

            progressing = [t for t in open_trials if math.isfinite(t.slope)]
            best = min(progressing, key=lambda t: t.slope, default=None)
            survivors = []
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
            under_cap = any(not t.capped for t in open_trials)
            if under_cap:
                self._trial_time *= 2
                self._note("trial_time", trial_time_s=self._trial_time, reason="doubled")
            # The parent takes one of the num_branches slots.
            new = self._new_trial() if len(open_trials) + 1 < self._config.num_branches else None
            if new is not None:
                open_trials.append(new)
            elif not under_cap:
                # Nothing left to schedule: the best trial wins even if unstable;
                # with no progress at all, the model has converged.
                for trial in open_trials:
                    if trial is not best:
                        self._drop(trial, "no_progress")
                if best is None:
                    return None, False
                self._trial_time = best.run_time
                self._tell(best, "best")
                return best, False

    # -- §1.1 step 3b: sequential search ---------------------------------------------

    def _sequential(self, best: Trial) -> Trial:
        while True:
            trial = self._new_trial()
            if trial is None:
                return best
            self._extend(trial)
            self._summarize(trial)
            # Any finite, better slope replaces the best; CONVERGING is not required.
            if math.isfinite(trial.slope) and trial.slope < best.slope:
                self._tell(trial, "best")
                self._note("best", branch=trial.branch, tunables=trial.tunables,
                           slope=trial.slope, replaces=best.branch)
                self._free(best)
                best = trial
            else:
                diverged = trial.summary is not None and (
                    trial.summary.state is ProgressState.DIVERGED)
                self._drop(trial, "diverged" if diverged else "lost")

    # -- trials ------------------------------------------------------------------------

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
                   trial=proposal.number, varied=proposal.varied, cap_clocks=cap)
        return trial

    def _extend(self, trial: Trial) -> None:
        # A new trial runs its first clocks to measure its time per clock, then
        # on to the trial time (§1.2); an older one only the second step.
        passes = 2 if trial.clocks == 0 else 1
        for _ in range(passes):
            clocks = trial.clocks_to_reach(self._trial_time, self._config.num_progress_samples)
            if clocks > 0:
                reports = self._system.run(trial.branch, clocks)
                self._check_count(trial.branch, reports, clocks)
                trial.record(reports)

    def _summarize(self, trial: Trial) -> None:
        summary = trial.summarize(self._baseline)
        self._note("summary", branch=trial.branch, tunables=trial.tunables,
                   loss=trial.losses[-1], state=summary.state, slope=summary.slope,
                   noise=summary.noise, range=summary.range, run_time_s=trial.run_time,
                   clocks=trial.clocks)

    def _tell(self, trial: Trial, outcome: str) -> None:
        if trial.told or trial.summary is None:
            return
        trial.told = True
        self._searcher.tell(trial.proposal, trial.summary, trial.losses, {
            "branch": trial.branch, "outcome": outcome, "run_time_s": trial.run_time,
            "search": self._index,
        })

    def _free(self, trial: Trial) -> None:
        self._system.free(trial.branch)

    def _drop(self, trial: Trial, reason: str) -> None:
        self._tell(trial, reason)
        self._free(trial)
        self._note("free_trial", branch=trial.branch, tunables=trial.tunables, reason=reason,
                   slope=trial.slope)

    # -- §1.1 step 4 -------------------------------------------------------------------

    def _finish(self, winner: Trial | None) -> SearchResult:
        study = self._searcher.study
        study.set_user_attr("starting_progress", self._baseline)
        study.set_user_attr("trial_time_s", self._trial_time if math.isfinite(self._trial_time)
                            else None)
        if winner is not None:
            self._system.free(self._parent)
            study.set_user_attr("winner_trial", winner.proposal.number)
            study.set_user_attr("winner_tunables", winner.tunables)
            self._note("winner", branch=winner.branch, tunables=winner.tunables,
                       slope=winner.slope, state=winner.summary.state if winner.summary else None,
                       clocks=winner.clocks, trials=len(self._trials),
                       trial_time_s=self._trial_time)
        else:
            self._note("no_progress", branch=self._parent, trials=len(self._trials))
        all_diverged = bool(self._trials) and all(
            t.summary is not None and t.summary.state is ProgressState.DIVERGED
            for t in self._trials
        )
        return SearchResult(winner, len(self._trials), self._baseline, self._trial_time,
                            all_diverged)

    # -- helpers -----------------------------------------------------------------------

    def _check_count(self, branch: int, reports: Any, clocks: int) -> None:
        # A system that runs fewer clocks than asked would make the trial loop spin.
        if len(reports) != clocks:
            raise TuningError(
                f"the training system returned {len(reports)} clock reports for branch "
                f"{branch}, asked to run {clocks} clocks"
            )

    def _stop_once(self, reason: str) -> None:
        if not self._stop_logged:
            self._stop_logged = True
            self._note("search_stop", reason=reason, trials=len(self._trials))

    def _note(self, event: str, **fields: Any) -> None:
        self._log.write(event, phase=_PHASE, search=self._index, **fields)
