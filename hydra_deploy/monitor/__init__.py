"""Watching a deployed model without labels: a drift alarm with a false-alarm guarantee (numpy only).

- :class:`DriftTest`: exact randomised conformal p-values of each input's score against the export's
  in-distribution reference plus the stream so far, a betting martingale over them (Simple Jumper
  or a power mixture), an alarm at ``1 / alpha`` (Ville: P(a false alarm ever) <= alpha), and a
  restart after it (the expected number of false alarms over the whole stream <= alpha / (1 - alpha)).
- :class:`RateWatch`: a rate (OOD flags, abstentions, empty sets) against calibration's expectation,
  an exact binomial test per window; :class:`WindowMean`: label-free estimates over a window.
- :class:`Monitor`: all of them over one stream, thread-safe, its state saved atomically as JSON and
  resumed exactly.

Edge code: numpy and the standard library only.
"""

from hydra_deploy.monitor.betting import BETTING_RULES, PowerMixture, SimpleJumper
from hydra_deploy.monitor.drift import Alarm, DriftTest, Step
from hydra_deploy.monitor.monitor import RATES, Monitor
from hydra_deploy.monitor.pvalues import ConformalPValues
from hydra_deploy.monitor.rates import RateAlert, RateWatch, WindowMean, binomial_interval

__all__ = [
    "BETTING_RULES",
    "RATES",
    "Alarm",
    "ConformalPValues",
    "DriftTest",
    "Monitor",
    "PowerMixture",
    "RateAlert",
    "RateWatch",
    "SimpleJumper",
    "Step",
    "WindowMean",
    "binomial_interval",
]
