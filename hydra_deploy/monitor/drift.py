"""The drift alarm: a conformal test martingale over a stream of scores, alarming at 1 / alpha.

:class:`DriftTest` turns each input's score (the OOD score by default, oriented higher = more
unusual) into an exact randomised conformal p-value against the export's in-distribution reference
plus the stream so far (:class:`~hydra_deploy.monitor.pvalues.ConformalPValues`), bets on it
(:mod:`~hydra_deploy.monitor.betting`) and raises an alarm when the martingale reaches
``1 / alpha``.

What an alarm promises, when the inputs are exchangeable with the reference (nothing changed):

- **the first alarm**: P(a false alarm ever, over the whole stream) <= ``alpha`` (Ville's inequality);
- **after an alarm** the martingale restarts at 1 while the p-values go on against the same growing
  reference, so they stay independent and uniform: each new run alarms falsely with probability at
  most ``alpha`` whatever happened before, hence P(k or more false alarms ever) <= ``alpha^k`` and the
  expected number of false alarms over the whole stream is at most ``alpha / (1 - alpha)`` (0.053 at
  0.05): a bound on the alarm frequency that does not grow with the stream's length.

What it does not promise: an alarm says the scores are no longer exchangeable with the reference,
not that accuracy fell (a harmless shift can alarm); a shift that leaves the score's distribution
unchanged is invisible; and the delay until an alarm depends on how far the scores moved.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

from hydra_deploy.errors import ParameterError
from hydra_deploy.monitor.betting import betting_rule
from hydra_deploy.monitor.pvalues import ConformalPValues

__all__ = ["Alarm", "DriftTest", "Step"]

STATE_VERSION = 1


@dataclass(frozen=True)
class Alarm:
    """An alarm: at the ``index``-th input of the stream (0-based), the martingale ``value``."""

    index: int
    value: float
    run: int  # 0: the first run (Ville's guarantee), k: the run after the k-th restart


@dataclass(frozen=True)
class Step:
    """One input: its p-value, the martingale after it, and whether it raised an alarm."""

    pvalue: float
    martingale: float
    alarm: bool


class DriftTest:
    """A conformal test martingale with an alarm at ``1 / alpha`` and a restart after it.

    ``reference``: in-distribution scores (the export's); ``rule``: ``jumper`` (Simple Jumper,
    both directions) or ``mixture`` (power bettors, inputs more unusual than the reference only);
    ``restart``: after an alarm, start a new run (False: the alarm stays raised, the first-alarm
    guarantee only).
    """

    def __init__(
        self,
        reference: Any,
        *,
        alpha: float = 0.05,
        rule: str = "jumper",
        restart: bool = True,
        seed: int = 0,
    ) -> None:
        if not 0.0 < float(alpha) < 1.0:
            raise ParameterError(f"`alpha` {alpha} must be in (0, 1): the false-alarm level")
        self.alpha = float(alpha)
        self.restart = bool(restart)
        self.pvalues = ConformalPValues(reference, seed=seed)
        self.bettor = betting_rule(rule)
        self.alarms: list[Alarm] = []
        self.raised = False  # an alarm is standing (restart=False)
        self.max_log_value = 0.0  # the largest log martingale of the current run

    @property
    def threshold(self) -> float:
        return 1.0 / self.alpha

    @property
    def index(self) -> int:
        """How many inputs the test has seen."""
        return self.pvalues.count

    @property
    def log_value(self) -> float:
        return self.bettor.log_wealth

    @property
    def value(self) -> float:
        """The martingale of the current run (1 at its start)."""
        return math.exp(min(self.log_value, 700.0))

    def update(self, score: float) -> Step:
        """Test one more input's score."""
        index = self.index
        p = self.pvalues.pvalue(score)
        self.bettor.bet(p)
        log_value = self.log_value
        self.max_log_value = max(self.max_log_value, log_value)
        value = math.exp(min(log_value, 700.0))
        alarm = False
        if not self.raised and log_value >= -math.log(self.alpha):
            alarm = True
            self.alarms.append(Alarm(index=index, value=value, run=len(self.alarms)))
            if self.restart:
                self.bettor.reset()
                self.max_log_value = 0.0
            else:
                self.raised = True
        return Step(pvalue=p, martingale=value, alarm=alarm)

    def update_many(self, scores: Any) -> dict[str, np.ndarray]:
        """Test a batch in order: arrays ``pvalue``, ``martingale``, ``alarm``, one row each."""
        steps = [self.update(s) for s in np.asarray(scores, dtype=np.float64).reshape(-1)]
        return {
            "pvalue": np.array([s.pvalue for s in steps]),
            "martingale": np.array([s.martingale for s in steps]),
            "alarm": np.array([s.alarm for s in steps], dtype=bool),
        }

    def state(self) -> dict[str, Any]:
        """A JSON-ready state; :meth:`from_state` with the same reference resumes exactly."""
        return {
            "version": STATE_VERSION,
            "alpha": self.alpha,
            "restart": self.restart,
            "bettor": self.bettor.state(),
            "pvalues": self.pvalues.state(),
            "alarms": [asdict(a) for a in self.alarms],
            "raised": self.raised,
            "max_log_value": self.max_log_value,
        }

    @classmethod
    def from_state(cls, reference: Any, state: dict[str, Any]) -> DriftTest:
        if state.get("version") != STATE_VERSION:
            raise ParameterError(
                f"a monitor state of version {state.get('version')!r}; this hydra-deploy reads "
                f"version {STATE_VERSION}: start a new state (delete the file)"
            )
        bettor = state["bettor"]
        settings = {k: v for k, v in bettor.items() if k in ("jump", "grid")}
        made = cls(
            reference,
            alpha=state["alpha"],
            rule=bettor["rule"],
            restart=state["restart"],
            seed=state["pvalues"]["seed"],
        )
        made.bettor = betting_rule(bettor["rule"], **settings)
        made.bettor.restore(bettor)
        made.pvalues = ConformalPValues.from_state(reference, state["pvalues"])
        made.alarms = [Alarm(**a) for a in state["alarms"]]
        made.raised = bool(state["raised"])
        made.max_log_value = float(state["max_log_value"])
        return made
