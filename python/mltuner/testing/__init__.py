"""Training systems for testing tuners and training drivers without a
parameter server.

- :class:`ScriptedSystem`: reports exactly the losses, clock times and
  accuracies a test gives it, and records every fork, run and free;
- :class:`QuadraticSystem`: a simulated model (a noisy quadratic bowl) with a
  best learning rate, a divergence edge and batch-size trade-offs.

Both implement :class:`mltuner.tune.BranchSystem`, so a test can run a
:class:`~mltuner.tune.Tuner`, a baseline or your own driver on them and check
its decisions and that it freed what it forked.
"""

from __future__ import annotations

from mltuner.testing._quadratic import CURVATURES, QuadraticSystem
from mltuner.testing._scripted import AccuracyCurve, LossCurve, ScriptedSystem

__all__ = ["ScriptedSystem", "QuadraticSystem", "LossCurve", "AccuracyCurve", "CURVATURES"]
