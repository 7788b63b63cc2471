"""The session's sample indices as a DataLoader's ``batch_sampler``.

Each step of a :class:`~mltuner.tune.session.TuningSession` names this
worker's samples (``Step.indices``): of the training set, or of the
validation set on TESTING steps. :class:`StepBatchSampler` yields them as
the batches of a ``torch.utils.data.DataLoader`` over
``ConcatDataset([train_set, validation_set])`` (validation indices shifted
by the training set's length), one batch per step, in step with the
session::

    loader = DataLoader(ConcatDataset([train_set, val_set]), batch_sampler=session.batch_sampler())
    for step, (x, y) in zip(session, loader):   # the session first: zip asks it first
        ...

(``TuningSession.data_loader`` makes that loader, with a collate that turns
a step without samples of this rank into a batch of 0 samples.)

A step's indices exist only once the session has yielded the step (the
tuner decides the next branch and batch size as training goes), so the
loader must not read ahead: ``num_workers=0``. A loader that asks for a
batch before the session's next step gets an error saying so.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

from mltuner.exceptions import InvalidArgumentError
from mltuner.tune._system import BranchKind

if TYPE_CHECKING:
    from mltuner.tune.session._session import Step, TuningSession

__all__ = ["StepBatchSampler", "collate_allowing_empty"]


class StepBatchSampler:
    """Batches of a DataLoader in step with a session (module docstring):
    the indices of the step the session yielded last, into
    ``ConcatDataset([train_set, validation_set])``."""

    def __init__(self, session: TuningSession, num_train: int) -> None:
        self._session = session
        self._num_train = num_train
        self._last: Step | None = None

    def __iter__(self) -> Iterator[list[int]]:
        return self

    def __next__(self) -> list[int]:
        step = self._session.current_step
        if step is None or step is self._last:
            raise InvalidArgumentError(
                "the DataLoader asked for a batch ahead of the tuning session: each step's batch exists only once "
                "the session yields the step. Use DataLoader(..., num_workers=0) and draw one batch per step after "
                "the step, e.g. `for step, batch in zip(session, loader)`"
            )
        self._last = step
        offset = self._num_train if step.kind is BranchKind.TESTING else 0
        return [int(i) + offset for i in step.indices]


def collate_allowing_empty(dataset: Any, collate_fn: Callable[[list[Any]], Any] | None = None
                           ) -> Callable[[list[Any]], Any]:
    """``collate_fn`` (default torch's ``default_collate``) for the session's
    batches, where a step with none of this rank's samples is ``[]``: that
    one becomes a batch of 0 samples, the collated first sample of
    ``dataset`` with every tensor cut to nothing, so that it has the shapes
    and dtypes of the others."""
    import torch
    from torch.utils._pytree import tree_map
    from torch.utils.data import default_collate

    inner = collate_fn or default_collate

    def collate(batch: list[Any]) -> Any:
        if batch:
            return inner(batch)
        return tree_map(lambda leaf: leaf[:0] if isinstance(leaf, torch.Tensor) else leaf, inner([dataset[0]]))

    return collate
