"""Tuning inside a training loop on the parameter server: the session every
rank iterates, the branch system rank 0's driver sees, and the commands
that travel between them."""

from __future__ import annotations

from mltuner.tune.session._commands import (
    Command,
    EndCommand,
    ErrorCommand,
    ForkCommand,
    FreeCommand,
    RunCommand,
    parse_command,
)
from mltuner.tune.session._sampler import StepBatchSampler, collate_allowing_empty
from mltuner.tune.session._session import Collective, Driver, PSBranchSystem, ServingCollective, Step, TuningSession

__all__ = [
    "TuningSession", "Step", "StepBatchSampler", "collate_allowing_empty", "PSBranchSystem", "Driver", "Collective",
    "ServingCollective",
    "Command", "ForkCommand", "FreeCommand", "RunCommand", "EndCommand", "ErrorCommand", "parse_command",
]
