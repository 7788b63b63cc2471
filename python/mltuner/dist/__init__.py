"""Running one job as several processes: :class:`Job` (this process's worker,
its server shard, and the ZeroMQ transport to the other ranks), where this
process sits in the job (:func:`detect_environment`, which reads the
variables of ``mltuner launch``, torchrun, Slurm or Open MPI), and the local
launcher behind ``mltuner launch`` (:func:`launch`). docs/launching.md and
docs/distributed.md describe them."""

from __future__ import annotations

from mltuner.dist._env import ProcessEnv, detect_environment
from mltuner.dist._job import Job
from mltuner.dist._launch import launch

__all__ = ["Job", "ProcessEnv", "detect_environment", "launch"]
