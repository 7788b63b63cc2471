"""Starting a job of several processes and joining it: :class:`Job` (this
process's worker, its server shard and its links to the other ranks), where
this process sits in the job (:func:`detect_environment`, which reads the
variables of ``mltuner launch``, torchrun, Slurm or Open MPI), the rendezvous
at rank 0, checkpoints to restart from, and the local launcher behind
``mltuner launch`` (:func:`launch`). The bytes between processes move through
:mod:`mltuner.transport`. docs/launching.md and docs/distributed.md describe
them."""

from __future__ import annotations

from mltuner.launch._env import ProcessEnv, detect_environment
from mltuner.launch._checkpoint import read_attachment
from mltuner.launch._job import Job
from mltuner.launch._launcher import launch

__all__ = ["Job", "ProcessEnv", "detect_environment", "launch", "read_attachment"]
