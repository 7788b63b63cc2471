"""The rollback guard's eye on training: the training branch's loss,
summarised chunk by chunk with the trials' summariser (mltuner.md §1.3)."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

from mltuner.tune._progress import DIVERGENCE_THRESHOLD, GO_UP_THRESHOLD, summarize_progress

__all__ = ["TrainingGuard", "Alarm", "RISE_NOISE_FACTOR", "RISE_FRACTION", "RISE_CHUNKS",
           "CLEAR_DROP_ERRORS"]

# A chunk's mean loss counts as a rise when it is above the lowest chunk mean
# so far by more than the band: this many times that chunk's noise (the
# summariser's largest rise between consecutive points), and at least
# RISE_FRACTION of the progress made since the job's starting loss. A loss
# at its noise floor wanders by far more than one chunk's noise (SGD noise
# is correlated over many clocks), and a rise that undoes less than half
# of the training is the validation margin's to judge; a dead network
# undoes nearly all of it.
RISE_NOISE_FACTOR = 3.0
RISE_FRACTION = 0.5
# Chunks in a row that must rise before the guard calls it: one chunk may
# hold an unlucky stretch of batches, two in a row rarely do.
RISE_CHUNKS = 2
# A chunk mean is clearly below the starting loss when it is below it by
# more than this many standard errors of that mean (its clocks' spread over
# the square root of their count). A network that dies early (ReLUs killed
# by a large step in its first epoch) has made too little progress for the
# rise band, whose floor is a tenth of the loss: it is caught by its loss
# going clearly below the start and then back to it (within one standard
# error) or above; one that died within its trial by its loss staying clearly
# above the start.
CLEAR_DROP_ERRORS = 3.0


@dataclasses.dataclass(frozen=True)
class Alarm:
    """Why the guard wants a rollback.

    Attributes:
        reason: ``"diverged"`` (a non-finite loss, or a chunk mean above
            10x the job's starting loss), ``"loss_rise"`` or ``"collapsed"``
            (for RISE_CHUNKS chunks in a row, the loss back at the starting
            loss after it had gone clearly below it, or clearly above it:
            a dead network).
        loss: the mean loss of the chunk that raised it (NaN when not finite).
        reference: the lowest chunk mean of this stretch before it.
        band: the noise band the rise went beyond.
    """

    reason: str
    loss: float
    reference: float
    band: float


class TrainingGuard:
    """Watches one stretch of training (one setting on one branch, from a
    search's winner, or a rollback, to the next of either).

    Each :meth:`check` takes the next chunk of clocks. A non-finite loss, or
    a chunk mean above DIVERGENCE_THRESHOLD times the starting loss, raises
    the alarm at once. (The trials' 10x rule on the last point is not used:
    late in training, single small-batch losses spread over orders of
    magnitude around a small mean.) The chunk is summarised against the
    previous chunk's mean for its noise; a chunk mean above the stretch's
    lowest by more than the band, RISE_CHUNKS times in a row, raises it too. A dead network sits near its starting loss, far above
    where training had brought it, so it trips the rise long before 10x.
    One that died before it got far (its whole progress inside the band)
    is caught by its chunk means going back to the starting loss (within
    one standard error) or above, RISE_CHUNKS times in a row, after one had
    been clearly below it, or clearly above it (by CLEAR_DROP_ERRORS
    standard errors: worse than the untrained network).

    Args:
        start_loss: the job's starting loss (the initial search's starting
            progress); None takes the first chunk's mean.
    """

    def __init__(self, start_loss: float | None = None) -> None:
        self._start = start_loss if start_loss is not None and math.isfinite(start_loss) else None
        self._reference: float | None = None
        self._band = 0.0
        self._rises = 0
        self._last_mean: float | None = None
        self._dropped = False   # some chunk mean was clearly below the start
        self._at_start = 0      # chunk means in a row back at or above it since
        self._trained = False   # the last chunk mean is clearly below the start

    @property
    def trained(self) -> bool:
        """Whether the last chunk's mean loss is clearly below the starting
        loss (by CLEAR_DROP_ERRORS standard errors): the stretch has made
        progress that noise does not explain."""
        return self._trained

    def check(self, seconds: Sequence[float], losses: Sequence[float]) -> Alarm | None:
        """Takes one chunk (each clock's seconds and loss); returns an
        :class:`Alarm`, or None while training looks healthy."""
        if not losses:
            return None
        reference = self._reference if self._reference is not None else math.nan
        if not all(math.isfinite(v) for v in losses):
            return Alarm("diverged", math.nan, reference, self._band)
        mean = math.fsum(losses) / len(losses)
        if self._start is None:
            self._start = mean
        times, elapsed = [], 0.0
        for s in seconds:
            elapsed += float(s)
            times.append(elapsed)
        baseline = self._last_mean if self._last_mean is not None else mean
        summary = summarize_progress(times, losses, baseline)
        self._last_mean = mean
        if mean > DIVERGENCE_THRESHOLD * abs(self._start):
            return Alarm("diverged", mean, reference, self._band)
        if len(losses) >= 2:  # one loss has no spread to measure "clearly" by (an epoch of one clock)
            spread = math.sqrt(math.fsum((v - mean) ** 2 for v in losses) / (len(losses) - 1))
            error = spread / math.sqrt(len(losses))
            self._trained = mean < self._start - CLEAR_DROP_ERRORS * error
            self._dropped = self._dropped or self._trained
            # Back at the start: within one standard error of it, or above (a
            # dead network's constant output may fit the class frequencies a
            # little better than the untrained one did).
            back = mean >= self._start - error
            # Clearly above the start: worse than the untrained network (one that
            # died within its trial, never to go below the start in training).
            above = mean > self._start + CLEAR_DROP_ERRORS * error
            self._at_start = self._at_start + 1 if (self._dropped and back) or above else 0
        if self._reference is None or mean < self._reference:
            self._reference = mean
            noise = summary.noise if math.isfinite(summary.noise) else 0.0
            progress = max(0.0, self._start - mean)
            self._band = max(RISE_NOISE_FACTOR * noise, RISE_FRACTION * progress,
                             GO_UP_THRESHOLD * abs(mean))
            self._rises = 0
        elif mean > self._reference + self._band:
            self._rises += 1
            if self._rises >= RISE_CHUNKS:
                return Alarm("loss_rise", mean, self._reference, self._band)
        else:
            self._rises = 0
        if self._at_start >= RISE_CHUNKS:
            return Alarm("collapsed", mean, self._reference, self._band)
        return None
