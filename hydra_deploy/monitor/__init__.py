"""Watching a deployed model without labels: a drift alarm with a false-alarm guarantee (numpy only).

- :class:`DriftTest`: exact randomised conformal p-values of each input's score against the export's
  in-distribution reference plus the stream so far, a betting martingale over them (Simple Jumper
  or a power mixture), an alarm at ``1 / alpha`` (Ville: P(a false alarm ever) <= alpha), and a
  restart after it (the expected number of false alarms over the whole stream <= alpha / (1 - alpha)).

Edge code: numpy and the standard library only.
"""

from hydra_deploy.monitor.betting import BETTING_RULES, PowerMixture, SimpleJumper
from hydra_deploy.monitor.drift import Alarm, DriftTest, Step
from hydra_deploy.monitor.pvalues import ConformalPValues

__all__ = [
    "BETTING_RULES",
    "Alarm",
    "ConformalPValues",
    "DriftTest",
    "PowerMixture",
    "SimpleJumper",
    "Step",
]
